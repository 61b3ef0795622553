// The decode splits merged by the last of them to finish, inside the decode launch.
//
// Each split CTA of a (row, kv head, head chunk) writes its normalised partial output and
// log-sum-exp to the workspace (as for the merge kernel), then counts itself in on the slot's
// arrival counter. The CTA that arrives last reads every split's partials back from L2 and
// writes the output. So no merge kernel runs, and no CTA waits for another.
//
// The counters (Params::arrival_counters) are zero before the call, and the last CTA of each
// slot sets its counter back to zero. The next call on the stream touches them only after its
// PDL wait, that is after this grid has finished, so they are zero again by then. Every CTA of
// a slot computes the same `active` from the same seqlens_k, so all agree on the count.
//
// A CTA that took the error path writes NaN as its log-sum-exp before it arrives; the merging
// CTA then writes NaN. (Every CTA normally takes the error path together; they can differ
// only when the error word changes during the launch, from another stream's call.)
#pragma once

#include "common.cuh"

namespace gqa {
namespace cuda {
namespace detail {

// The counter of a (row, kv head x head chunk) slot, of kv_chunks (kv heads x head chunks) a
// row.
__device__ __forceinline__ uint32_t* arrival_counter(const Work& w, int kv_chunks, int row, int kv_chunk) {
  return w.arrivals + static_cast<int64_t>(row) * kv_chunks + kv_chunk;
}

// The count, as one acquire-release atomic at GPU scope. The counters pass messages (the
// partials), which needs release and acquire only; __threadfence() is the sequentially
// consistent fence (MEMBAR.SC.GPU in the SASS), which also orders every fenced thread against
// every other, and costs more. On sm90 this is MEMBAR.ALL.GPU (the release: it waits for the
// CTA's partial stores), the atomic, and an L1 invalidation (the acquire), where a fence before
// and another after a relaxed atomic put a second MEMBAR on the merging CTA's path.
__device__ __forceinline__ uint32_t atomic_add_acq_rel_gpu(uint32_t* counter, uint32_t value) {
  uint32_t before;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(before) : "l"(counter), "r"(value) : "memory");
  return before;
}

// Called by every thread of the CTA, after its partial stores. True in the one CTA of the slot
// that arrived last; its later loads see every other split's partials.
__device__ __forceinline__ bool arrive_last(uint32_t* counter, int active) {
  __shared__ int last_flag;
  __syncthreads();  // the CTA's partial stores come before thread 0's count (bar.sync orders them)
  if (threadIdx.x == 0) {
    // Release: the partials are visible GPU-wide before the count says so. Acquire: the last
    // CTA's reads see the other splits' partials, released before their counts.
    const uint32_t before = atomic_add_acq_rel_gpu(counter, 1u);
    const bool last = before + 1u == static_cast<uint32_t>(active);
    if (last) {
      // Nothing in this launch reads the counter again (the next call does after its PDL wait,
      // when this grid has finished).
      *counter = 0u;
    }
    last_flag = last ? 1 : 0;
  }
  __syncthreads();
  return last_flag != 0;
}

// The merging CTA: each thread takes four consecutive columns of kUnits query heads (kUnits
// float4 units, kThreads apart) and combines the active splits' partials, kBatch splits of each
// unit's loads in flight at a time (L2 reads: __ldcg, since L1 is not coherent with the other
// SMs' stores). `part` is the slot's first partial index (row h0's split 0), as in the decode
// kernel; kPlain as the decode kernel's. Where the slot has more units (nh D / 4) than the CTA
// threads, kUnits > 1 puts a thread's units' loads in one round trip to L2 instead of one after
// another.
template <typename T, int D, int kThreads, bool kPlain, int kBatch = 16, int kUnits = 1>
__device__ void arrival_merge_splits(const Params& p, const Work& w, int64_t part, int active, int h0, int nh,
                                     T* out_row) {
  constexpr int kUnitsPerRow = D / 4;
  const int64_t head_stride = p.output_strides.head;
  const int units = nh * kUnitsPerRow;
  for (int i0 = threadIdx.x; i0 < units; i0 += kThreads * kUnits) {
    bool valid[kUnits];
    int row[kUnits], d[kUnits];
    const float* lse_src[kUnits];
    const float4* out_src[kUnits];
    // An online merge over batches: m is the largest log-sum-exp so far, l and acc the sum of
    // the weights and of the weighted partials relative to it.
    float m[kUnits], l[kUnits];
    float4 acc[kUnits];
    bool poisoned[kUnits];
#pragma unroll
    for (int u = 0; u < kUnits; ++u) {
      const int i = i0 + u * kThreads;
      valid[u] = u == 0 || i < units;  // (unit 0: the loop's own bound)
      row[u] = i / kUnitsPerRow;
      d[u] = 4 * (i - row[u] * kUnitsPerRow);
      const int64_t slot = part + static_cast<int64_t>(row[u]) * w.max_splits;
      lse_src[u] = w.partial_lse + slot;
      out_src[u] = reinterpret_cast<const float4*>(w.partial_out + slot * D + d[u]);
      m[u] = -INFINITY;
      l[u] = 0.f;
      acc[u] = make_float4(0.f, 0.f, 0.f, 0.f);
      poisoned[u] = false;
    }
    for (int s0 = 0; s0 < active; s0 += kBatch) {
      float lse[kUnits][kBatch];
      float4 v[kUnits][kBatch];
#pragma unroll
      for (int u = 0; u < kUnits; ++u) {
#pragma unroll
        for (int s = 0; s < kBatch; ++s) {
          const bool ok = valid[u] && s0 + s < active;
          lse[u][s] = ok ? __ldcg(lse_src[u] + s0 + s) : -INFINITY;
          v[u][s] = ok ? __ldcg(out_src[u] + static_cast<int64_t>(s0 + s) * kUnitsPerRow)
                       : make_float4(0.f, 0.f, 0.f, 0.f);
        }
      }
      // Unit u's batch folded into its running state (a lambda, so that an empty batch returns
      // early for its own unit only).
      auto fold = [&](int u) {
        float mb = m[u];
#pragma unroll
        for (int s = 0; s < kBatch; ++s) {
          poisoned[u] |= lse[u][s] != lse[u][s];
          mb = fmaxf(mb, lse[u][s]);
        }
        if (mb == -INFINITY) return;  // every split so far was empty
        const float c = fast_exp2(m[u] - mb);  // 0 while m is -inf
        l[u] *= c;
        acc[u].x *= c;
        acc[u].y *= c;
        acc[u].z *= c;
        acc[u].w *= c;
        // No branch a split: an empty split (its partial is zeros) or none (v is zeros) has a
        // log-sum-exp of -inf, so weight 0. A poisoned one (NaN) makes the output NaN anyway.
#pragma unroll
        for (int s = 0; s < kBatch; ++s) {
          const float e = fast_exp2(lse[u][s] - mb);
          l[u] += e;
          acc[u].x = fmaf(e, v[u][s].x, acc[u].x);
          acc[u].y = fmaf(e, v[u][s].y, acc[u].y);
          acc[u].z = fmaf(e, v[u][s].z, acc[u].z);
          acc[u].w = fmaf(e, v[u][s].w, acc[u].w);
        }
        m[u] = mb;
      };
#pragma unroll
      for (int u = 0; u < kUnits; ++u) fold(u);
    }
#pragma unroll
    for (int u = 0; u < kUnits; ++u) {
      if (!valid[u]) continue;
      const float f = poisoned[u] ? quiet_nan() : final_factor_t<kPlain>(p, h0 + row[u], m[u], l[u]);
      store_scaled4<T>(out_row + (h0 + row[u]) * head_stride + d[u], acc[u], f);
    }
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace gqa
