// The portable attention path and the split-K merge.
//
// generic_attn_kernel: any dtype (fp32 included), any even head size, any alignment. One warp
// per (query token, query head) row, CUDA cores, fp32 math. Keys go 32 at a time: each lane
// scores one key (its own dot product over D), the warp takes the chunk's max and updates the
// online softmax once, then every lane accumulates its own dims over the chunk's values.
// Decode (S == 1) uses the same split-K as the tensor-core path; prefill uses one split.
//
// merge_kernel: one CTA per (row, query token, query head): combines the active splits' partial
// outputs by their log-sum-exp, with the head sink / smooth-softmax logit in the denominator.
// Decode splits by row length; prefill (a short chunk on a long cache) splits every query
// block's key range into the plan's number of parts.
#include "kernels.h"

namespace gqa {
namespace cuda {
namespace detail {
namespace {

constexpr int kGenericWarps = 4;

template <typename T>
__global__ void __launch_bounds__(kGenericWarps * 32)
    generic_attn_kernel(const __grid_constant__ Params p, const Work w) {
  extern __shared__ float gsm[];  // per warp: q[D], o[D]
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int split = blockIdx.y;
  const int b = blockIdx.z;
  const int D = p.head_dim;
  const int Hq = p.q_heads;
  const int S = p.query_len;
  const int r = blockIdx.x * kGenericWarps + warp;

  pdl_wait();
  pdl_launch_dependents();
  if (r >= S * Hq) return;
  const int s = r / Hq;
  const int h = r - s * Hq;
  const int kvh = h / p.group_size;
  float* q_s = gsm + warp * 2 * D;
  float* o_s = q_s + D;
  const TokenStrides os = p.output_strides;
  T* out = static_cast<T*>(p.output) + b * os.batch + static_cast<int64_t>(s) * os.token + h * os.head;

  const RowGeometry g = row_geometry(p, p.seqlens_k[b]);
  const uint32_t word = read_error_word(p.error_word);
  if (word != 0 || g.flags != 0) {
    if (split == 0)
      for (int d = lane; d < D; d += 32) out[d] = from_f<T>(quiet_nan());
    return;
  }
  if (s >= g.valid_queries) {  // first-prompt padding
    if (split == 0)
      for (int d = lane; d < D; d += 32) out[d] = from_f<T>(0.f);
    return;
  }
  const KeyRange vis = visible_keys(p, g.total, g.query_start + s);
  const int n = vis.hi - vis.lo;
  const int active = S == 1 ? active_splits(n, w.max_splits, w.min_split_keys) : 1;
  if (split >= active) return;
  const int chunk = (n + active - 1) / active;
  const int k0 = vis.lo + split * chunk;
  const int k1 = min(vis.hi, k0 + chunk);
  const int64_t slot = (static_cast<int64_t>(b) * Hq + h) * w.max_splits + split;
  if (k0 >= k1) {
    if (active == 1) {
      for (int d = lane; d < D; d += 32) out[d] = from_f<T>(0.f);
    } else {  // an empty tail split: zero weight, and finite (zero) values for the merge
      for (int d = lane; d < D; d += 32) w.partial_out[slot * D + d] = 0.f;
      if (lane == 0) w.partial_lse[slot] = -INFINITY;
    }
    return;
  }

  {
    const TokenStrides qs = p.query_strides;
    const T* qsrc = static_cast<const T*>(p.query) + b * qs.batch + static_cast<int64_t>(s) * qs.token + h * qs.head;
    const int64_t pos = p.do_rotary ? rotary_position(p, g, b, s) : 0;
    rope_row<T>(p, qsrc, p.do_rotary, pos, lane, 32, [&](int d, T v) { q_s[d] = to_f(v); });
    for (int d = lane; d < D; d += 32) o_s[d] = 0.f;
    __syncwarp();
  }

  const TokenStrides cs = p.cache_strides;
  const T* kbase = static_cast<const T*>(p.key_cache) + b * cs.batch + kvh * cs.head;
  const T* vbase = static_cast<const T*>(p.value_cache) + b * cs.batch + kvh * cs.head;
  const float scale = p.scale;
  const float softcap = p.softcap;
  const int dgroups = (D + 31) / 32;
  float m = -INFINITY;
  float l_lane = 0.f;

  for (int j0 = k0; j0 < k1; j0 += 32) {
    const int j = j0 + lane;
    float x = -INFINITY;
    if (j < k1) {
      const T* kr = kbase + static_cast<int64_t>(j) * cs.token;
      float acc0 = 0.f, acc1 = 0.f;
      int d = 0;
      for (; d + 1 < D; d += 2) {
        acc0 = fmaf(q_s[d], to_f(kr[d]), acc0);
        acc1 = fmaf(q_s[d + 1], to_f(kr[d + 1]), acc1);
      }
      if (d < D) acc0 = fmaf(q_s[d], to_f(kr[d]), acc0);
      x = (acc0 + acc1) * scale;
      if (softcap > 0.f) x = softcap * tanhf(x / softcap);
      x *= kLog2e;
    }
    const float mn = fmaxf(m, warp_max(x));
    const float mu = mn == -INFINITY ? 0.f : mn;
    const float corr = exp2f(m - mu);
    m = mn;
    const float pj = exp2f(x - mu);
    l_lane = l_lane * corr + pj;
    const int cnt = min(32, k1 - j0);
    for (int i = 0; i < dgroups; ++i) {
      const int d = lane + 32 * i;
      const bool live = d < D;
      float acc = live ? o_s[d] * corr : 0.f;
      const T* vcol = vbase + static_cast<int64_t>(j0) * cs.token + (live ? d : 0);
      for (int k = 0; k < cnt; ++k) {
        const float pk = __shfl_sync(0xffffffffu, pj, k);
        if (live) acc = fmaf(pk, to_f(vcol[static_cast<int64_t>(k) * cs.token]), acc);
      }
      if (live) o_s[d] = acc;
    }
  }
  const float l = warp_sum(l_lane);
  __syncwarp();
  if (active == 1) {
    const float f = final_factor(p, h, m, l);
    for (int d = lane; d < D; d += 32) out[d] = from_f<T>(o_s[d] * f);
  } else {
    const float inv = 1.f / l;
    for (int d = lane; d < D; d += 32) w.partial_out[slot * D + d] = o_s[d] * inv;
    if (lane == 0) w.partial_lse[slot] = m + log2f(l);
  }
}

// One CTA of 256 threads per (row, query token, query head). Each split's weight comes from one
// thread (at most 128 splits); each of the 8 warps sums every 8th split over float2 pairs of
// dims, and the warps' sums meet in shared memory.
constexpr int kMergeThreads = 256;
constexpr int kMergeWarps = kMergeThreads / 32;
// The loads of one round: every split (kMergeWarps x kMergeSplitsPerWarp >= 128, the most
// splits) of kMergePairs column pairs a lane, that is the whole row at head sizes up to 128.
constexpr int kMergeSplitsPerWarp = 16;
constexpr int kMergePairs = 2;
static_assert(kMergeWarps * kMergeSplitsPerWarp >= 128, "one round of loads covers every split");

// L2 loads (the partials were written by other SMs) as volatile asm, so that the compiler keeps
// them where they are written: ahead of the error word's test, whose round trip they share.
__device__ __forceinline__ float2 ld_merge_pair(const float2* src) {
  float2 v;
  asm volatile("ld.global.cg.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(src));
  return v;
}
__device__ __forceinline__ float ld_merge_lse(const float* src) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(src));
  return v;
}

template <typename T>
__global__ void __launch_bounds__(kMergeThreads) merge_kernel(const __grid_constant__ Params p, const Work w) {
  extern __shared__ float macc[];  // [kMergeWarps][D]
  __shared__ float s_w[kMergeThreads];
  __shared__ float s_red[kMergeWarps];
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int idx = blockIdx.x;  // ((b * S) + s) * Hq + h
  const int per_row = p.query_len * p.q_heads;
  const int b = idx / per_row;
  const int s = (idx - b * per_row) / p.q_heads;
  const int h = idx - b * per_row - s * p.q_heads;
  const int D = p.head_dim;
  const TokenStrides os = p.output_strides;
  T* out = static_cast<T*>(p.output) + b * os.batch + static_cast<int64_t>(s) * os.token + h * os.head;
  // The row's geometry and split count come from seqlens_k, read before the PDL wait
  // (pdl_early_read): after the wait, only the error word and the partials are on the path.
  const RowGeometry g = row_geometry(p, pdl_early_read(p.seqlens_k + b));
  int active = w.max_splits;  // prefill split-K: every part wrote its partial (-inf where it saw no key)
  bool merges;                // this row's splits need merging (decode: else the kernel wrote it)
  if (p.query_len == 1) {     // decode: the splits this row's length uses
    const KeyRange vis = visible_keys(p, g.total, g.query_start);
    active = active_splits(vis.hi - vis.lo, w.max_splits, w.min_split_keys);
    merges = active > 1;
  } else {
    merges = s < g.valid_queries;  // first-prompt padding: exactly zero, below
  }
  merges = merges && g.flags == 0;
  pdl_wait();
  pdl_launch_dependents();

  // One round of loads: the error word, the log-sum-exps and the partial outputs go out before
  // any of them is used, so that the merge waits for one L2 round trip (it waited for three:
  // the word, then the weights with the first splits, then the rest).
  const uint32_t word = read_error_word(p.error_word);
  const int64_t base = static_cast<int64_t>(idx) * w.max_splits;
  const int n2 = D / 2;
  const float2* po = reinterpret_cast<const float2*>(w.partial_out + base * D);
  float2 v[kMergePairs][kMergeSplitsPerWarp];
  // Column pairs c0, c0 + 32, ... of every split this warp sums, zeros past its splits (a lane
  // past the row's end, in a warp that holds part of it, reads the row's last pair, never
  // summed). Each address is one 32-bit multiply-add from the warp's first, and the bounds are
  // warp-uniform breaks: with a 64-bit product and a predicate a load, the last load went out
  // 300-400 instructions after the wait (nvcc 13.0).
  const int warp_splits = merges ? (active - warp + kMergeWarps - 1) / kMergeWarps : 0;
  const int split_step = kMergeWarps * n2;  // float2 units between a warp's splits
  const float2* const warp_po = po + static_cast<int64_t>(warp) * n2;
  auto load_pairs = [&](int c0) {
#pragma unroll
    for (int j = 0; j < kMergePairs; ++j) {
#pragma unroll
      for (int u = 0; u < kMergeSplitsPerWarp; ++u) v[j][u] = make_float2(0.f, 0.f);
    }
#pragma unroll
    for (int j = 0; j < kMergePairs; ++j) {
      if (c0 - lane + 32 * j >= n2) break;  // (warp-uniform: no lane of the warp has this pair)
      const float2* const src = warp_po + min(c0 + 32 * j, n2 - 1);
#pragma unroll
      for (int u = 0; u < kMergeSplitsPerWarp; ++u) {
        if (u >= warp_splits) break;  // (warp-uniform)
        v[j][u] = ld_merge_pair(src + u * split_step);
      }
    }
  };
  load_pairs(lane);
  const float lse = merges && tid < active ? ld_merge_lse(w.partial_lse + base + tid) : -INFINITY;

  if (word != 0 || g.flags != 0) {
    for (int d = tid; d < D; d += kMergeThreads) out[d] = from_f<T>(quiet_nan());
    return;
  }
  if (!merges) {
    if (p.query_len != 1)
      for (int d = tid; d < D; d += kMergeThreads) out[d] = from_f<T>(0.f);
    return;
  }

  float m = warp_max(lse);
  if (lane == 0) s_red[warp] = m;
  __syncthreads();
  m = -INFINITY;
#pragma unroll
  for (int i = 0; i < kMergeWarps; ++i) m = fmaxf(m, s_red[i]);
  float sink = -INFINITY;
  if (p.head_sink != nullptr) sink = p.head_sink[h] * kLog2e;
  float mx = fmaxf(m, sink);
  if (p.smooth_softmax) mx = fmaxf(mx, 0.f);
  const float wt = lse == -INFINITY ? 0.f : exp2f(lse - mx);
  s_w[tid] = wt;
  const float wsum = warp_sum(wt);
  __syncthreads();  // everyone has read s_red (the max) before it is reused for the sum
  if (lane == 0) s_red[warp] = wsum;
  __syncthreads();
  float den = 0.f;
#pragma unroll
  for (int i = 0; i < kMergeWarps; ++i) den += s_red[i];
  if (p.head_sink != nullptr) den += exp2f(sink - mx);
  if (p.smooth_softmax) den += exp2f(-mx);
  const float inv = den > 0.f ? 1.f / den : 0.f;

  // Head sizes past 64 column pairs (256) take further rounds, one a kMergePairs pairs.
  for (int c0 = lane; c0 < n2; c0 += 32 * kMergePairs) {
    if (c0 != lane) load_pairs(c0);
#pragma unroll
    for (int j = 0; j < kMergePairs; ++j) {
      const int c = c0 + 32 * j;
      if (c >= n2) break;
      float ax = 0.f, ay = 0.f;
#pragma unroll
      for (int u = 0; u < kMergeSplitsPerWarp; ++u) {
        const float ws = s_w[warp + u * kMergeWarps];  // 0 past the active splits
        ax = fmaf(ws, v[j][u].x, ax);
        ay = fmaf(ws, v[j][u].y, ay);
      }
      macc[warp * D + 2 * c] = ax;
      macc[warp * D + 2 * c + 1] = ay;
    }
  }
  __syncthreads();
  for (int d = tid; d < D; d += kMergeThreads) {
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < kMergeWarps; ++i) acc += macc[i * D + d];
    out[d] = from_f<T>(acc * inv);
  }
}

template <typename T>
void launch_generic_t(const Params& p, const Work& w, cudaStream_t stream) {
  constexpr auto kernel = generic_attn_kernel<T>;
  const size_t smem = static_cast<size_t>(kGenericWarps) * 2 * p.head_dim * sizeof(float);
  if (smem > 200 * 1024) throw std::runtime_error("gqa: head_size too large for the CUDA kernels");
  ensure_smem<kernel>(smem, "generic_attn_kernel");
  const int rows = p.query_len * p.q_heads;
  const int splits = p.query_len == 1 ? w.max_splits : 1;
  const dim3 grid((rows + kGenericWarps - 1) / kGenericWarps, splits, p.batch);
  launch_kernel("generic_attn_kernel", kernel, grid, dim3(kGenericWarps * 32), smem, stream, p, w);
}

template <typename T>
void launch_merge_t(const Params& p, const Work& w, cudaStream_t stream) {
  constexpr auto kernel = merge_kernel<T>;
  const size_t smem = kMergeWarps * static_cast<size_t>(p.head_dim) * sizeof(float);
  ensure_smem<kernel>(smem, "merge_kernel");
  const int64_t items = static_cast<int64_t>(p.batch) * p.query_len * p.q_heads;  // one CTA per output row
  if (items > INT_MAX) throw std::runtime_error("gqa: internal error: too many rows to merge");
  launch_kernel("merge_kernel", kernel, dim3(static_cast<unsigned>(items)), dim3(kMergeThreads), smem, stream, p, w);
}

}  // namespace

void launch_generic(const Params& p, const Work& w, cudaStream_t stream) {
  switch (p.dtype) {
    case DType::kFloat32: launch_generic_t<float>(p, w, stream); break;
    case DType::kFloat16: launch_generic_t<__half>(p, w, stream); break;
    default: launch_generic_t<__nv_bfloat16>(p, w, stream); break;
  }
}

void launch_merge(const Params& p, const Work& w, cudaStream_t stream) {
  switch (p.dtype) {
    case DType::kFloat32: launch_merge_t<float>(p, w, stream); break;
    case DType::kFloat16: launch_merge_t<__half>(p, w, stream); break;
    default: launch_merge_t<__nv_bfloat16>(p, w, stream); break;
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace gqa
