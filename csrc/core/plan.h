// The plan: a pure function of shapes, dtypes, attributes and the device. It never reads
// device data, so the same plan sizes the workspace, the launch grids and the fake tensors,
// and a call can be captured in a CUDA graph.
#pragma once

#include <cstddef>
#include <cstdint>

#include "params.h"

namespace gqa {

struct DeviceInfo {
  int32_t sm_count = 132;
  int32_t sm_major = 9;
  // The decode kernel's TMA loaders can run (an sm90 device, a build with sm90a code, and no test
  // budget of shared memory standing in for another GPU: kernels/launch.h). They give it four
  // warps a CTA at head size 256, which take one CTA an SM (kernels/decode_cfg.cuh, DecodeCfg),
  // and the balanced partition's kernel, built on them alone (plan.cpp: without them its bands
  // take 16 splits an item instead).
  bool decode_tma_kernels = true;
};

enum class Route : int32_t {
  kDecode = 0,   // S == 1: fused prep + split-K decode + merge
  kPrefill = 1,  // S > 1: fused prep + flash prefill
};

// Byte offsets into one workspace allocation (count, then carve).
struct WorkspaceLayout {
  size_t partial_out = 0;     // float [B, S, Hq, max_splits, D]   (split-K only)
  size_t partial_lse = 0;     // float [B, S, Hq, max_splits]      (split-K only)
  size_t work_counter = 0;    // int32, prefill only: Params::work_counter
  size_t total_bytes = 0;
};

struct Plan {
  Route route = Route::kDecode;
  int32_t max_splits = 1;     // decode: upper bound on split-K CTAs per (row, kv head); prefill:
                              // the key-range splits of every query block (1: none)
  int32_t min_split_keys = 0; // smallest key chunk one split takes
  // Decode: the device takes the batch's rows longest first (by visible keys), so that the
  // CTAs of long rows are dispatched before those of short ones. Set where the launch has more
  // CTAs than SMs, two rows or more, and 2,048 keys of capacity a split or more.
  bool longest_first = false;
  // Decode, with longest_first: the splits a row takes when every row of the batch sees as many
  // keys (the device tells from its ranking), where that is fewer than max_splits; 0: none
  // fewer. The plan's splits past one wave spread a ragged batch's long rows; equal rows have
  // none to spread.
  int32_t equal_rows_splits = 0;
  // Decode, at head size 128: the launch keeps to one CTA an SM (it asks for more than half an
  // SM's shared memory), where the plan's grid fits in one wave at two CTAs an SM and a batch
  // of equal rows takes one split, one CTA an SM anyway. Then every CTA of a ragged batch would
  // be resident at once, so none of its work could move to an SM that finished early; at one
  // CTA an SM the grid is two waves, dispatched longest first (plan.cpp). Nearly equal rows
  // then take the equal rows' one split too (near_equal_sixteenths 15).
  bool one_cta_per_sm = false;
  // Decode, with equal_rows_splits: a ragged batch whose shortest row sees at least this many
  // sixteenths of the longest one's keys takes the equal rows' splits too (nearly equal rows:
  // decode_schedule.cuh); 0: only a batch of equal rows does.
  int32_t near_equal_sixteenths = 0;
  // Decode, at head size 128: max_splits is twice equal_rows_splits, the splits of a grid of
  // one wave at two CTAs an SM, so that a ragged batch runs in two waves (plan.cpp; nearly equal
  // rows keep the one wave: near_equal_sixteenths 8, or 11 where the splits hold 2,048 keys).
  bool ragged_two_waves = false;
  // Decode, with longest_first and one split a row: where a batch of equal rows would run more
  // than one wave at two CTAs an SM (one at head size 256 with four warps a CTA) and its last
  // wave at most half full, the rows of that last wave (the last equal_rows_tail_items (row,
  // kv head, head chunk) slots in row order) take equal_rows_tail_splits splits each, so that
  // they fill the slots their SMs free together instead of running two an SM on the SMs that
  // finished first (plan.cpp). max_splits is then equal_rows_tail_splits (the partials' room),
  // equal_rows_splits and ragged_splits are 1, and the launch is a grid of just the working
  // CTAs (decode_schedule.cuh). 0: none.
  int32_t equal_rows_tail_splits = 0;
  int32_t equal_rows_tail_items = 0;
  // Decode: the splits a ragged batch's row takes where that is fewer than max_splits (the
  // tail's room, above); 0: max_splits.
  int32_t ragged_splits = 0;
  // Decode, at head sizes 128 and 64: a balanced partition of the batch's keys over a grid of
  // `shares` CTAs (decode_schedule.cuh, shares_walk): each CTA takes an equal share of the
  // visible keys of every (row, kv head, head chunk) laid end to end, so that no CTA of the grid
  // is idle whatever the rows' lengths; the CTAs that share an item merge in the launch
  // (max_splits is then the most CTAs an item spans). 0: the grid of splits above.
  int32_t shares = 0;
  // Under shares: how many keys' worth of time serving an item costs besides its keys, which
  // the partition weighs each item by on top of its keys, so that a CTA whose share holds many
  // short items gets fewer keys. (Not its first tiles' round trip, which the kernel overlaps with
  // the item before since the fiftieth round: the weight stayed at 512; NOTES.md.)
  int32_t share_item_keys = 0;
  WorkspaceLayout workspace;
};

// Plan::share_item_keys where the plan takes the partition (and the "force" pin's default).
constexpr int32_t kShareItemKeys = 512;

// The most splits a decode launch merges inside itself (the last split CTA of each slot to
// arrive, decode_arrival.cuh); with more, the merge kernel runs after it.
constexpr int32_t kMaxInLaunchMergeSplits = 16;

// Rounds up to a multiple of the workspace alignment (256 bytes, the allocator's own).
size_t align_workspace(size_t bytes);

Plan make_plan(const Params& p, const DeviceInfo& device);

// Turns off the decode grid of splits' own rules for batches of equal rows and for ragged
// batches (equal_rows_splits, one_cta_per_sm, near_equal_sixteenths, ragged_two_waves, the
// tail's splits, ragged_splits), which a pinned split count and the balanced partition replace.
void clear_split_grid_rules(Plan& plan);

// The balanced partition's splits without its kernel: kMaxInLaunchMergeSplits splits an item in
// the rows' order, in place of the grid of splits' rules (make_plan, where the decode kernel has
// no TMA loaders; take_shares).
void take_partition_splits(Plan& plan);

// Takes the balanced partition (Plan::shares) over a grid of `sms` CTAs, each item weighed by its
// keys plus `item_keys`, in place of the grid of splits' rules. (make_plan; the test hook that
// forces the partition on, set_decode_shares("force"), then lays out the workspace again.)
void take_shares(Plan& plan, int64_t sms, int32_t item_keys);

// Fills plan.workspace from plan.route and plan.max_splits (make_plan calls it; a tuning hook
// that changes max_splits calls it again).
void layout_workspace(Plan& plan, const Params& p);

// How many splits a row of `total` keys actually uses (device and host agree on this).
// Pure, so the decode kernels and the tests compute the same number.
#if defined(__CUDACC__)
__host__ __device__
#endif
inline int32_t active_splits(int32_t total, int32_t max_splits, int32_t min_split_keys) {
  if (total <= 0) return 1;
  int32_t by_len = (total + min_split_keys - 1) / min_split_keys;
  return by_len < max_splits ? by_len : max_splits;
}

// The tensor-core decode's CTAs for one kv head and split: one a chunk of up to 16 of its
// group_size query heads (the mma rows). The plan, the launch and the kernel all count them so.
#if defined(__CUDACC__)
__host__ __device__
#endif
inline int32_t decode_head_chunks(int32_t group_size) {
  return (group_size + 15) >> 4;  // (group_size >= 1: a shift, without signed division's fix-up)
}

}  // namespace gqa
