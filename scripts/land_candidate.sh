#!/usr/bin/env bash
# The H200 call that decides whether stop 89's landing candidate lands (csrc/kernels/NOTES.md,
# stops 88-92): main against the candidate's build in two interleaved repeats over the rows
# that decide it, then benchmarks/ab_land_rule.py over that log; where the rule holds, the
# candidate's three decode tables from its own tree (FlexAttention left out, to stay short).
# Its tests and sanitizers passed on H100s (stops 89 and 92); the H200 is what the rule needs.
#
#   bash scripts/land_candidate.sh        # on the device, with .variants/ and the .so carried
#
# The candidate's packed build (scripts/pack_variant.sh) is unpacked when .variants/ holds it,
# else the patch is built (about 1 minute with 16 jobs). Exits 0 where the rule holds and the
# tables ran, 1 where the rule does not hold (main stays), 2 on a failed step, 3 at once on a
# card other than an H200 (whose timings cannot decide the rule; GQA_ANY_GPU=1 runs anyway).
# Not yet run as one script; its steps' timeouts (200 s each) bound it to about 400 s plus the
# machine's start.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/gpu_out}
CANDIDATE=${GQA_CANDIDATE:-benchmarks/variants/share_whole_four_stages.patch}
# Stop 89's rows. The grid's rows 1, 5 and 7 (B1 L8192, B8 L32768, B64 L8192) run kernels the
# patch leaves alone; row 11 (B16 64/8 L8192) and B15 64/8 L8192 decide it; the ragged batches,
# B16 32/8 L16384 and B26 32/8 L4096 (items cut into segments) are where it may cost.
ROWS="--rows 1 5 7 11 --shapes 15x64x8x128x8192 16x64x8x128x8192r256 12x64x8x128x8192r256"
ROWS+=" 16x32x8x128x16384 26x32x8x128x4096 20x32x8x128x4096r256"
mkdir -p "$OUT/ab" "$OUT/bench"
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,uuid,power.limit --format=csv \
  | tee "$OUT/gpu.txt"
if ! grep -q H200 "$OUT/gpu.txt"; then
  echo "not an H200: the rule was set for the H200's rates"
  [ "${GQA_ANY_GPU:-0}" = 1 ] || exit 3
fi

OUT=$OUT/ab GQA_VARIANTS="$CANDIDATE" GQA_AB_REPEATS=2 GQA_ABDECODE_ARGS="$ROWS" \
  timeout 200 bash scripts/gpu_check.sh variants abdecode > "$OUT/ab.txt" 2>&1
ab_rc=$?
echo "A/B rc=$ab_rc after ${SECONDS} s"
grep " row " "$OUT/ab.txt"
python3 benchmarks/ab_land_rule.py "$OUT/ab.txt" | tee "$OUT/rule.txt"
if [ "${PIPESTATUS[0]}" -ne 0 ]; then
  [ "$ab_rc" -eq 0 ] && exit 1
  echo "the A/B failed or was cut short (see $OUT/ab.txt)"; exit 2
fi

# gpu_check.sh's variants mode left the candidate's tree, with its build, in /tmp/gqa_variant_0.
OUT=$OUT/bench GQA_BENCH_ARGS=--no-flex timeout 200 \
  bash /tmp/gqa_variant_0/scripts/gpu_validate.sh bench > "$OUT/bench.txt" 2>&1 \
  || { echo "the candidate's tables failed (see $OUT/bench.txt)"; exit 2; }
echo "tables done after ${SECONDS} s"
tail -50 "$OUT/bench.txt"
