#!/usr/bin/env bash
# One whole GPU round on the device machine: build, GPU tests, compute-sanitizer, benchmarks.
# Summaries go to stdout; the full logs and benchmarks/results/ to $OUT/gpu_logs.tgz (one
# file, because the device tool brings back only a few files per call).
# Usage: bash scripts/gpu_check.sh [build|test|sanitize|bench|prefill|sass|e2e|soak|sweep|probe|bwprobe|ab|abbuild|variants|abdecode|abprofile|timeline|dtbuild|dtimeline|order|profile|checks]...
# (default: build test sanitize bench prefill, in that order). "checks" runs test, soak and the
# four sanitizer tools at once, as separate processes (correctness only; never with benchmarks);
# GQA_CHECKS picks a subset of them; GQA_OMP_THREADS the CPU threads of the test step (shared
# out over its processes) and of each sanitizer;
# GQA_TESTS the test paths (default: tests); GQA_TEST_K a pytest -k expression; GQA_TEST_SPLIT
# -k terms separated by ';' that split the GQA_TESTS shard into processes; GQA_TEST_ARGS
# more pytest arguments (split on spaces); GQA_BENCH_ARGS and GQA_PREFILL_ARGS the arguments of
# bench_decode.py and bench_prefill.py; GQA_AB_ARGS those of ab_prefill_routes.py (the "ab"
# step: an interleaved A/B of prefill routes; "abbuild" runs it with --cudnn in turn in the build
# at GQA_AB_BASE (another checkout, built there with build_ext; this checkout's script imports
# its gqa_torch) and in this one, GQA_AB_REPEATS times each, to set two builds' ours / cuDNN side
# by side), GQA_TIMELINE_ARGS those of block_timeline.py, GQA_DTIMELINE_ARGS those of
# decode_timeline.py (the "dtimeline" step, which runs it in a copy of the tree built with the
# decode stamps: "dtbuild", GQA_DTIMELINE_TREE),
# GQA_ORDER_SHAPES the shapes of interleave_order.py (the "order" step), GQA_SWEEP_ARGS those of
# sweep_decode_splits.py (the "sweep" step). scripts/gpu_pair.sh
# runs a round on two GPUs.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
FINAL_OUT=${OUT:-$PWD/gpu_out}
OUT=${GQA_LOG_DIR:-$FINAL_OUT/logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
# The device image sets CXX to a toolchain (/opt/gcc) that links a private copy of libstdc++
# into extensions; its iostreams then crash on the first formatted error message. Build with
# the system compiler, which shares the libstdc++ that torch loads.
if [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++; fi
steps=${*:-build test sanitize bench prefill}
# CUDA_TEST_FILES: one shard of the test step; the sanitizers' tests.
source scripts/cuda_test_files.sh
# The tree without its build outputs, into directory $1 (a copy to build another way).
copy_tree() { tar --exclude=./build --exclude='./gqa_torch/_C*.so' --exclude=./gpu_out --exclude=./.variants -cf - . | tar -xf - -C "$1"; }
status=0
# This tree, then each GQA_VARIANTS tree that the "variants" step built or unpacked, into the
# array `trees` (each build waited for, up to 10 minutes; one that failed is named and left out,
# and sets status).
variant_trees() {
  trees=("$PWD"); local i=0 vt patch
  for patch in ${GQA_VARIANTS:-}; do
    vt=/tmp/gqa_variant_$i
    for _ in $(seq 600); do [ -e "$vt/.built" ] || [ -e "$vt/.failed" ] && break; sleep 1; done
    if [ -e "$vt/.built" ]; then trees+=("$vt"); else echo "variant $i ($patch) did not build:"; tail -20 "$OUT/variant$i.log"; status=1; fi
    i=$((i + 1))
  done
}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1

for step in $steps; do
  case $step in
    build)
      start=$(date +%s)
      TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-16} GQA_REQUIRE_CUDA=1 \
        python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { echo "BUILD FAILED"; tail -40 "$OUT/build.log"; exit 1; }
      echo "build: $(( $(date +%s) - start )) s"
      grep -E "registers|spill" "$OUT/build.log" | sort | uniq | head -40 ;;
    test)
      # Two shards at once (the CUDA test files, most of the device time, and the rest), each
      # with half the CPU threads; faulthandler dumps the stacks of a test stuck for 120 s.
      # GQA_TEST_SPLIT (-k terms separated by ';') splits the GQA_TESTS shard further: a process
      # for each term's matches and one for the rest (the ragged-batch settings, 40-80 s each).
      if [ -n "${GQA_TESTS:-}" ]; then shards=("$GQA_TESTS"); else shards=("$CUDA_TEST_FILES" "tests $(printf -- ' --ignore=%s' $CUDA_TEST_FILES)"); fi
      ks=("${GQA_TEST_K:-}")
      if [ -n "${GQA_TESTS:-}" ] && [ -n "${GQA_TEST_SPLIT:-}" ]; then
        IFS=';' read -r -a terms <<< "$GQA_TEST_SPLIT"
        rest=$(printf ' or (%s)' "${terms[@]}"); ks=()
        for term in "${terms[@]}" "not (${rest# or })"; do ks+=("${GQA_TEST_K:+($GQA_TEST_K) and }($term)"); done
        shards=(); for _ in "${ks[@]}"; do shards+=("$GQA_TESTS"); done
      fi
      # The step's CPU threads (GQA_OMP_THREADS: its share under "checks") are divided over the
      # shards, twice over and at least two each: 52 threads on 16 cores ran at full speed
      # (twenty-seventh round, call 3), but six shards at 16 threads each crawled (call 4: five
      # of them hit GQA_TEST_TIMEOUT).
      threads=$(( 2 * ${GQA_OMP_THREADS:-$(nproc)} / ${#shards[@]} ))
      threads=$(( threads > 2 ? threads : 2 ))
      pids=(); i=0
      for shard in "${shards[@]}"; do
        k=${ks[$i]:-${GQA_TEST_K:-}}
        OMP_NUM_THREADS=$threads timeout ${GQA_TEST_TIMEOUT:-1800} python3 -m pytest $shard -q -ra \
          -p no:cacheprovider -o faulthandler_timeout=120 --durations=10 ${k:+-k "$k"} ${GQA_TEST_ARGS:-} \
          > "$OUT/tests$i.log" 2>&1 &
        pids+=($!); i=$((i + 1))
      done
      i=0
      for pid in "${pids[@]}"; do
        wait "$pid"; rc=$?
        # timeout's own status: the shard was killed, so its log ends without a summary.
        if [ $rc -eq 124 ]; then echo "tests$i: killed after GQA_TEST_TIMEOUT=${GQA_TEST_TIMEOUT:-1800} s" >> "$OUT/tests$i.log"; fi
        [ $rc -eq 0 ] || status=1; i=$((i + 1))
      done
      for log in "$OUT"/tests*.log; do echo "-- $log"; tail -25 "$log"; done ;;
    sanitize)
      # Every compute-sanitizer tool over a subset of the GPU tests that runs each kernel.
      for tool in ${GQA_SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}; do
        OMP_NUM_THREADS=${GQA_OMP_THREADS:-$(nproc)} timeout ${GQA_SANITIZE_TIMEOUT:-300} compute-sanitizer --tool $tool --error-exitcode 9 python3 -m pytest $CUDA_TEST_FILES -q -x \
          -k "${GQA_SANITIZE_K:-(parity_grid and (decode or prefill)) or test_cuda_decode}" -p no:cacheprovider > "$OUT/$tool.log" 2>&1 || status=1
        echo "$tool: $(grep -E "(ERROR|RACECHECK) SUMMARY" "$OUT/$tool.log" | tail -1) $(grep -E "passed|failed" "$OUT/$tool.log" | tail -1)"
      done ;;
    soak)
      timeout ${GQA_SOAK_TIMEOUT:-400} python3 scripts/soak.py ${GQA_SOAK_ARGS:-} > "$OUT/soak.log" 2>&1 || status=1
      tail -12 "$OUT/soak.log" ;;
    bench)
      (cd benchmarks && timeout ${GQA_BENCH_TIMEOUT:-900} python3 bench_decode.py ${GQA_BENCH_ARGS:-}) > "$OUT/bench_decode.log" 2>&1 || status=1
      cp -r benchmarks/results "$OUT/" 2>/dev/null
      grep -v "^    " "$OUT/bench_decode.log" | tail -45 ;;
    prefill)
      (cd benchmarks && timeout ${GQA_BENCH_TIMEOUT:-900} python3 bench_prefill.py ${GQA_PREFILL_ARGS:-}) > "$OUT/bench_prefill.log" 2>&1 || status=1
      cp -r benchmarks/results "$OUT/" 2>/dev/null  # also when nested (GQA_NESTED)
      grep -v "^    " "$OUT/bench_prefill.log" | tail -25 ;;
    checks)
      pids=()
      subs=${GQA_CHECKS:-test soak memcheck racecheck initcheck synccheck}
      # The CPU threads shared out: every process at nproc threads (float64 references) made the
      # tests crawl (seventeenth round: 100 tests in 360 s instead of 750 in 316).
      n_subs=$(echo $subs | wc -w); export GQA_OMP_THREADS=${GQA_OMP_THREADS:-$(( $(nproc) / n_subs > 0 ? $(nproc) / n_subs : 1 ))}
      for sub in $subs; do
        case $sub in test|soak) args=$sub; tools= ;; *) args=sanitize; tools=$sub ;; esac
        mkdir -p "$OUT/$sub"
        GQA_LOG_DIR=$OUT/$sub GQA_SANITIZE_TOOLS=$tools GQA_NESTED=1 bash "$0" $args > "$OUT/$sub/summary.txt" 2>&1 &
        pids+=($!)
      done
      for pid in "${pids[@]}"; do wait "$pid" || status=1; done
      for sub in $subs; do echo "== $sub"; cat "$OUT/$sub/summary.txt"; done ;;
    sass)
      # Issue 6's SASS check: the wgmma, TMA and setmaxnreg instructions in the built prefill object.
      obj=$(find build -name prefill_mma.o | head -1)
      if [ -z "$obj" ]; then echo "sass: no prefill_mma.o under build/"; status=1; else
        cuobjdump --dump-sass "$obj" > "$OUT/prefill_mma.sass" 2>&1 || status=1
        for op in HGMMA UTMALDG UTMASTG USETMAXREG; do echo "sass: $op $(grep -c "$op" "$OUT/prefill_mma.sass")"; done
        gzip -f "$OUT/prefill_mma.sass"
      fi ;;
    bwprobe)
      # The decode stream's ceilings without compute (scripts/decode_bw_probe.cu); GQA_BWPROBE_ARGS
      # its section ("promotion": the L2 fetch size of each loader, twenty-seventh round; none:
      # the launch chain and every loader).
      nvcc -O3 -std=c++17 -arch=sm_90a -lcuda scripts/decode_bw_probe.cu -o "$OUT/decode_bw_probe" > "$OUT/bwprobe.log" 2>&1 \
        && timeout ${GQA_BENCH_TIMEOUT:-900} "$OUT/decode_bw_probe" ${GQA_BWPROBE_ARGS:-} >> "$OUT/bwprobe.log" 2>&1 || status=1
      rm -f "$OUT/decode_bw_probe"; grep -v "^ \|^$\|warning\|Remark" "$OUT/bwprobe.log" | tail -40 ;;
    probe)
      # Issue 6: the wgmma conventions on their own, then the wgmma prefill against mma.sync.
      nvcc -gencode arch=compute_90a,code=sm_90a -O2 -o "$OUT/wgmma_probe" scripts/wgmma_probe.cu > "$OUT/probe.log" 2>&1 \
        && timeout 60 "$OUT/wgmma_probe" >> "$OUT/probe.log" 2>&1 || status=1
      timeout 120 python3 scripts/wgmma_check.py >> "$OUT/probe.log" 2>&1 || status=1
      rm -f "$OUT/wgmma_probe"; cat "$OUT/probe.log" | tail -40 ;;
    sweep)
      (cd benchmarks && timeout ${GQA_BENCH_TIMEOUT:-900} python3 sweep_decode_splits.py ${GQA_SWEEP_ARGS:-}) > "$OUT/sweep.log" 2>&1 || status=1
      tail -20 "$OUT/sweep.log" ;;
    ab)
      (cd benchmarks && timeout ${GQA_BENCH_TIMEOUT:-900} python3 ab_prefill_routes.py ${GQA_AB_ARGS:-}) > "$OUT/ab.log" 2>&1 || status=1
      grep -E "^\||^device" "$OUT/ab.log" | tail -20 ;;
    abbuild)
      if [ -z "${GQA_AB_BASE:-}" ]; then echo "abbuild: set GQA_AB_BASE to the other build's checkout"; status=2; continue; fi
      # A build started alongside this script's own marks its end with $GQA_AB_BASE/.built.
      for _ in $(seq 300); do [ -e "$GQA_AB_BASE/.built" ] && break; sleep 1; done
      for i in $(seq ${GQA_AB_REPEATS:-2}); do
        for tree in "$GQA_AB_BASE" "$PWD"; do
          echo "== $tree" >> "$OUT/abbuild.log"
          (cd benchmarks && PYTHONPATH="$tree" timeout ${GQA_BENCH_TIMEOUT:-900} python3 ab_prefill_routes.py --cudnn \
            ${GQA_AB_ARGS:-}) >> "$OUT/abbuild.log" 2>&1 || status=1
        done
      done
      grep -E "^\||^==" "$OUT/abbuild.log" | grep -v "^|---" ;;
    variants)
      # Copies of the tree, each with one patch of GQA_VARIANTS (paths relative to the tree,
      # space-separated) applied, built in the background at /tmp/gqa_variant_<i>, each marking
      # its end with .built or .failed; "abdecode" waits for them. Start it before "build": the
      # builds share the cores (a build's wall time is mostly its longest translation unit). A
      # variant packed beforehand (scripts/pack_variant.sh: .variants/<patch name>.so.xz) is
      # unpacked instead of built.
      i=0
      for patch in ${GQA_VARIANTS:-}; do
        vt=/tmp/gqa_variant_$i; patch_path=$PWD/$patch; log=$OUT/variant$i.log
        packed=$PWD/.variants/$(basename "$patch" .patch).so.xz
        rm -rf "$vt"; mkdir -p "$vt"
        copy_tree "$vt"
        if [ -f "$packed" ]; then
          (cd "$vt" && patch -p1 < "$patch_path" > "$log" 2>&1 \
            && xz -dc "$packed" > gqa_torch/_C.cpython-312-x86_64-linux-gnu.so && touch .built || touch .failed)
          echo "variant $i: $patch unpacked at $vt"; i=$((i + 1)); continue
        fi
        (cd "$vt" && patch -p1 < "$patch_path" > "$log" 2>&1 && TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} \
          MAX_JOBS=${MAX_JOBS:-16} GQA_REQUIRE_CUDA=1 python3 setup.py build_ext --inplace >> "$log" 2>&1 \
          && touch .built || touch .failed) &
        echo "variant $i: $patch building at $vt"; i=$((i + 1))
      done ;;
    abdecode)
      # benchmarks/ab_decode.py (GQA_ABDECODE_ARGS) in this tree and in each variant's, in turn,
      # GQA_AB_REPEATS times (default 3), the order alternating.
      variant_trees
      for r in $(seq ${GQA_AB_REPEATS:-3}); do
        order=("${trees[@]}"); [ $((r % 2)) -eq 0 ] && mapfile -t order < <(printf '%s\n' "${trees[@]}" | tac)
        for tree in "${order[@]}"; do
          (cd "$tree/benchmarks" && PYTHONPATH="$tree" timeout ${GQA_BENCH_TIMEOUT:-900} python3 ab_decode.py \
            --tag "$(basename "$tree")" ${GQA_ABDECODE_ARGS:-}) >> "$OUT/abdecode.log" 2>&1 || status=1
        done
      done
      grep " row " "$OUT/abdecode.log" | sort -k3,3n -k1,1 -s ;;
    timeline)
      # Where the prefill kernel's time goes, block by block (the per-block SM-clock stamps).
      (cd benchmarks && timeout ${GQA_BENCH_TIMEOUT:-900} python3 block_timeline.py ${GQA_TIMELINE_ARGS:-} \
        --json "$OUT/block_timeline.json" --raw "$OUT/block_timeline.pt") > "$OUT/timeline.log" 2>&1 || status=1
      grep -E "^\||^device" "$OUT/timeline.log" ;;
    dtbuild|dtimeline)
      # Where a decode call's time goes, CTA by CTA (the decode kernel's per-CTA stamps). The
      # stamps are compiled in only with GQA_DECODE_TIMELINE=1, so "dtbuild" builds a copy of the
      # tree with them at $GQA_DTIMELINE_TREE (about two minutes at 16 jobs; it may run in the
      # background beside the main build), and "dtimeline" builds it unless that is done, then
      # runs decode_timeline.py and the timeline's GPU test against that copy.
      tl=${GQA_DTIMELINE_TREE:-/tmp/gqa_dtimeline}
      # A "dtbuild" under way in the background: wait for it (up to 10 minutes).
      for _ in $(seq 600); do [ -e "$tl/.building" ] && [ ! -e "$tl/.built" ] || break; sleep 1; done
      if [ ! -e "$tl/.built" ]; then
        rm -rf "$tl"; mkdir -p "$tl"; touch "$tl/.building"
        copy_tree "$tl"
        (cd "$tl" && GQA_DECODE_TIMELINE=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-16} \
          GQA_REQUIRE_CUDA=1 python3 setup.py build_ext --inplace) > "$OUT/dtimeline_build.log" 2>&1 \
          || { echo "TIMELINE BUILD FAILED"; tail -20 "$OUT/dtimeline_build.log"; rm -f "$tl/.building"; status=1; continue; }
        touch "$tl/.built"
      fi
      [ "$step" = dtbuild ] && continue
      (cd "$tl/benchmarks" && PYTHONPATH="$tl" timeout ${GQA_BENCH_TIMEOUT:-900} python3 decode_timeline.py \
        ${GQA_DTIMELINE_ARGS:-}) > "$OUT/dtimeline.log" 2>&1 || status=1
      grep -v "^timeline:" "$OUT/dtimeline.log"
      (cd "$tl" && PYTHONPATH="$tl" timeout 300 python3 -m pytest tests/test_cuda.py -q -p no:cacheprovider \
        -k "decode_timeline_only_in_its_build") > "$OUT/dtimeline_test.log" 2>&1 || status=1
      tail -1 "$OUT/dtimeline_test.log" ;;
    order)
      (cd benchmarks && timeout ${GQA_BENCH_TIMEOUT:-900} python3 interleave_order.py ${GQA_ORDER_SHAPES:-2x4096x128 1x16384x128}) \
        > "$OUT/order.log" 2>&1 || status=1
      grep "ours/cudnn" "$OUT/order.log" ;;
    profile)
      # Nsight Compute with per-instruction stall samples over the decode rows in
      # GQA_PROFILE_ROWS (scripts/profile_gpu.sh, on the build already here).
      OUT=$OUT GQA_SKIP_BUILD=1 GQA_SASS=1 timeout ${GQA_PROFILE_TIMEOUT:-300} bash scripts/profile_gpu.sh \
        ${GQA_PROFILE_ROWS:-b1_l1024 b8_l32768} > "$OUT/profile.log" 2>&1 || status=1
      grep -v "^ *$" "$OUT/profile.log" | cut -c1-200 | tail -60
      rm -f "$OUT"/rep_*.ncu-rep ;;
    abprofile)
      # The "profile" step (Nsight Compute over GQA_PROFILE_ROWS, with the per-instruction stall
      # samples) in this tree and in each variant's, so that two forms of a kernel can be
      # profiled on one card in one call; each tree's logs under $OUT/profile_<tree>/.
      variant_trees
      for tree in "${trees[@]}"; do
        name=$(basename "$tree"); mkdir -p "$OUT/profile_$name"
        echo "== profile of $name"
        (cd "$tree" && OUT=$OUT/profile_$name GQA_SKIP_BUILD=1 GQA_SASS=1 timeout ${GQA_PROFILE_TIMEOUT:-300} \
          bash scripts/profile_gpu.sh ${GQA_PROFILE_ROWS:-g8_b16_l8192}) > "$OUT/profile_$name/profile.log" 2>&1 || status=1
        grep -v "^ *$" "$OUT/profile_$name/profile.log" | cut -c1-200 | tail -40
        rm -f "$OUT/profile_$name"/rep_*.ncu-rep
      done ;;
    e2e)
      (cd benchmarks && python3 bench_e2e.py ${GQA_E2E_ARGS:-}) > "$OUT/bench_e2e.log" 2>&1 || status=1
      tail -20 "$OUT/bench_e2e.log" ;;
    *)
      echo "gpu_check: unknown step '$step'"; status=2 ;;
  esac
done
if [ -z "${GQA_NESTED:-}" ]; then
  cp -r benchmarks/results "$OUT/" 2>/dev/null
  tar czf "$FINAL_OUT/gpu_logs.tgz" -C "$OUT" . && rm -rf "$OUT"
fi
exit $status
