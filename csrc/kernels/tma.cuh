// TMA (sm90): a tensor map of a K or V cache, encoded on the host, and the load of one box of
// it into shared memory (128-byte swizzled: 16-byte chunk c of row r at chunk c ^ (r % 8),
// each 8-row atom 1024-byte aligned). Used by the wgmma prefill and the decode kernel.
#pragma once

#include <cuda.h>  // CUtensorMap (the encoder is fetched through the runtime, no -lcuda)
#include <cudaTypedefs.h>

#include "common.cuh"

namespace gqa {
namespace cuda {
namespace detail {

// A TMA map of one cache ([B][Hkv][C][D] in whatever order its strides say) in boxes of 64
// columns x `box_keys` keys, 128-byte swizzled as the blocked tiles are (wgmma.cuh). False when
// the driver has no encoder or refuses the layout; the caller then keeps cp.async.
inline bool encode_cache_map(CUtensorMap* map, const void* base, const Params& p, int box_keys) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (encode == nullptr) return false;
  const TokenStrides s = p.cache_strides;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(p.head_dim), static_cast<cuuint64_t>(p.capacity),
                              static_cast<cuuint64_t>(p.kv_heads), static_cast<cuuint64_t>(p.batch)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(s.token) * 2, static_cast<cuuint64_t>(s.head) * 2,
                                 static_cast<cuuint64_t>(s.batch) * 2};  // bytes, dims 1..3
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(box_keys), 1, 1};
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  const CUtensorMapDataType type =
      p.dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return encode(map, type, 4, const_cast<void*>(base), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// TMA: one box of a 4-D tensor map (a __grid_constant__ kernel parameter, by generic address)
// to shared memory; completes as bytes on the mbarrier.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void* tensor_map, int c0, int c1, int c2, int c3,
                                            uint32_t bar) {
#if GQA_ASYNC_COPY_ENABLED
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
#endif
}

// Fetches a tensor map (a __grid_constant__ kernel parameter) into the TMA unit's cache ahead
// of the first load through it.
__device__ __forceinline__ void tma_prefetch_map(const void* tensor_map) {
#if GQA_ASYNC_COPY_ENABLED
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(tensor_map)) : "memory");
#endif
}

}  // namespace detail
}  // namespace cuda
}  // namespace gqa
