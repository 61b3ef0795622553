#!/usr/bin/env bash
# Builds here, for the device, the extension for other GPU architectures than the landed 9.0a,
# from the committed tree in a scratch copy (the in-tree build stays as it is), and packs it as
# .variants/<name>.so.xz with its _build_info.py beside it:
#
#   bash scripts/pack_arch_build.sh 8.0 sm80_only     # about 2 minutes on 2 cores
#
# tests/test_cuda_other_gpus.py runs .variants/sm80_only.so.xz on the H200, which it has no
# code for, to check the error that names the GPU and the TORCH_CUDA_ARCH_LIST to rebuild with.
# .variants/ is git-ignored: name it in the device tool's `carry`.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 2 ] || { echo "usage: bash scripts/pack_arch_build.sh ARCH_LIST NAME" >&2; exit 2; }
archs=$1 name=$2
VENV=${GQA_DEVICE_VENV:-/work/venv312}
scratch=$(mktemp -d /tmp/gqa_arch_build.XXXXXX)
trap 'rm -rf "$scratch"' EXIT
git archive HEAD | tar -x -C "$scratch"
(cd "$scratch" && TORCH_CUDA_ARCH_LIST=$archs MAX_JOBS=${MAX_JOBS:-2} GQA_REQUIRE_CUDA=1 CC=/usr/bin/gcc \
  CXX=/usr/bin/g++ "$VENV/bin/python" setup.py build_ext --inplace > build.log 2>&1) \
  || { tail -30 "$scratch/build.log"; exit 1; }
mkdir -p .variants
xz -T2 -3 -c "$scratch"/gqa_torch/_C.cpython-312-*.so > ".variants/$name.so.xz"
cp "$scratch/gqa_torch/_build_info.py" ".variants/$name.build_info.py"
echo "packed .variants/$name.so.xz ($(du -h ".variants/$name.so.xz" | cut -f1)) for TORCH_CUDA_ARCH_LIST=$archs"
