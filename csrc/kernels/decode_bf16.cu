// Tensor-core decode instantiations for __nv_bfloat16 (one file per dtype so they build in parallel).
#include "decode_launch.cuh"
#include "kernels.h"

namespace gqa {
namespace cuda {
namespace detail {

bool launch_decode_mma_bf16(const Params& p, const Work& w, bool fused, cudaStream_t stream) {
  return launch_decode_mma_t<__nv_bfloat16>(p, w, fused, stream);
}

}  // namespace detail
}  // namespace cuda
}  // namespace gqa
