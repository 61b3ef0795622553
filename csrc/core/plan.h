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
};

enum class Route : int32_t {
  kDecode = 0,   // S == 1: fused prep + split-K decode + merge
  kPrefill = 1,  // S > 1: fused prep + flash prefill
};

// Byte offsets into one workspace allocation (count, then carve).
struct WorkspaceLayout {
  size_t partial_out = 0;     // float [B, S, Hq, split_slots, D]  (split-K only)
  size_t partial_lse = 0;     // float [B, S, Hq, split_slots]     (split-K only)
  size_t work_counter = 0;    // int32, prefill only: Params::work_counter
  size_t total_bytes = 0;
};

struct Plan {
  Route route = Route::kDecode;
  int32_t max_splits = 1;     // decode: upper bound on split-K CTAs per (row, kv head); prefill:
                              // the key-range splits of every query block (1: none)
  int32_t min_split_keys = 0; // smallest key chunk one split takes
  // Decode: whether the device may deal the batch's keys in balanced splits (balanced_chunk
  // below) instead of max_splits a row, and how many splits a row may then take: the partials'
  // split dimension, max_splits when the schedule is off (layout_workspace sets it).
  bool balanced = false;
  int32_t split_slots = 1;
  WorkspaceLayout workspace;
};

// Rounds up to a multiple of the workspace alignment (256 bytes, the allocator's own).
size_t align_workspace(size_t bytes);

Plan make_plan(const Params& p, const DeviceInfo& device);

// Fills plan.split_slots and plan.workspace from plan.route, max_splits, min_split_keys and
// balanced (make_plan calls it; a tuning hook that changes max_splits calls it again).
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

// The balanced decode schedule: every split of the batch takes about total_keys / target keys
// (never fewer than min_split_keys), so a long row takes more splits than a short one and no
// CTA streams much longer than the others, whatever the spread of the rows' lengths. A row of
// `keys` visible keys takes ceil(keys / chunk) splits, clamped to [1, max_splits]. Summed over
// the rows that is at most target + rows (each row adds less than one split to keys / chunk),
// which bounds the launch grid. Pure, so the kernels and the tests agree.
#if defined(__CUDACC__)
__host__ __device__
#endif
inline int32_t balanced_chunk(int64_t total_keys, int32_t target, int32_t min_split_keys) {
  const int64_t chunk = target > 0 ? (total_keys + target - 1) / target : total_keys;
  return chunk > min_split_keys ? static_cast<int32_t>(chunk) : (min_split_keys > 0 ? min_split_keys : 1);
}

#if defined(__CUDACC__)
__host__ __device__
#endif
inline int32_t balanced_splits(int32_t keys, int32_t chunk, int32_t max_splits) {
  if (keys <= 0) return 1;
  const int64_t splits = (static_cast<int64_t>(keys) + chunk - 1) / chunk;
  return splits < max_splits ? static_cast<int32_t>(splits) : max_splits;
}

}  // namespace gqa
