# The GPU test files, sourced by .ci/run and the device scripts (gpu_check.sh, gpu_pair.sh,
# gpu_validate.sh) so that the list lives in one place. test_cuda_other_gpus.py is not among them:
# it runs with the other test files.
CUDA_TEST_FILES="tests/test_cuda.py tests/test_cuda_decode.py tests/test_cuda_decode_batches.py tests/test_cuda_graphs.py"
