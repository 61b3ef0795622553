// The order in which the decode kernel takes the batch's rows.
//
// The SMs take a launch's CTAs in grid order, x fastest: all the splits and kv heads of row 0,
// then row 1, and so on. With more CTAs than fit at once and rows of different lengths, the
// rows dispatched last may be long ones, and their CTAs stream on after every other SM has
// finished. With Work::longest_first the grid's row index is a rank instead: the CTA serves
// the row of that rank in decreasing visible length (ties in row order), so the longest rows
// start first and the short ones fill in behind them (longest processing time first). A batch
// of equal rows keeps row order.
//
// Every CTA reads the whole batch's seqlens_k to rank them. They are read before the PDL wait
// (pdl_early_read: no kernel of this extension writes seqlens_k).
#pragma once

#include "common.cuh"

namespace gqa {
namespace cuda {
namespace detail {

// A row's visible keys, clamped to [0, capacity] (a bad row's may be anything: its CTAs take
// the error path, but every CTA must rank it the same way).
__device__ __forceinline__ int schedule_row_keys(const Params& p, int seqlen) {
  const RowGeometry g = row_geometry(p, seqlen);
  const KeyRange vis = visible_keys(p, g.total, g.query_start);
  return min(max(vis.hi - vis.lo, 0), p.capacity);
}

struct RankedRow {
  int row;
  int seqlen;  // its seqlens_k, so that the kernel need not read it again after the ranking
  int own;     // seqlens_k[threadIdx.x] (0 past the batch): the fused row checks start there
};

// The batch row of rank `rank`. Called by every thread of the CTA (it synchronises). Batches of
// more rows than the CTA has threads keep row order.
template <int kThreads>
__device__ RankedRow longest_first_row(const Params& p, int rank) {
  __shared__ int row_keys[kThreads];
  __shared__ int2 claim;
  const int tid = threadIdx.x;
  const int seqlen = tid < p.batch ? pdl_early_read(p.seqlens_k + tid) : 0;
  if (p.batch > kThreads) return RankedRow{rank, pdl_early_read(p.seqlens_k + rank), seqlen};
  const int mine = tid < p.batch ? schedule_row_keys(p, seqlen) : -1;
  row_keys[tid] = mine;
  __syncthreads();
  // (keys, row) orders the rows totally, so the ranks are 0..B-1 once each and exactly one
  // thread claims `rank` (< B, the grid's rows).
  if (tid < p.batch) {
    int before = 0;  // rows ranked ahead of this thread's
    for (int j = 0; j < p.batch; ++j) {
      const int k = row_keys[j];
      before += k > mine || (k == mine && j < tid);
    }
    if (before == rank) claim = make_int2(tid, seqlen);
  }
  __syncthreads();
  return RankedRow{claim.x, claim.y, seqlen};
}

}  // namespace detail
}  // namespace cuda
}  // namespace gqa
