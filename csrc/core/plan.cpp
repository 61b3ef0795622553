#include "plan.h"

namespace gqa {

size_t align_workspace(size_t bytes) { return (bytes + 255) / 256 * 256; }

Plan make_plan(const Params& p, const DeviceInfo& device) {
  Plan plan;
  plan.route = p.query_len == 1 ? Route::kDecode : Route::kPrefill;

  if (plan.route == Route::kDecode) {
    // One CTA per (row, kv head, split). Aim for about two waves of CTAs so that B=1 still
    // fills every SM; a split never takes fewer than min_split_keys keys, so short rows use
    // fewer splits (chosen on the device from seqlens_k).
    const int64_t base_ctas = static_cast<int64_t>(p.batch) * p.kv_heads;
    const int64_t want = 2LL * device.sm_count;
    int64_t splits = (want + base_ctas - 1) / base_ctas;
    if (splits < 1) splits = 1;
    if (splits > 64) splits = 64;
    // Never more splits than the capacity can feed.
    plan.min_split_keys = 256;
    const int64_t by_capacity = (static_cast<int64_t>(p.capacity) + plan.min_split_keys - 1) / plan.min_split_keys;
    if (splits > by_capacity) splits = by_capacity < 1 ? 1 : by_capacity;
    plan.max_splits = static_cast<int32_t>(splits);
  } else {
    plan.max_splits = 1;
    plan.min_split_keys = 0;
  }

  // Count, then carve.
  size_t offset = 0;
  plan.workspace.row_meta = offset;
  offset += align_workspace(sizeof(int32_t) * 4 * static_cast<size_t>(p.batch));
  if (plan.route == Route::kDecode && plan.max_splits > 1) {
    const size_t heads = static_cast<size_t>(p.batch) * p.q_heads * plan.max_splits;
    plan.workspace.partial_out = offset;
    offset += align_workspace(sizeof(float) * heads * p.head_dim);
    plan.workspace.partial_lse = offset;
    offset += align_workspace(sizeof(float) * heads);
  }
  plan.workspace.total_bytes = offset;
  return plan;
}

}  // namespace gqa
