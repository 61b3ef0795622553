#!/usr/bin/env bash
# A GPU round on a two-GPU machine (the device tool's nvidia-h200-x2 costs the same device time
# as one GPU): build once, then at the same time
#   GPU 1: the tests (GQA_TEST_K, a pytest -k expression over GQA_TESTS), in processes split by
#          GQA_TEST_SPLIT (-k terms separated by ';': each one's matches, then the rest);
#   GPU 0: the gpu_check.sh steps in GQA_GPU0_STEPS (benchmarks: default "prefill"), then the
#          sanitizer tools in GQA_SANITIZE_TOOLS at once over GQA_SANITIZE_K.
# Every process gets a share of the CPU threads. All must end by GQA_DEADLINE seconds from the
# start (default 540: the device tool stops a command at 600). The logs go to
# $OUT/gpu_pair.tgz, the summaries to stdout. On one GPU: GQA_TEST_GPU=0 with GQA_GPU0_STEPS=none
# (the tests alone, in their processes; no benchmarks beside them).
#   GQA_TEST_K="prefill and not decode" GQA_SANITIZE_K="prefill_sizes and 513" bash scripts/gpu_pair.sh
set -u
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++; fi
FINAL_OUT=${OUT:-$PWD/gpu_out}
L=$FINAL_OUT/pair_logs
mkdir -p "$L/g0" "$L/g1"
deadline=${GQA_DEADLINE:-540}
t0=$(date +%s)
left() { echo $(( deadline - ($(date +%s) - t0) )); }
threads=$(( $(nproc) / 6 > 0 ? $(nproc) / 6 : 1 ))

GQA_LOG_DIR=$L/g1 GQA_NESTED=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} bash scripts/gpu_check.sh build sass || exit 1
echo "built at $(( $(date +%s) - t0 )) s"

k=${GQA_TEST_K:-prefill}
# GQA_TEST_SPLIT: -k terms separated by ';', one process each, and one for the rest.
split=${GQA_TEST_SPLIT:-parity_grid}
IFS=';' read -r -a terms <<< "$split"
parts=("${terms[@]}")
rest=$(printf ' or (%s)' "${terms[@]}"); parts+=("not (${rest# or })")
source scripts/cuda_test_files.sh  # CUDA_TEST_FILES
pids=(); i=0
for part in "${parts[@]}"; do
  i=$((i + 1)); echo "-k ($k) and ($part)" > "$L/g1/tests_$i.log"
  CUDA_VISIBLE_DEVICES=${GQA_TEST_GPU:-1} OMP_NUM_THREADS=$threads timeout "$(left)" python3 -m pytest ${GQA_TESTS:-$CUDA_TEST_FILES} -q -ra \
    -p no:cacheprovider -o faulthandler_timeout=100 --durations=10 -k "($k) and ($part)" \
    >> "$L/g1/tests_$i.log" 2>&1 &
  pids+=($!)
done

( export CUDA_VISIBLE_DEVICES=0
  if [ "${GQA_GPU0_STEPS:-prefill}" != none ]; then
    GQA_LOG_DIR=$L/g0 GQA_NESTED=1 bash scripts/gpu_check.sh ${GQA_GPU0_STEPS:-prefill}
  fi
  echo "GPU 0's steps done at $(( $(date +%s) - t0 )) s"
  if [ -n "${GQA_SANITIZE_K:-}" ]; then
    GQA_LOG_DIR=$L/g0 GQA_NESTED=1 GQA_OMP_THREADS=$threads GQA_SANITIZE_TIMEOUT=$(( $(left) - 5 )) \
      GQA_CHECKS="${GQA_SANITIZE_TOOLS:-memcheck racecheck synccheck}" bash scripts/gpu_check.sh checks || exit 1
  fi ) 2>&1 | tee "$L/g0/lane0.txt"
status=${PIPESTATUS[0]}
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
for f in "$L"/g1/tests_*.log; do echo "-- $f"; tail -14 "$f"; done
cp -r benchmarks/results "$L/" 2>/dev/null
tar czf "$FINAL_OUT/gpu_pair.tgz" -C "$L" . && rm -rf "$L"
echo "done at $(( $(date +%s) - t0 )) s"
exit $status
