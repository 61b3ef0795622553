// Decode (S == 1) on tensor cores, fp16/bf16, head sizes 64/80/96/128/256.
//
// Grid (split, kv head x head chunk, row; w.longest_first: the row's rank in decreasing length,
// decode_schedule.cuh). One CTA serves up to 16 query heads of one kv head
// (all G of them when G <= 16), so each K/V byte is read from memory once. The CTA takes keys
// [k0, k1) of the row's visible range (split-K; the active split count is chosen here from the
// row's length), streams them through a pipeline of kStages tiles (loaded by TMA, each warp its
// own 16 keys, or 32 under kLoadTmaWide, on sm90 at every fast head size, with K instead
// loaded straight into registers at 64/128 under a pin; by cp.async, the whole CTA,
// elsewhere: auto's choices are in launch_decode_mma_d, decode_launch.cuh), and each warp multiplies its 16 keys
// of a tile (32: two k-steps of P V) with mma.sync m16n8k16:
//   S[16 heads x 16 keys] = Q[16 x D] K^T,  O[16 x D] += P[16 x 16] V[16 x D],
// with an online softmax in fp32 (log2 domain) per warp. The warps' states are merged through
// shared memory at the end; a CTA either writes the output (one split) or its normalised
// partial output and log-sum-exp, which the merge kernel combines or (w.arrivals) the last
// split CTA to finish (decode_arrival.cuh), and then no merge kernel runs.
//
// `fused` (in-place op): no prep launch ran. Every CTA checks all rows itself (so a bad row
// anywhere makes the whole call NaN, as the error word would), the CTA whose range holds the
// new key writes the new K (after RoPE) and V into the cache and patches the same values into
// its own tile or K registers (the warp whose keys hold it), since nothing in this launch may
// read that cache row.
#pragma once

#include "common.cuh"
#include "decode_arrival.cuh"
#include "decode_cfg.cuh"
#include "decode_schedule.cuh"
#include "launch.h"
#include "tma.cuh"

namespace gqa {
namespace cuda {
namespace detail {

// The K and V cache maps of the TMA loader (unused by the cp.async one).
struct DecodeCacheMaps {
  CUtensorMap k;
  CUtensorMap v;
};

// Diagnostics (Work::timeline, benchmarks/decode_timeline.py): thread 0 of a CTA that computes
// stamps its record (kDecodeTimelineFields wide) with the GPU timer at entry and exit, its SM's
// clock at entry, after the PDL wait, after the error word and the row checks, with Q staged,
// after the tile loop and at exit (after its merge, if it merged), its SM and tile count, and
// its block coordinates. Under kShares each segment of a CTA stamps a record of its own, record
// c + g s for segment s of CTA c in a grid of g (benchmarks/segment_timeline.py), the entry
// stamps in segment 0's. Only in a build with GQA_DECODE_TIMELINE defined (setup.py defines it
// when the environment sets GQA_DECODE_TIMELINE=1): elsewhere a stamp is no code at all. As
// uniform branches on a null pointer the seven stamp sites were not free at B = 1, where the
// warps wait for instructions: built out, B1 L1024 ran 5.99 us against 6.18 with them, and
// 14/2/64 L1024 4.87 against 5.09 (H200, twenty-fifth and twenty-sixth rounds).
#ifdef GQA_DECODE_TIMELINE
constexpr bool kDecodeTimelineBuilt = true;
#else
constexpr bool kDecodeTimelineBuilt = false;
#endif
enum DecodeTimelineField { kDtEntryNs, kDtEntry, kDtWaited, kDtChecked, kDtQReady, kDtLoopDone, kDtExit, kDtExitNs,
                           kDtSmTiles, kDtCta, kDtFieldsUsed };
static_assert(kDtFieldsUsed <= kDecodeTimelineFields, "the decode timeline's record width");
__device__ __forceinline__ void decode_stamp(const Work& w, int field, unsigned long long value = 0, int segment = 0) {
  if constexpr (kDecodeTimelineBuilt) {
    if (w.timeline == nullptr || threadIdx.x != 0) return;
    const int64_t record =
        blockIdx.x + static_cast<int64_t>(gridDim.x) * (blockIdx.y + static_cast<int64_t>(gridDim.y) * blockIdx.z) +
        static_cast<int64_t>(segment) * gridDim.x * gridDim.y * gridDim.z;
    if (record >= w.timeline_records) return;
    if (field == kDtEntryNs || field == kDtExitNs) {
      value = global_ns();
    } else if (field == kDtSmTiles) {
      value |= static_cast<unsigned long long>(sm_id()) << 32;  // value: the tile count
    } else if (field != kDtCta) {
      value = sm_clock();
    }
    w.timeline[record * kDecodeTimelineFields + field] = value;
  }
}

// Rows [0, rows) of D elements, `stride` elements apart, into L2 (l2_prefetch_bulk): one
// request when they are contiguous, else one a row, dealt over the CTA's threads from `thread`
// (the caller's thread index, rotated so that several calls spread over different threads).
template <int D, typename T>
__device__ __forceinline__ void l2_prefetch_rows(const T* src, int rows, int64_t stride, int thread, int threads) {
  constexpr uint32_t kRowBytes = D * sizeof(T);
  if (stride == D) {
    if (thread == 0) l2_prefetch_bulk(src, static_cast<uint32_t>(rows) * kRowBytes);
    return;
  }
#pragma unroll 1
  for (int r = thread; r < rows; r += threads) l2_prefetch_bulk(src + r * stride, kRowBytes);
}

// The online softmax's step for one row: its running max `m` takes the tile's max `tile_max`
// (both in log2 units); `mu` is the offset the tile's exponentials subtract (0 while the row has
// seen only masked keys, so that exp2(-inf - 0) = 0 and never NaN), `corr` the factor on the
// row's sum and output so far.
__device__ __forceinline__ void online_max_step(float& m, float tile_max, float& mu, float& corr) {
  const float mn = fmaxf(m, tile_max);
  mu = mn == -INFINITY ? 0.f : mn;
  corr = fast_exp2(m - mu);
  m = mn;
}

// kTma (sm90, see launch_decode_mma_d): each warp streams its own 16 (or 32) keys of every tile
// as TMA boxes onto an mbarrier of its own, so the warps never wait for each other in the tile loop
// (kRegK: V only; each lane loads its part of K into registers, see load_k); otherwise the CTA
// copies whole tiles with cp.async between two barriers a tile.
//
// kPlain: compiled for calls that use none of RoPE, softcap, a local window, head sinks and
// smooth softmax (launch_decode_loader, decode_launch.cuh, picks it at run time). Those
// features are run-time flags in the general kernel, where they cost no issue slots when off
// but do cost code on the path: at B = 1 a warp ran about 1,460 instructions through one tile,
// and its largest stall was waiting for instructions to be fetched (twenty-third round). kPlain
// compiles them out (1,237 a warp; 7.56 against 6.27 us a call at B = 1, L = 1024:
// twenty-fourth round).
// kShares (Work::shares): each CTA walks the segments of its share of the batch's keys
// (shares_walk), running the body below once a segment; built only for the TMA loader at head
// size 128 and the 32-key slices at 64 (decode_launch.cuh, decode_shares_built).
template <typename T, int D, int kLoader, bool kPlain, bool kShares = false, bool kKeysM = false>
__global__ void __launch_bounds__(DecodeCfg<D, kLoader>::kThreads)
    decode_mma_kernel(const __grid_constant__ Params p, const Work w, const int fused,
                      const __grid_constant__ DecodeCacheMaps maps) {
  using Cfg = DecodeCfg<D, kLoader>;
  constexpr bool kTma = Cfg::kTma;
  constexpr bool kRegK = Cfg::kRegK;
  constexpr int kKU = Cfg::kKChunks;
  constexpr int kStride = Cfg::kStride;
  constexpr int kTile = Cfg::kTile;
  constexpr int kStages = Cfg::kStages;
  extern __shared__ __align__(16) uint8_t smem[];
  T* q_s = reinterpret_cast<T*>(smem);
  uint8_t* stages = smem + Cfg::kQBytes;
  if constexpr (kTma) stages += (1024u - (static_cast<uint32_t>(__cvta_generic_to_shared(stages)) & 1023u)) & 1023u;
  // kTma outside kShares: the stages' shared address, and below each warp's stage barriers',
  // held in registers. The opaque copies keep ptxas from rebuilding them (an S2R of the CTA's
  // cluster id and the alignment's arithmetic) where a tile's copies go out: every TMA tile
  // loop 2-5% shorter, and at B = 1 the warps wait on their own instructions (fifty-second and
  // fifty-third rounds, NOTES.md). The kShares kernel keeps the plain expressions: there the same
  // change ran the B16 64/8 grid row 1.2% slower.
  uint32_t stages_s = static_cast<uint32_t>(__cvta_generic_to_shared(stages));
  if constexpr (!kShares) asm("" : "+r"(stages_s));
  T* kv_s = reinterpret_cast<T*>(stages);
  T* new_s = reinterpret_cast<T*>(stages + kStages * Cfg::kStageBytes);
  __shared__ float red_m[Cfg::kWarps][16];
  __shared__ float red_l[Cfg::kWarps][16];
  __shared__ float2 fin_ml[16];  // per query head: the CTA's running max (log2) and sum
  __shared__ __align__(8) uint64_t slice_full[kTma ? Cfg::kWarps * kStages : 1];  // [warp][stage]

  decode_stamp(w, kDtEntryNs);
  decode_stamp(w, kDtEntry);
  uint32_t warp_slice_bars = static_cast<uint32_t>(__cvta_generic_to_shared(&slice_full[(threadIdx.x >> 5) * kStages]));
  if constexpr (!kShares) asm("" : "+r"(warp_slice_bars));
  // The features, constant under kPlain.
  const bool rotary = !kPlain && p.do_rotary;
  const int32_t window = kPlain ? -1 : p.local_window;
  const float softcap = kPlain ? 0.f : p.softcap;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  // The CTA's split, kv head x head chunk and row: the grid's own, or with w.longest_first the
  // row of that rank in decreasing length (which reads seqlens_k only, before the PDL wait, and
  // hands back the row's), and for a batch of equal rows that takes fewer splits than the grid
  // has, coordinates from the linear block index (decode_schedule.cuh).
  // kShares: the CTA's TMA ring carries on from one segment to the next. The stage barriers are
  // initialised once, so each warp keeps the parity of each of its stage barriers (bit s of
  // ring_phase: a warp waits on a stage only where it loaded its slice); the error word and the
  // fused row checks run in the first segment only (cta_bad), since they are the call's, not
  // the item's; and each segment issues the next one's first tiles before its own partials and
  // merge (next_tiles_issued), so that their round trip to memory overlaps them.
  uint32_t ring_phase = 0;
  // The merge by the split that arrives last (decode_arrival.cuh): under kShares a thread's two
  // units in one round trip to L2, four splits at a time (the partition cuts an item into a few
  // CTAs' segments, and a merge on a segment's boundary holds up the CTA's next segment or ends
  // the call: 0.4-1% faster on ragged batches at 64/8 and 32/4 heads, nh = 8, NOTES.md); the
  // grid of splits one unit and 16 splits (up to 16 splits at B = 1 in one round trip).
  constexpr int kMergeBatch = kShares ? 4 : 16;
  constexpr int kMergeUnits = kShares ? 2 : 1;
  int segment_index = 0;  // kShares: the timeline record of this segment (counted only where stamps are built)
  bool cta_bad = false;
  bool next_tiles_issued = false;
  // One (row, kv head x head chunk, split): the whole CTA in the grid of splits, one segment of
  // its share under kShares (a return below ends the segment), where `first` says whether it is
  // the CTA's first and `has_next` whether `next` is the CTA's next segment.
  auto run = [&](const DecodeCta& cta, const bool first, const bool has_next, const DecodeCta& next) {
  const RankedRow& ranked = cta.ranked;
  const int split = cta.split;
  const int kv_chunk = cta.kv_chunk;  // kv head x head chunk
  const int G = p.group_size;
  const int hchunks = decode_head_chunks(G);
  const int kvh = hchunks == 1 ? kv_chunk : kv_chunk / hchunks;  // G <= 16: no division
  const int hc = kv_chunk - kvh * hchunks;
  const int b = ranked.row;
  const int h0 = kvh * G + hc * 16;
  const int nh = min(16, G - hc * 16);
  const TokenStrides os = p.output_strides;
  T* out_row = static_cast<T*>(p.output) + b * os.batch;

  // Work that reads nothing an earlier kernel writes runs before the PDL wait, under the tail of
  // the kernel before: this warp's stage barriers, and the tensor maps' prefetch.
  const uint32_t slice_bars =
      kShares ? static_cast<uint32_t>(__cvta_generic_to_shared(&slice_full[warp * kStages])) : warp_slice_bars;
  if (kTma && (!kShares || first)) {
    if (lane == 0) {
      for (int s = 0; s < kStages; ++s) mbarrier_init(slice_bars + 8u * s, 1);
      if (warp == 0) {
        tma_prefetch_map(&maps.v);
        if constexpr (!kRegK) tma_prefetch_map(&maps.k);
      }
    }
    __syncwarp();
    generic_to_async_proxy();  // the initialised barriers, before the copies complete on them
  }

  // seqlens_k goes before the PDL wait too (see pdl_early_read in common.cuh): the row's
  // length, and in fused mode each thread's first row to check, so that neither read is on the
  // path after the wait. (The row's geometry and this split's part of its keys are written here
  // too, but nvcc 13.0 places the split's division after the wait, where they are first used;
  // the branch wip/decode-prewait-settle pins them before it.)
  // (Under kShares the walk has read them.)
  const int seqlen = kShares || w.longest_first ? ranked.seqlen : pdl_early_read(p.seqlens_k + b);
  const int first_check_seqlen =
      kShares || w.longest_first ? ranked.own : (fused && tid < p.batch ? pdl_early_read(p.seqlens_k + tid) : 0);
  const RowGeometry g = row_geometry(p, seqlen);
  // The one query token sits at position query_start; it sees [lo, hi) (used once the row
  // checks pass).
  const KeyRange vis = visible_keys(window, g.total, g.query_start);
  const int n = vis.hi - vis.lo;
  // (Under kShares the segment's keys and its item's count of CTAs come with it.)
  const int active = kShares ? cta.splits : active_splits(n, cta.splits, w.min_split_keys);
  const int chunk = (n + active - 1) / active;
  const int k0 = kShares ? vis.lo + cta.k_begin : vis.lo + split * chunk;
  const int k1 = kShares ? min(vis.hi, vis.lo + cta.k_end) : min(vis.hi, k0 + chunk);

  auto aligned16 = [](const T* row, int64_t stride) {
    return ((reinterpret_cast<uintptr_t>(row) | static_cast<uintptr_t>(stride * sizeof(T))) & 15u) == 0;
  };
  const TokenStrides qs = p.query_strides;
  const T* const qsrc = static_cast<const T*>(p.query) + b * qs.batch;
  const TokenStrides cs = p.cache_strides;
  const T* kbase = static_cast<const T*>(p.key_cache) + b * cs.batch + kvh * cs.head;
  const T* vbase = static_cast<const T*>(p.value_cache) + b * cs.batch + kvh * cs.head;

  // w.l2_prefetch: the first keys of the split (those the first tiles after the wait copy) and
  // the CTA's query rows are asked into L2 before the PDL wait. When the kernel before is one of
  // ours, this CTA usually starts while that kernel still runs and waits here, so these bytes
  // come from memory under its tail, and the copies after the wait find them in L2. L2 is the
  // point where all reads and writes meet, so the kernel before may still write these lines
  // (the previous step's append, its output fed back as q): the copies read what it wrote.
  // Only for a valid row's non-empty split, whose keys lie inside the capacity.
  if (w.l2_prefetch != 0 && g.flags == 0 && split < active && k0 < k1) {
    constexpr int kL2Keys = (Cfg::kAhead < 2 ? Cfg::kAhead : 2) * kTile;
    const int keys = min(k1 - k0, kL2Keys);
    const int64_t first = static_cast<int64_t>(k0) * cs.token;
    l2_prefetch_rows<D>(kbase + first, keys, cs.token, tid, Cfg::kThreads);
    l2_prefetch_rows<D>(vbase + first, keys, cs.token, (tid + 32) % Cfg::kThreads, Cfg::kThreads);
    const T* const q_first = qsrc + h0 * qs.head;
    if (aligned16(q_first, qs.head)) l2_prefetch_rows<D>(q_first, nh, qs.head, (tid + 64) % Cfg::kThreads, Cfg::kThreads);
  }

  if (!kShares || first) {
    pdl_wait();
    pdl_launch_dependents();
  }
  decode_stamp(w, kDtWaited, 0, segment_index);

  // The error word may be set by the kernel just before: after the wait.
  const uint32_t word = tid == 0 && (!kShares || first) ? read_error_word(p.error_word) : 0u;
  // Q's 16-byte units, and in fused mode the new key's and value's, go into registers right
  // after the PDL wait (they may be the kernel before's output): their memory round trip
  // overlaps the error word's, the row checks and the first K/V loads instead of following
  // them. (Nsight Compute, B1 L1024, TMA loader: the Q units' shared stores waiting on their
  // loads and the barrier behind them held 16% of the stall samples; the first K/V wait none.)
  // Not with K in registers (their budget) nor at D = 256 (eight units a thread).
  constexpr bool kPrefetch = !kRegK && D <= 128;
  constexpr int kE = 16 / static_cast<int>(sizeof(T));  // elements in 16 bytes
  constexpr int kQPre = kPrefetch ? (16 * (D / kE) + Cfg::kThreads - 1) / Cfg::kThreads : 1;
  // A row in 16-byte units (rope_vec_units; without RoPE each unit is one chunk, copied).
  const bool rope_vec = kPlain || rope_vec_ok(p, static_cast<int>(sizeof(T)), rotary);
  const bool q_vec = aligned16(qsrc, qs.head) && rope_vec;
  const int q_units = kPlain ? D / kE : rope_vec_units(p, static_cast<int>(sizeof(T)), rotary);  // also a new key's
  auto unit_chunks = [&](int u, int& c0, int& c1) {
    if constexpr (kPlain) {
      c0 = u;
      c1 = -1;
    } else {
      rope_unit_chunks(p, static_cast<int>(sizeof(T)), rotary, u, c0, c1);
    }
  };
  const T* const ksrc = static_cast<const T*>(p.key) + b * p.key_strides.batch + kvh * p.key_strides.head;
  const T* const vsrc = static_cast<const T*>(p.value) + b * p.value_strides.batch + kvh * p.value_strides.head;
  const bool kv_pre = kPrefetch && fused && aligned16(ksrc, 0) && aligned16(vsrc, 0) && rope_vec;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  uint4 q_pre[kQPre][2], k_pre[2] = {zero, zero}, v_pre = zero;
  if constexpr (kPrefetch) {
#pragma unroll
    for (int j = 0; j < kQPre; ++j) {
      const int i = tid + j * Cfg::kThreads;
      q_pre[j][0] = q_pre[j][1] = zero;
      if (q_vec && i < nh * q_units) {
        const int r = i / q_units;
        int c0, c1;
        unit_chunks(i - r * q_units, c0, c1);
        const uint4* const row = reinterpret_cast<const uint4*>(qsrc + (h0 + r) * qs.head);
        q_pre[j][0] = row[c0];
        if (c1 >= 0) q_pre[j][1] = row[c1];
      }
    }
    if (kv_pre && tid < q_units) {
      int c0, c1;
      unit_chunks(tid, c0, c1);
      k_pre[0] = reinterpret_cast<const uint4*>(ksrc)[c0];
      if (c1 >= 0) k_pre[1] = reinterpret_cast<const uint4*>(ksrc)[c1];
    }
    if (kv_pre && tid < D / kE) v_pre = reinterpret_cast<const uint4*>(vsrc)[tid];
  }

  const int ntiles = (k1 - k0 + kTile - 1) / kTile;

  // Each thread copies one fixed 16-byte column chunk of rows r0, r0 + kRowsPerPass, ... of a
  // tile, so a pass is a pointer step, a bounds test and two cp.async (no per-chunk division
  // or 64-bit multiply). With 80/96-wide rows (10/12 chunks) a few threads sit out.
  constexpr int kRowsPerPass = Cfg::kThreads / Cfg::kChunks;
  constexpr int kPasses = (kTile + kRowsPerPass - 1) / kRowsPerPass;
  const int my_chunk = tid % Cfg::kChunks;
  const int my_row = tid / Cfg::kChunks;  // >= kRowsPerPass: this thread copies nothing
  const int64_t pass_step = static_cast<int64_t>(kRowsPerPass) * cs.token;
  const T* kcol = kbase + my_chunk * 8;
  const T* vcol = vbase + my_chunk * 8;
  // The cp.async copies and regs_k's K loads ask L2 for the aligned 128 bytes around each read
  // (.L2::128B; twenty-seventh round: 3% more for cp.async than the sectors alone, level for the
  // plain loads). Fixed here, not chosen at run time as Work::l2_fetch chooses the TMA maps'
  // promotion: a run-time choice kept three copies of every copy loop in the kernel (D = 64
  // cp.async: 7,752 SASS instructions against 6,152 with one), and at B = 1 the warps wait for
  // instructions to be fetched more than for anything else (twenty-eighth round, interleaved:
  // 14/2/64 L32768 10.1 against 10.8 us; TMA, which has no such loop, 10.9 in both runs).
  auto load_tile = [&](int tile, int stage) {
    if (my_row >= kRowsPerPass) return;
    T* ks = kv_s + stage * 2 * kTile * kStride + my_row * kStride + my_chunk * 8;
    T* vs = ks + kTile * kStride;
    int j = k0 + tile * kTile + my_row;
    int64_t off = static_cast<int64_t>(j) * cs.token;
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      if (pass * kRowsPerPass + my_row < kTile) {
        const bool ok = j < k1;  // rows past the split's end are zero-filled, never read
        cp_async16<true>(ks, kcol + (ok ? off : 0), ok);
        cp_async16<true>(vs, vcol + (ok ? off : 0), ok);
      }
      ks += kRowsPerPass * kStride;
      vs += kRowsPerPass * kStride;
      j += kRowsPerPass;
      off += pass_step;
    }
  };

  // kTma: lane 0 of each warp loads its slice's keys of K and V, D / 64 boxes each (rows past the
  // capacity are zero-filled; rows past the split's end but inside the capacity are loaded
  // and, for V, zeroed after the wait: P is 0 there, and 0 times a stale NaN would be NaN).
  constexpr int kSliceKeys = Cfg::kSliceKeys;
  const int kw = warp * kSliceKeys;  // this warp's keys within a tile
  auto slice_keys = [&](int tile) { return min(kSliceKeys, k1 - (k0 + tile * kTile + kw)); };  // <= 0: none
  // 16-byte chunk c of row r (below kSliceKeys) of this warp's K (or V) slice in a stage.
  auto slice_chunk = [&](int stage, bool v, int r, int c) -> T* {
    if constexpr (kTma) {
      uint8_t* slice = stages + stage * Cfg::kStageBytes + (v && !kRegK ? Cfg::kWarps : 0) * Cfg::kSliceBytes +
                       warp * Cfg::kSliceBytes;
      return reinterpret_cast<T*>(slice + (c >> 3) * (kSliceKeys * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4));
    } else {
      return kv_s + stage * 2 * kTile * kStride + (v ? kTile * kStride : 0) + (kw + r) * kStride + c * 8;
    }
  };
  // kTma: the shared address of slice_chunk(stage, v, 0, box * 8), where box `box` of this warp's
  // K (or V) slice lands (kShares: from the generic pointer, as above).
  auto slice_chunk_shared = [&](int stage, bool v, int box) -> uint32_t {
    if constexpr (kShares) {
      return static_cast<uint32_t>(__cvta_generic_to_shared(slice_chunk(stage, v, 0, box * 8)));
    } else {
      return stages_s + stage * Cfg::kStageBytes + ((v && !kRegK ? Cfg::kWarps : 0) + warp) * Cfg::kSliceBytes +
             box * (kSliceKeys * 128);
    }
  };
  // Of the keys [kb, ke) of row row_b and kv head kv_head (this segment's, or under kShares the
  // next one's).
  auto load_slice_of = [&](int kb, int ke, int kv_head, int row_b, int tile, int stage) {
    const int row = kb + tile * kTile + kw;
    if (lane != 0 || min(kSliceKeys, ke - row) <= 0) return;
    const uint32_t bar = slice_bars + 8u * stage;
    mbarrier_arrive_expect_bytes(bar, static_cast<uint32_t>((kRegK ? 1 : 2) * Cfg::kSliceBytes));
#pragma unroll
    for (int cb = 0; cb < Cfg::kBoxes; ++cb) {
      if constexpr (!kRegK) {
        tma_load_4d(slice_chunk_shared(stage, false, cb), &maps.k,
                    cb * 64, row, kv_head, row_b, bar);
      }
      tma_load_4d(slice_chunk_shared(stage, true, cb), &maps.v,
                  cb * 64, row, kv_head, row_b, bar);
    }
  };
  auto load_slice = [&](int tile, int stage) { load_slice_of(k0, k1, kvh, b, tile, stage); };
  // The parity this warp waits for on its barrier of `stage` for the segment's tile `tile`
  // (kShares: the warp's running parity, which the wait flips).
  auto stage_parity = [&](int tile, int stage) -> uint32_t {
    if constexpr (kShares) {
      const uint32_t parity = (ring_phase >> stage) & 1u;
      ring_phase ^= 1u << stage;
      return parity;
    } else {
      return static_cast<uint32_t>(tile / kStages) & 1u;
    }
  };

  // kRegK: K goes from memory straight into the mma B fragments of S = Q K^T. The dot product
  // over d does not care about the order of d, so lane q = lane % 4 of key group row lane / 4
  // takes the physical columns u * 32 + q * 8 + (0..7), u < D / 32 (one 16-byte load each, and a
  // warp's load covers 64 contiguous bytes of each of 8 keys), and Q's fragments take the same
  // order: logical column 16 s + 2 q + (j & 1) + 8 (j >> 1) of k-step s is physical column
  // (s >> 1) * 32 + q * 8 + (s & 1) * 4 + j. Keys past the split's end load as zeros (never
  // past the capacity); the new key is patched into the registers after the load.
  const T* k_lane = kbase + (lane & 3) * 8;
  auto load_k = [&](int tile, uint4 (&kr)[2][kKU]) {
    const int key0 = k0 + tile * kTile + kw + (lane >> 2);
#pragma unroll
    for (int grp = 0; grp < 2; ++grp) {
      const int key = key0 + grp * 8;
      const bool ok = key < k1;
      const uint4* src = reinterpret_cast<const uint4*>(k_lane + static_cast<int64_t>(ok ? key : k0) * cs.token);
#pragma unroll
      for (int u = 0; u < kKU; ++u)
        kr[grp][u] = ok ? ld_stream16_l2_128(src + u * 4) : make_uint4(0u, 0u, 0u, 0u);
    }
  };

  // The split's first kAhead tiles. The loops stay rolled: unrolled, each of the two call
  // sites below held kAhead copies of the copy code (120-624 more SASS instructions a
  // kernel, forty-first round; no row measured faster either way).
  auto issue_first_tiles = [&]() {
    if constexpr (kTma) {
#pragma unroll 1
      for (int s = 0; s < Cfg::kAhead && s < ntiles; ++s) load_slice(s, s);
    } else {
#pragma unroll 1
      for (int s = 0; s < Cfg::kAhead; ++s) {
        if (s < ntiles) load_tile(s, s);
        cp_async_commit();
      }
    }
  };
  // w.early_tiles: the first tiles go out now, before the error word's round trip and the row
  // checks, so that the first K/V bytes (a memory round trip of their own) no longer wait for
  // them; at one tile a warp this chain is the call. Only for a valid row's non-empty split,
  // whose keys lie inside the capacity. Should the checks then fail, the CTA waits for those
  // copies before it leaves (drain_first_tiles).
  // kShares: the segment before issued this one's first tiles.
  const bool tiles_issued = kShares && next_tiles_issued;
  if constexpr (kShares) next_tiles_issued = false;
  const bool early =
      !tiles_issued && !(kShares && cta_bad) && w.early_tiles != 0 && g.flags == 0 && split < active && k0 < k1;
  if (early) issue_first_tiles();
  auto drain_first_tiles = [&]() {
    if constexpr (kTma && kShares) {
      for (int s = 0; s < Cfg::kAhead && s < ntiles; ++s) {
        if (slice_keys(s) > 0) {
          const uint32_t parity = stage_parity(s, s);  // (every lane keeps the warp's parities)
          if (lane == 0) mbarrier_wait(slice_bars + 8u * s, parity);
        }
      }
    } else if constexpr (kTma) {
      if (lane == 0) {
        for (int s = 0; s < Cfg::kAhead && s < ntiles; ++s) {
          if (slice_keys(s) > 0) mbarrier_wait(slice_bars + 8u * s, 0);
        }
      }
    } else {
      cp_async_wait<0>();
    }
  };

  uint32_t bad = g.flags | word;
  if (fused && (!kShares || first)) {
    for (int bb = tid; bb < p.batch; bb += Cfg::kThreads) {
      const RowGeometry gb = row_geometry(p, bb == tid ? first_check_seqlen : p.seqlens_k[bb]);
      uint32_t f = gb.flags;
      if (f == 0 && rotary && !position_in_range(p, rotary_position(p, gb, bb, 0))) f |= kErrPosition;
      if (f != 0) {
        bad |= f;
        // One CTA sets each bad row's flags: under kShares the one that serves the first keys
        // of row 0's first item (always its first segment, while a bad row's item may be no
        // CTA's first segment, and the first CTA may serve nothing: shares_walk), else the
        // row's first split of its first kv chunk.
        if (kShares ? b == 0 && kv_chunk == 0 && split == 0 : bb == b && split == 0 && kv_chunk == 0)
          atomicOr(p.error_word, f);
      }
    }
  }
  // kShares: the call's checks ran in the CTA's first segment; a later one adds its own row's.
  bool failed;
  if (kShares && !first) {
    failed = cta_bad || g.flags != 0;
  } else {
    failed = __syncthreads_or(bad != 0) != 0;
    if constexpr (kShares) cta_bad = failed;
  }
  if (failed) {
    if (early || tiles_issued) drain_first_tiles();
    if (split == 0) {
      for (int i = tid; i < nh * D; i += Cfg::kThreads) {
        const int r = i / D;
        out_row[(h0 + r) * os.head + (i - r * D)] = from_f<T>(quiet_nan());
      }
    }
    // The arrival merge counts every active split in, this one too (its NaN log-sum-exps make
    // the merge write NaN, should another split have passed its checks).
    if (w.arrivals != nullptr && active > 1 && split < active) {
      const int64_t part = (static_cast<int64_t>(b) * p.q_heads + h0) * w.max_splits + split;
      for (int r = tid; r < nh; r += Cfg::kThreads) w.partial_lse[part + static_cast<int64_t>(r) * w.max_splits] = quiet_nan();
      if (arrive_last(arrival_counter(w, p.kv_heads * hchunks, b, kv_chunk), active)) {
        for (int i = tid; i < nh * D; i += Cfg::kThreads) {
          const int r = i / D;
          out_row[(h0 + r) * os.head + (i - r * D)] = from_f<T>(quiet_nan());
        }
      }
    }
    return;
  }

  if (split >= active) return;
  const int64_t part = (static_cast<int64_t>(b) * p.q_heads + h0) * w.max_splits + split;
  if (k0 >= k1) {  // only possible with several splits: an empty tail split (zero weight)
    for (int i = tid; i < nh * D; i += Cfg::kThreads) {
      const int r = i / D;
      const int64_t slot = part + static_cast<int64_t>(r) * w.max_splits;
      w.partial_out[slot * D + (i - r * D)] = 0.f;
      if (i - r * D == 0) w.partial_lse[slot] = -INFINITY;
    }
    if (w.arrivals != nullptr && arrive_last(arrival_counter(w, p.kv_heads * hchunks, b, kv_chunk), active))
      arrival_merge_splits<T, D, Cfg::kThreads, kPlain, kMergeBatch, kMergeUnits>(p, w, part - split, active, h0, nh, out_row);
    return;
  }

  decode_stamp(w, kDtChecked, 0, segment_index);
  if (!early && !tiles_issued) issue_first_tiles();

  // kRegK: K of the even / odd tiles (unused otherwise). The first two go out now, after the
  // first V slices and before the Q rows, so that a split of one or two tiles waits for one
  // memory round trip, not two (Q's RoPE tables and Q itself are a round trip of their own).
  uint4 k_even[2][kKU], k_odd[2][kKU];
  if constexpr (kRegK) {
    load_k(0, k_even);
    if (ntiles > 1) load_k(1, k_odd);
  }

  // Q rows (RoPE'd, rounded to T) while the first tiles are in flight; rows >= nh are zero.
  // In 16-byte units spread over the CTA when the rows and the rotary tables allow it (one
  // load and one store a unit instead of an element each: the element path was the kernel's
  // top stall at B=1, each 2-byte shared store waiting on its own global load); else a warp
  // a row, element by element.
  const int64_t rot_pos = rotary ? rotary_position(p, g, b, 0) : 0;
  // Unit u from its chunks as read (rope_unit_rotate).
  auto unit_rotate = [&](const uint4& x0, const uint4& x1, int u, uint4& y0, uint4& y1) {
    if constexpr (kPlain) {
      y0 = x0;
      y1 = x1;
    } else {
      rope_unit_rotate<T>(p, x0, x1, rotary, rot_pos, u, y0, y1);
    }
  };
  {
    if (q_vec) {
      if constexpr (kPrefetch) {  // the units read after the PDL wait
#pragma unroll
        for (int j = 0; j < kQPre; ++j) {
          const int i = tid + j * Cfg::kThreads;
          if (i >= nh * q_units) continue;
          const int r = i / q_units, u = i - r * q_units;
          int c0, c1;
          unit_chunks(u, c0, c1);
          uint4 y0, y1;
          unit_rotate(q_pre[j][0], q_pre[j][1], u, y0, y1);
          uint4* const row = reinterpret_cast<uint4*>(q_s + r * kStride);
          row[c0] = y0;
          if (c1 >= 0) row[c1] = y1;
        }
      } else {
        for (int i = tid; i < nh * q_units; i += Cfg::kThreads) {
          const int r = i / q_units, u = i - r * q_units;
          int c0, c1;
          unit_chunks(u, c0, c1);
          const uint4* const src = reinterpret_cast<const uint4*>(qsrc + (h0 + r) * qs.head);
          uint4 y0, y1;
          unit_rotate(src[c0], c1 >= 0 ? src[c1] : make_uint4(0u, 0u, 0u, 0u), u, y0, y1);
          uint4* const row = reinterpret_cast<uint4*>(q_s + r * kStride);
          row[c0] = y0;
          if (c1 >= 0) row[c1] = y1;
        }
      }
      for (int i = nh * (D / kE) + tid; i < 16 * (D / kE); i += Cfg::kThreads) {
        const int r = i / (D / kE);
        reinterpret_cast<uint4*>(q_s + r * kStride)[i - r * (D / kE)] = make_uint4(0u, 0u, 0u, 0u);
      }
    } else {
      for (int r = warp; r < 16; r += Cfg::kWarps) {
        T* dst = q_s + r * kStride;
        if (r < nh) {
          rope_row<T>(p, qsrc + (h0 + r) * qs.head, rotary, rot_pos, lane, 32, [&](int d, T v) { dst[d] = v; });
        } else {
          for (int d = lane; d < D; d += 32) dst[d] = from_f<T>(0.f);
        }
      }
    }
  }
  // The new key of this row (fused mode): the CTA whose range holds it computes it once.
  const bool owner = fused && g.past >= k0 && g.past < k1;
  if (owner) {
    const int64_t coff = b * cs.batch + static_cast<int64_t>(g.past) * cs.token + kvh * cs.head;
    T* kdst = static_cast<T*>(p.key_cache) + coff;
    T* vdst = static_cast<T*>(p.value_cache) + coff;
    const bool write_cache = hc == 0;
    if (kv_pre) {  // the units read after the PDL wait (cache rows are 16-byte aligned here)
      if (tid < q_units) {
        int c0, c1;
        unit_chunks(tid, c0, c1);
        uint4 y0, y1;
        unit_rotate(k_pre[0], k_pre[1], tid, y0, y1);
        reinterpret_cast<uint4*>(new_s)[c0] = y0;
        if (c1 >= 0) reinterpret_cast<uint4*>(new_s)[c1] = y1;
        if (write_cache) {
          reinterpret_cast<uint4*>(kdst)[c0] = y0;
          if (c1 >= 0) reinterpret_cast<uint4*>(kdst)[c1] = y1;
        }
      }
      if (tid < D / kE) {
        reinterpret_cast<uint4*>(new_s + D)[tid] = v_pre;
        if (write_cache) reinterpret_cast<uint4*>(vdst)[tid] = v_pre;
      }
    } else {
      rope_row<T>(p, ksrc, rotary, rot_pos, tid, Cfg::kThreads, [&](int d, T v) {
        new_s[d] = v;
        if (write_cache) kdst[d] = v;
      });
      for (int d = tid; d < D; d += Cfg::kThreads) {
        const T v = vsrc[d];
        new_s[D + d] = v;
        if (write_cache) vdst[d] = v;
      }
    }
  }
  __syncthreads();
  decode_stamp(w, kDtQReady, 0, segment_index);

  // kKeysM (G <= 8, D <= 128, every loader but kRegK: decode_keys_as_rows_built in
  // decode_launch.cuh): the tile's keys are the mma's 16 rows and the query heads its 8 columns,
  // S^T = K Q^T and O^T += V^T P^T, so that no mma multiplies padding rows (heads as the rows pad
  // G to 16: half of every mma at G = 8, three quarters at G = 4). Q^T is then the B operand: qb[k-step] = Q[head g][2q..],
  // Q[head g][8 + 2q..]. A kernel of its own: both forms in one kernel kept the larger form's
  // registers and code, and cost the B = 1 rows 2-7% (stop 77, keys_as_m_g8.patch).
  static_assert(!kKeysM || (!kRegK && D <= 128), "keys as the mma rows: D <= 128, K not in registers");
  uint32_t qa[!kKeysM && Cfg::kQInRegs ? D / 16 : 1][4];
  uint32_t qb[kKeysM && Cfg::kQInRegs ? D / 16 : 1][2];
  if constexpr (kRegK) {  // in the K fragments' column order (load_k)
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const T* q0 = q_s + (lane >> 2) * kStride + (kk >> 1) * 32 + (lane & 3) * 8 + (kk & 1) * 4;
      qa[kk][0] = *reinterpret_cast<const uint32_t*>(q0);
      qa[kk][1] = *reinterpret_cast<const uint32_t*>(q0 + 8 * kStride);
      qa[kk][2] = *reinterpret_cast<const uint32_t*>(q0 + 2);
      qa[kk][3] = *reinterpret_cast<const uint32_t*>(q0 + 8 * kStride + 2);
    }
  } else if constexpr (kKeysM && Cfg::kQInRegs) {
    const T* const q_row = q_s + (lane >> 2) * kStride + 2 * (lane & 3);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      qb[kk][0] = *reinterpret_cast<const uint32_t*>(q_row + kk * 16);
      qb[kk][1] = *reinterpret_cast<const uint32_t*>(q_row + kk * 16 + 8);
    }
  } else if constexpr (Cfg::kQInRegs) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) ldmatrix_x4(qa[kk], q_s + (lane & 15) * kStride + kk * 16 + (lane >> 4) * 8);
  }

  // O (heads as the rows: [16 heads x D] in n-tiles of 8 columns), or kKeysM O^T ([D x 8 heads]
  // in m-tiles of 16 rows: o[t] = O[head 2q][16 t + g], O[2q + 1][16 t + g], then the same at
  // 16 t + g + 8).
  constexpr int kOTiles = kKeysM ? D / 16 : D / 8;
  float o[kOTiles][4];
#pragma unroll
  for (int i = 0; i < kOTiles; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m_r[2] = {-INFINITY, -INFINITY};
  float l_r[2] = {0.f, 0.f};
  const float scale_l2 = p.scale * kLog2e;
  // tanh's argument is score * (scale / softcap), with the quotient formed once and clamped:
  // as scale * (1 / softcap) a subnormal softcap made 1 / softcap inf, and a zero scale then
  // gave 0 * inf = NaN.
  const float cap_k =
      softcap > 0.f ? copysignf(fminf(fabsf(p.scale) / softcap, 3.4028234663852886e38f), p.scale) : 0.f;

  // kKeysM: this warp's keys of the tile in `stage` (the first at t0 + kw), in 16-key halves.
  // S^T[16 keys x 8 heads] = K Q^T takes the K rows' ldmatrix as the A operand; P^T, moved into
  // the B operand's layout by an 8x8 transpose of each half, multiplies V^T (the V rows'
  // transposing ldmatrix as the A operand). m_r, l_r and the corrections are per head: heads 2q
  // and 2q + 1 of each lane, reduced over the lanes' key rows (g).
  auto keys_m_tile = [&](const int tile, const int stage, const int t0) {
    if constexpr (kKeysM) {  // (compiled only into the keys-as-rows instantiations)
      constexpr int kHalves = kSliceKeys / 16;
      constexpr bool kTwoChains = D >= 128;  // as below: two chains of D / 32 mmas a score
      float st[kHalves][4], st_odd[kHalves][4];
#pragma unroll
      for (int hf = 0; hf < kHalves; ++hf) {
#pragma unroll
        for (int e = 0; e < 4; ++e) st[hf][e] = st_odd[hf][e] = 0.f;
      }
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t b0, b1;
        if constexpr (Cfg::kQInRegs) {
          b0 = qb[kk][0];
          b1 = qb[kk][1];
        } else {
          const T* const q_row = q_s + (lane >> 2) * kStride + kk * 16 + 2 * (lane & 3);
          b0 = *reinterpret_cast<const uint32_t*>(q_row);
          b1 = *reinterpret_cast<const uint32_t*>(q_row + 8);
        }
#pragma unroll
        for (int hf = 0; hf < kHalves; ++hf) {
          // The A operand's order: keys 0-7 x d 0-7, keys 8-15 x d 0-7, keys 0-7 x d 8-15, keys
          // 8-15 x d 8-15. The lanes' addresses put each 8 x 8 matrix in its own register, so
          // the mma takes them as loaded (a reorder after the load cost four moves an mma).
          uint32_t ka[4];
          const int key = hf * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
          ldmatrix_x4(ka, slice_chunk(stage, false, key, kk * 2 + (lane >> 4)));
          mma16816<T>(kTwoChains && (kk & 1) ? st_odd[hf] : st[hf], ka, b0, b1);
        }
      }
      const bool need_mask = t0 + kw + kSliceKeys > k1;
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int hf = 0; hf < kHalves; ++hf) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = kTwoChains ? st[hf][e] + st_odd[hf][e] : st[hf][e];
          if (softcap > 0.f) {
            x = softcap * tanhf(x * cap_k) * kLog2e;
          } else {
            x *= scale_l2;
          }
          if (need_mask && t0 + kw + hf * 16 + (lane >> 2) + (e >> 1) * 8 >= k1) x = -INFINITY;
          st[hf][e] = x;
          mx[e & 1] = fmaxf(mx[e & 1], x);
        }
      }
      float mu[2], corr[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {  // a head's keys are spread over the lanes' g (lane bits 2-4)
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 4));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 8));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 16));
        online_max_step(m_r[r], mx[r], mu[r], corr[r]);
      }
      float rs[2] = {0.f, 0.f};
#pragma unroll
      for (int hf = 0; hf < kHalves; ++hf) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float pe = fast_exp2(st[hf][e] - mu[e & 1]);
          st[hf][e] = pe;
          rs[e & 1] += pe;
        }
      }
      l_r[0] = l_r[0] * corr[0] + rs[0];
      l_r[1] = l_r[1] * corr[1] + rs[1];
      if (tile > 0 && __any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) {  // (O is zero at the first)
#pragma unroll
        for (int i = 0; i < kOTiles; ++i) {
          o[i][0] *= corr[0];
          o[i][1] *= corr[1];
          o[i][2] *= corr[0];
          o[i][3] *= corr[1];
        }
      }
#pragma unroll
      for (int hf = 0; hf < kHalves; ++hf) {
        // The B operand (16 keys x 8 heads): P^T[keys 2q, 2q + 1][head g], then keys 8 + 2q, 9 + 2q.
        const uint32_t pb0 = movmatrix_trans(pack2<T>(st[hf][0], st[hf][1]));
        const uint32_t pb1 = movmatrix_trans(pack2<T>(st[hf][2], st[hf][3]));
#pragma unroll
        for (int dn = 0; dn < D / 16; ++dn) {
          // (V^T) in the A operand's order, as loaded: d 0-7 x keys 0-7, d 8-15 x keys 0-7,
          // d 0-7 x keys 8-15, d 8-15 x keys 8-15.
          uint32_t va[4];
          const int key = hf * 16 + (lane >> 4) * 8 + (lane & 7);
          ldmatrix_x4_trans(va, slice_chunk(stage, true, key, dn * 2 + ((lane >> 3) & 1)));
          mma16816<T>(o[dn], va, pb0, pb1);
        }
      }
    }
  };

  // One tile of this warp; kRegK: K of this tile is in kc (the next tile's is on its way into
  // the other register set).
  auto tile_step = [&](const int tile, uint4 (&kc)[2][kKU]) {
    const int nt = tile + Cfg::kAhead;  // the tile that goes into the stage tile + kAhead - kStages used
    const int stage = tile % kStages;
    if constexpr (kTma) {
      // This warp's slice of tile - 1 is consumed (its ldmatrix reads and any new-key patch or
      // zeroed rows are this warp's own, ordered before the TMA writes by the proxy fence).
      if (nt < ntiles) {
        __syncwarp();
        generic_to_async_proxy();
        load_slice(nt, nt % kStages);
      }
      const int valid = slice_keys(tile);
      if (valid <= 0) return;  // this warp's keys are all past the end
      mbarrier_wait(slice_bars + 8u * stage, stage_parity(tile, stage));
      if (valid < kSliceKeys) {
        for (int i = lane; i < (kSliceKeys - valid) * Cfg::kChunks; i += 32) {
          const int r = valid + i / Cfg::kChunks;
          *reinterpret_cast<uint4*>(slice_chunk(stage, true, r, i % Cfg::kChunks)) = make_uint4(0u, 0u, 0u, 0u);
        }
        __syncwarp();
      }
    } else {
      // Refill before the wait: once every warp is done with tile - 1 (the first barrier), tile
      // + kAhead goes into its stage (the one tile - 1 used, where kAhead = kStages - 1; an
      // older one under kLoadCpAsyncOneAhead), and only then does this thread wait for tile
      // `tile`, so kAhead tiles stay in flight during the wait instead of kAhead - 1. The second
      // barrier makes tile `tile` (each thread waited for its own copies) visible to every warp.
      __syncthreads();
      if (nt < ntiles) load_tile(nt, nt % kStages);
      cp_async_commit();
      cp_async_wait<Cfg::kAhead>();
      __syncthreads();
    }
    const int t0 = k0 + tile * kTile;
    if (t0 + kw >= k1) return;  // this warp's keys are all past the end
    // The new key replaces the cache row it was copied from (the row this launch writes):
    // only the warp whose keys hold it reads it.
    if (owner && g.past >= t0 + kw && g.past < t0 + kw + kSliceKeys) {
      const int r = g.past - t0 - kw;
      if constexpr (kRegK) {
        if ((lane >> 2) == (r & 7)) {  // the four lanes that hold key r (load_k's order)
          const uint4* nk = reinterpret_cast<const uint4*>(new_s) + (lane & 3);
#pragma unroll
          for (int u = 0; u < kKU; ++u) {
            if (r < 8) kc[0][u] = nk[u * 4];
            else kc[1][u] = nk[u * 4];
          }
        }
      }
      for (int d = lane; d < D; d += 32) {
        if constexpr (!kRegK) slice_chunk(stage, false, r, d >> 3)[d & 7] = new_s[d];
        slice_chunk(stage, true, r, d >> 3)[d & 7] = new_s[D + d];
      }
      __syncwarp();
    }

    if constexpr (kKeysM) {
      keys_m_tile(tile, stage, t0);
    } else {
    // The scores of this warp's keys, in 8-key n-tiles (two a 16-key half of the slice).
    constexpr int kN = kSliceKeys / 8;
    float sc[kN][4];
#pragma unroll
    for (int nn = 0; nn < kN; ++nn) sc[nn][0] = sc[nn][1] = sc[nn][2] = sc[nn][3] = 0.f;
    if constexpr (kRegK) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
        for (int grp = 0; grp < 2; ++grp) {
          const uint4& c = kc[grp][kk >> 1];
          mma16816<T>(sc[grp], qa[kk], (kk & 1) ? c.z : c.x, (kk & 1) ? c.w : c.y);
        }
      }
      // kc is spent: it takes tile + 2 (the other set holds tile + 1), so two tiles of K stay
      // in flight behind the compute with two register sets. (With one, a CTA an SM kept only
      // 16 KB of K in flight, and rows with one CTA an SM ran up to 1.25x slower than TMA.)
      if (tile + 2 < ntiles) load_k(tile + 2, kc);
    }
    // At head sizes 128 and 256 the odd k-steps accumulate apart and are added at the end: each
    // score then waits for two chains of D / 32 dependent mmas instead of one of D / 16, since at
    // B = 1 a CTA's warps are few and each mma's latency is on the path. H200, thirty-eighth
    // round, interleaved against one chain (us): B1 L8192 12.07-12.11 against 12.17-12.21, B8
    // L1024 12.06-12.08 against 12.16-12.24, B1 32/8/256 L1024 11.44-11.46 against 11.49-11.50,
    // B1 28/4/256 L4096 14.61-14.69 against 14.78-14.86. At 64 and 96 it lost (14/2/64 L1024
    // 4.25-4.28 against 4.23-4.24, B1 32/8/96 L1024 5.31-5.32 against 5.19-5.22), so they keep
    // one chain.
    constexpr bool kTwoChains = D >= 128;
    float sc_odd[kN][4];
#pragma unroll
    for (int nn = 0; nn < kN; ++nn) sc_odd[nn][0] = sc_odd[nn][1] = sc_odd[nn][2] = sc_odd[nn][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < (kRegK ? 0 : D / 16); ++kk) {
      uint32_t a[4];
      if constexpr (Cfg::kQInRegs) {
        a[0] = qa[kk][0]; a[1] = qa[kk][1]; a[2] = qa[kk][2]; a[3] = qa[kk][3];
      } else {
        ldmatrix_x4(a, q_s + (lane & 15) * kStride + kk * 16 + (lane >> 4) * 8);
      }
      float (&acc)[kN][4] = kTwoChains && (kk & 1) ? sc_odd : sc;
#pragma unroll
      for (int half = 0; half < kN / 2; ++half) {
        uint32_t bk[4];
        ldmatrix_x4(bk, slice_chunk(stage, false, half * 16 + (lane >> 4) * 8 + (lane & 7), kk * 2 + ((lane >> 3) & 1)));
        mma16816<T>(acc[2 * half], a, bk[0], bk[1]);
        mma16816<T>(acc[2 * half + 1], a, bk[2], bk[3]);
      }
    }
    if constexpr (kTwoChains && !kRegK) {
#pragma unroll
      for (int nn = 0; nn < kN; ++nn) {
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[nn][e] += sc_odd[nn][e];
      }
    }

    // Scores -> log2 domain, masked past k1; per-row (head) max over this warp's keys.
    const bool need_mask = t0 + kw + kSliceKeys > k1;
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nn = 0; nn < kN; ++nn) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = sc[nn][e];
        if (softcap > 0.f) {
          x = softcap * tanhf(x * cap_k) * kLog2e;
        } else {
          x *= scale_l2;
        }
        if (need_mask) {
          const int j = t0 + kw + nn * 8 + 2 * (lane & 3) + (e & 1);
          if (j >= k1) x = -INFINITY;
        }
        sc[nn][e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
    }
    float mu[2], corr[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // a head row's keys are spread over the lanes' q (lane bits 0-1)
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      online_max_step(m_r[r], mx[r], mu[r], corr[r]);
    }
    float rs[2] = {0.f, 0.f};
#pragma unroll
    for (int nn = 0; nn < kN; ++nn) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pe = fast_exp2(sc[nn][e] - mu[e >> 1]);
        sc[nn][e] = pe;
        rs[e >> 1] += pe;
      }
    }
    l_r[0] = l_r[0] * corr[0] + rs[0];
    l_r[1] = l_r[1] * corr[1] + rs[1];
    // (At the warp's first tile O is still zero: nothing to rescale.)
    if (tile > 0 && __any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) {
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        o[i][0] *= corr[0];
        o[i][1] *= corr[0];
        o[i][2] *= corr[1];
        o[i][3] *= corr[1];
      }
    }
    // O += P V, one 16-key half of the slice at a time (a k-step of the mma).
#pragma unroll
    for (int half = 0; half < kN / 2; ++half) {
      uint32_t pa[4];
      pa[0] = pack2<T>(sc[2 * half][0], sc[2 * half][1]);
      pa[1] = pack2<T>(sc[2 * half][2], sc[2 * half][3]);
      pa[2] = pack2<T>(sc[2 * half + 1][0], sc[2 * half + 1][1]);
      pa[3] = pack2<T>(sc[2 * half + 1][2], sc[2 * half + 1][3]);
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, slice_chunk(stage, true, half * 16 + ((lane >> 3) & 1) * 8 + (lane & 7),
                                          dn * 2 + (lane >> 4)));
        mma16816<T>(o[2 * dn], pa, bv[0], bv[1]);
        mma16816<T>(o[2 * dn + 1], pa, bv[2], bv[3]);
      }
    }
    }
  };
  if constexpr (kRegK) {
    // Two tiles a step, so that the K registers alternate without copies.
    for (int tile = 0; tile < ntiles; tile += 2) {
      tile_step(tile, k_even);
      if (tile + 1 < ntiles) tile_step(tile + 1, k_odd);
    }
  } else {
    for (int tile = 0; tile < ntiles; ++tile) tile_step(tile, k_even);
  }
  if constexpr (!kTma) cp_async_wait<0>();  // (every TMA load was waited for in the loop)
  decode_stamp(w, kDtLoopDone, 0, segment_index);
  decode_stamp(w, kDtSmTiles, static_cast<unsigned>(ntiles), segment_index);
  decode_stamp(w, kDtCta, (static_cast<unsigned long long>(b) << 32) | (static_cast<unsigned>(kv_chunk) << 16) | split,
               segment_index);

  // ---- merge the warps' states ---------------------------------------------------------
  const int gr = lane >> 2;
  if constexpr (kKeysM) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l_r[r] += __shfl_xor_sync(0xffffffffu, l_r[r], 4);
      l_r[r] += __shfl_xor_sync(0xffffffffu, l_r[r], 8);
      l_r[r] += __shfl_xor_sync(0xffffffffu, l_r[r], 16);
    }
    if (lane < 4) {
      red_m[warp][2 * lane] = m_r[0];
      red_m[warp][2 * lane + 1] = m_r[1];
      red_l[warp][2 * lane] = l_r[0];
      red_l[warp][2 * lane + 1] = l_r[1];
    }
  } else {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l_r[r] += __shfl_xor_sync(0xffffffffu, l_r[r], 1);
      l_r[r] += __shfl_xor_sync(0xffffffffu, l_r[r], 2);
    }
    if ((lane & 3) == 0) {
      red_m[warp][gr] = m_r[0];
      red_m[warp][gr + 8] = m_r[1];
      red_l[warp][gr] = l_r[0];
      red_l[warp][gr + 8] = l_r[1];
    }
  }
  __syncthreads();  // all warps are done with the stages too: reuse them as the combine buffer
  float* o_s = reinterpret_cast<float*>(kv_s);  // [kWarps][16][D]
  // The factor that brings this warp's state of head `row` (its max `m`) to the CTA's max.
  const auto to_cta_max = [&](const int row, const float m) {
    float M = -INFINITY;
#pragma unroll
    for (int ww = 0; ww < Cfg::kWarps; ++ww) M = fmaxf(M, red_m[ww][row]);
    return (m == -INFINITY) ? 0.f : fast_exp2(m - M);
  };
  if constexpr (kKeysM) {  // O^T: each lane holds heads 2q and 2q + 1 at columns 16 i + g (+ 8)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = 2 * (lane & 3) + r;
      if (row >= nh) continue;
      const float f = to_cta_max(row, m_r[r]);
      float* dst = o_s + (warp * 16 + row) * D + gr;
#pragma unroll
      for (int i = 0; i < kOTiles; ++i) {
        dst[i * 16] = o[i][r] * f;
        dst[i * 16 + 8] = o[i][2 + r] * f;
      }
    }
  } else {
    // Only the nh head rows are read back below: the upper eight rows are skipped whole (the
    // test is warp-uniform) when nh <= 8, as at G = 4, and single rows past nh by their lanes.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (8 * r >= nh) break;
      const int row = gr + 8 * r;
      if (row >= nh) continue;
      const float f = to_cta_max(row, m_r[r]);
      float* dst = o_s + (warp * 16 + row) * D + 2 * (lane & 3);
#pragma unroll
      for (int i = 0; i < kOTiles; ++i) {
        *reinterpret_cast<float2*>(dst + i * 8) = make_float2(o[i][2 * r] * f, o[i][2 * r + 1] * f);
      }
    }
  }
  if (tid < (kKeysM ? 8 : 16)) {
    float M = -INFINITY;
#pragma unroll
    for (int ww = 0; ww < Cfg::kWarps; ++ww) M = fmaxf(M, red_m[ww][tid]);
    float L = 0.f;
#pragma unroll
    for (int ww = 0; ww < Cfg::kWarps; ++ww) {
      const float mw = red_m[ww][tid];
      if (mw != -INFINITY) L += red_l[ww][tid] * fast_exp2(mw - M);
    }
    fin_ml[tid] = make_float2(M, L);
  }
  __syncthreads();

  // Four consecutive columns a thread (float4 from the combine buffer, float4 to the partials;
  // D is a multiple of 16 and the workspace 256-byte aligned).
  for (int i = tid; i < nh * (D / 4); i += Cfg::kThreads) {
    const int row = i / (D / 4);
    const int d = 4 * (i - row * (D / 4));
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int ww = 0; ww < Cfg::kWarps; ++ww) {
      const float4 v = *reinterpret_cast<const float4*>(o_s + (ww * 16 + row) * D + d);
      acc.x += v.x;
      acc.y += v.y;
      acc.z += v.z;
      acc.w += v.w;
    }
    const float M = fin_ml[row].x;
    const float L = fin_ml[row].y;
    if (active == 1) {
      const float f = final_factor_t<kPlain>(p, h0 + row, M, L);
      store_scaled4<T>(out_row + (h0 + row) * os.head + d, acc, f);
    } else {
      const int64_t slot = part + static_cast<int64_t>(row) * w.max_splits;
      const float inv_l = 1.f / L;  // L >= 1: the split holds a key, and its largest weight is 1
      *reinterpret_cast<float4*>(w.partial_out + slot * D + d) =
          make_float4(acc.x * inv_l, acc.y * inv_l, acc.z * inv_l, acc.w * inv_l);
      if (d == 0) w.partial_lse[slot] = M + fast_log2(L);
    }
  }
  // kShares: the next segment's first tiles go out now, before this one's count and merge: every
  // stage is free once every warp has read the combine buffer (the stages) above. Only for a
  // valid row's non-empty segment, whose keys lie inside the capacity (the CTA's checks passed).
  if constexpr (kShares) {
    if (has_next) {
      const RowGeometry ng = row_geometry(p, next.ranked.seqlen);
      const KeyRange nvis = visible_keys(window, ng.total, ng.query_start);
      const int nk0 = nvis.lo + next.k_begin;
      const int nk1 = min(nvis.hi, nvis.lo + next.k_end);
      if (ng.flags == 0 && nk0 < nk1) {
        generic_to_async_proxy();  // each thread's reads of the stages, before the copies into them
        __syncthreads();
        const int nkvh = hchunks == 1 ? next.kv_chunk : next.kv_chunk / hchunks;
        const int ntiles_next = (nk1 - nk0 + kTile - 1) / kTile;
#pragma unroll 1
        for (int s = 0; s < Cfg::kAhead && s < ntiles_next; ++s) load_slice_of(nk0, nk1, nkvh, next.ranked.row, s, s);
        next_tiles_issued = true;
      }
    }
  }
  if (w.arrivals != nullptr && active > 1 && arrive_last(arrival_counter(w, p.kv_heads * hchunks, b, kv_chunk), active)) {
    arrival_merge_splits<T, D, Cfg::kThreads, kPlain, kMergeBatch, kMergeUnits>(p, w, part - split, active, h0, nh, out_row);
  }
  decode_stamp(w, kDtExit, 0, segment_index);
  decode_stamp(w, kDtExitNs, 0, segment_index);
  };
  if constexpr (kShares) {
    shares_walk<Cfg::kThreads>(p, w.share_item_keys, w.share_whole_items != 0,
                               [&](const DecodeCta& segment, bool first, bool has_next, const DecodeCta& next) {
                                 run(segment, first, has_next, next);
                                 if constexpr (kDecodeTimelineBuilt) ++segment_index;
                                 __syncthreads();  // the segment's Q rows and new key are read before the next one's
                               });
  } else {
    const DecodeCta cta = decode_cta<Cfg::kThreads>(p, w);
    if (cta.leave) return;
    run(cta, true, false, cta);
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace gqa
