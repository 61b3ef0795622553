"""The build script's own messages (setup.py), checked without building anything."""
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
