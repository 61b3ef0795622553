// gqa::cuda::launch: picks the kernels for one call and enqueues them.
//
//   decode, in-place, tensor-core eligible:  decode_mma(fused)          [+ merge]
//   (the rows of a large batch taken longest first: set_decode_schedule)
//   decode, otherwise:                       prep -> decode_mma|generic [+ merge]
//   (decode_mma merges its own splits, with no merge kernel, in the last split CTA to finish,
//   when launch_decode_kernel picks that: see set_decode_merge)
//   prefill:                    [validate] -> prep -> prefill_mma (prefill_mma.cu) [+ merge]|generic
//   (in place without RoPE, prefill_mma appends the rows with no past itself, and prep only
//   checks them: prefill_mma_appends)
//
// Tensor-core eligible: fp16/bf16, D in {64, 80, 96, 128, 256}, and a cache whose rows are
// 16-byte aligned (cp.async); for decode also a device whose blocks may hold the kernel's shared
// memory (decode_mma_fits). Everything else takes the generic CUDA-core kernel.
#include "launch.h"

#include <algorithm>

#include "decode_cfg.cuh"
#include "kernels.h"
#include "prefill_mma.h"

namespace gqa {
namespace cuda {

namespace detail {
std::atomic<int> g_decode_loader{0};
std::atomic<int> g_decode_merge{0};
std::atomic<int> g_decode_schedule{0};
std::atomic<int> g_decode_features{0};
std::atomic<int> g_decode_early_tiles{0};
std::atomic<int> g_decode_l2_prefetch{0};
std::atomic<int> g_decode_l2_fetch{0};
std::atomic<int> g_decode_share_grid{0};
std::atomic<int> g_decode_share_keys{-1};
std::atomic<unsigned long long*> g_decode_timeline{nullptr};
std::atomic<int> g_decode_timeline_records{0};
std::atomic<int> g_smem_limit_override{0};
}

void set_decode_loader(int loader) { detail::g_decode_loader.store(loader, std::memory_order_relaxed); }
void set_decode_merge(int merge) { detail::g_decode_merge.store(merge, std::memory_order_relaxed); }
void set_decode_schedule(int schedule) { detail::g_decode_schedule.store(schedule, std::memory_order_relaxed); }
void set_decode_features(int features) { detail::g_decode_features.store(features, std::memory_order_relaxed); }
void set_decode_early_tiles(int early) { detail::g_decode_early_tiles.store(early, std::memory_order_relaxed); }
void set_decode_l2_prefetch(int prefetch) { detail::g_decode_l2_prefetch.store(prefetch, std::memory_order_relaxed); }
bool decode_tma_kernels(int sm_major) {
  return detail::kBuiltSm90a && sm_major == 9 && detail::g_smem_limit_override.load(std::memory_order_relaxed) == 0;
}
void set_decode_shares(int grid, int item_keys) {
  detail::g_decode_share_grid.store(grid, std::memory_order_relaxed);
  detail::g_decode_share_keys.store(item_keys, std::memory_order_relaxed);
}
void set_smem_limit_override(int bytes) {
  detail::g_smem_limit_override.store(bytes > 0 ? bytes : 0, std::memory_order_relaxed);
}

namespace {
// Compiled for the same architectures as every other kernel, so its code stands for theirs.
__global__ void device_code_probe_kernel() {}
}  // namespace

DeviceSupport current_device_support() {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return kDeviceSupported;  // (not this check's to report: the first launch says what failed)
  }
  if (major < 8) return kDeviceTooOld;
  cudaFuncAttributes attributes;
  const cudaError_t e = cudaFuncGetAttributes(&attributes, device_code_probe_kernel);
  if (e == cudaSuccess) return kDeviceSupported;
  (void)cudaGetLastError();
  return e == cudaErrorInvalidDeviceFunction || e == cudaErrorNoKernelImageForDevice ? kDeviceNoCode
                                                                                     : kDeviceSupported;
}

void set_decode_l2_fetch(int fetch) { detail::g_decode_l2_fetch.store(fetch, std::memory_order_relaxed); }
#ifdef GQA_DECODE_TIMELINE
bool decode_timeline_built() { return true; }
#else
bool decode_timeline_built() { return false; }
#endif
void set_decode_timeline(unsigned long long* records, int count) {
  detail::g_decode_timeline_records.store(records != nullptr ? count : 0, std::memory_order_relaxed);
  detail::g_decode_timeline.store(records, std::memory_order_relaxed);
}

namespace {

// Auto's bound for the decode kernel's L2 prefetch (set_decode_l2_prefetch).
constexpr int64_t kL2PrefetchMaxBytes = 8LL << 20;

bool cache_rows_aligned16(const Params& p) {
  const auto aligned = [](const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; };
  const int64_t per = 16 / dtype_size(p.dtype);
  const TokenStrides& s = p.cache_strides;
  return aligned(p.key_cache) && aligned(p.value_cache) && s.batch % per == 0 && s.token % per == 0 &&
         s.head % per == 0;
}

bool tensor_core_path(const Params& p) {
  return p.dtype != DType::kFloat32 && detail::is_fast_head_dim(p.head_dim) && cache_rows_aligned16(p);
}

// Whether the tensor-core decode kernel's shared memory fits the device at this head size,
// whichever loader and grid the launch then picks. Everything fits on sm90 (227 KB a block)
// and sm80 (163 KB). Where a block may hold 99 KB (sm86, sm89, sm120), the four-warp cp.async
// stages fit at head sizes 64 and 80; at 96 and 128 (107-108 KB) the launch takes two warps a
// CTA instead (kLoadCpAsyncNarrow, 56 KB), and at 256, where two warps take 108 KB, one (59 KB).
// Only a smaller block limit sends a call to the generic kernel. (A grid of one CTA an SM asks
// for half an SM and 1 KB more, within the limit: launch_decode_kernel.)
constexpr size_t kLargestDecodeSmem =
    std::max({detail::decode_max_smem<64>(true), detail::decode_max_smem<80>(true), detail::decode_max_smem<96>(true),
              detail::decode_max_smem<128>(true), detail::decode_max_smem<256>(true)});

bool decode_mma_fits(int head_dim) {
  const int limit = detail::device_smem_limit();
  // (An H100 or H200 holds every configuration.)
  if (limit <= 0 || static_cast<size_t>(limit) >= kLargestDecodeSmem) return true;
  const bool tma = detail::sm90a_kernels_usable();
  detail::DecodeSmemFit fit = detail::kFitsNone;
  switch (head_dim) {
    case 64: fit = detail::decode_smem_fit<64>(tma, limit); break;
    case 80: fit = detail::decode_smem_fit<80>(tma, limit); break;
    case 96: fit = detail::decode_smem_fit<96>(tma, limit); break;
    case 128: fit = detail::decode_smem_fit<128>(tma, limit); break;
    default: fit = detail::decode_smem_fit<256>(tma, limit); break;
  }
  return fit != detail::kFitsNone;
}

}  // namespace

void launch(const Params& params, const Plan& plan, void* workspace, void* stream_ptr) {
  Params p = params;  // (prefill: with its work counter)
  if (p.batch <= 0 || p.query_len <= 0 || p.q_heads <= 0) return;
  if (p.batch > 65535) throw std::runtime_error("gqa: the CUDA kernels support at most 65535 batch rows");
  if (p.error_word == nullptr) throw std::runtime_error("gqa: internal error: no error word");
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  char* ws = static_cast<char*>(workspace);

  detail::Work w;
  w.max_splits = plan.max_splits;
  w.min_split_keys = plan.min_split_keys > 0 ? plan.min_split_keys : 1;
  if (w.max_splits > 128) throw std::runtime_error("gqa: internal error: at most 128 splits are supported");
  if (w.max_splits > 1) {
    w.partial_out = reinterpret_cast<float*>(ws + plan.workspace.partial_out);
    w.partial_lse = reinterpret_cast<float*>(ws + plan.workspace.partial_lse);
  }

  if (plan.route == Route::kDecode) {
    const bool tc = tensor_core_path(p) && decode_mma_fits(p.head_dim);
    // The decode grid's (row, kv head, head chunk) slots, each with an arrival counter if the
    // stream has enough of them (decode_arrival.cuh).
    const int64_t arrival_slots = static_cast<int64_t>(p.batch) * p.kv_heads * decode_head_chunks(p.group_size);
    if (w.max_splits > 1 && p.arrival_counters != nullptr && arrival_slots <= p.arrival_slots)
      w.arrivals = p.arrival_counters;
    const int schedule = detail::g_decode_schedule.load(std::memory_order_relaxed);
    w.longest_first = tc && (schedule == 2 || (schedule != 1 && plan.longest_first)) ? 1 : 0;
    // Schedule 5 runs a ragged batch in the plan's one wave (Plan::ragged_two_waves): the
    // equal rows' splits for every batch. (The workspace holds the plan's splits.)
    const bool one_wave = schedule == 5 && plan.ragged_two_waves;
    if (one_wave) w.max_splits = plan.equal_rows_splits;
    // (launch_decode_kernel drops it without the in-launch merge: the merge kernel counts a
    // row's splits from its length alone.)
    w.equal_rows_splits = w.longest_first && schedule != 3 && !one_wave ? plan.equal_rows_splits : 0;
    w.one_cta_per_sm = w.equal_rows_splits > 0 && (schedule == 0 || schedule == 5) && plan.one_cta_per_sm ? 1 : 0;
    // (Schedule 4 keeps two CTAs an SM, and with it the launch before nearly equal rows took the
    // equal rows' splits there.)
    w.near_equal_sixteenths =
        w.equal_rows_splits > 0 && (w.one_cta_per_sm != 0 || !plan.one_cta_per_sm) ? plan.near_equal_sixteenths : 0;
    // Plan::equal_rows_tail_splits: where the equal rows' splits merge in the launch (the
    // decode kernel on the arrival counters, auto's merge at the tail's at most 8 splits;
    // equal rows take the in-launch merge only). Else every batch takes the plan's own splits.
    const bool tail = tc && plan.equal_rows_tail_splits > 0 && w.equal_rows_splits > 0 && schedule == 0 &&
                      w.arrivals != nullptr && detail::g_decode_merge.load(std::memory_order_relaxed) != 1;
    if (tail) {
      w.equal_rows_tail_splits = plan.equal_rows_tail_splits;
      w.equal_rows_tail_items = plan.equal_rows_tail_items;
      w.ragged_splits = plan.ragged_splits;
    } else if (plan.ragged_splits > 0) {
      w.max_splits = plan.ragged_splits;  // (the workspace holds more)
      if (w.equal_rows_splits >= w.max_splits) w.equal_rows_splits = 0;
      if (w.max_splits <= 1) w.arrivals = nullptr;
    }
    // Plan::shares under auto's schedule and merge, where the stream has its arrival counters
    // (the CTAs that share an item merge in the launch); otherwise the plan's grid of max_splits.
    w.shares = tc && plan.shares > 0 && schedule == 0 && w.arrivals != nullptr &&
                       detail::g_decode_merge.load(std::memory_order_relaxed) != 1
                   ? plan.shares
                   : 0;
    if (w.shares > 0) {
      const int share_grid = detail::g_decode_share_grid.load(std::memory_order_relaxed);
      if (share_grid == 1) w.shares = static_cast<int32_t>(arrival_slots);
      if (share_grid == 2) w.shares = 2 * plan.shares;
      const int share_keys = detail::g_decode_share_keys.load(std::memory_order_relaxed);
      w.share_item_keys = share_keys >= 0 ? share_keys : plan.share_item_keys;
      w.share_whole_items = share_grid == 3 ? 0 : 1;
    }
    w.early_tiles = detail::g_decode_early_tiles.load(std::memory_order_relaxed) != 1 ? 1 : 0;
    // The prefetched lines must survive in L2 until the wait ends, while the kernel before
    // streams its own bytes. On an H200 (twenty-fifth round, the kernel before being the same
    // call on other caches) it paid at 4 MB of K/V a call (B1 L1024: 6.0 against 6.3 us) and
    // cost 13-16% at 34 MB (B1 L8192, B8 L1024: the lines were gone, and read twice).
    const int l2_prefetch = detail::g_decode_l2_prefetch.load(std::memory_order_relaxed);
    const int64_t cache_kv_bytes = 2LL * p.batch * p.kv_heads * p.capacity * p.head_dim * dtype_size(p.dtype);
    w.l2_prefetch = l2_prefetch == 2 || (l2_prefetch == 0 && cache_kv_bytes <= kL2PrefetchMaxBytes) ? 1 : 0;
    // The switch's code less one is the fetch (launch.h); auto: 128 bytes (see decode_mma.cuh,
    // launch_decode_mma_d, which gives the TMA maps the same).
    const int l2_fetch = detail::g_decode_l2_fetch.load(std::memory_order_relaxed);
    w.l2_fetch = l2_fetch == 0 ? detail::kL2Fetch128 : l2_fetch - 1;
    w.timeline = detail::g_decode_timeline.load(std::memory_order_relaxed);
    w.timeline_records = detail::g_decode_timeline_records.load(std::memory_order_relaxed);
    const bool fused = tc && p.inplace;
    if (!fused) detail::launch_prep(p, /*check_positions=*/true, stream);
    bool merged = false;
    if (tc) {
      merged = p.dtype == DType::kBFloat16 ? detail::launch_decode_mma_bf16(p, w, fused, stream)
                                           : detail::launch_decode_mma_fp16(p, w, fused, stream);
    } else {
      detail::launch_generic(p, w, stream);
    }
    if (w.max_splits > 1 && !merged) detail::launch_merge(p, w, stream);
    return;
  }

  // Prefill. prep zeroes the counter of the warp-specialised kernels' dynamic walk.
  if (ws != nullptr && plan.workspace.total_bytes >= plan.workspace.work_counter + sizeof(int32_t))
    p.work_counter = reinterpret_cast<int32_t*>(ws + plan.workspace.work_counter);
  // Every prep CTA checks every row (so a bad row anywhere stops all cache writes);
  // with many explicit positions they are checked once, per row, in a small launch before it.
  const bool separate_check =
      p.do_rotary && p.position_ids != nullptr && static_cast<int64_t>(p.batch) * p.query_len > 2048;
  if (separate_check) detail::launch_validate_rows(p, stream);
  // The tensor-core kernel reads q in place (packed or not). With RoPE, prep rotates q into the
  // output tensor and the kernel reads it from there (each block reads its q rows before it
  // writes the same rows of output): one bandwidth-bound pass, where rotating on load sat on
  // every query block's critical path. The kernel declines fp32, unsupported head sizes and
  // misaligned rows, which take the generic kernel (which rotates q itself and does not split).
  // When the plan splits the key range, the merge finishes the rows.
  const void* q = p.do_rotary ? p.output : p.query;
  const TokenStrides q_strides = p.do_rotary ? p.output_strides : p.query_strides;
  const bool tensor_cores = prefill_mma_covers(p, q, q_strides);
  // Rows with no past: the attention kernel appends them where it can (prefill_mma_appends).
  const bool kernel_appends = tensor_cores && prefill_mma_appends(p, w.max_splits);
  detail::launch_prep(p, !separate_check, stream, tensor_cores && p.do_rotary, kernel_appends);
  if (tensor_cores &&
      launch_prefill_mma(p, q, q_strides, w.partial_out, w.partial_lse, w.max_splits, kernel_appends, stream)) {
    if (w.max_splits > 1) detail::launch_merge(p, w, stream);
    return;
  }
  detail::Work w1;
  detail::launch_generic(p, w1, stream);
}

}  // namespace cuda
}  // namespace gqa
