// Hopper warpgroup MMA (wgmma, sm90a) for the prefill kernel: shared-memory matrix
// descriptors for 128-byte-swizzled tiles, the async-proxy fences, and the three shapes the
// prefill uses: S[64 x N] = Q K^T (N = 64, 80 or 128 keys; both operands in shared memory,
// K-major), and O[64 x D] += P V (P from registers in the mma.sync A-fragment layout, V in
// shared memory stored [keys][D], i.e. MN-major, transposed on the fly), N = 64 or 128 (D = 256
// is two n128 products).
//
// Tile layout (see blocked_offset): a tile of R rows and D columns is D/64 column blocks of
// [R][64] elements, 128 bytes per row, 16-byte chunk c of row r stored at chunk c ^ (r % 8);
// every 8-row atom (1024 bytes) starts 1024-byte aligned.
//
// Everything here is compiled only for sm90a; on other targets the functions trap, and the
// host never dispatches to them (prefill_mma.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "tma.cuh"

namespace gqa {
namespace cuda {
namespace wg {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GQA_WGMMA_ENABLED 1
#else
#define GQA_WGMMA_ENABLED 0
#endif

// Byte offset of 16-byte chunk `chunk` of row `row` in a blocked tile of `rows` rows.
__host__ __device__ constexpr uint32_t blocked_offset(int row, int chunk, int rows) {
  return static_cast<uint32_t>((chunk >> 3) * rows * 128 + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

// Byte offsets of the MN-major (V) descriptor: which field carries the stride between 64-wide
// column blocks and which the stride between 8-row atoms. scripts/wgmma_probe.cu settles it.
constexpr bool kMnMajorLeadingIsBlockStride = true;

// A shared-memory matrix descriptor: start address, leading / stride byte offsets, 128-byte
// swizzle. `smem_addr` is a shared-window address (__cvta_generic_to_shared).
__device__ __forceinline__ uint64_t descriptor(uint32_t smem_addr, uint32_t leading_bytes, uint32_t stride_bytes) {
  uint64_t d = static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>((leading_bytes >> 4) & 0x3FFF) << 16;
  d |= static_cast<uint64_t>((stride_bytes >> 4) & 0x3FFF) << 32;
  d |= static_cast<uint64_t>(1) << 62;  // 128-byte swizzle
  return d;
}

// The descriptor of the part `bytes` past a tile's start: the tile's descriptor with bytes / 16
// added to its start-address field, which cannot carry into the next field (shared-window
// addresses stay below 2^18, and the part lies inside the tile). So the tile's descriptor is
// built once and each MMA's descriptor costs one 32-bit add, where masking and shifting every
// part's own address put a chain of four uniform-datapath instructions in front of each wgmma.
__device__ __forceinline__ uint64_t advanced(uint64_t tile_desc, uint32_t bytes) {
  const uint32_t start = static_cast<uint32_t>(tile_desc) + (bytes >> 4);
  return (tile_desc & 0xFFFFFFFF00000000ull) | start;
}

// K-major operand (Q, K): k-step ks of 16 elements of a blocked tile of `rows` rows.
__device__ __forceinline__ uint64_t k_major(uint32_t tile, int rows, int ks) {
  return advanced(descriptor(tile, 16, 1024), (ks >> 2) * rows * 128 + (ks & 3) * 32);
}

// MN-major operand (V stored [keys][D]): k-step ks of 16 keys of a blocked tile of `rows` keys.
__device__ __forceinline__ uint64_t mn_major(uint32_t tile, int rows, int ks) {
  const uint32_t block_stride = rows * 128, atom_stride = 1024;
  const uint64_t tile_desc = kMnMajorLeadingIsBlockStride ? descriptor(tile, block_stride, atom_stride)
                                                          : descriptor(tile, atom_stride, block_stride);
  return advanced(tile_desc, ks * 16 * 128);
}

__device__ __forceinline__ void fence_operands() {
#if GQA_WGMMA_ENABLED
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void commit() {
#if GQA_WGMMA_ENABLED
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_all() {
#if GQA_WGMMA_ENABLED
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#endif
}
// Waits until at most N committed groups are still running (groups complete in order).
template <int N>
__device__ __forceinline__ void wait_pending() {
#if GQA_WGMMA_ENABLED
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// Ties registers to this point of the program: reads after it (and writes before it) cannot be
// moved across it. Without it the compiler may move arithmetic on an accumulator or an A
// operand of an MMA still in flight across the wait, and ptxas then serialises the MMAs.
template <int N>
__device__ __forceinline__ void pin_registers(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void pin_registers(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
// dst = src, one mov a register, each its own asm: ptxas can neither fold the copy into the code
// that computed src (the pipelined order's packing, which would then sink below a wgmma wait)
// nor drop it (C::kOneStep's P of the next tile, copied into the current tile's registers).
template <int N>
__device__ __forceinline__ void copy_registers(uint32_t (&dst)[N], const uint32_t (&src)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("mov.b32 %0, %1;" : "=r"(dst[i]) : "r"(src[i]));
}
// A barrier of this thread's warpgroup only (named barrier 1 + warpgroup; 0 is __syncthreads).
__device__ __forceinline__ void warpgroup_barrier() {
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + static_cast<int>(threadIdx.x >> 7)) : "memory");
}
// Named barrier `id` over `threads` threads: wait for all of them, or only count this warp in.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// ---- warp specialisation: the register split (the mbarriers are in common.cuh) ------------
using detail::mbarrier_arrive;
using detail::mbarrier_arrive_expect_bytes;
using detail::mbarrier_init;
using detail::mbarrier_wait;
using detail::tma_load_4d;

// The register split between the loading warpgroup and the computing ones (all four warps of a
// warpgroup execute it together).
template <int kRegs>
__device__ __forceinline__ void release_registers() {
#if GQA_WGMMA_ENABLED
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}
template <int kRegs>
__device__ __forceinline__ void claim_registers() {
#if GQA_WGMMA_ENABLED
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}
using detail::generic_to_async_proxy;

// The accumulator operand lists of the asm below: 32 or 64 "+f" registers.
#define GQA_WG_ACC32(d, o) "+f"(d[o + 0]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3]), "+f"(d[o + 4]), "+f"(d[o + 5]), "+f"(d[o + 6]), "+f"(d[o + 7]), "+f"(d[o + 8]), "+f"(d[o + 9]), "+f"(d[o + 10]), "+f"(d[o + 11]), "+f"(d[o + 12]), "+f"(d[o + 13]), "+f"(d[o + 14]), "+f"(d[o + 15]), "+f"(d[o + 16]), "+f"(d[o + 17]), "+f"(d[o + 18]), "+f"(d[o + 19]), "+f"(d[o + 20]), "+f"(d[o + 21]), "+f"(d[o + 22]), "+f"(d[o + 23]), "+f"(d[o + 24]), "+f"(d[o + 25]), "+f"(d[o + 26]), "+f"(d[o + 27]), "+f"(d[o + 28]), "+f"(d[o + 29]), "+f"(d[o + 30]), "+f"(d[o + 31])
#define GQA_WG_ACC64(d) GQA_WG_ACC32(d, 0), GQA_WG_ACC32(d, 32)
// 40 (m64n80, the 80-key tiles of route 9): 32 and 8 more.
#define GQA_WG_ACC40(d) GQA_WG_ACC32(d, 0), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])

// One k-step (16) of D[64 x N] (f32) += A[64 x 16] B[16 x N], N = 64 or 128 (SS also 80: S of an
// 80-key tile; its B is 10 8-row atoms, 1024 bytes apart as always); `accumulate` = 0
// overwrites D. SS: A and B from shared memory (K-major descriptors; S = Q K^T). RS: A from
// registers in the mma.sync A-fragment layout, B MN-major with the transpose bit (P V, V stored
// [keys][D]). T (__half or __nv_bfloat16) picks the input type.
template <typename T, int N>
__device__ __forceinline__ void ss_m64(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  static_assert(N == 64 || N == 80 || N == 128, "m64n64, m64n80 or m64n128");
#if GQA_WGMMA_ENABLED
  constexpr bool kHalf = std::is_same<T, __half>::value;
  if constexpr (N == 80 && kHalf) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %42, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n80k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}, %40, %41, p, 1, 1, 0, 0;\n}\n"
                 : GQA_WG_ACC40(d) : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  } else if constexpr (N == 80) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %42, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n80k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}, %40, %41, p, 1, 1, 0, 0;\n}\n"
                 : GQA_WG_ACC40(d) : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  } else if constexpr (N == 64 && kHalf) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : GQA_WG_ACC32(d, 0) : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  } else if constexpr (N == 64) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : GQA_WG_ACC32(d, 0) : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  } else if constexpr (kHalf) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : GQA_WG_ACC64(d) : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : GQA_WG_ACC64(d) : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  }
#else
  __trap();
#endif
}

template <typename T, int N>
__device__ __forceinline__ void rs_m64(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b, int accumulate) {
  static_assert(N == 64 || N == 128, "m64n64 or m64n128");
#if GQA_WGMMA_ENABLED
  constexpr bool kHalf = std::is_same<T, __half>::value;
  if constexpr (N == 64 && kHalf) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : GQA_WG_ACC32(d, 0) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
  } else if constexpr (N == 64) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : GQA_WG_ACC32(d, 0) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
  } else if constexpr (kHalf) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                 : GQA_WG_ACC64(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                 : GQA_WG_ACC64(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
  }
#else
  __trap();
#endif
}

#undef GQA_WG_ACC40
#undef GQA_WG_ACC64
#undef GQA_WG_ACC32

}  // namespace wg
}  // namespace cuda
}  // namespace gqa
