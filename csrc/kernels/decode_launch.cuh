// The tensor-core decode's launch: which loader, grid and form of decode_mma_kernel
// (decode_mma.cuh) a call takes, host code apart from the kernel so that each reads in one
// sitting. launch_decode_mma_t is the entry (decode_{bf16,fp16}.cu instantiate it a dtype); the
// plan (core/plan.cpp) has chosen the splits, and the rules below choose the rest from the
// shapes, the device and the test pins (set_decode_loader and the others, launch.h). No torch
// here.
#pragma once

#include "decode_mma.cuh"

namespace gqa {
namespace cuda {
namespace detail {

// set_decode_loader (launch.cu): 0 auto (on an sm90 device in an sm90a build: TMA for K and V at
// head sizes 80, 96, 128 and 256, one tile ahead at 128 where more CTAs than SMs stream splits of
// 1,024-4,096 keys and at 80 and 96 where the grid is one wave at two CTAs an SM, at 256 four warps
// a CTA where the grid is one wave at one CTA an SM; at 64, TMA in three stages where more than
// three CTAs an SM stream splits of up to 2,048 keys in row order (not longest first), else TMA
// with 32-key slices where the splits hold 512 keys of capacity or more; cp.async elsewhere, in
// three stages at 64 where the grid is one wave at one CTA an SM of short splits, and at 80 and 96
// where it is one wave at one CTA an SM (at 96 of splits of fewer than 512 keys), or without TMA
// one tile ahead where it is one wave at two CTAs an SM), 1 cp.async always (five stages at 64,
// three tiles ahead at 80 and 96), 2 TMA where it can run (two tiles ahead at 80, 96 and 128, five
// stages at 64), 3 K by plain loads into registers and V by TMA where it can run (head sizes 64 and
// 128), else as auto, 4 as 2 with four warps a CTA at 256 whatever the grid, 5 cp.async in three
// stages at 64 whatever the grid, 6 cp.async one tile ahead at 80 and 96 whatever the grid (5 and 6
// elsewhere as 1), 7 TMA one tile ahead at 80, 96 and 128 whatever the grid, 8 TMA in three stages
// at 64 whatever the grid, 9 TMA with 32-key slices at 64 whatever the grid (7, 8 and 9 elsewhere
// as 2).
extern std::atomic<int> g_decode_loader;
// set_decode_merge (launch.cu): 0 auto (see launch_decode_kernel), 1 the merge kernel always,
// 2 the last CTA to arrive wherever the stream has arrival counters (else the merge kernel).
extern std::atomic<int> g_decode_merge;
// set_decode_features (launch.cu): 0 auto (the kPlain kernel for calls that use no feature it
// compiles out), 1 the general kernel always.
extern std::atomic<int> g_decode_features;

// Dynamic shared memory that keeps a grid to one CTA an SM: more than half an SM's (within what
// a block may hold; only a test budget is lower).
inline size_t half_sm_smem() {
  const size_t half = static_cast<size_t>(device_attribute<cudaDevAttrMaxSharedMemoryPerMultiprocessor>()) / 2 + 1024;
  const int limit = device_smem_limit();
  return limit > 0 ? std::min(half, static_cast<size_t>(limit)) : half;
}

// Where the kShares kernel (Plan::shares) is built: the loader its head size's partition runs.
constexpr bool decode_shares_built(int d, int loader) {
  return (d == 128 && loader == kLoadTma) || (d == 64 && loader == kLoadTmaWide);
}

// Returns whether the splits merged inside this launch (the last CTA of each (row, kv head,
// head chunk) to arrive); otherwise, with several splits, the caller runs the merge kernel.
// w.arrivals: the stream's counters when there are enough of them, else null.
template <typename T, int D, int kLoader, bool kPlain, bool kKeysM>
bool launch_decode_kernel(const Params& p, const Work& w, bool fused, cudaStream_t stream, const DecodeCacheMaps& maps) {
  const int hchunks = decode_head_chunks(p.group_size);
  dim3 grid(w.max_splits, p.kv_heads * hchunks, p.batch);
  if (w.ragged_splits > 0) {
    // Work::equal_rows_tail_splits: a one-dimensional grid of as many CTAs as the larger of a
    // ragged batch's and a batch of equal rows' working CTAs (decode_schedule.cuh).
    const int64_t items = static_cast<int64_t>(p.batch) * p.kv_heads * hchunks;
    const int64_t ragged = items * w.ragged_splits;
    const int64_t equal = (items - w.equal_rows_tail_items) * w.equal_rows_splits +
                          static_cast<int64_t>(w.equal_rows_tail_items) * w.equal_rows_tail_splits;
    grid = dim3(static_cast<unsigned>(std::max(ragged, equal)));
  }
  const dim3 block(DecodeCfg<D, kLoader>::kThreads);
  constexpr auto kernel = decode_mma_kernel<T, D, kLoader, kPlain, false, kKeysM>;
  // Plan::shares: a grid of w.shares CTAs, each walking its share of the keys, merged in the
  // launch (the plan's max_splits is the most CTAs an item spans). Built for the TMA loader at
  // head size 128 and its 32-key slices at 64 only (launch_decode_mma_d takes them there);
  // elsewhere the grid of splits.
  if constexpr (decode_shares_built(D, kLoader)) {
    if (w.shares > 0 && w.arrivals != nullptr && w.max_splits <= kMaxInLaunchMergeSplits) {
      constexpr auto shares_kernel = decode_mma_kernel<T, D, kLoader, kPlain, true, kKeysM>;
      // A grid of at most one CTA an SM asks for more than half an SM's shared memory, so that
      // no SM holds two shares while another idles (the shares are equal, so the SM that held
      // two would finish last).
      size_t smem = DecodeCfg<D, kLoader>::kSmem;
      if (w.shares <= device_attribute<cudaDevAttrMultiProcessorCount>()) smem = std::max(smem, half_sm_smem());
      ensure_smem<shares_kernel>(smem, "decode_mma_kernel");
      launch_kernel("decode_mma_kernel", shares_kernel, dim3(w.shares), block, smem, stream, p, w, fused ? 1 : 0, maps);
      return true;
    }
  }
  // Auto has the last split merge up to 16 splits: interleaved on an H200 (twenty-first round)
  // it beat the merge kernel by 2-3% at B1 L8192 and L32768 (16 splits) and tied at B1 L1024 and
  // B8 L32768. At 14/2/64 (D = 64) it lost 10% at 16 splits then; since the count is one
  // acquire-release atomic (twenty-sixth round) it wins there, 4.57 against 4.87 us. At 66
  // splits it lost 29%, and still loses (11.7 against 10.3): the last CTA's serial merge is 5
  // rounds of loads where the merge kernel spreads them over 14 CTAs. At head sizes 96 and 256
  // (twenty-ninth round, interleaved, arrival / merge kernel): B8 32/8/96 L1024 (2 splits) 11.3
  // / 12.7 us, B8 32/8/256 L1024 34.7 / 36.0, B1 32/8/256 L8192 (16 splits) 35.8 / 36.9.
  // The merge kernel's one round of loads (thirty-third round) left the limit where it was: at 16
  // splits the arrival still wins, B1 L8192 12.1 against 12.8 us, B1 L32768 34.8 against 35.8.
  // (Until the twenty-ninth round pairs of splits merged in a thread-block cluster where every
  // CTA was resident at once; that code was a quarter of the kernel, and without it the warps,
  // which wait for instructions to be fetched at B = 1, ran 2-4% faster on every latency row:
  // NOTES.md.)
  constexpr int kAutoMaxArrivalSplits = kMaxInLaunchMergeSplits;
  const int merge = g_decode_merge.load(std::memory_order_relaxed);
  const bool auto_arrival = w.max_splits <= kAutoMaxArrivalSplits;
  Work wk = w;
  if (w.max_splits <= 1 || !(merge == 2 || (merge == 0 && auto_arrival))) wk.arrivals = nullptr;
  if (wk.arrivals == nullptr || w.equal_rows_splits >= w.max_splits) wk.equal_rows_splits = 0;
  // Plan::one_cta_per_sm, where the equal rows' splits are in use: more than half an SM's shared
  // memory, so that one CTA an SM fits (the rest is never touched).
  size_t smem = DecodeCfg<D, kLoader>::kSmem;
  if (wk.one_cta_per_sm != 0 && wk.equal_rows_splits > 0) smem = std::max(smem, half_sm_smem());
  ensure_smem<kernel>(smem, "decode_mma_kernel");
  launch_kernel("decode_mma_kernel", kernel, grid, block, smem, stream, p, wk, fused ? 1 : 0, maps);
  return wk.arrivals != nullptr;
}

// Where the keys-as-rows form of the tile is built (decode_mma_kernel's kKeysM): every loader
// but K in registers, at head sizes up to 128 (at 256 it read 3% slower, stop 77).
constexpr bool decode_keys_as_rows_built(int d, int loader) { return d <= 128 && loader != kLoadTmaV; }

// The kPlain kernel where the call uses none of the features it compiles out; the keys-as-rows
// form where a CTA has at most 8 query heads (G <= 8: one head chunk).
template <typename T, int D, int kLoader>
bool launch_decode_loader(const Params& p, const Work& w, bool fused, cudaStream_t stream, const DecodeCacheMaps& maps) {
  const bool plain = g_decode_features.load(std::memory_order_relaxed) == 0 && !p.do_rotary && !(p.softcap > 0.f) &&
                     p.local_window <= 0 && p.head_sink == nullptr && !p.smooth_softmax;
  if constexpr (decode_keys_as_rows_built(D, kLoader)) {
    if (p.group_size <= 8) {
      return plain ? launch_decode_kernel<T, D, kLoader, true, true>(p, w, fused, stream, maps)
                   : launch_decode_kernel<T, D, kLoader, false, true>(p, w, fused, stream, maps);
    }
  }
  return plain ? launch_decode_kernel<T, D, kLoader, true, false>(p, w, fused, stream, maps)
               : launch_decode_kernel<T, D, kLoader, false, false>(p, w, fused, stream, maps);
}

template <typename T, int D>
bool launch_decode_mma_d(const Params& p, const Work& w, bool fused, cudaStream_t stream) {
  DecodeCacheMaps maps{};
  const int pinned = g_decode_loader.load(std::memory_order_relaxed);
  bool tma = pinned != kPinCpAsync && pinned != kPinCpAsyncShallow && pinned != kPinCpAsyncOneAhead &&
             sm90a_kernels_usable();
  // Where a block cannot hold the usual stages (99 KB on sm86, sm89 and sm120), fewer warps a
  // CTA (two at 96 and 128, one at 256), whatever the pin.
  if constexpr (D == 96 || D == 128 || D == 256) {
    if (decode_smem_fit<D>(tma, device_smem_limit()) == kFitsNarrow)
      return launch_decode_loader<T, D, kLoadCpAsyncNarrow>(p, w, fused, stream, maps);
  }
  // The maps' L2 promotion is Work::l2_fetch (auto 128 bytes, what the kernel's cp.async copies
  // and plain loads always ask for).
  // On an H200 (twenty-seventh round, scripts/decode_bw_probe.cu, the decode grid streaming
  // 8.6 GB with nothing computed) 256-byte promotion held the TMA slices to 4.28-4.31 TB/s
  // where 128 bytes or none read 4.53-4.55, and regs_k's K loads asking for 256 bytes fell from
  // 4.5 to 4.2; cp.async asking for 128 bytes rose from 4.20 to 4.33.
  const CUtensorMapL2promotion promotion = w.l2_fetch == kL2FetchSectors ? CU_TENSOR_MAP_L2_PROMOTION_NONE
                                           : w.l2_fetch == kL2Fetch256    ? CU_TENSOR_MAP_L2_PROMOTION_L2_256B
                                                                          : CU_TENSOR_MAP_L2_PROMOTION_L2_128B;
  // 16-key boxes: one warp's slice. False when the driver has no encoder (cp.async then).
  if (tma)
    tma = encode_cache_map(&maps.k, p.key_cache, p, 16, promotion) &&
          encode_cache_map(&maps.v, p.value_cache, p, 16, promotion);
  const int64_t slots = static_cast<int64_t>(p.batch) * p.kv_heads * decode_head_chunks(p.group_size);
  // The loaders below are chosen by the grid of a ragged batch's splits (with
  // Work::equal_rows_tail_splits, only the last wave of equal rows takes more).
  const int64_t row_splits = w.ragged_splits > 0 ? w.ragged_splits : w.max_splits;
  const int64_t ctas = slots * row_splits;  // slots: (row, kv head, head chunk)
  const int64_t sms = device_attribute<cudaDevAttrMultiProcessorCount>();
  const bool many_ctas = ctas >= sms;
  const int64_t split_keys = p.capacity / row_splits;  // a split's keys of capacity
  // A batch of equal rows would take one wave of at most one CTA an SM (Plan::equal_rows_splits)
  // in a grid of more CTAs.
  const bool equal_rows_one_wave = w.equal_rows_splits > 0 && w.equal_rows_splits * slots <= sms;
  // One wave at two CTAs an SM (more CTAs than SMs, at most twice as many) that equal rows would
  // not reduce to one CTA an SM: where the loaders at 80 and 96 keep one tile ahead (below).
  const bool one_wave_at_two = ctas > sms && ctas <= 2 * sms && !equal_rows_one_wave;
  if constexpr (D == 64 || D == 128) {
    // K into registers (V by TMA) only under its pin. Auto took it at D = 128 while the TMA maps
    // promoted 256 bytes (eleventh H200 round: B16 64/8 L8192, 256 CTAs of 4,096 keys, 133 us
    // with K in registers against 137); with 128 (twenty-seventh round, call 3, interleaved, TMA
    // / K in registers) TMA ties or wins on every such row: B64 L8192 470 / 476, B64 L32768 1860
    // / 1860, B8 L32768 241 / 244, B16 124 / 126. Auto also took it at D = 64 where many CTAs
    // stream long ranges, until the fortieth round measured it there against the other two
    // loaders: it took up to a quarter longer than either (below).
    if (tma && pinned == kPinRegsK)
      return launch_decode_loader<T, D, kLoadTmaV>(p, w, fused, stream, maps);
  }
  // With one CTA an SM, auto takes cp.async at D = 64. Eleventh H200 round, three runs: TMA read
  // 6% slower on both 14/2/64 rows (B1 L1024 6.16 against 6.55 us, L32768 12.5 against 13.3;
  // twenty-seventh round, call 3: 4.75 against 4.57, and 11.0 against 10.9). At D = 128 auto
  // takes TMA everywhere: with the maps promoting 128 bytes it beat cp.async where cp.async had
  // won, on long splits with one CTA an SM (twenty-seventh round, call 3, interleaved, TMA /
  // cp.async: B8 L8192 64.9 / 69.2, B1 L32768 35.0 / 36.7); short splits already favoured it
  // (twenty-fourth round). At D = 256, where the grid is one wave at one CTA an SM, auto and the
  // TMA pin take four warps a CTA by TMA (DecodeCfg; thirty-ninth round: faster than two warps
  // by cp.async, the choice before, by 9-22% at B = 1 with up to 8,192 keys, and level at
  // 32,768). With more CTAs two warps by TMA (B8 32/8/256 L8192, 256 CTAs, two an SM: 138 us
  // against cp.async's 143, thirtieth round), and the cp.async pin keeps two warps (at fewer
  // CTAs than SMs it read faster than two warps by TMA then: B1 32/8/256 L8192 33.9 / 35.9).
  // So, too, where a batch of equal rows would take one such wave (Plan::equal_rows_splits) in a
  // grid of more CTAs: then a ragged batch runs that grid in waves, longest first (thirty-ninth
  // round, interleaved, four warps / two warps two CTAs an SM, us: B16 32/8/256 L8192 equal rows
  // 241 / 282, lengths from 256 118 / 171-181, from 4,096 197 / 224; B33 16/4/256 L8192 245 /
  // 287, from 1,024 138 / 175; B16 16/8/256 L16384 474 / 562, from 2,048 261 / 267). Grids of
  // more CTAs than that keep two warps, two an SM (four warps in waves: B17 32/8/256 L2048 102 /
  // 81, B64 32/8/256 L1024 137 / 134, B32 16/8/256 L4096 245 / 243), except where the plan
  // sized the equal rows' last wave for them (Plan::equal_rows_tail_splits; plan.cpp, stop 79).
  if constexpr (D == 256) {
    if (tma && (ctas <= sms || equal_rows_one_wave || w.equal_rows_tail_splits > 0 || pinned == kPinTmaFourWarps))
      return launch_decode_loader<T, D, kLoadTmaFourWarps>(p, w, fused, stream, maps);
  }
  // At D = 64 auto takes TMA where at least as many CTAs as SMs stream splits of 2,048 keys of
  // capacity or more, unless a batch of equal rows would run one CTA an SM: there cp.async, as at
  // B = 1. Fortieth round, one H200, interleaved, us, K in registers (auto before) / TMA /
  // cp.async (SDPA cuDNN): B64 32/8/64 L2048 84.3 / 68.0 / 70.2 (63.4); B32 L8192 159.9 / 123.1 /
  // 136.1 (119.9); B16 L4096, equal rows in one split a row, 49.7 / 41.3 / 36.9 (37.5), lengths
  // from 256 34.0 / 31.0 / 32.7 (a ragged batch pays 5% for the equal rows' 11%). Shorter
  // ranges keep cp.async (measured once: B64 L1024 38.5 against TMA's 37.8; 14/2/64 L32768, 132
  // CTAs of 496 keys, 9.7 against 10.1). Since the forty-fourth round every such grid, and the
  // equal rows' one wave too, takes the 32-key slices instead (kLoadTmaWide, below), so auto
  // never takes this loader at 64.
  const bool auto_tma = D == 128 || (D == 256 && many_ctas);
  // Two variants of the TMA loader, each where a grid of many CTAs read faster with it
  // (forty-second round, two H200s, one process each, interleaved, two runs, us, SDPA cuDNN in
  // brackets):
  // - At D = 128, one tile in flight ahead instead of two (kLoadTmaOneAhead), where the grid has
  //   more CTAs than SMs, its splits hold 1,024-4,096 keys of capacity and a batch of equal rows
  //   would not run one CTA an SM. One ahead / two: B64 32/8 L1024 66.40-66.44 / 67.06-67.08
  //   (66.0) and 65.10-65.21 / 65.82-65.83 (65.0); B48 L2048 97.9-98.0 / 99.2-99.3 (96.4); B64
  //   L1024 lengths from 256 48.2-48.3 / 49.4-49.5; B8 L8192 66.35-66.48 / 66.88-66.96 and
  //   65.08-65.12 / 65.34-65.48; B8 L32768 245.8-246.2 / 246.2-246.7; B128 L1024 125.7-125.9 /
  //   126.1-126.2; level at B64 L4096 and B32 L8192. Elsewhere two stay: one ahead lost with
  //   longer splits (B64 L8192 +0.2%, L32768 +0.35%), with shorter ones and at B = 1 (B8 L1024,
  //   256-key splits, 12.6 / 12.2; B1 L8192 12.4-12.5 / 12.25) and moved either way at B16 64/8,
  //   whose equal rows run one CTA an SM (127.0-127.1 / 126.7-126.9 on one H200, 122.5-122.6 /
  //   124.2 on the other).
  // - At D = 64, three stages instead of five (kLoadTmaShallow, about 51 KB, so four CTAs share an
  //   SM where two did), where the grid has more than three CTAs an SM (so that at four an SM
  //   its first wave is nearly full), its splits hold 2,048 keys of capacity or fewer, the rows
  //   are not dispatched longest first (Plan::longest_first) and equal rows would not run one
  //   CTA an SM; cp.async took those splits before. Three TMA stages / auto before (cp.async):
  //   B64 32/8/64 L1024 36.2 / 38.8-39.1 (34.8), lengths from 256 27.0 / 29.8-30.0; B128 L1024
  //   66.5-67.0 / 70.1-70.3 (64.0), lengths from 256 47.0-47.1 / 48.6 (TMA 49.5-49.8); B100
  //   L1024 55.6-56.2 / 57.5-57.8 (52.7), lengths from 256 41.1-41.2 / 42.7. Where the plan
  //   ranks the rows (splits of 2,048 keys here), a ragged batch's ranks are dealt over the SMs
  //   at the launch in one wave of four an SM, where in two waves of two the SMs that finish
  //   first take the next ones: B64 L2048 lengths from 256 48.6-49.0 against 41.0-41.1 with
  //   five stages (though equal rows gained, 66.25 against 68.75-68.84, and B128 L2048 127.5-127.7
  //   against 131.7). It lost with fewer CTAs too, against five stages: B48 L2048 (384 CTAs)
  //   lengths from 256 41.2-42.8 against 34.3-34.5, B40 (320) 30.9-31.3 against 29.0-29.2; and
  //   with longer splits: B32 L8192 (256 CTAs of 4,096 keys) 129.5-137.1 against 125.7-125.9,
  //   B16 L4096 41.8 against cp.async's 36.9.
  if constexpr (D == 128) {
    // Plan::shares runs the TMA loader's own ring (its kernel is built for that loader only).
    if (tma && w.shares > 0 && pinned == kPinLoaderAuto)
      return launch_decode_loader<T, D, kLoadTma>(p, w, fused, stream, maps);
    const bool one_ahead = ctas > sms && split_keys >= 1024 && split_keys <= 4096 && !equal_rows_one_wave;
    if (tma && ((pinned == kPinLoaderAuto && one_ahead) || pinned == kPinTmaOneAhead))
      return launch_decode_loader<T, D, kLoadTmaOneAhead>(p, w, fused, stream, maps);
  }
  if constexpr (D == 64) {
    // Plan::shares runs the 32-key slices' own ring (below), as at 128 the TMA loader's.
    const bool shares = tma && w.shares > 0 && pinned == kPinLoaderAuto;
    const bool four_an_sm =
        !shares && ctas > 3 * sms && split_keys <= 2048 && w.longest_first == 0 && !equal_rows_one_wave;
    if (tma && ((pinned == kPinLoaderAuto && four_an_sm) || pinned == kPinTmaShallow))
      return launch_decode_loader<T, D, kLoadTmaShallow>(p, w, fused, stream, maps);
    // Elsewhere at D = 64, where the splits hold 512 keys of capacity or more, TMA with 32 keys a
    // warp a stage (kLoadTmaWide): one online-softmax step a warp (the row maxima and their
    // shuffles, the rescale of O, the barrier wait) serves twice the keys, which at 128 bytes a
    // key row was a larger share of a tile's work than at D = 128. Forty-fourth round, one H200,
    // one process, interleaved, us, 32-key slices (auto) / the loader auto took before (SDPA
    // cuDNN): B48 32/8/64 L2048 52.2 / 53.8 TMA (48.7), B40 44.5 / 45.8 (41.6), B64 65.9 / 68.1
    // (63.6), B128 128.9 / 131.8 (121.7), B64 L4096 123.5 / 125.8, B32 L8192 123.4 / 125.1
    // (120.2), B8 L8192 35.4 / 36.2; where cp.async ran: B16 L4096 34.0 / 36.7 (37.5), B8 12/12
    // L1024 9.16 / 11.12 (11.47), B32 12/12 L1024 28.9 / 32.6 (26.4), B1 32/8/64 L16384 12.0 /
    // 13.2, B2 L8192 11.9 / 13.3, B4 14/2/64 L16384 12.2 / 13.6; B1 32/8/64 L8192 8.45 / 8.64
    // (three cp.async stages), B8 14/2/64 L4096 8.56 / 8.79. Ragged batches (lengths from 256)
    // gained 4-13% (B48 L2048 32.8 / 34.3, B16 L4096 29.8 / 33.0, B8 12/12 L1024 from 128 8.52 /
    // 9.78), tied at B32 L8192 (79.8 / 79.7) and lost 1.1% at B64 L2048 (41.1 / 40.7). With
    // shorter splits it lost (B1 14/2/64 L1024, splits of 16 keys: 4.57 against 4.17), and it
    // tied at 14/2/64 L32768 (496 keys: 9.31 / 9.35; since stop 53 the plan gives that row 64
    // splits of 512 keys, and it takes this loader); with four CTAs an SM the three shallow
    // stages stay (B64 L1024 37.1 against 36.3).
    const bool wide = shares || (!four_an_sm && split_keys >= 512);
    if (tma && ((pinned == kPinLoaderAuto && wide) || pinned == kPinTmaWide)) {
      // Maps whose boxes hold a warp's 32 keys (a slice).
      if (encode_cache_map(&maps.k, p.key_cache, p, 32, promotion) &&
          encode_cache_map(&maps.v, p.value_cache, p, 32, promotion))
        return launch_decode_loader<T, D, kLoadTmaWide>(p, w, fused, stream, maps);
      tma = false;
    }
  }
  // At D = 80 and 96 auto takes TMA (each slice row two boxes, the second padded to 64 columns
  // with zeros, DecodeCfg::kBoxes), one tile ahead where the grid is one wave at two CTAs an SM
  // and a batch of equal rows would not run one CTA an SM (as the cp.async loader below). Where
  // the grid is one wave of at most one CTA an SM, cp.async stays at D = 80 and for splits of
  // fewer than 512 keys of capacity at 96. Fifty-sixth round, one H200, one process,
  // interleaved, two passes, us, TMA / TMA one ahead / cp.async as auto took it before (one
  // tile ahead at B = 8; SDPA cuDNN in brackets):
  // - More CTAs than SMs: B8 32/32/80 L2048 45.2-45.3 / 44.4 / 45.2 (44.0), lengths from 256
  //   33.3-33.6 / 32.5-32.8 / 34.3-34.6; B8 32/32/96 L4096 100.8-101.0 / 99.0-99.1 / 101.9-102.2
  //   (100.7), lengths from 256 77.5-77.6 / 74.8-74.9 / 79.3-79.5; B8 24/8/96 L8192 53.2-53.4 /
  //   52.6 / 54.4 (54.8-54.9); B4 32/32/96 L4096, equal rows one CTA an SM, 52.3-52.6 /
  //   56.5-56.9 / 54.3-54.6 (54.5-54.8); B12 32/32/96 L4096 145.9-146.7 / 145.8-146.3 /
  //   152.8-155.7 (160.4-160.6); B12 32/32/80 L2048 66.9-67.0 / 66.7-66.9 / 68.3-68.6; B16
  //   32/32/80 L1024 46.6 / 46.4 / 47.7-47.9 (46.2); B32 32/32/80 L2048 165.9-166.4 /
  //   167.4-167.7 / 170.2-170.8 (161.3-161.8); B32 32/32/96 L4096 379.6-382.3 / 375.2-376.0 /
  //   391.5-394.3 (377.6-380.2).
  // - One CTA an SM (128 CTAs), TMA / cp.async: at 96, B1 32/32 L4096 (1,024-key splits) 16.8 /
  //   17.4, L8192 28.9 / 29.7, B2 L2048 16.8-16.9 / 17.2, B1 24/8 L16384 17.2 / 17.6, L8192 (512
  //   keys) 11.1-11.2 / 11.3, B1 32/32 L2048 (512) 11.0 / 11.1-11.4, but B1 32/32 L1024 (256)
  //   8.1-8.3 / 8.0-8.3 and B1 24/8 L4096 (256) 8.2 / 8.0-8.1; at 80 cp.async at every length:
  //   B1 32/32 L2048 (512) 10.6-10.7 / 10.3-10.4, L4096 16.1 / 15.2-15.3, L8192 27.2 / 26.2, B2
  //   L2048 16.4 / 15.6, B4 L1024 14.8 / 14.0, B1 16/16 L8192 16.2-16.3 / 15.4, B4 L2048 lengths
  //   from 256 23.5 / 22.3.
  if constexpr (D == 80 || D == 96) {
    const bool auto_tma_here = pinned == kPinLoaderAuto && !(ctas <= sms && (D == 80 || split_keys < 512));
    if (tma && ((auto_tma_here && one_wave_at_two) || pinned == kPinTmaOneAhead))
      return launch_decode_loader<T, D, kLoadTmaOneAhead>(p, w, fused, stream, maps);
    if (tma && auto_tma_here) return launch_decode_loader<T, D, kLoadTma>(p, w, fused, stream, maps);
  }
  if (tma && (pinned == kPinTma || pinned == kPinTmaFourWarps || pinned == kPinTmaOneAhead ||
              pinned == kPinTmaShallow || pinned == kPinTmaWide || auto_tma))
    return launch_decode_loader<T, D, kLoadTma>(p, w, fused, stream, maps);
  // At D = 64, where the grid is one wave of at most one CTA an SM and the splits are short (512
  // keys of capacity or fewer, eight tiles), auto's cp.async takes three stages instead of five
  // (kLoadCpAsyncShallow). Forty-first round, one H200, interleaved in one process, us, three /
  // five stages (SDPA cuDNN): B1 14/2/64 L1024 4.18-4.21 / 4.25-4.28 (5.36-5.45), L32768
  // 9.34-9.42 / 9.69-9.72 (11.82-11.87), B1 32/8/64 L8192 8.67-8.69 / 9.34-9.35 (10.55), B4
  // 32/8/64 L1024 6.48-6.51 / 6.78-6.79, B8 14/2/64 L4096 8.87-8.88 / 9.40-9.42; level at B1
  // 14/2/64 L4096 and L16384 and B2 L8192. With longer splits three stages left the stream short
  // of requests: B8 12/12/64 L1024 (96 CTAs of 1,024 keys) 11.17-11.22 / 10.90-10.92.
  const bool short_ranges = split_keys <= 512;
  if constexpr (D == 64) {
    if ((pinned == kPinLoaderAuto && ctas <= sms && short_ranges) || pinned == kPinCpAsyncShallow)
      return launch_decode_loader<T, D, kLoadCpAsyncShallow>(p, w, fused, stream, maps);
  }
  // At D = 80 and 96 by cp.async (without TMA, or under the pins), where the grid is one
  // wave at two CTAs an SM (more CTAs than SMs, at most twice as many) and a batch of equal rows
  // would not run one CTA an SM, auto keeps one tile in flight ahead instead of three
  // (kLoadCpAsyncOneAhead). Forty-first round, one H200, one process, interleaved, us, one /
  // three tiles ahead (SDPA cuDNN): B8 32/32/80 L2048 45.2-45.3 / 47.0-47.2 (44.1), B8 32/32/96
  // L4096 100.9-101.8 / 106.0-107.1 (100.4), lengths from 256 78.9-79.0 / 82.1-82.4. Elsewhere
  // three stay: one ahead tied at B16 32/32/80 L1024 (512 CTAs; 47.2-47.3 / 47.3-47.5), lost at
  // B32 32/32/80 L2048 (1,024 CTAs; 171.4 / 169.1) and at B4 32/32/96 L4096, whose equal rows
  // run one CTA an SM (58.8 / 53.7), and at B = 1 (10.6 / 10.5).
  if constexpr (D == 80 || D == 96) {
    if ((pinned == kPinLoaderAuto && one_wave_at_two) || pinned == kPinCpAsyncOneAhead)
      return launch_decode_loader<T, D, kLoadCpAsyncOneAhead>(p, w, fused, stream, maps);
  }
  return launch_decode_loader<T, D, kLoadCpAsync>(p, w, fused, stream, maps);
}

template <typename T>
bool launch_decode_mma_t(const Params& p, const Work& w, bool fused, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_decode_mma_d<T, 64>(p, w, fused, stream);
    case 80: return launch_decode_mma_d<T, 80>(p, w, fused, stream);
    case 96: return launch_decode_mma_d<T, 96>(p, w, fused, stream);
    case 128: return launch_decode_mma_d<T, 128>(p, w, fused, stream);
    case 256: return launch_decode_mma_d<T, 256>(p, w, fused, stream);
    default: throw std::runtime_error("gqa: internal error: no tensor-core decode for this head size");
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace gqa
