// Shared pieces of the CUDA kernels: dtype conversion, the error word, RoPE on one head row,
// tensor-core fragments (ldmatrix / mma.sync m16n8k16), cp.async, sm90 mbarriers,
// programmatic dependent launch, and the host-side launch helper. No torch here.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "../core/errors.h"
#include "../core/params.h"
#include "../core/plan.h"

namespace gqa {
namespace cuda {
namespace detail {

constexpr float kLog2e = 1.4426950408889634f;

// Split-K scratch (plan.workspace): partial outputs normalised by their own sum, and their
// log2-sum-exp. Null when the plan has one split.
// The width of a decode timeline record (Work::timeline), in 64-bit fields.
constexpr int kDecodeTimelineFields = 16;

struct Work {
  float* partial_out = nullptr;  // [B, S, Hq, max_splits, D]: each split's normalised output
  float* partial_lse = nullptr;  // [B, S, Hq, max_splits]: its log-sum-exp, log2 domain
  int32_t max_splits = 1;
  int32_t min_split_keys = 1;
  // Decode on tensor cores: the grid's row index is a rank, and the CTA serves the batch row of
  // that rank in decreasing visible length (decode_schedule.cuh); 0: the row itself.
  int32_t longest_first = 0;
  // Decode on tensor cores with longest_first and the in-launch merge: the splits a row takes
  // when every row of the batch sees as many keys, fewer than max_splits (Plan::
  // equal_rows_splits; decode_schedule.cuh); 0: active_splits as for any batch.
  int32_t equal_rows_splits = 0;
  // Decode (Plan::one_cta_per_sm): the launch asks for more than half an SM's shared memory, so
  // that one CTA an SM fits.
  int32_t one_cta_per_sm = 0;
  // Decode, with equal_rows_splits: nearly equal rows take them too, where the shortest row sees
  // at least this many sixteenths of the longest one's keys (Plan::near_equal_sixteenths;
  // decode_schedule.cuh); 0: only equal rows.
  int32_t near_equal_sixteenths = 0;
  // Decode, with equal_rows_splits (Plan::equal_rows_tail_splits): the last
  // equal_rows_tail_items (row, kv head x head chunk) slots of a batch of equal rows take
  // equal_rows_tail_splits splits each, and a ragged batch's rows ragged_splits; the grid is
  // one-dimensional, of just the working CTAs (decode_schedule.cuh). 0: none.
  int32_t equal_rows_tail_splits = 0;
  int32_t equal_rows_tail_items = 0;
  int32_t ragged_splits = 0;
  // Decode: the per-stream arrival counters (Params::arrival_counters), one per (row, kv head,
  // head chunk), when the splits merge in the last CTA to arrive (decode_arrival.cuh); null
  // otherwise. They are zero between calls: the last CTA resets its counter.
  uint32_t* arrivals = nullptr;
  // Decode on tensor cores: each CTA issues its split's first tiles right after the PDL wait,
  // before the error word and the row checks (decode_mma.cuh); 0: after them.
  int32_t early_tiles = 0;
  // Decode on tensor cores: before the PDL wait, each CTA asks L2 for its split's first keys
  // and its query rows (decode_mma.cuh); 0: it does not.
  int32_t l2_prefetch = 0;
  // Decode on tensor cores: the TMA maps' L2 promotion, that is how much L2 fetches from memory
  // around each TMA copy of K and V: the whole aligned block of kL2Fetch128 or kL2Fetch256
  // bytes; kL2FetchSectors: only the sectors asked for. (The kernel's cp.async copies and
  // regs_k's K loads always ask for 128 bytes: decode_mma.cuh.)
  int32_t l2_fetch = 0;
  // Diagnostics (set_decode_timeline): each tensor-core decode CTA that computes writes a
  // record of kDecodeTimelineFields stamps here (decode_mma.cuh, DecodeTimelineField), the
  // record of its linear block index if that is below timeline_records; null: none.
  unsigned long long* timeline = nullptr;
  int32_t timeline_records = 0;
  // Decode on tensor cores with the in-launch merge (Plan::shares): the grid's CTAs each take an
  // equal share of the batch's keys (decode_schedule.cuh, shares_walk); 0: the grid of splits.
  // (Last, so that the other fields keep their offsets in the kernels' parameters.)
  int32_t shares = 0;
  // Under shares: the keys' worth of time an item costs besides its keys (shares_walk weighs
  // each item by its keys plus this; Plan::share_item_keys).
  int32_t share_item_keys = 0;
  // Under shares: equal rows whose items fill 7/8 of the grid or more take one CTA an item
  // (shares_walk); 0: their items are cut as any others are (a pin for tests and benchmarks).
  int32_t share_whole_items = 0;
};

// ------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------

[[noreturn]] inline void throw_cuda(cudaError_t e, const char* what) {
  throw std::runtime_error(std::string("gqa: CUDA launch of ") + what + " failed: " + cudaGetErrorString(e));
}

// An attribute of the current device, asked once per device (0 when it cannot be asked; no
// attribute used here is 0 on a real device, so 0 also marks "not asked yet").
template <cudaDeviceAttr kAttribute>
int device_attribute() {
  static std::atomic<int> known[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
  int v = known[dev].load(std::memory_order_relaxed);
  if (v == 0) {
    if (cudaDeviceGetAttribute(&v, kAttribute, dev) != cudaSuccess) v = 0;
    known[dev].store(v, std::memory_order_relaxed);
  }
  return v;
}

// Whether the current device is an sm90 part.
inline bool device_is_sm90() { return device_attribute<cudaDevAttrComputeCapabilityMajor>() == 9; }

// Tests (set_smem_limit_override, launch.h): a budget of dynamic shared memory a block below the
// current device's, so that an H100 or H200 can stand in for GPUs with less of it (99 KB a
// block on sm86, sm89 and sm120, 163 KB on sm80, against 227 KB on sm90) and without the sm90a
// kernels (sm90a_kernels_usable); 0: none.
extern std::atomic<int> g_smem_limit_override;

// The dynamic shared memory a block may opt in to on the current device, or the test budget
// where that is lower; 0 when the device cannot be asked.
inline int device_smem_limit() {
  const int device = device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>();
  const int budget = g_smem_limit_override.load(std::memory_order_relaxed);
  return budget > 0 && (device == 0 || budget < device) ? budget : device;
}

// Programmatic dependent launch lets a kernel's launch overlap the tail of the one before it;
// every kernel here waits (griddepcontrol.wait) before touching global memory that an earlier
// kernel may write (seqlens_k, which none of ours writes, is read before it: pdl_early_read),
// so it is safe after any predecessor. GQA_DISABLE_PDL=1 turns it off (for debugging).
bool pdl_enabled();

// Enqueues `kernel` (with programmatic dependent launch where pdl_enabled(), on sm90 devices and
// newer: the kernels' griddepcontrol instructions exist only in their sm90+ code, so an older
// device must run its launches in stream order); throws with the kernel's `name` if the launch
// fails.
template <typename... KArgs, typename... Args>
void launch_kernel(const char* name, void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                   cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  int n = 0;
  if (pdl_enabled() && device_attribute<cudaDevAttrComputeCapabilityMajor>() >= 9) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, args...);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    throw_cuda(e, name);
  }
  e = cudaGetLastError();
  if (e != cudaSuccess) throw_cuda(e, name);
}

[[noreturn]] inline void throw_smem(const char* name, size_t bytes, int limit) {
  throw std::runtime_error(std::string("gqa: ") + name + " needs " + std::to_string(bytes) +
                           " bytes of shared memory a block, and this GPU allows " + std::to_string(limit) +
                           " (a smaller head_size needs less)");
}

// Raises a kernel's dynamic shared-memory limit once per device (cudaFuncSetAttribute is
// per function; the cache keeps the per-call host cost at one cudaGetDevice). A size past the
// device's limit (or the test budget) throws, naming the kernel and both sizes.
template <auto Kernel>
void ensure_smem(size_t bytes, const char* name) {
  if (bytes <= 48 * 1024) return;
  // (The test budget is checked on every call: it may be set after the device's opt-in.)
  const int budget = g_smem_limit_override.load(std::memory_order_relaxed);
  if (budget > 0 && bytes > static_cast<size_t>(budget)) throw_smem(name, bytes, budget);
  static std::atomic<size_t> done[64];
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev >= 0 && dev < 64 && done[dev].load(std::memory_order_relaxed) >= bytes) return;
  const int limit = device_smem_limit();
  if (limit > 0 && bytes > static_cast<size_t>(limit)) throw_smem(name, bytes, limit);
  cudaError_t e = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    throw_cuda(e, name);
  }
  if (dev >= 0 && dev < 64) done[dev].store(bytes, std::memory_order_relaxed);
}

// Whether the build has sm90a code: the wgmma prefill (elsewhere wgmma.cuh traps) and the
// decode kernel's TMA loader need it on an sm90 device.
#ifdef GQA_BUILT_SM90A
constexpr bool kBuiltSm90a = true;
#else
constexpr bool kBuiltSm90a = false;
#endif

// Whether calls on the current device may take the kernels built from sm90a code (TMA decode
// loaders, the wgmma prefill): an sm90 device, an sm90a build, and no test budget (which stands
// in for another GPU).
inline bool sm90a_kernels_usable() {
  return kBuiltSm90a && device_is_sm90() && g_smem_limit_override.load(std::memory_order_relaxed) == 0;
}

// ------------------------------------------------------------------------------------------
// Device side
// ------------------------------------------------------------------------------------------

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000); }

// 2^x by the SFU alone (ex2.approx.ftz: -inf gives 0, NaN stays NaN). exp2f adds a fix-up of a
// few instructions for results below 2^-126, which this flushes to 0; the softmax weights are
// relative to a maximum of weight 1, so such a weight changes no fp32 sum it is added to.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
// log2(x) by the SFU alone (lg2.approx.ftz, absolute error about 2^-22): for the log-sum-exps
// of the decode splits, whose sums are 1 or more; log2f adds a fix-up for subnormal inputs.
__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Coherent read of the sticky error word (never cached in L1): a strong load at GPU scope. The
// word (cudaMalloc'd device memory) may be set by another stream's kernel at any time. (A
// volatile load is a system-scope one, LDG.E.STRONG.SYS, which device memory does not need.)
__device__ __forceinline__ uint32_t read_error_word(const uint32_t* w) {
  uint32_t v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(w) : "memory");
  return v;
}

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// A read of seqlens_k before pdl_wait(), so that its round trip runs under the previous
// kernel's tail. Safe for seqlens_k only: no kernel of this extension writes it, and each of
// them calls pdl_launch_dependents() only after its own pdl_wait(). So when a grid of ours
// starts, every kernel that could have written seqlens_k has completed, as long as the
// caller's kernel that wrote it did not trigger early (PyTorch's copy and elementwise kernels
// do not; README, Troubleshooting). q, k, v, the caches and the error word can be written by
// the kernel just before ours (the previous call's output fed back as q, the previous step's
// append): those are read after the wait. The read bypasses L1 (ld.global.cg), which two
// overlapping grids on one SM share.
__device__ __forceinline__ int pdl_early_read(const int32_t* ptr) { return __ldcg(ptr); }

// Diagnostics stamps (the decode and prefill timelines): the SM's cycle counter, the GPU's
// nanosecond timer (one clock for every SM) and the SM's index.
__device__ __forceinline__ unsigned long long sm_clock() { return static_cast<unsigned long long>(clock64()); }
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned sm_id() {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Visible keys [lo, hi) of a query at position `pos` in a row of `total` keys.
struct KeyRange {
  int32_t lo, hi;
};
// `window`: p.local_window (<= 0: off).
__device__ __forceinline__ KeyRange visible_keys(int32_t window, int32_t total, int32_t pos) {
  KeyRange r;
  r.hi = min(total, pos + 1);
  r.lo = window > 0 ? max(0, pos - window + 1) : 0;
  if (r.hi < r.lo) r.hi = r.lo;
  return r;
}
__device__ __forceinline__ KeyRange visible_keys(const Params& p, int32_t total, int32_t pos) {
  return visible_keys(p.local_window, total, pos);
}

// Multiplier that turns an unnormalised accumulator (relative to running max `m`, log2 units,
// with sum `l`) into the output: adds the head sink and the smooth-softmax zero logit to the
// denominator without overflow. Returns 0 when nothing is visible.
__device__ __forceinline__ float final_factor(const Params& p, int h, float m, float l) {
  float mx = m;
  float sink = -INFINITY;
  if (p.head_sink != nullptr) sink = p.head_sink[h] * kLog2e;
  mx = fmaxf(mx, sink);
  if (p.smooth_softmax) mx = fmaxf(mx, 0.f);
  if (mx == -INFINITY) return 0.f;
  const float s1 = (m == -INFINITY) ? 0.f : exp2f(m - mx);
  float den = l * s1;
  if (p.head_sink != nullptr) den += exp2f(sink - mx);
  if (p.smooth_softmax) den += exp2f(-mx);
  return (l > 0.f && den > 0.f) ? s1 / den : 0.f;
}
// final_factor for a kernel compiled for calls with no head sink and no smooth softmax when
// kPlain (the same value: s1 = 1 and den = l there).
template <bool kPlain>
__device__ __forceinline__ float final_factor_t(const Params& p, int h, float m, float l) {
  if constexpr (kPlain) {
    return (m != -INFINITY && l > 0.f) ? 1.f / l : 0.f;
  } else {
    return final_factor(p, h, m, l);
  }
}

// cos/sin of rotary pair i at position pos, in fp32, whatever dtype the cache holds.
__device__ __forceinline__ void rotary_cos_sin(const Params& p, int64_t pos, int i, float& c, float& s) {
  const int64_t idx = pos * (p.rotary_dim / 2) + i;
  switch (p.rotary_dtype) {
    case DType::kFloat32:
      c = static_cast<const float*>(p.cos_cache)[idx];
      s = static_cast<const float*>(p.sin_cache)[idx];
      break;
    case DType::kFloat16:
      c = to_f(static_cast<const __half*>(p.cos_cache)[idx]);
      s = to_f(static_cast<const __half*>(p.sin_cache)[idx]);
      break;
    default:
      c = to_f(static_cast<const __nv_bfloat16*>(p.cos_cache)[idx]);
      s = to_f(static_cast<const __nv_bfloat16*>(p.sin_cache)[idx]);
      break;
  }
}

// One head row of D values from `src`, with RoPE at `pos` when `rotate` (fp32 math, one
// rounding to T), handed to dst(d, value_as_T). Work is split over `nlanes` cooperating
// threads; `lane` is this thread's index among them. Dims >= R are copied unchanged.
template <typename T, typename Dst>
__device__ __forceinline__ void rope_row(const Params& p, const T* src, bool rotate, int64_t pos, int lane,
                                         int nlanes, Dst&& dst) {
  const int D = p.head_dim;
  const int half = rotate ? p.rotary_dim / 2 : 0;
  const int units = D - half;
  for (int u = lane; u < units; u += nlanes) {
    if (u < half) {
      const int d0 = p.rotary_interleaved ? 2 * u : u;
      const int d1 = p.rotary_interleaved ? 2 * u + 1 : u + half;
      const float x0 = to_f(src[d0]);
      const float x1 = to_f(src[d1]);
      float c, s;
      rotary_cos_sin(p, pos, u, c, s);
      // Explicit roundings (no FMA contraction), so fp32 matches the CPU backend bit for bit.
      dst(d0, from_f<T>(__fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s))));
      dst(d1, from_f<T>(__fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c))));
    } else {
      const int d = 2 * half + (u - half);
      dst(d, src[d]);
    }
  }
}

// rope_row in 16-byte units: src and dst rows 16-byte aligned, D a multiple of E = 16 /
// sizeof(T), and the rotary part whole chunks (half style: R / 2 a multiple of E, each unit a
// chunk and its partner R / 2 later; interleaved: R a multiple of E, each unit one chunk of E / 2
// pairs; the chunks past R are units of their own, copied). A unit's cos/sin values are
// contiguous and read as vectors (so the tables must be 16-byte aligned). Same arithmetic and
// roundings as rope_row; the caller checks rope_vec_ok.
GQA_HOST_DEVICE bool rope_vec_ok(const Params& p, int elem_bytes, bool rotate) {
  const int E = 16 / elem_bytes;
  if ((p.head_dim % E) != 0) return false;
  if (!rotate) return true;
  const bool tables16 = ((reinterpret_cast<uintptr_t>(p.cos_cache) | reinterpret_cast<uintptr_t>(p.sin_cache)) & 15u) == 0;
  return tables16 && (p.rotary_interleaved ? p.rotary_dim % E == 0 : (p.rotary_dim / 2) % E == 0);
}
// cos/sin of rotary pairs k0 .. k0 + N - 1 at `pos`, by vector loads (k0 and R / 2 multiples of N).
template <int N>
__device__ __forceinline__ void rotary_cos_sin_vec(const Params& p, int64_t pos, int k0, float (&c)[N], float (&s)[N]) {
  const int64_t idx = pos * (p.rotary_dim / 2) + k0;
  if (p.rotary_dtype == DType::kFloat32) {
    static_assert(N % 2 == 0, "pairs of floats at least");
#pragma unroll
    for (int j = 0; j < N; j += 2) {  // float2 steps: the compiler merges them into wider loads
      const float2 cv = reinterpret_cast<const float2*>(static_cast<const float*>(p.cos_cache) + idx)[j / 2];
      const float2 sv = reinterpret_cast<const float2*>(static_cast<const float*>(p.sin_cache) + idx)[j / 2];
      c[j] = cv.x;
      c[j + 1] = cv.y;
      s[j] = sv.x;
      s[j + 1] = sv.y;
    }
  } else {
    static_assert(N % 2 == 0, "pairs of halves at least");
    const bool bf = p.rotary_dtype == DType::kBFloat16;
#pragma unroll
    for (int j = 0; j < N; j += 2) {
      const uint32_t cw = reinterpret_cast<const uint32_t*>(static_cast<const uint16_t*>(p.cos_cache) + idx)[j / 2];
      const uint32_t sw = reinterpret_cast<const uint32_t*>(static_cast<const uint16_t*>(p.sin_cache) + idx)[j / 2];
      auto half_to_f = [bf](uint16_t h) {
        return bf ? __bfloat162float(__ushort_as_bfloat16(h)) : __half2float(__ushort_as_half(h));
      };
      c[j] = half_to_f(static_cast<uint16_t>(cw & 0xffffu));
      c[j + 1] = half_to_f(static_cast<uint16_t>(cw >> 16));
      s[j] = half_to_f(static_cast<uint16_t>(sw & 0xffffu));
      s[j + 1] = half_to_f(static_cast<uint16_t>(sw >> 16));
    }
  }
}
// The units of one row: rotation units first, then the chunks copied unchanged.
GQA_HOST_DEVICE int rope_vec_units(const Params& p, int elem_bytes, bool rotate) {
  const int E = 16 / elem_bytes;
  const int R = rotate ? p.rotary_dim : 0;
  return (p.rotary_interleaved ? R / E : R / (2 * E)) + (p.head_dim - R) / E;
}
// The 16-byte chunks that unit u of a row reads and writes (u < rope_vec_units): c0, and c1
// for the partner chunk of a rotate-half pair (else -1).
GQA_HOST_DEVICE void rope_unit_chunks(const Params& p, int elem_bytes, bool rotate, int u, int& c0, int& c1) {
  const int E = 16 / elem_bytes;
  const int R = rotate ? p.rotary_dim : 0;
  const int rot_units = p.rotary_interleaved ? R / E : R / (2 * E);
  c1 = -1;
  if (u >= rot_units) {
    c0 = R / E + (u - rot_units);
  } else {
    c0 = u;
    if (!p.rotary_interleaved) c1 = u + rot_units;
  }
}

// Unit u from its chunks as read (x0 at c0, x1 at c1: rope_unit_chunks): y0 for c0, y1 for
// c1 (rotate-half pairs only); a chunk past the rotary part is copied.
template <typename T>
__device__ __forceinline__ void rope_unit_rotate(const Params& p, uint4 x0v, uint4 x1v, bool rotate, int64_t pos, int u,
                                                 uint4& y0v, uint4& y1v) {
  constexpr int E = 16 / static_cast<int>(sizeof(T));
  const int R = rotate ? p.rotary_dim : 0;
  const bool inter = p.rotary_interleaved;
  const int rot_units = inter ? R / E : R / (2 * E);
  y0v = x0v;
  y1v = x1v;
  if (u >= rot_units) return;
  // Element j of a chunk as float, and the chunk from E floats (constant indices only, so
  // that nothing goes through local memory).
  auto unpack = [](uint4 v, float (&x)[E]) {
    const T* const e = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int j = 0; j < E; ++j) x[j] = to_f(e[j]);
  };
  auto pack = [](const float (&y)[E]) {
    uint4 v;
    T* const e = reinterpret_cast<T*>(&v);
#pragma unroll
    for (int j = 0; j < E; ++j) e[j] = from_f<T>(y[j]);
    return v;
  };
  // Explicit roundings (no FMA contraction), as rope_row.
  auto rot0 = [](float a, float b, float c, float s) { return __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)); };
  auto rot1 = [](float a, float b, float c, float s) { return __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c)); };
  float x0[E], y0[E];
  unpack(x0v, x0);
  if (inter) {  // pairs (2j, 2j + 1) of chunk u
    float c[E / 2], s[E / 2];
    rotary_cos_sin_vec<E / 2>(p, pos, u * (E / 2), c, s);
#pragma unroll
    for (int j = 0; j < E / 2; ++j) {
      y0[2 * j] = rot0(x0[2 * j], x0[2 * j + 1], c[j], s[j]);
      y0[2 * j + 1] = rot1(x0[2 * j], x0[2 * j + 1], c[j], s[j]);
    }
    y0v = pack(y0);
  } else {  // pairs (j of chunk u, j of chunk u + rot_units)
    float x1[E], y1[E], c[E], s[E];
    unpack(x1v, x1);
    rotary_cos_sin_vec<E>(p, pos, u * E, c, s);
#pragma unroll
    for (int j = 0; j < E; ++j) {
      y0[j] = rot0(x0[j], x1[j], c[j], s[j]);
      y1[j] = rot1(x0[j], x1[j], c[j], s[j]);
    }
    y0v = pack(y0);
    y1v = pack(y1);
  }
}

// Unit u of a row (u < rope_vec_units), from src to dst.
template <typename T>
__device__ __forceinline__ void rope_unit_vec(const Params& p, const T* src, T* dst, bool rotate, int64_t pos, int u) {
  int c0, c1;
  rope_unit_chunks(p, static_cast<int>(sizeof(T)), rotate, u, c0, c1);
  const uint4* const s4 = reinterpret_cast<const uint4*>(src);
  uint4* const d4 = reinterpret_cast<uint4*>(dst);
  uint4 y0, y1;
  rope_unit_rotate<T>(p, s4[c0], c1 >= 0 ? s4[c1] : make_uint4(0u, 0u, 0u, 0u), rotate, pos, u, y0, y1);
  d4[c0] = y0;
  if (c1 >= 0) d4[c1] = y1;
}

// ---- tensor cores ------------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
  __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Four consecutive output elements acc * f (fp16/bf16): one 8-byte store where dst is 8-byte
// aligned, else four.
template <typename T>
__device__ __forceinline__ void store_scaled4(T* dst, const float4& acc, float f) {
  if ((reinterpret_cast<uintptr_t>(dst) & 7u) == 0) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(pack2<T>(acc.x * f, acc.y * f), pack2<T>(acc.z * f, acc.w * f));
  } else {
    dst[0] = from_f<T>(acc.x * f);
    dst[1] = from_f<T>(acc.y * f);
    dst[2] = from_f<T>(acc.z * f);
    dst[3] = from_f<T>(acc.w * f);
  }
}

template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_ptr) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_ptr) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// The transpose of an 8x8 matrix of 16-bit elements held as an mma fragment (each thread two
// neighbours of a row), into the same fragment layout.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// How much L2 fetches from memory around a decode TMA copy (Work::l2_fetch, the maps' L2
// promotion): the sectors asked for, or the aligned 128- or 256-byte block.
enum L2Fetch : int { kL2FetchSectors = 0, kL2Fetch128 = 1, kL2Fetch256 = 2 };

// 16-byte global->shared copy; when !pred the destination is zero-filled and nothing is read.
// kL2Block128: L2 fetches the aligned 128 bytes around the read from memory (.L2::128B), not
// only the sectors read.
template <bool kL2Block128 = false>
__device__ __forceinline__ void cp_async16(void* smem_ptr, const void* gmem_ptr, bool pred) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
  const int n = pred ? 16 : 0;
  if constexpr (kL2Block128) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem_ptr), "r"(n));
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem_ptr), "r"(n));
  }
}
// A streamed 16-byte global load (ld.global.cs, as __ldcs) for which L2 fetches the aligned 128
// bytes around the read (.L2::128B). The asm is not volatile, as __ldcs is not: the compiler may
// schedule it like any load.
__device__ __forceinline__ uint4 ld_stream16_l2_128(const uint4* src) {
  uint4 v;
  asm("ld.global.cs.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(src));
  return v;
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---- sm90: shared-memory mbarriers (no-ops below sm90, never reached there) ----------------
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define GQA_ASYNC_COPY_ENABLED 1
#else
#define GQA_ASYNC_COPY_ENABLED 0
#endif
// An mbarrier completes a phase when `count` arrivals have happened (and, with expected bytes,
// when that many bytes of TMA copies have landed); waiters name the phase by its parity (0
// for the first, then alternating). `bar` is a shared-window address.
__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t count) {
#if GQA_ASYNC_COPY_ENABLED
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
#endif
}
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
#if GQA_ASYNC_COPY_ENABLED
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
#endif
}
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
#if GQA_ASYNC_COPY_ENABLED
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
#endif
}
// Arrival that also announces `bytes` of TMA data the phase must wait for.
__device__ __forceinline__ void mbarrier_arrive_expect_bytes(uint32_t bar, uint32_t bytes) {
#if GQA_ASYNC_COPY_ENABLED
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n" ::"r"(bar),
               "r"(bytes)
               : "memory");
#endif
}
// Generic-proxy accesses to shared memory (st.shared, ld/ldmatrix, cp.async) ordered before
// later async-proxy ones (wgmma reads, TMA writes).
__device__ __forceinline__ void generic_to_async_proxy() {
#if GQA_ASYNC_COPY_ENABLED
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

}  // namespace detail
}  // namespace cuda
}  // namespace gqa
