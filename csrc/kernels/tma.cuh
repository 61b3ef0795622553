// TMA (sm90): tensor maps of a K or V cache, of an in-place call's new keys or values and of
// the queries, encoded on the host; the load of one box into shared memory (128-byte swizzled:
// 16-byte chunk c of row r at chunk c ^ (r % 8), each 8-row atom 1024-byte aligned) and the
// store of one back. Used by the wgmma prefill and the decode kernel.
#pragma once

#include <cuda.h>  // CUtensorMap (the encoder is fetched through the runtime, no -lcuda)
#include <cudaTypedefs.h>

#include "common.cuh"

namespace gqa {
namespace cuda {
namespace detail {

// The driver's tensor-map encoder, fetched through the runtime once (null when the driver has
// none).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// A 4-D fp16/bf16 tensor map (dims[0] contiguous; strides in elements for dims 1..3) in boxes
// whose rows are 64 elements (128 bytes), 128-byte swizzled as the blocked tiles are
// (wgmma.cuh); elements outside the tensor read as zeros. `promotion`: how much L2 fetches from
// memory around each box row (the prefill's maps keep the 256 bytes they always had; the
// decode's ask for 128, see launch_decode_mma_d). False when the driver has no encoder or
// refuses the layout; the caller then keeps cp.async.
inline bool encode_map_4d(CUtensorMap* map, const void* base, const Params& p, const int64_t (&dims)[4],
                          const int64_t (&strides)[3], const int (&box)[4],
                          CUtensorMapL2promotion promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr || box[0] != 64) return false;
  cuuint64_t g_dims[4];
  cuuint64_t g_strides[3];
  cuuint32_t g_box[4];
  for (int i = 0; i < 4; ++i) {
    g_dims[i] = static_cast<cuuint64_t>(dims[i]);
    g_box[i] = static_cast<cuuint32_t>(box[i]);
  }
  for (int i = 0; i < 3; ++i) g_strides[i] = static_cast<cuuint64_t>(strides[i]) * 2;  // bytes
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  const CUtensorMapDataType type =
      p.dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return encode(map, type, 4, const_cast<void*>(base), g_dims, g_strides, g_box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// A TMA map of one cache ([B][Hkv][C][D] in whatever order its strides say) in boxes of 64
// columns x `box_keys` keys, `promotion` as encode_map_4d's.
inline bool encode_cache_map(CUtensorMap* map, const void* base, const Params& p, int box_keys,
                             CUtensorMapL2promotion promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B) {
  const TokenStrides s = p.cache_strides;
  return encode_map_4d(map, base, p, {p.head_dim, p.capacity, p.kv_heads, p.batch}, {s.token, s.head, s.batch},
                       {64, box_keys, 1, 1}, promotion);
}

// A TMA map of the new keys or values of an in-place call ([B][S][Hkv][D] in whatever order
// `ns` says), with the cache maps' dimension order and box (64 columns x `box_keys` tokens), so
// that a box of tile t is read with the same coordinates from either.
inline bool encode_new_rows_map(CUtensorMap* map, const void* base, TokenStrides ns, const Params& p, int box_keys) {
  return encode_map_4d(map, base, p, {p.head_dim, p.query_len, p.kv_heads, p.batch}, {ns.token, ns.head, ns.batch},
                       {64, box_keys, 1, 1});
}

// A TMA map of the queries ([B][S][Hq][D] in whatever order `qs` says) whose box is 64 packed
// query rows of one kv head: 64 columns x the group's `G` heads x 64 / G tokens, so that row
// s * G + g of the box is head g of token s, as the prefill packs them. G must divide 64.
inline bool encode_query_map(CUtensorMap* map, const void* q, TokenStrides qs, const Params& p) {
  const int G = p.group_size;
  if (G <= 0 || 64 % G != 0) return false;
  return encode_map_4d(map, q, p, {p.head_dim, p.q_heads, p.query_len, p.batch}, {qs.head, qs.token, qs.batch},
                       {64, G, 64 / G, 1});
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

// L2 eviction policies for the copies below that take one (createpolicy: the whole access at
// that priority; a copy without one gets evict_normal). volatile, so that the compiler makes
// the policy where it is used instead of hoisting it out of loops into a register held
// throughout (that cost the 40-register prefill loader 28-64 bytes of spill).
enum class L2Evict { kFirst, kLast };
template <L2Evict kPriority>
__device__ __forceinline__ uint64_t l2_policy() {
  uint64_t policy = 0;
#if GQA_ASYNC_COPY_ENABLED
  if constexpr (kPriority == L2Evict::kLast)
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(policy));
  else
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
#endif
  return policy;
}

// tma_load_4d with an L2 eviction policy (l2_policy).
__device__ __forceinline__ void tma_load_4d_hint(uint32_t dst, const void* tensor_map, int c0, int c1, int c2, int c3,
                                                 uint32_t bar, uint64_t policy) {
#if GQA_ASYNC_COPY_ENABLED
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, %3, "
      "%4, %5}], [%6], %7;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar), "l"(policy)
      : "memory");
#endif
}

// Asks L2 to fetch [src, src + bytes) from memory (16-byte aligned, a multiple of 16 bytes);
// nothing is written and nothing waits for it. L2 is where every SM's reads and writes of
// global memory meet, so a line fetched early can never be stale: a later write by any kernel
// updates it there.
__device__ __forceinline__ void l2_prefetch_bulk(const void* src, uint32_t bytes) {
#if GQA_ASYNC_COPY_ENABLED
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src), "r"(bytes) : "memory");
#endif
}

// 4- and 16-byte global stores with an L2 eviction policy.
__device__ __forceinline__ void st_global_b32_hint(void* ptr, uint32_t value, uint64_t policy) {
#if GQA_ASYNC_COPY_ENABLED
  asm volatile("st.global.L2::cache_hint.b32 [%0], %1, %2;\n" ::"l"(ptr), "r"(value), "l"(policy) : "memory");
#else
  *static_cast<uint32_t*>(ptr) = value;
#endif
}
__device__ __forceinline__ void st_global_v4_hint(void* ptr, uint4 value, uint64_t policy) {
#if GQA_ASYNC_COPY_ENABLED
  asm volatile("st.global.L2::cache_hint.v4.b32 [%0], {%1, %2, %3, %4}, %5;\n" ::"l"(ptr), "r"(value.x), "r"(value.y),
               "r"(value.z), "r"(value.w), "l"(policy)
               : "memory");
#else
  *static_cast<uint4*>(ptr) = value;
#endif
}

// TMA: one box from shared memory to a 4-D tensor map's global memory (boxes past the tensor's
// bounds are clipped), in this thread's bulk-async group; bulk_commit closes the group.
// The shared memory must not be overwritten before bulk_wait_read, nor the kernel exit before
// bulk_wait_all.
__device__ __forceinline__ void tma_store_4d(const void* tensor_map, uint32_t src, int c0, int c1, int c2, int c3) {
#if GQA_ASYNC_COPY_ENABLED
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(tensor_map)),
               "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
#endif
}
// tma_store_4d with an L2 eviction policy (l2_policy).
__device__ __forceinline__ void tma_store_4d_hint(const void* tensor_map, uint32_t src, int c0, int c1, int c2, int c3,
                                                  uint64_t policy) {
#if GQA_ASYNC_COPY_ENABLED
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group.L2::cache_hint [%0, {%2, %3, %4, %5}], [%1], %6;\n" ::"l"(
          reinterpret_cast<uint64_t>(tensor_map)),
      "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "l"(policy)
      : "memory");
#endif
}
__device__ __forceinline__ void bulk_commit() {
#if GQA_ASYNC_COPY_ENABLED
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}
// Waits until this thread's committed bulk stores have read their shared memory.
__device__ __forceinline__ void bulk_wait_read() {
#if GQA_ASYNC_COPY_ENABLED
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
#endif
}
// Waits until this thread's committed bulk stores are complete.
__device__ __forceinline__ void bulk_wait_all() {
#if GQA_ASYNC_COPY_ENABLED
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
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
