#!/usr/bin/env bash
# The profile round (device only): build, the graph timeline of each row, then Nsight Compute
# over the decode/merge/prefill kernels of each row. Full ncu output: $OUT/ncu_<row>.log; the
# key lines are printed. Usage: bash scripts/profile_gpu.sh [rows...]; GQA_PREFILL_ROUTE picks the
# prefill kernel (see _C._set_prefill_route; default auto); GQA_SASS=1 also keeps each report and
# writes the per-instruction stall samples (sass_<row>.csv, hotspots_<row>.txt); GQA_NCU_CACHE=none
# keeps the caches (instructions too) warm between ncu's passes, as back-to-back calls do.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++; fi  # see gpu_check.sh
rows=${*:-b1_l1024 b8_l8192 b8_l32768 b64_l32768 prefill_b2_l4096}
if [ -z "${GQA_SKIP_BUILD:-}" ]; then
  TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-16} GQA_REQUIRE_CUDA=1 \
    python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { echo "BUILD FAILED"; tail -30 "$OUT/build.log"; exit 1; }
fi
route=${GQA_PREFILL_ROUTE:-auto}
python3 scripts/profile_decode.py --mode timeline --prefill-route "$route" --row $rows 2>&1 | grep -v Warning
for row in $rows; do
  ncu --clock-control none --cache-control "${GQA_NCU_CACHE:-all}" -k "regex:decode_mma|merge_kernel|prefill_mma|prep_kernel" --launch-skip 2 --launch-count 2 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section ComputeWorkloadAnalysis --section SourceCounters \
    ${GQA_SASS:+-o "$OUT/rep_$row"} python3 scripts/profile_decode.py --mode ncu --prefill-route "$route" --row "$row" \
    > "$OUT/ncu_$row.log" 2>&1
  if [ -n "${GQA_SASS:-}" ]; then  # per-instruction stall samples (scripts/sass_hotspots.py)
    ncu -i "$OUT/rep_$row.ncu-rep" --page details > "$OUT/ncu_$row.log" 2>&1
    ncu -i "$OUT/rep_$row.ncu-rep" --page source --csv --print-source sass > "$OUT/sass_$row.csv" 2>&1
    python3 scripts/sass_hotspots.py "$OUT/sass_$row.csv" --stretches > "$OUT/hotspots_$row.txt" 2>&1
    head -4 "$OUT/hotspots_$row.txt"
  fi
  echo "== ncu $row"
  grep -E "_kernel|Duration|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Warp Cycles Per Issued|stalled|This stall|Issue Slots Busy|No Eligible|Executed Ipc A|ERROR|rror" \
    "$OUT/ncu_$row.log" | cut -c1-220 | head -60
done
