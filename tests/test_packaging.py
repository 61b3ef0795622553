"""The build script (setup.py) and the source distribution, checked without compiling anything."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_setup_without_torch_says_how_to_build():
    """pip's build isolation hides the installed torch from setup.py; the build must stop with
    a message that names the fix, not with a bare ModuleNotFoundError."""
    hide_torch = "import sys; sys.modules['torch'] = None; sys.argv = ['setup.py', '--version']; " \
                 "exec(compile(open('setup.py').read(), 'setup.py', 'exec'))"
    result = subprocess.run([sys.executable, "-c", hide_torch], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert "torch is not importable here" in result.stderr, result.stderr
    assert "pip install --no-build-isolation ." in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_sdist_carries_every_source(tmp_path):
    """An sdist must hold every file the build compiles or includes: setup.py globs the .cpp and
    .cu files, and MANIFEST.in adds the headers, which `python -m build` (a wheel built from the
    sdist) and a `pip install` of the sdist need. The per-build _build_info.py stays out."""
    import tarfile

    expected = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "csrc")):
        for name in files:
            if name.endswith((".h", ".cuh", ".cpp", ".cu")):
                expected.add(os.path.relpath(os.path.join(folder, name), ROOT))
    assert any(name.endswith(".cuh") for name in expected) and any(name.endswith(".h") for name in expected)
    command = [sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path), "sdist", "-d",
               str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    (archive,) = tmp_path.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert not expected - names, sorted(expected - names)
    assert "gqa_torch/_build_info.py" not in names
