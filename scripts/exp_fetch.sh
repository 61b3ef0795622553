set -u
export CC=/usr/bin/gcc CXX=/usr/bin/g++ PYTHONPATH=$PWD PYTHONUNBUFFERED=1
s=$(date +%s)
TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 GQA_REQUIRE_CUDA=1 python3 setup.py build_ext --inplace > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
echo "built $(( $(date +%s) - s )) s"
OMP_NUM_THREADS=8 timeout 130 python3 -m pytest tests/test_cuda.py -q -p no:cacheprovider -k "l2_fetch_switch" > $OUT/ta.log 2>&1 &
OMP_NUM_THREADS=8 timeout 130 python3 -m pytest tests/test_cuda.py -q -p no:cacheprovider -k "(decode_loaders and (cp_async or regs_k)) or (split_shapes and kernel)" > $OUT/tb.log 2>&1 &
wait
tail -1 $OUT/ta.log; tail -1 $OUT/tb.log; echo "tests done $(( $(date +%s) - s )) s"
(cd benchmarks && timeout 130 python3 bench_decode.py --no-flex --only decode > $OUT/bench.log 2>&1); cp benchmarks/results/decode.* $OUT/ 2>/dev/null
grep -E "^\| (1|16) " $OUT/bench.log | head -20; echo "end $(( $(date +%s) - s )) s"
