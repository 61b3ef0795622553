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
// A batch of equal rows (every row sees as many keys) may take fewer splits than the grid has,
// Work::equal_rows_splits (the plan's splits spread a ragged batch's long rows, which such a
// batch has none of). Then the CTAs take their coordinates from the linear block index, so that
// the working ones come first in grid order and the rest leave at once: the SMs take a launch's
// CTAs in that order, so the working CTAs spread evenly over the SMs. (Leaving CTAs interleaved
// with working ones, as split-fastest coordinates would have them, gave some SMs two working
// CTAs and others none: H200, thirty-first round, B16 64/8 L8192 131.7-132.3 us against 128.2
// with the plan's 2 splits and 124.1 with one split a row in a grid of one.) So does a batch of
// nearly equal rows, where the plan says so (Work::near_equal_sixteenths: the shortest row sees
// at least that many sixteenths of the longest one's keys). Where the equal rows' last wave
// would be at most half full, its rows take more splits (Work::equal_rows_tail_splits: the grid
// is then one-dimensional, and a ragged batch takes Work::ragged_splits in the same order).
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
  bool equal_rows;  // every row of the batch sees as many keys (false where nothing was ranked)
  bool nearly_equal_rows;  // the shortest row sees at least w.near_equal_sixteenths / 16 of the
                           // longest one's keys
};

// The batch row of rank `rank`. Called by every thread of the CTA (it synchronises). Batches of
// more rows than the CTA has threads keep row order. `row_seqlens` (kThreads entries of shared
// memory) receives every row's seqlens_k.
template <int kThreads>
__device__ RankedRow longest_first_row(const Params& p, const Work& w, int rank, int* row_seqlens) {
  __shared__ int row_keys[kThreads];
  __shared__ int2 claim;
  __shared__ int2 key_range;  // (the longest row's keys, the shortest's)
  const int tid = threadIdx.x;
  const int seqlen = tid < p.batch ? pdl_early_read(p.seqlens_k + tid) : 0;
  if (p.batch > kThreads) return RankedRow{rank, pdl_early_read(p.seqlens_k + rank), seqlen, false, false};
  const int mine = tid < p.batch ? schedule_row_keys(p, seqlen) : -1;
  row_keys[tid] = mine;
  row_seqlens[tid] = seqlen;
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
    if (before == 0) key_range.x = mine;
    if (before == p.batch - 1) key_range.y = mine;
  }
  // (The barrier that publishes the claim also tells whether every row matches row 0. Reading
  // that from key_range behind a plain barrier instead ran the 14/2/64 rows, which never come
  // here, 1-2.4% slower on an H200: code layout, thirty-eighth round.)
  const bool equal_rows = __syncthreads_and(tid >= p.batch || mine == row_keys[0]) != 0;
  const bool nearly_equal_rows = w.near_equal_sixteenths > 0 &&
                                 16LL * key_range.y >= static_cast<long long>(w.near_equal_sixteenths) * key_range.x;
  return RankedRow{claim.x, claim.y, seqlen, equal_rows, nearly_equal_rows};
}

// A decode CTA's coordinates: its split, its (kv head x head chunk) index and its row, with the
// row's seqlens_k and the CTA's first row to check (RankedRow::own), and the row's bound on its
// splits; leave: this CTA has no work (a batch of equal rows that takes fewer splits than the
// grid has: see the top of this file).
struct DecodeCta {
  int split;
  int splits;    // the most splits the row takes (active_splits' bound): w.max_splits, or fewer
  int kv_chunk;  // kv head x head chunk
  RankedRow ranked;
  bool leave;
  // shares_walk: the segment's keys, [k_begin, k_end) of the item's visible ones (splits is then
  // the exact count of CTAs the item spans, split this CTA's index among them).
  int k_begin = 0;
  int k_end = 0;
};

template <int kThreads>
__device__ DecodeCta decode_cta(const Params& p, const Work& w) {
  if (!w.longest_first)
    return DecodeCta{static_cast<int>(blockIdx.x), w.max_splits, static_cast<int>(blockIdx.y),
                     RankedRow{static_cast<int>(blockIdx.z), 0, 0, false, false}, false};
  __shared__ int row_seqlens[kThreads];
  const int kv_chunks = p.kv_heads * decode_head_chunks(p.group_size);
  const int items = kv_chunks * p.batch;  // (kv head x head chunk, row)
  const int linear = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  // A ragged batch's coordinates (split, kv chunk, rank): the grid's own, or with
  // w.ragged_splits (a one-dimensional grid: Work::equal_rows_tail_splits) the same order from
  // the linear block index, split fastest; the CTAs past them leave.
  int split = blockIdx.x, kv_chunk = blockIdx.y, rank = blockIdx.z, splits = w.max_splits;
  bool leave = false;
  if (w.ragged_splits > 0) {
    splits = w.ragged_splits;
    const int item = linear / splits;
    leave = item >= items;
    split = linear - item * splits;
    rank = leave ? p.batch - 1 : item / kv_chunks;  // (a leaving CTA ranks a row all the same)
    kv_chunk = item - rank * kv_chunks;
  }
  DecodeCta c{split, splits, kv_chunk, longest_first_row<kThreads>(p, w, rank, row_seqlens), leave};
  // Nearly equal rows (Work::near_equal_sixteenths) take the equal rows' splits too. Where the
  // launch keeps to one CTA an SM (15/16) the plan's splits would run in two waves of the rows'
  // halves (H200, thirty-fifth round, B16 64/8, lengths from 8,000 to 8,192: 130.6 us, against
  // 127.2-127.4 at two CTAs an SM and 125.3-125.5 in one split); where the plan doubled the
  // splits of one wave for a ragged batch (8/16), two waves of short splits cost more than the
  // one wave's spread of shares (plan.cpp).
  const bool equal = c.ranked.equal_rows || c.ranked.nearly_equal_rows;
  if (w.equal_rows_splits > 0 && equal) {
    // In row order (which equal rows rank in; nearly equal ones stream in one wave, so their
    // order does not matter), the first equal_rows_splits x kv chunks x rows CTAs in grid order
    // take (split, kv chunk, row), split fastest; the others leave.
    // With w.equal_rows_tail_splits the last equal_rows_tail_items slots take that many splits
    // instead, in the same order after the others.
    int splits = w.equal_rows_splits;
    int first_item = 0;  // of the CTA's run: the slots of `splits` splits from here
    int index = linear;  // the CTA's index in that run
    const int whole = items - w.equal_rows_tail_items;
    if (w.equal_rows_tail_splits > 0 && linear >= whole * splits) {
      index = linear - whole * splits;
      first_item = whole;
      splits = w.equal_rows_tail_splits;
    }
    c.splits = splits;
    const int run_item = splits == 1 ? index : index / splits;
    const int item = first_item + run_item;  // (kv head x head chunk, row)
    c.leave = item >= items;
    c.split = index - run_item * splits;
    c.ranked.row = item / kv_chunks;
    c.kv_chunk = item - c.ranked.row * kv_chunks;
    c.ranked.seqlen = c.leave ? 0 : row_seqlens[c.ranked.row];
  }
  return c;
}

// Work::shares (Plan::shares): a balanced partition of the batch's keys over the grid. The items
// (row, kv head x head chunk), in row order, lie end to end, each as long as its row's visible
// keys (at least 1, so that a bad row's items still have a CTA to write their NaN) plus
// `item_keys` positions before them that stand for what serving an item costs besides its keys
// (Work::share_item_keys). CTA c takes the positions [c W, (c + 1) W), W = max(ceil(total /
// CTAs), ceil(longest row / 15)) rounded up to a tile, so that an item's keys span at most 16
// CTAs (the in-launch merge's count and the workspace's room); with `whole_items`, for equal
// rows whose items fill 7/8 of the grid or more, W is one item. It serves the keys of each item
// its range meets as one segment, in order: `segment` gets a DecodeCta whose split is the CTA's
// index among the CTAs that hold the item's keys and splits their count, whether the segment is
// the CTA's first, and whether the CTA has a next segment and which (so that the kernel can
// start that one's loads early). A range that meets only an item's leading positions serves
// nothing of it. Called by every thread of the CTA.
template <int kThreads, typename Segment>
__device__ void shares_walk(const Params& p, int item_keys, bool whole_items, Segment&& segment) {
  __shared__ long long row_first[kThreads + 1];  // the position of each row's first item
  __shared__ int row_keys[kThreads];
  __shared__ int row_seqlen[kThreads];
  __shared__ long long share;
  const int tid = threadIdx.x;
  const int kv_chunks = p.kv_heads * decode_head_chunks(p.group_size);
  const int seqlen = tid < p.batch ? pdl_early_read(p.seqlens_k + tid) : 0;
  row_seqlen[tid] = seqlen;
  row_keys[tid] = tid < p.batch ? max(1, schedule_row_keys(p, seqlen)) : 0;
  __syncthreads();
  if (tid == 0) {
    long long pos = 0;
    int longest = 0;
    bool equal = true;
    for (int r = 0; r < p.batch; ++r) {
      row_first[r] = pos;
      pos += (static_cast<long long>(row_keys[r]) + item_keys) * kv_chunks;
      longest = max(longest, row_keys[r]);
      equal = equal && row_keys[r] == row_keys[0];
    }
    row_first[p.batch] = pos;
    const long long items = static_cast<long long>(p.batch) * kv_chunks;
    if (whole_items && equal && items <= gridDim.x && 8 * items >= 7 * static_cast<long long>(gridDim.x)) {
      // Equal rows whose items fill 7/8 of the grid or more: one CTA an item, whole (no segment
      // cut in two, no merge), the CTAs past them idle. Cutting the items to fill the rest cost
      // more than those CTAs would stream. H200, fiftieth round (the TMA ring carried across
      // segments), us, this / the items cut (Work::share_whole_items): B16 64/8 L8192 (128
      // items) 122.2 / 127.1 and 126.5 / 129.7, B15 64/8 L8192 (120) 117.8 / 122.4, B30 32/4
      // L8192 (120) 117.1 / 120.2; but B14 64/8 L8192 (112, 85%) 115.6 / 112.1, and level on
      // another H200 (114.3-114.9 either way). With fewer items, fewer SMs stream too little:
      // B12 64/8 L16384 in a grid of one CTA an item ran 205.1 against 190.4 with the items cut
      // (forty-ninth round).
      share = static_cast<long long>(row_keys[0]) + item_keys;
    } else {
      const long long by_grid = (pos + gridDim.x - 1) / gridDim.x;
      const long long by_merge = (longest + 14) / 15;
      share = (max(by_grid, by_merge) + 63) / 64 * 64;
    }
  }
  __syncthreads();
  const long long w = share;
  const long long total = row_first[p.batch];
  long long pos = static_cast<long long>(blockIdx.x) * w;
  const long long end = min(total, pos + w);
  int row = 0;
  // The next segment of [pos, end) into c; false when none is left.
  auto advance = [&](DecodeCta& c) {
    while (pos < end) {
      while (row_first[row + 1] <= pos) ++row;
      const int n = row_keys[row];
      const long long span = static_cast<long long>(n) + item_keys;  // an item's positions
      const int kv_chunk = static_cast<int>((pos - row_first[row]) / span);
      const long long keys_start = row_first[row] + kv_chunk * span + item_keys;
      const long long keys_end = keys_start + n;
      const long long seg_begin = max(pos, keys_start);
      const long long seg_end = min(end, keys_end);
      pos = keys_end;
      if (seg_begin < seg_end) {
        const int first_cta = static_cast<int>(keys_start / w);
        const int last_cta = static_cast<int>((keys_end - 1) / w);
        c = DecodeCta{static_cast<int>(blockIdx.x) - first_cta, last_cta - first_cta + 1, kv_chunk,
                      RankedRow{row, row_seqlen[row], seqlen, false, false}, false};
        c.k_begin = static_cast<int>(seg_begin - keys_start);
        c.k_end = static_cast<int>(seg_end - keys_start);
        return true;
      }
    }
    return false;
  };
  DecodeCta current, next;
  bool have = advance(current);
  bool first = true;
  while (have) {
    const bool have_next = advance(next);
    segment(current, first, have_next, next);
    current = next;
    have = have_next;
    first = false;
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace gqa
