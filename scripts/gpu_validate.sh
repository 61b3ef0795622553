#!/usr/bin/env bash
# The whole GPU validation of the landed code in three device calls, each under the device
# tool's 600 s, on an extension built beforehand (scripts/build_for_device.sh here, carried; or
# `bash scripts/gpu_check.sh build` there first):
#
#   bash scripts/gpu_validate.sh decode  # every non-prefill decode test in 14 processes (315 s
#                                        # in 13 on an H100 in stop 83), then memcheck, racecheck
#                                        # and synccheck over 172 tests, side by side
#   bash scripts/gpu_validate.sh decode_tests  # decode's tests alone (no sanitizers)
#   bash scripts/gpu_validate.sh sanitizers    # decode's sanitizers alone (no tests)
#   bash scripts/gpu_validate.sh rest    # the prefill GPU tests in seven processes beside the
#                                        # other test files (the CUDA fuzz, parity, torch
#                                        # integration, soak and concurrency, ORT)
#   bash scripts/gpu_validate.sh others  # those other test files alone (a decode-only change)
#   bash scripts/gpu_validate.sh bench   # the three decode tables alone, FlexAttention included
#                                        # (GQA_BENCH_ARGS=--no-flex leaves it out), then
#                                        # benchmarks/small_smem.py
#   bash scripts/gpu_validate.sh smem    # the 99 KB GPUs' paths alone: their tests, memcheck and
#                                        # racecheck over them, benchmarks/small_smem.py
#   bash scripts/gpu_validate.sh grid    # bench, then smem's tests and sanitizers: one call
#                                        # (101 s with GQA_BENCH_ARGS=--no-flex in stop 73)
#   bash scripts/gpu_validate.sh rules   # the plan rules of stops 79-82, each against a pin that
#                                        # gives its equal rows the plan before it (ab_decode.py)
#   bash scripts/gpu_validate.sh shards  # no GPU: collects the decode shards, names any test that
#                                        # two of them select
#
# Each part runs scripts/gpu_check.sh with the settings that earlier rounds found to fit
# (csrc/kernels/NOTES.md, "A full decode round on one H200 in one call"), and leaves one log
# archive a part under $OUT (part_*/gpu_logs.tgz). test_fuzz.py needs hypothesis, which the
# device machine lacks and cannot download: scripts/build_for_device.sh puts its wheels in
# .device_wheels/, and this script installs them from there when that folder was carried.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT_OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$ROOT_OUT"
status=0

if ! python3 -c "import hypothesis" 2>/dev/null && [ -d .device_wheels ]; then
  python3 -m pip install -q --no-index --find-links .device_wheels hypothesis > "$ROOT_OUT/pip_hypothesis.log" 2>&1 \
    || echo "gpu_validate: hypothesis did not install from .device_wheels (see pip_hypothesis.log)"
fi

# One gpu_check.sh run whose logs go to $ROOT_OUT/part_$1 (its own archive), with the rest of
# the arguments as its steps.
# Returns gpu_check.sh's status.
part() {
  local name=$1 rc=0; shift
  OUT=$ROOT_OUT/part_$name bash scripts/gpu_check.sh "$@" > "$ROOT_OUT/part_$name.txt" 2>&1 || rc=1
  echo "== $name"; cat "$ROOT_OUT/part_$name.txt"
  return $rc
}

source scripts/cuda_test_files.sh
DECODE_FILES="$CUDA_TEST_FILES tests/test_hf.py tests/test_user_layer.py tests/test_decode_schedule.py tests/test_validation.py"
# The shards, each test in one: the balanced partition's tests in four, the ragged batches in
# two, then the equal rows, the bad rows (two), the error word and L2 fetch, the loaders and the
# head sizes; the last process takes what no term matches. The partition's first shard took 304
# of its 340 s on an H100 in stop 83 as one process, hence its two halves.
SHARES_MAIN="decode_shares and not (more_items or bad_row or fewer_items or twice)"
DECODE_SPLIT="$SHARES_MAIN and not (head_size_64 or on_4096 or wide_groups)"
DECODE_SPLIT+=";$SHARES_MAIN and (head_size_64 or on_4096 or wide_groups);decode_shares and (more_items or bad_row)"
DECODE_SPLIT+=";decode_shares and (fewer_items or twice);ragged_batch_row_orders;ragged_batch and not row_orders"
DECODE_SPLIT+=";equal_rows and not decode_shares;bad_row and not (decode_shares or equal_rows) and (64 or 80)"
DECODE_SPLIT+=";bad_row and not (decode_shares or equal_rows) and not (64 or 80);error or l2_fetch;decode_loaders"
DECODE_SPLIT+=";head_size_64 and not decode_shares;head_size and not (head_size_64 or decode_shares)"
# The prefill tests of test_cuda.py in seven processes (the last takes what no term matches).
# Stop 68: same_bits and many_blocks in one process (304 tests) did not finish in 340 s; stop 72:
# many_blocks alone (144) did not on an H100, and each half took 182-185 s.
PREFILL_SPLIT="prefill_routes and fp16;prefill_routes and bf16;prefill_kernel_append"
PREFILL_SPLIT+=";prefill_route_same_bits;prefill_many_blocks and fp16;prefill_many_blocks and bf16"
OTHER_FILES="tests/test_fuzz.py tests/test_parity.py tests/test_torch_integration.py tests/test_soak_concurrency.py"
OTHER_FILES+=" tests/test_ort.py tests/test_harness.py tests/test_fast_div.py tests/test_autograd.py"
OTHER_FILES+=" tests/test_cpu_output_cache.py tests/test_cuda_other_gpus.py"
# What the sanitizers run (bf16, 172 tests): every decode loader at every fast head size, in
# place; the bad-row tests outside the balanced partition; the decode parity grid; the merge
# kernel over 66 and 128 splits; the mma and the pipelined wgmma prefill with its append. In
# stop 68, in parts: memcheck ran them in about 15 s of pytest time, synccheck 168 of them in
# 26 s, racecheck 103 in 70 s. (The set before, 63 cases of the balanced partition and the
# equal rows' tail splits among them, did not finish in 200 s under any of the three.)
SANITIZE_K="(decode_loaders and inplace and bf16) or (decode and bad_row and bf16 and not decode_shares)"
SANITIZE_K+=" or (parity_grid and decode) or (merge_kernel_many_splits and bf16)"
SANITIZE_K+=" or prefill_kernel_append[wgmma_ws_kv_pipe-128-bf16-300] or prefill_kernel_append[mma-128-bf16-300]"

# The three decode tables, alone on the GPU. FlexAttention compiles each shape first, up to
# bench_decode.py's --flex-budget (240 s) of compiling and timing; GQA_BENCH_TIMEOUT bounds the
# whole run (36 s without Flex in stop 68).
decode_tables() {
  GQA_BENCH_ARGS=${GQA_BENCH_ARGS:-} GQA_BENCH_TIMEOUT=${GQA_BENCH_TIMEOUT:-560} part bench bench
}

# The decode path of a 99 KB GPU, imitated under a budget on this one (six shapes).
small_smem_timings() {
  local rc=0
  (cd benchmarks && PYTHONPATH=$PWD/.. timeout 200 python3 small_smem.py) > "$ROOT_OUT/small_smem.md" 2> "$ROOT_OUT/small_smem.log" \
    || rc=1
  echo "== small_smem"; cat "$ROOT_OUT/small_smem.md"
  return $rc
}

# The paths of GPUs with 99 KB of shared memory a block, imitated under a budget (stop 70 and
# after): their tests, then memcheck and racecheck over their bf16 ones. Logs straight under
# $ROOT_OUT.
small_smem_checks() {
  local rc=0
  timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda_other_gpus.py \
    "tests/test_cuda_graphs.py::test_cuda_kernels_available_asks_about_the_device" > "$ROOT_OUT/other_gpus.log" 2>&1 || rc=1
  echo "== other_gpus tests"; tail -15 "$ROOT_OUT/other_gpus.log"
  # The tests of what the kernels compute, in bf16: those of which kernel ran need the profiler,
  # which records nothing under a sanitizer, and ran in the pytest run before.
  local k="99kb_budget and not (takes_a_loader or runs_the) and (bf16 or more_rows)"
  for tool in ${GQA_SMEM_TOOLS-memcheck racecheck}; do
    timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider -rs \
      tests/test_cuda_other_gpus.py -k "$k" > "$ROOT_OUT/other_gpus_$tool.log" 2>&1 || rc=1
    echo "== $tool"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed|error" "$ROOT_OUT/other_gpus_$tool.log" | tail -4
  done
  return $rc
}

# The plan rules of stops 79-82 (plan.cpp), timed on this GPU against pins that give their equal
# rows the plan before each rule, all interleaved in one process a table. `splits=1`: one split a
# row, which share_short's and stop 81's equal rows took before; `splits=2`: stop 81's two splits,
# which stop 82's share_short took over at 199-231 items; `schedule=keep_splits`: head size
# 256's last wave in the grid of two warps before stop 79. The ragged batches (r256) run auto only:
# the pins would change their plan too. Head size 64's rule (share_64) has no such pin: its rows
# are timed against SDPA cuDNN alone. Logs straight under $ROOT_OUT.
plan_rules() {
  local rc=0
  # ab_decode.py imports gqa_torch from this tree (gpu_check.sh sets the same path for its steps)
  export PYTHONPATH=$PWD
  local equal="20x32x8x128x4096 24x32x8x128x4096 40x28x4x128x4096 25x32x8x128x4096 26x32x8x128x4096"
  equal+=" 28x32x8x128x4096 28x32x8x128x6144 26x64x8x128x4096"
  local others="20x32x8x128x4096r256 26x32x8x128x4096r256 20x32x8x64x4096 12x32x8x64x8192 20x32x8x64x4096r256"
  timeout 200 python3 benchmarks/ab_decode.py --rows --shapes $equal --pins splits=1 splits=2 --tag rules \
    > "$ROOT_OUT/rules_128.txt" 2>&1 || rc=1
  timeout 150 python3 benchmarks/ab_decode.py --rows --shapes 17x32x8x256x2048 24x16x8x256x4096 \
    17x32x8x256x2048r256 --pins schedule=keep_splits --flash --tag rules > "$ROOT_OUT/rules_256.txt" 2>&1 || rc=1
  timeout 150 python3 benchmarks/ab_decode.py --rows --shapes $others --tag rules \
    > "$ROOT_OUT/rules_others.txt" 2>&1 || rc=1
  echo "== plan rules"; grep -h "row" "$ROOT_OUT"/rules_*.txt
  return $rc
}

# Collects each decode shard as gpu_check.sh builds them (each term, then the rest) and names any
# test that two shards select. Fails too where a shard selects nothing (a stale term) or does not
# collect. Needs no GPU: CI runs it (.ci/run).
check_decode_shards() {
  local terms rest term i=0 ids out rc=0
  ids=$(mktemp)
  IFS=';' read -r -a terms <<< "$DECODE_SPLIT"
  rest=$(printf ' or (%s)' "${terms[@]}")
  for term in "${terms[@]}" "not (${rest# or })"; do
    # pytest's status is 5 where the expression selects no test, 2 where collection failed.
    if ! out=$(python3 -m pytest -q -p no:cacheprovider --collect-only $DECODE_FILES -k "(not prefill) and ($term)" 2>&1); then
      echo "shard $i selects no test or does not collect: $term"; echo "$out" | tail -5; rc=1
    fi
    echo "$out" | grep "::" | sed "s/^/$i /" >> "$ids"
    echo "shard $i: $(grep -c "^$i " "$ids") tests"; i=$((i + 1))
  done
  local repeated
  repeated=$(cut -d' ' -f2 "$ids" | sort | uniq -d)
  rm -f "$ids"
  if [ -n "$repeated" ]; then echo "in two shards or more:"; echo "$repeated"; return 1; fi
  [ $rc -eq 0 ] && echo "no test is in two shards"
  return $rc
}

# The non-prefill decode tests in their shards (267 s on an H200 in stop 84).
decode_tests() {
  GQA_CHECKS="test" GQA_TESTS="$DECODE_FILES" GQA_TEST_K="not prefill" GQA_TEST_TIMEOUT=340 \
    GQA_TEST_SPLIT="$DECODE_SPLIT" part decode_tests checks
}

# The three sanitizers over SANITIZE_K's tests, side by side (160 s on an H200 in stop 84).
decode_sanitizers() {
  GQA_CHECKS="memcheck racecheck synccheck" GQA_SANITIZE_K="$SANITIZE_K" GQA_SANITIZE_TIMEOUT=240 \
    part sanitizers checks
}

# The GPU test files besides decode's and prefill's (OTHER_FILES), in four processes that share
# $1 CPU threads.
other_tests() {
  GQA_CHECKS="test" GQA_OMP_THREADS=$1 GQA_TEST_TIMEOUT=340 GQA_TEST_SPLIT="fuzz;parity;integration" \
    GQA_TESTS="$OTHER_FILES" part other_tests checks
}

case ${1:-} in
  decode)
    # The sanitizers after the tests: memcheck beside the equal-rows shard slowed it past its
    # timeout.
    decode_tests || status=1
    decode_sanitizers || status=1 ;;
  decode_tests)
    decode_tests || status=1 ;;
  sanitizers)
    decode_sanitizers || status=1 ;;
  rest)
    # Two test runs side by side, each told half the cores.
    GQA_CHECKS="test" GQA_OMP_THREADS=8 GQA_TESTS="tests/test_cuda.py" GQA_TEST_K="prefill" GQA_TEST_TIMEOUT=340 \
      GQA_TEST_SPLIT="$PREFILL_SPLIT" part prefill_tests checks &
    prefill=$!
    other_tests 8 || status=1
    wait $prefill || status=1 ;;
  others)
    other_tests 16 || status=1 ;;
  bench)
    decode_tables || status=1
    small_smem_timings || status=1 ;;
  smem)
    small_smem_checks || status=1
    small_smem_timings || status=1 ;;
  rules)
    plan_rules || status=1 ;;
  grid)
    # Stop 73's one H200 call (101 s with --no-flex): the tables, then the 99 KB paths' checks.
    decode_tables || status=1
    small_smem_timings || status=1
    small_smem_checks || status=1 ;;
  shards)
    PYTHONPATH=$PWD check_decode_shards || status=1 ;;
  *)
    echo "usage: bash scripts/gpu_validate.sh decode|decode_tests|sanitizers|rest|others|bench|smem|grid|rules|shards"; exit 2 ;;
esac
exit $status
