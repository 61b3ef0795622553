#!/usr/bin/env bash
# Installs what the build needs (torch from PyPI when missing) and builds gqa_torch._C in place.
# The CUDA kernels compile whenever torch is a CUDA build and a matching nvcc exists; with no
# matching nvcc on PATH/CUDA_HOME it fetches one from PyPI (nvidia-cuda-nvcc) rather than
# silently building CPU-only. GQA_REQUIRE_CUDA=1 makes a CPU-only build fatal.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! $PY -c "import torch" 2>/dev/null; then
  echo "[build] installing torch from PyPI"
  $PY -m pip install -q torch
fi
$PY -m pip install -q ninja setuptools wheel numpy

torch_cuda=$($PY -c "import torch; print(torch.version.cuda or '')")
if [ -n "$torch_cuda" ]; then
  torch_major=${torch_cuda%%.*}
  nvcc_bin=${CUDA_HOME:-/usr/local/cuda}/bin/nvcc
  nvcc_major=""
  if [ -x "$nvcc_bin" ]; then
    nvcc_major=$("$nvcc_bin" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
  fi
  if [ "$nvcc_major" != "$torch_major" ] && [ "$torch_major" -lt 13 ]; then
    # Checked at stop 70: PyPI's CUDA 12 compiler wheel (nvidia-cuda-nvcc-cu12) holds ptxas alone.
    echo "[build] torch is CUDA $torch_cuda but nvcc at $nvcc_bin is '${nvcc_major:-missing}', and PyPI has no"
    echo "[build] nvcc $torch_major to fetch: install the CUDA $torch_major toolkit and set CUDA_HOME, or use a torch"
    echo "[build] built for CUDA 13 (pip install torch --index-url https://download.pytorch.org/whl/cu130)."
    echo "[build] Going on without the CUDA kernels unless GQA_REQUIRE_CUDA=1 (setup.py says which)."
  elif [ "$nvcc_major" != "$torch_major" ]; then
    echo "[build] torch is CUDA $torch_cuda but nvcc at $nvcc_bin is '${nvcc_major:-missing}': fetching nvcc $torch_major from PyPI"
    $PY -m pip install -q "nvidia-cuda-nvcc==${torch_major}.*" "nvidia-cuda-runtime==${torch_major}.*" "nvidia-cuda-cccl==${torch_major}.*"
    nvcc_found=$($PY - <<'PYEOF'
import glob, os, site
roots = site.getsitepackages() + [site.getusersitepackages()]
hits = [p for r in roots for p in glob.glob(os.path.join(r, "nvidia", "**", "bin", "nvcc"), recursive=True)]
print(hits[0] if hits else "")
PYEOF
)
    [ -n "$nvcc_found" ] || { echo "[build] could not find the nvcc that pip installed"; exit 1; }
    CUDA_HOME=$(dirname "$(dirname "$nvcc_found")")
    export CUDA_HOME
    echo "[build] CUDA_HOME=$CUDA_HOME"
  else
    export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
  fi
fi

jobs=${MAX_JOBS:-$(nproc)}
echo "[build] building gqa_torch._C with MAX_JOBS=$jobs, TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-(unset: the GPUs setup.py sees, else 9.0a)}"
start=$(date +%s)
MAX_JOBS=$jobs $PY setup.py build_ext --inplace 2>&1 | grep -v "^copying\|^creating\|^running" || { echo "[build] FAILED"; exit 1; }
echo "[build] done in $(( $(date +%s) - start )) s"
$PY -c "import gqa_torch, json; print('[build] build_info:', json.dumps(gqa_torch.build_info()))"
