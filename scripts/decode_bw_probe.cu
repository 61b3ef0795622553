// Probe of the H200's ceilings for the decode kernel's memory pattern and launch chain.
//
// Not part of the extension. It answers two questions the decode kernel cannot answer about
// itself, because it always computes:
//   1. How fast can K/V caches laid out [B][Hkv][S][D] be streamed by CTAs of the decode grid
//      (split, kv head, row), with each loader design (TMA boxes a warp, whole-row TMA boxes from
//      one thread, cp.async tiles, plain 16-byte loads) and depth, when nothing is computed?
//   2. What does one kernel node of a CUDA graph cost, with and without programmatic dependent
//      launch, and when two kernels with different shared-memory needs alternate?
// Each loader variant is spelled out in full (not factored into shared helpers), so that each
// kernel reads alone as the pattern it measures.
// Build and run on the device: nvcc -O3 -std=c++17 -arch=sm_90a -lcuda scripts/decode_bw_probe.cu -o /tmp/probe && /tmp/probe
// (`/tmp/probe promotion` runs only the comparison of L2 fetch sizes: the 128- or 256-byte blocks
// that L2 fetches around each read, by plain loads, cp.async and the TMA maps' promotion.)
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#define CK(x)                                                                               \
  do {                                                                                      \
    cudaError_t e_ = (x);                                                                   \
    if (e_ != cudaSuccess) {                                                                \
      std::printf("CUDA error %s at line %d: %s\n", #x, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)

constexpr int kD = 128;  // head size of the probe's caches (bf16)

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ bool mbar_try(uint32_t bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(ok)
      : "r"(bar), "r"(parity)
      : "memory");
  return ok != 0;
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try(bar, parity)) {
  }
}
__device__ __forceinline__ void proxy_fence() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
template <bool kHint>
__device__ __forceinline__ void tma4(uint32_t dst, const CUtensorMap* m, int c0, int c1, int c2, int c3, uint32_t bar,
                                     uint64_t pol) {
  if constexpr (kHint) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, %3, %4, %5}], [%6], %7;" ::"r"(dst),
        "l"(m), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar), "l"(pol)
        : "memory");
  } else {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];" ::"r"(dst),
        "l"(m), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
  }
}
__device__ __forceinline__ void tma5(uint32_t dst, const CUtensorMap* m, int c0, int c1, int c2, int c3, int c4,
                                     uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5, %6}], [%7];" ::"r"(dst),
      "l"(m), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar)
      : "memory");
}

// (1a) The landed decode loader without its compute: lane 0 of each warp streams that warp's KPW
// keys of every tile (K and V, D/64 boxes of 64 columns each) onto the warp's own mbarriers.
template <int kStages, int kKpw, int kWarps, bool kHint>
__global__ void __launch_bounds__(kWarps * 32) k_tma_slices(const __grid_constant__ CUtensorMap mk,
                                                           const __grid_constant__ CUtensorMap mv, int S, int chunk,
                                                           unsigned* sink, int mode, int H, int rows) {
  extern __shared__ uint8_t sm_raw[];
  uint8_t* sm = sm_raw + ((1024u - (smem_u32(sm_raw) & 1023u)) & 1023u);
  __shared__ __align__(8) uint64_t bars[kWarps * kStages];
  constexpr int kTile = kWarps * kKpw;
  constexpr int kBox = kKpw * 128;  // bytes of one 64-column box
  constexpr int kSlice = kBox * (kD / 64);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // mode 0: the CTA reads keys [k0, k0 + chunk) of its (row, head), in order (the decode
  // kernel's split); 1: tiles split, split + splits, ... of its (row, head) (splits interleaved,
  // so the CTAs of one head read neighbouring tiles at the same time); 2: tile blockIdx.x +
  // t * gridDim.x of all rows and heads in memory order (a persistent, flat sweep).
  const int h = blockIdx.y, b = blockIdx.z;
  const int k0 = blockIdx.x * chunk, k1 = min(S, k0 + chunk);
  const int tiles_per_head = S / kTile;
  const int ntiles = mode == 0   ? (k1 - k0 + kTile - 1) / kTile
                     : mode == 1 ? tiles_per_head / gridDim.x
                                 : (tiles_per_head * H * rows) / gridDim.x;
  auto tile_coords = [&](int t, int& row, int& hh, int& bb) {
    if (mode == 0) {
      row = k0 + t * kTile, hh = h, bb = b;
    } else if (mode == 1) {
      row = (blockIdx.x + t * gridDim.x) * kTile, hh = h, bb = b;
    } else {
      const int g = blockIdx.x + t * gridDim.x;
      const int bh = g / tiles_per_head;
      row = (g - bh * tiles_per_head) * kTile, hh = bh % H, bb = bh / H;
    }
  };
  const uint32_t bar0 = smem_u32(&bars[warp * kStages]);
  uint8_t* mine = sm + warp * kStages * 2 * kSlice;
  const uint64_t pol = kHint ? evict_first_policy() : 0;
  if (lane == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(bar0 + 8 * s, 1);
  }
  __syncwarp();
  proxy_fence();
  auto issue = [&](int t) {
    const int st = t % kStages;
    const uint32_t bar = bar0 + 8 * st;
    mbar_expect(bar, 2 * kSlice);
    int row, hh, bb;
    tile_coords(t, row, hh, bb);
    row += warp * kKpw;
    const uint32_t dst = smem_u32(mine + st * 2 * kSlice);
#pragma unroll
    for (int cb = 0; cb < kD / 64; ++cb) {
      tma4<kHint>(dst + cb * kBox, &mk, cb * 64, row, hh, bb, bar, pol);
      tma4<kHint>(dst + kSlice + cb * kBox, &mv, cb * 64, row, hh, bb, bar, pol);
    }
  };
  if (lane == 0) {
    for (int t = 0; t < kStages - 1 && t < ntiles; ++t) issue(t);
  }
  unsigned acc = 0;
  for (int t = 0; t < ntiles; ++t) {
    const int nt = t + kStages - 1;
    __syncwarp();
    proxy_fence();
    if (lane == 0 && nt < ntiles) issue(nt);
    const int st = t % kStages;
    mbar_wait(bar0 + 8 * st, (t / kStages) & 1);
    acc += reinterpret_cast<const unsigned*>(mine + st * 2 * kSlice)[lane];
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

// (1b) Whole rows: one thread streams kKeys keys x D columns of K and of V per stage, each one
// TMA box of a 5-D view (64 columns, D/64 halves, keys, heads, rows): one request per stream a
// stage, every request contiguous in global memory.
template <int kStages, int kKeys>
__global__ void __launch_bounds__(32) k_tma_rows(const __grid_constant__ CUtensorMap mk,
                                                 const __grid_constant__ CUtensorMap mv, int S, int chunk,
                                                 unsigned* sink) {
  extern __shared__ uint8_t sm_raw[];
  uint8_t* sm = sm_raw + ((1024u - (smem_u32(sm_raw) & 1023u)) & 1023u);
  __shared__ __align__(8) uint64_t bars[kStages];
  constexpr int kBytes = kKeys * kD * 2;
  const int lane = threadIdx.x;
  const int h = blockIdx.y, b = blockIdx.z;
  const int k0 = blockIdx.x * chunk, k1 = min(S, k0 + chunk);
  const int ntiles = (k1 - k0 + kKeys - 1) / kKeys;
  const uint32_t bar0 = smem_u32(&bars[0]);
  if (lane == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(bar0 + 8 * s, 1);
  }
  __syncwarp();
  proxy_fence();
  auto issue = [&](int t) {
    const int st = t % kStages;
    const uint32_t bar = bar0 + 8 * st;
    mbar_expect(bar, 2 * kBytes);
    const uint32_t dst = smem_u32(sm + st * 2 * kBytes);
    tma5(dst, &mk, 0, 0, k0 + t * kKeys, h, b, bar);
    tma5(dst + kBytes, &mv, 0, 0, k0 + t * kKeys, h, b, bar);
  };
  if (lane == 0) {
    for (int t = 0; t < kStages - 1 && t < ntiles; ++t) issue(t);
  }
  unsigned acc = 0;
  for (int t = 0; t < ntiles; ++t) {
    const int nt = t + kStages - 1;
    __syncwarp();
    proxy_fence();
    if (lane == 0 && nt < ntiles) issue(nt);
    const int st = t % kStages;
    mbar_wait(bar0 + 8 * st, (t / kStages) & 1);
    acc += reinterpret_cast<const unsigned*>(sm + st * 2 * kBytes)[lane];
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

// (1c) cp.async tiles of 64 keys by 128 threads, kStages deep, one CTA barrier a tile (the
// decode kernel's other loader). kFetch: the L2 prefetch size each copy asks for (0 none, else
// 128 or 256 bytes).
template <int kStages, int kFetch = 0>
__global__ void __launch_bounds__(128) k_cp_async(const uint16_t* K, const uint16_t* V, int S, int H, int chunk,
                                                 unsigned* sink) {
  extern __shared__ uint8_t sm_raw[];
  constexpr int kStride = kD + 8;
  uint16_t* sm = reinterpret_cast<uint16_t*>(sm_raw);
  const int tid = threadIdx.x;
  const int h = blockIdx.y, b = blockIdx.z;
  const int k0 = blockIdx.x * chunk, k1 = min(S, k0 + chunk);
  const int ntiles = (k1 - k0 + 63) / 64;
  const size_t head = (static_cast<size_t>(b) * H + h) * S * kD;
  const int c = tid % 16, r0 = tid / 16;
  auto load = [&](int t, int st) {
    uint16_t* ks = sm + st * 2 * 64 * kStride;
    for (int pass = 0; pass < 8; ++pass) {
      const int r = r0 + pass * 8;
      const size_t g = head + static_cast<size_t>(k0 + t * 64 + r) * kD + c * 8;
      const uint32_t dk = smem_u32(ks + r * kStride + c * 8), dv = smem_u32(ks + (64 + r) * kStride + c * 8);
      if constexpr (kFetch == 256) {
        asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(dk), "l"(K + g) : "memory");
        asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(dv), "l"(V + g) : "memory");
      } else if constexpr (kFetch == 128) {
        asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;" ::"r"(dk), "l"(K + g) : "memory");
        asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;" ::"r"(dv), "l"(V + g) : "memory");
      } else {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dk), "l"(K + g) : "memory");
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dv), "l"(V + g) : "memory");
      }
    }
  };
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ntiles) load(s, s);
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
  unsigned acc = 0;
  for (int t = 0; t < ntiles; ++t) {
    __syncthreads();
    const int nt = t + kStages - 1;
    if (nt < ntiles) load(nt, nt % kStages);
    asm volatile("cp.async.commit_group;" ::: "memory");
    asm volatile("cp.async.wait_group %0;" ::"n"(kStages - 1) : "memory");
    __syncthreads();
    acc += reinterpret_cast<const unsigned*>(sm + (t % kStages) * 2 * 64 * kStride)[tid];
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

// (1d) x.sum()-like: plain 16-byte loads, kUnroll in flight a thread, grid-stride over K then V.
template <int kUnroll>
__global__ void __launch_bounds__(256) k_ldg(const uint4* K, const uint4* V, size_t n, unsigned* sink) {
  unsigned acc = 0;
  for (int which = 0; which < 2; ++which) {
    const uint4* src = which ? V : K;
    const size_t step = static_cast<size_t>(gridDim.x) * blockDim.x * kUnroll;
    for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x * kUnroll + threadIdx.x; i < n; i += step) {
      uint4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const size_t j = i + static_cast<size_t>(u) * blockDim.x;
        v[u] = j < n ? __ldcs(src + j) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) acc ^= v[u].x ^ v[u].w;
    }
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

// (1e) the decode split's pattern with plain loads: each CTA streams keys [k0, k0 + chunk) of
// its (row, head), K and V alternately, kUnroll 16-byte loads of each in flight a thread.
template <int kUnroll, int kThreads = 256>
__global__ void __launch_bounds__(kThreads) k_ldg_split(const uint4* K, const uint4* V, int S, int H, int chunk,
                                                  unsigned* sink) {
  const int h = blockIdx.y, b = blockIdx.z;
  const size_t base = ((static_cast<size_t>(b) * H + h) * S + static_cast<size_t>(blockIdx.x) * chunk) * (kD / 8);
  const size_t n = static_cast<size_t>(chunk) * (kD / 8);
  unsigned acc = 0;
  for (size_t i = threadIdx.x; i < n; i += kThreads * kUnroll) {
    uint4 a[kUnroll], c[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const size_t j = i + u * kThreads;
      a[u] = j < n ? __ldcs(K + base + j) : make_uint4(0, 0, 0, 0);
      c[u] = j < n ? __ldcs(V + base + j) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= a[u].x ^ c[u].w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

// A streamed 16-byte load asking L2 for kFetch bytes around it (0: the sectors read).
template <int kFetch>
__device__ __forceinline__ uint4 ld_k(const uint4* p) {
  uint4 v;
  if constexpr (kFetch == 256) {
    asm volatile("ld.global.cs.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  } else if constexpr (kFetch == 128) {
    asm volatile("ld.global.cs.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  } else {
    v = __ldcs(p);
  }
  return v;
}
// (1f) K into registers by plain 16-byte loads (a warp's 16 keys: 8 loads a lane, the next
// tile's issued before this one is used), V by TMA slices as the landed loader: is the ceiling
// of the smem-staged loaders one of the path, which plain loads would sidestep for half the bytes?
// kRegsKOrder: K in the landed regs_k loader's order instead (lane (l & 3) of key row l >> 2
// loads 16-byte units u * 32 + (l & 3) * 8 of its key, u < 4, for keys l >> 2 and 8 + (l >> 2)
// of the warp's 16: one warp instruction reads 64 bytes of each of 8 keys, where in key order it
// reads 512 contiguous bytes). kFetch: the L2 prefetch size the K loads ask for (0 none, else
// 128 or 256 bytes).
template <int kStages, bool kRegsKOrder = false, int kFetch = 0>
__global__ void __launch_bounds__(128) k_mixed(const uint4* K, const __grid_constant__ CUtensorMap mv, int S, int H,
                                              int chunk, unsigned* sink) {
  extern __shared__ uint8_t sm_raw[];
  uint8_t* sm = sm_raw + ((1024u - (smem_u32(sm_raw) & 1023u)) & 1023u);
  __shared__ __align__(8) uint64_t bars[4 * kStages];
  constexpr int kSlice = 16 * kD * 2;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int h = blockIdx.y, b = blockIdx.z;
  const int k0 = blockIdx.x * chunk;
  const int ntiles = chunk / 64;
  const uint32_t bar0 = smem_u32(&bars[warp * kStages]);
  uint8_t* mine = sm + warp * kStages * kSlice;
  // This lane's first 16-byte unit of the warp's 16 keys, and where its unit u lies from there.
  const uint4* kb = K + ((static_cast<size_t>(b) * H + h) * S + k0 + warp * 16) * (kD / 8) +
                    (kRegsKOrder ? (lane >> 2) * (kD / 8) + (lane & 3) : lane);
  auto unit = [](int u) { return kRegsKOrder ? (u >> 2) * 8 * (kD / 8) + (u & 3) * 4 : u * 32; };
  if (lane == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(bar0 + 8 * s, 1);
  }
  __syncwarp();
  proxy_fence();
  auto issue = [&](int t) {
    const int st = t % kStages;
    const uint32_t bar = bar0 + 8 * st;
    mbar_expect(bar, kSlice);
    const uint32_t dst = smem_u32(mine + st * kSlice);
    for (int cb = 0; cb < kD / 64; ++cb) tma4<false>(dst + cb * 2048, &mv, cb * 64, k0 + t * 64 + warp * 16, h, b, bar, 0);
  };
  if (lane == 0) {
    for (int t = 0; t < kStages - 1 && t < ntiles; ++t) issue(t);
  }
  uint4 cur[8], nxt[8];
#pragma unroll
  for (int u = 0; u < 8; ++u) cur[u] = ld_k<kFetch>(kb + unit(u));
  unsigned acc = 0;
  for (int t = 0; t < ntiles; ++t) {
    const uint4* kt = kb + static_cast<size_t>(t + 1) * 64 * (kD / 8);
#pragma unroll
    for (int u = 0; u < 8; ++u) nxt[u] = t + 1 < ntiles ? ld_k<kFetch>(kt + unit(u)) : make_uint4(0, 0, 0, 0);
    const int nt = t + kStages - 1;
    __syncwarp();
    proxy_fence();
    if (lane == 0 && nt < ntiles) issue(nt);
    const int st = t % kStages;
    mbar_wait(bar0 + 8 * st, (t / kStages) & 1);
    acc += reinterpret_cast<const unsigned*>(mine + st * kSlice)[lane];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      acc ^= cur[u].x ^ cur[u].z;
      cur[u] = nxt[u];
    }
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

__global__ void k_fill(uint32_t* p, size_t n, uint32_t seed) {
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u + seed;
    x ^= x >> 13;
    p[i] = (x & 0x3fff3fffu) | 0x30003000u;  // finite bf16 pairs
  }
}

// (2) Launch-chain probes.
__global__ void k_empty(int pdl) {
  if (pdl) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  }
}
// A CTA that needs `smem` bytes of dynamic shared memory and reads then writes one word.
__global__ void k_touch(int pdl, unsigned* p) {
  extern __shared__ unsigned touch_sm[];
  if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (threadIdx.x == 0) {
    touch_sm[0] = p[blockIdx.x];
    p[blockIdx.x] = touch_sm[0] + 1;
  }
  if (pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

using EncodeFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

struct Bufs {
  uint16_t* K;
  uint16_t* V;
  int B, H, S;
  size_t bytes_each;
};

static float time_ms(cudaStream_t st, int reps, const std::function<void()>& body) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  body();  // warm-up
  CK(cudaStreamSynchronize(st));
  std::vector<float> t;
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(a, st));
    body();
    CK(cudaEventRecord(b, st));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  CK(cudaGetLastError());
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

static EncodeFn get_encoder() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q{};
  CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
  return reinterpret_cast<EncodeFn>(fn);
}

// The L2 promotion of the 4-D maps (the `promotion` section varies it).
static CUtensorMapL2promotion g_map_promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B;

// 4-D map [B][H][S][D] in boxes of 64 columns x box_keys keys, 128-byte swizzled.
static CUtensorMap map4(EncodeFn enc, void* base, const Bufs& m, int box_keys) {
  CUtensorMap t;
  const cuuint64_t dims[4] = {kD, (cuuint64_t)m.S, (cuuint64_t)m.H, (cuuint64_t)m.B};
  const cuuint64_t str[3] = {kD * 2ull, (cuuint64_t)m.S * kD * 2, (cuuint64_t)m.H * m.S * kD * 2};
  const cuuint32_t box[4] = {64, (cuuint32_t)box_keys, 1, 1}, unit[4] = {1, 1, 1, 1};
  if (enc(&t, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, base, dims, str, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
          CU_TENSOR_MAP_SWIZZLE_128B, g_map_promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
    std::printf("map4 encode failed\n");
    std::exit(1);
  }
  return t;
}
// 5-D view (64 columns, D/64 halves, S, H, B): a box of whole rows.
static CUtensorMap map5(EncodeFn enc, void* base, const Bufs& m, int box_keys) {
  CUtensorMap t;
  const cuuint64_t dims[5] = {64, kD / 64, (cuuint64_t)m.S, (cuuint64_t)m.H, (cuuint64_t)m.B};
  const cuuint64_t str[4] = {128, kD * 2ull, (cuuint64_t)m.S * kD * 2, (cuuint64_t)m.H * m.S * kD * 2};
  const cuuint32_t box[5] = {64, kD / 64, (cuuint32_t)box_keys, 1, 1}, unit[5] = {1, 1, 1, 1, 1};
  if (enc(&t, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 5, base, dims, str, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
          CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
    std::printf("map5 encode failed\n");
    std::exit(1);
  }
  return t;
}

template <class Kern>
static void set_smem(Kern k, size_t bytes) {
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
}

static void report(const char* name, const Bufs& m, int rows, int chunk, float ms, int ctas_per_sm) {
  const double bytes = 2.0 * rows * m.H * (double)m.S * kD * 2;
  std::printf("%-34s B=%-3d chunk=%-6d CTAs/SM=%d  %8.1f us  %5.2f TB/s  %5.1f%% of 4.8\n", name, rows, chunk,
              ctas_per_sm, ms * 1e3, bytes / (ms * 1e-3) / 1e12, 100.0 * bytes / (ms * 1e-3) / 4.8e12);
}

template <class Kern>
static int occupancy(Kern k, int threads, size_t smem) {
  int n = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k, threads, smem));
  return n;
}

template <int kStages, int kKpw, int kWarps, bool kHint>
static void run_slices(const char* name, EncodeFn enc, const Bufs& m, int rows, int chunk, cudaStream_t st, unsigned* sink,
                       int mode = 0) {
  const CUtensorMap mk = map4(enc, m.K, m, kKpw), mv = map4(enc, m.V, m, kKpw);
  const size_t smem = 1024 + (size_t)kWarps * kStages * 2 * kKpw * kD * 2;
  auto k = k_tma_slices<kStages, kKpw, kWarps, kHint>;
  set_smem(k, smem);
  const int occ = occupancy(k, kWarps * 32, smem);
  // mode 2: one CTA per slot, `chunk` ignored.
  const dim3 grid = mode == 2 ? dim3(132 * occ) : dim3(m.S / chunk, m.H, rows);
  const float ms = time_ms(st, 5, [&] { k<<<grid, kWarps * 32, smem, st>>>(mk, mv, m.S, chunk, sink, mode, m.H, rows); });
  report(name, m, rows, chunk, ms, occ);
}

template <int kStages, int kKeys>
static void run_rows(const char* name, EncodeFn enc, const Bufs& m, int rows, int chunk, cudaStream_t st, unsigned* sink) {
  const CUtensorMap mk = map5(enc, m.K, m, kKeys), mv = map5(enc, m.V, m, kKeys);
  const size_t smem = 1024 + (size_t)kStages * 2 * kKeys * kD * 2;
  auto k = k_tma_rows<kStages, kKeys>;
  set_smem(k, smem);
  const dim3 grid(m.S / chunk, m.H, rows);
  const float ms = time_ms(st, 5, [&] { k<<<grid, 32, smem, st>>>(mk, mv, m.S, chunk, sink); });
  report(name, m, rows, chunk, ms, occupancy(k, 32, smem));
}

template <int kStages, int kFetch = 0>
static void run_cp(const char* name, const Bufs& m, int rows, int chunk, cudaStream_t st, unsigned* sink) {
  const size_t smem = (size_t)kStages * 2 * 64 * (kD + 8) * 2;
  auto k = k_cp_async<kStages, kFetch>;
  set_smem(k, smem);
  const dim3 grid(m.S / chunk, m.H, rows);
  const float ms = time_ms(st, 5, [&] { k<<<grid, 128, smem, st>>>(m.K, m.V, m.S, m.H, chunk, sink); });
  report(name, m, rows, chunk, ms, occupancy(k, 128, smem));
}

template <int kUnroll>
static void run_ldg(const char* name, const Bufs& m, int rows, int blocks, cudaStream_t st, unsigned* sink) {
  const size_t n = (size_t)rows * m.H * m.S * kD * 2 / 16;
  auto k = k_ldg<kUnroll>;
  const float ms = time_ms(st, 5, [&] {
    k<<<blocks, 256, 0, st>>>(reinterpret_cast<const uint4*>(m.K), reinterpret_cast<const uint4*>(m.V), n, sink);
  });
  report(name, m, rows, blocks, ms, occupancy(k, 256, 0));
}

template <int kUnroll, int kThreads = 256>
static void run_ldg_split(const char* name, const Bufs& m, int rows, int chunk, cudaStream_t st, unsigned* sink,
                          int max_ctas_per_sm = 0) {
  auto k = k_ldg_split<kUnroll, kThreads>;
  const dim3 grid(m.S / chunk, m.H, rows);
  // Optionally limit residency with unused dynamic shared memory (as the decode kernel's stages do).
  const size_t smem = max_ctas_per_sm ? (228 * 1024) / max_ctas_per_sm - 2048 : 0;
  if (smem) set_smem(k, smem);
  const float ms = time_ms(st, 5, [&] {
    k<<<grid, kThreads, smem, st>>>(reinterpret_cast<const uint4*>(m.K), reinterpret_cast<const uint4*>(m.V), m.S, m.H, chunk, sink);
  });
  report(name, m, rows, chunk, ms, occupancy(k, kThreads, smem));
}

template <int kStages, bool kRegsKOrder = false, int kFetch = 0>
static void run_mixed(const char* name, EncodeFn enc, const Bufs& m, int rows, int chunk, cudaStream_t st, unsigned* sink) {
  const CUtensorMap mv = map4(enc, m.V, m, 16);
  const size_t smem = 1024 + (size_t)4 * kStages * 16 * kD * 2;
  auto k = k_mixed<kStages, kRegsKOrder, kFetch>;
  set_smem(k, smem);
  const dim3 grid(m.S / chunk, m.H, rows);
  const float ms = time_ms(st, 5, [&] {
    k<<<grid, 128, smem, st>>>(reinterpret_cast<const uint4*>(m.K), mv, m.S, m.H, chunk, sink);
  });
  report(name, m, rows, chunk, ms, occupancy(k, 128, smem));
}

// Per-node cost of a graph of `n` launches (alternating two kernels when `alt`).
static void graph_probe(const char* name, cudaStream_t st, int n, dim3 g1, size_t s1, dim3 g2, size_t s2, bool alt,
                        bool pdl, unsigned* buf) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < n; ++i) {
    const bool second = alt && (i & 1);
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = second ? g2 : g1;
    cfg.blockDim = dim3(128);
    cfg.dynamicSmemBytes = std::max<size_t>(16, second ? s2 : s1);  // k_touch stages one word
    cfg.stream = st;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    CK(cudaLaunchKernelEx(&cfg, k_touch, pdl ? 1 : 0, buf));
  }
  CK(cudaStreamEndCapture(st, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  const float ms = time_ms(st, 20, [&] { CK(cudaGraphLaunch(exec, st)); });
  std::printf("%-58s %6.2f us a node\n", name, ms * 1e3 / n);
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
}

int main(int argc, char** argv) {
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  unsigned* sink;
  CK(cudaMalloc(&sink, 1 << 20));
  CK(cudaMemset(sink, 0, 1 << 20));

  // `promotion`: only the L2 prefetch-size comparison (twenty-seventh round), twice over.
  const bool promotion_only = argc > 1 && std::string(argv[1]) == "promotion";
  if (!promotion_only) {
  // (2) launch chain first (needs no big buffers).
  std::printf("== graph node cost (64 nodes, 20 replays, median) ==\n");
  const size_t big = 100 * 1024;
  CK(cudaFuncSetAttribute(k_touch, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)big));
  for (int pdl = 0; pdl < 2; ++pdl) {
    char nm[128];
    std::snprintf(nm, sizeof nm, "1 CTA, no smem, pdl=%d", pdl);
    graph_probe(nm, st, 64, dim3(1), 0, dim3(1), 0, false, pdl, sink);
    std::snprintf(nm, sizeof nm, "128 CTAs, 100 KB smem, pdl=%d", pdl);
    graph_probe(nm, st, 64, dim3(128), big, dim3(128), big, false, pdl, sink);
    std::snprintf(nm, sizeof nm, "alternating 128 CTAs 100 KB / 32 CTAs no smem, pdl=%d", pdl);
    graph_probe(nm, st, 64, dim3(128), big, dim3(32), 0, true, pdl, sink);
  }
  CK(cudaFuncSetAttribute(k_touch, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
  graph_probe("alternating, carveout pinned to max shared, pdl=1", st, 64, dim3(128), big, dim3(32), 0, true, true, sink);
  }

  // (1) streaming.
  Bufs m{nullptr, nullptr, 64, 8, 32768, 0};
  m.bytes_each = (size_t)m.B * m.H * m.S * kD * 2;
  CK(cudaMalloc(&m.K, m.bytes_each));
  CK(cudaMalloc(&m.V, m.bytes_each));
  k_fill<<<132 * 8, 256, 0, st>>>(reinterpret_cast<uint32_t*>(m.K), m.bytes_each / 4, 1u);
  k_fill<<<132 * 8, 256, 0, st>>>(reinterpret_cast<uint32_t*>(m.V), m.bytes_each / 4, 2u);
  CK(cudaStreamSynchronize(st));
  const EncodeFn enc = get_encoder();
  if (promotion_only) {
    std::printf("== L2 prefetch size of the K/V reads, [B][8][32768][128] bf16, nothing computed ==\n");
    const CUtensorMapL2promotion promos[3] = {CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                              CU_TENSOR_MAP_L2_PROMOTION_NONE};
    const char* promo_names[3] = {"256B", "128B", "none"};
    for (int round = 0; round < 2; ++round) {
      for (const auto& rc : {std::pair<int, int>{64, 8192}, {8, 16384}, {8, 4096}}) {
        const int rows = rc.first, chunk = rc.second;
        for (int pi = 0; pi < 3; ++pi) {
          g_map_promotion = promos[pi];
          char nm[96];
          std::snprintf(nm, sizeof nm, "tma slices, maps %s", promo_names[pi]);
          run_slices<3, 16, 4, false>(nm, enc, m, rows, chunk, st, sink, 0);
          std::snprintf(nm, sizeof nm, "regs_k K sectors, V map %s", promo_names[pi]);
          run_mixed<5, true, 0>(nm, enc, m, rows, chunk, st, sink);
          std::snprintf(nm, sizeof nm, "regs_k K L2::128B, V map %s", promo_names[pi]);
          run_mixed<5, true, 128>(nm, enc, m, rows, chunk, st, sink);
        }
        g_map_promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B;
        run_cp<3>("cp.async 3 st, sectors", m, rows, chunk, st, sink);
        run_cp<3, 128>("cp.async 3 st, L2::128B", m, rows, chunk, st, sink);
      }
    }
    CK(cudaDeviceSynchronize());
    return 0;
  }
  std::printf("== streaming [B][8][32768][128] bf16 K and V, nothing computed ==\n");
  for (int rows : {64, 8}) {
    for (int chunk : {32768, 4096, 1024}) {
      if (rows == 8 && chunk == 32768) continue;
      run_ldg_split<4>("ldg split, 256 thr x4 K+V", m, rows, chunk, st, sink);
      run_ldg_split<8, 128>("ldg split, 128 thr x8, 2 CTAs/SM", m, rows, chunk, st, sink, 2);
      run_ldg_split<4, 128>("ldg split, 128 thr x4, 2 CTAs/SM", m, rows, chunk, st, sink, 2);
      run_ldg_split<8, 128>("ldg split, 128 thr x8, 4 CTAs/SM", m, rows, chunk, st, sink, 4);
      run_slices<3, 16, 4, false>("tma slices (landed)", enc, m, rows, chunk, st, sink, 0);
      run_mixed<3>("K by ldg, V by tma, 3 st", enc, m, rows, chunk, st, sink);
      run_mixed<5>("K by ldg, V by tma, 5 st", enc, m, rows, chunk, st, sink);
      run_slices<2, 16, 1, false>("tma slices, 1-warp CTAs, 2 st", enc, m, rows, chunk, st, sink, 0);
      run_slices<4, 16, 1, false>("tma slices, 1-warp CTAs, 4 st", enc, m, rows, chunk, st, sink, 0);
    }
  }
  CK(cudaDeviceSynchronize());
  return 0;
}
