"""The build script (setup.py) and the source distribution, checked without compiling anything."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

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
    assert "gqa_torch/_cuda_archs.py" in names  # (setup.py loads it)
    assert "gqa_torch/_build_info.py" not in names


def test_default_archs_follow_the_visible_gpus():
    """Without TORCH_CUDA_ARCH_LIST the build targets the GPUs it sees (sm90 as 9.0a, for its
    arch-specific kernels), leaves out GPUs older than sm80 and says so, and falls back to 9.0a
    where none is left."""
    from gqa_torch import _cuda_archs as archs

    assert archs.default_archs([]) == ("9.0a", "9.0a (no GPU visible to the build: the default, H100/H200)")
    assert archs.default_archs([("NVIDIA H200", (9, 0))]) == (
        "9.0a", "9.0a (the GPUs visible to the build: NVIDIA H200)")
    pair = [("NVIDIA GeForce RTX 4090", (8, 9)), ("NVIDIA A100-SXM4-80GB", (8, 0)), ("NVIDIA GeForce RTX 4090", (8, 9))]
    assert archs.default_archs(pair) == (
        "8.0;8.9", "8.0;8.9 (the GPUs visible to the build: NVIDIA A100-SXM4-80GB, NVIDIA GeForce RTX 4090)")
    assert archs.default_archs([("NVIDIA B200", (10, 0)), ("NVIDIA H100", (9, 0))])[0] == "9.0a;10.0"
    assert archs.default_archs([("Tesla T4", (7, 5))]) == (
        "9.0a", "9.0a (no visible GPU the kernels support: the default, H100/H200; left out, older than compute "
                "capability 8.0: Tesla T4 (7.5) (call the op on CPU tensors there))")
    archs_list, why = archs.default_archs([("Tesla T4", (7, 5)), ("NVIDIA L4", (8, 9))])
    assert archs_list == "8.9" and why.endswith("left out, older than compute capability 8.0: Tesla T4 (7.5) "
                                                "(call the op on CPU tensors there))"), why


def test_arch_list_entries_below_sm80_are_found():
    from gqa_torch import _cuda_archs as archs

    assert archs.entries(" 8.0; 8.6+PTX,9.0a  10.0 ") == ["8.0", "8.6+PTX", "9.0a", "10.0"]
    assert archs.too_old("7.5;8.0;9.0a") == ["7.5"]
    assert archs.too_old("7.0+PTX 6.1 8.6") == ["7.0+PTX", "6.1"]
    assert archs.too_old("8.0;8.6;8.9;9.0a;10.0a;12.0") == []
    assert archs.too_old("Ampere;Hopper") == []  # (names are torch's to expand; not checked here)


def test_setup_refuses_archs_below_sm80():
    """An architecture the kernels cannot run on stops the build at once with what to do, not
    with ptxas errors minutes into the compile."""
    import gqa_torch

    if gqa_torch.build_info()["mode"] != "CUDA":
        pytest.skip("this machine builds CPU-only (no matching nvcc): setup.py checks the architectures only "
                    "when it compiles the CUDA kernels")
    env = dict(os.environ, TORCH_CUDA_ARCH_LIST="7.5;9.0a")
    env.pop("GQA_CPU_ONLY", None)
    result = subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert ("TORCH_CUDA_ARCH_LIST=7.5;9.0a: 7.5 cannot run gqa-torch's CUDA kernels, which need compute capability "
            "8.0 or newer") in result.stderr, result.stderr
    assert "GQA_CPU_ONLY=1" in result.stderr and "Traceback" not in result.stderr, result.stderr
