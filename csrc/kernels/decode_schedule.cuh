// The balanced decode schedule: which (row, split) a decode CTA takes.
//
// By default a decode CTA's row is blockIdx.z and its split blockIdx.x, and every row of the
// batch takes up to max_splits splits of its own length. With rows of different lengths that
// leaves some CTAs streaming many more keys than others, and the SMs that drew short rows idle
// at the end. The balanced schedule (Work::balanced_items > 0) deals splits of about the same
// number of keys instead: every CTA of a (kv head, head chunk) reads all the rows' lengths,
// sizes the splits from their sum (balanced_chunk in core/plan.h), counts each row's splits,
// and takes the row and split that its blockIdx.x falls on, in row order. The grid holds
// balanced_items + B CTAs in x, the bound on the count; the CTAs past the count exit at once.
//
// A row's CTAs all compute the same split count from the same seqlens_k, so the arrival merge
// (decode_arrival.cuh), which counts them in, needs no other agreement. The reads are
// seqlens_k only, so they may go before the PDL wait (pdl_early_read).
#pragma once

#include "common.cuh"

namespace gqa {
namespace cuda {
namespace detail {

struct DecodeItem {
  int row;     // -1: past the batch's splits, nothing to do
  int split;   // within the row
  int active;  // the row's split count
};

// A row's visible keys, clamped to [0, capacity] (a bad row's may be anything; its CTAs take
// the error path, but every CTA must count it the same way).
__device__ __forceinline__ int schedule_row_keys(const Params& p, int row) {
  const RowGeometry g = row_geometry(p, pdl_early_read(p.seqlens_k + row));
  const KeyRange vis = visible_keys(p, g.total, g.query_start);
  return min(max(vis.hi - vis.lo, 0), p.capacity);
}

// Called by every thread of the CTA (it synchronises). Each thread takes a run of consecutive
// rows, so that one block-wide scan of the per-thread split counts orders them by row.
template <int kThreads>
__device__ DecodeItem balanced_item(const Params& p, const Work& w, int item) {
  constexpr int kWarps = kThreads / 32;
  __shared__ long long warp_total[kWarps];
  __shared__ int4 claim;  // row, split, active
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int per_thread = (p.batch + kThreads - 1) / kThreads;
  const int r0 = min(p.batch, tid * per_thread);
  const int r1 = min(p.batch, r0 + per_thread);
  if (tid == 0) claim = make_int4(-1, 0, 0, 0);

  const int first_keys = r0 < r1 ? schedule_row_keys(p, r0) : 0;
  long long keys = first_keys;
  for (int r = r0 + 1; r < r1; ++r) keys += schedule_row_keys(p, r);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) keys += __shfl_xor_sync(0xffffffffu, keys, o);
  if (lane == 0) warp_total[warp] = keys;
  __syncthreads();
  long long total = 0;
#pragma unroll
  for (int i = 0; i < kWarps; ++i) total += warp_total[i];
  const int chunk = balanced_chunk(total, w.balanced_items, w.min_split_keys);

  int mine = r0 < r1 ? balanced_splits(first_keys, chunk, w.max_splits) : 0;
  for (int r = r0 + 1; r < r1; ++r) mine += balanced_splits(schedule_row_keys(p, r), chunk, w.max_splits);
  // Exclusive scan of `mine` over the block: within the warp, then the warps before.
  int inclusive = mine;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int x = __shfl_up_sync(0xffffffffu, inclusive, o);
    if (lane >= o) inclusive += x;
  }
  __syncthreads();  // every thread has read warp_total's sums
  if (lane == 31) warp_total[warp] = inclusive;
  __syncthreads();
  int first = inclusive - mine;
  for (int i = 0; i < warp; ++i) first += static_cast<int>(warp_total[i]);
  if (item >= first && item < first + mine) {
    int base = first;
    for (int r = r0; r < r1; ++r) {
      const int splits = balanced_splits(r == r0 ? first_keys : schedule_row_keys(p, r), chunk, w.max_splits);
      if (item < base + splits) {
        claim = make_int4(r, item - base, splits, 0);
        break;
      }
      base += splits;
    }
  }
  __syncthreads();
  return DecodeItem{claim.x, claim.y, claim.z};
}

// The row schedule with the rows taken longest first (Work::longest_first): grid row `rank` is
// the batch row of that rank in decreasing visible length (ties in row order), so that the
// longest rows' CTAs are dispatched first and the short ones fill in behind them. Called by
// every thread of the CTA (it synchronises); batches of more rows than threads keep row order.
template <int kThreads>
__device__ int longest_first_row(const Params& p, int rank) {
  __shared__ int row_keys[kThreads];
  __shared__ int claim;
  if (p.batch > kThreads) return rank;
  const int tid = threadIdx.x;
  if (tid == 0) claim = rank;
  const int mine = tid < p.batch ? schedule_row_keys(p, tid) : -1;
  row_keys[tid] = mine;
  __syncthreads();
  if (tid < p.batch) {
    int before = 0;
    for (int j = 0; j < p.batch; ++j) {
      const int k = row_keys[j];
      before += k > mine || (k == mine && j < tid);
    }
    if (before == rank) claim = tid;
  }
  __syncthreads();
  return claim;
}

}  // namespace detail
}  // namespace cuda
}  // namespace gqa
