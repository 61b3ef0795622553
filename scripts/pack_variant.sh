#!/usr/bin/env bash
# Builds here, for the device, one extension a patch (a variant of the landed code), so that a
# device call's A/B spends no device time building it:
#
#   bash scripts/pack_variant.sh benchmarks/variants/share_deep.patch [more.patch ...]
#
# Each patch is applied to this tree, built by scripts/build_for_device.sh (incremental: seconds
# where the patch touches host files, minutes where it touches a kernel), and its extension
# packed as .variants/<patch name>.so.xz (about 14 MB); then the patch is taken back out and the
# landed extension rebuilt. .variants/ is git-ignored: name it in the device tool's `carry`
# beside the extension (the carried paths hold 64 MiB in all: three variants at most beside the
# extension). There, `GQA_VARIANTS="<patch> ..." bash
# scripts/gpu_check.sh variants abdecode` unpacks a packed variant instead of building it.
# The files a patch touches must have no uncommitted changes.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: bash scripts/pack_variant.sh PATCH..." >&2; exit 2; }
mkdir -p .variants
for patch in "$@"; do
  name=$(basename "$patch" .patch)
  git apply --check "$patch"
  git apply "$patch"
  trap 'git apply -R "$patch"' EXIT  # the patch taken back out whatever happens below
  if ! bash scripts/build_for_device.sh > /tmp/gqa_pack_variant.log 2>&1; then
    tail -30 /tmp/gqa_pack_variant.log
    echo "pack_variant: $patch did not build" >&2
    exit 1
  fi
  # build_for_device.sh left the library without its debug sections, so the packed file is
  # about 14 MB: three variants fit in the carry's 64 MiB beside the extension.
  xz -T2 -6 -c gqa_torch/_C.cpython-312-x86_64-linux-gnu.so > ".variants/$name.so.xz"
  echo "packed .variants/$name.so.xz ($(du -h ".variants/$name.so.xz" | cut -f1))"
  git apply -R "$patch"
  trap - EXIT
done
bash scripts/build_for_device.sh | tail -1 > /dev/null
echo "rebuilt the landed extension"
