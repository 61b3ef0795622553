#!/usr/bin/env bash
# Builds gqa_torch._C here (no GPU needed) for the device machine, so that a device call can skip
# its own build (110-190 s there): the device runs Python 3.12 with torch 2.11.0+cu130, the same
# wheel PyPI serves, and this machine's nvcc 13.0 compiles for sm_90a. Pass the paths it
# prints to the device tool's `carry`, and leave `build` out of gpu_check.sh's steps (the third,
# .device_wheels, holds the test dependencies the device lacks: scripts/gpu_validate.sh).
#
#   bash scripts/build_for_device.sh            # ~5 min on 2 cores; the venv is made once
#
# GQA_DEVICE_VENV (default /work/venv312), GQA_DEVICE_PYTHON (python3.12) and
# GQA_DEVICE_TORCH (2.11.0) name the environment; change the last when the device's torch does.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${GQA_DEVICE_VENV:-/work/venv312}
TORCH=${GQA_DEVICE_TORCH:-2.11.0}
if [ ! -x "$VENV/bin/python" ]; then
  "${GQA_DEVICE_PYTHON:-python3.12}" -m venv "$VENV"
  "$VENV/bin/pip" install -q "torch==$TORCH" setuptools ninja numpy pybind11 pytest
fi
# The extension must match the device's torch exactly (its C++ ABI) and its CUDA major.
"$VENV/bin/python" - "$TORCH" <<'EOF'
import sys, torch
want = sys.argv[1]
assert torch.__version__.split("+")[0] == want, f"venv torch {torch.__version__}, device torch {want}"
assert (torch.version.cuda or "").startswith("13."), f"venv torch is CUDA {torch.version.cuda}, nvcc here is 13"
EOF
start=$(date +%s)
TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=${MAX_JOBS:-2} GQA_REQUIRE_CUDA=1 CC=/usr/bin/gcc CXX=/usr/bin/g++ \
  "$VENV/bin/python" setup.py build_ext --inplace > /tmp/gqa_build_for_device.log 2>&1 \
  || { tail -30 /tmp/gqa_build_for_device.log; exit 1; }
# The debug sections are half the library (34 MB); the carry holds 64 MiB in all.
strip -S gqa_torch/_C.cpython-312-*.so
echo "built in $(( $(date +%s) - start )) s; carry:"
ls gqa_torch/_C.cpython-312-*.so gqa_torch/_build_info.py
# The device has no hypothesis (tests/test_fuzz.py) and no network: its wheels, for
# scripts/gpu_validate.sh to install there. Best effort: without them the fuzz file skips itself.
if "$VENV/bin/pip" download -q --only-binary=:all: --python-version 3.12 -d .device_wheels hypothesis > /dev/null 2>&1; then
  echo .device_wheels
fi
