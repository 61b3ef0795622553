// Tensor-core flash-attention prefill, FlashAttention-2 style, for fp16/bf16 on sm80+.
//
// Shape of the work
// - Virtual rows: the G query heads of one KV head are packed into the M dimension, row
//   r = s*G + g (token s, head kvh*G + g). A CTA owns BM consecutive virtual rows of one
//   (batch row, KV head), so every K/V tile it streams serves all G heads, and a tile spans
//   only BM/G positions, which keeps the masked band along the diagonal narrow.
// - Each warp owns 16*MT rows. S = Q K^T and O += P V use mma.sync.m16n8k16 with fp32
//   accumulators; P never leaves registers (the S accumulator layout is the A-operand layout).
// - K/V stages of BN*SUB keys go through kStages shared-memory buffers filled by cp.async
//   (16-byte chunks, zero-filled past the row's total), one __syncthreads per stage; each warp
//   works through a stage in BN-key sub-tiles. Rows of D halves are
//   stored with an XOR swizzle (16-byte chunk c of row r sits at c ^ (r & 7)), so ldmatrix and
//   the cp.async writes are free of bank conflicts without padding.
// - Tiles are visited from the last one down, and only tiles that some row of the CTA can see
//   are touched: causal tiles beyond the diagonal and, with a local window, tiles left of the
//   window are skipped, not masked; only the tiles that straddle a boundary are masked.
// - Online softmax in the log2 domain with a lazy rescale: a row's exponent base moves only when
//   its max grows by more than kRescaleThreshold (log2 units), so most tiles skip the O rescale;
//   P stays <= 2^8, well inside the fp16/bf16 range.
// - Optional (Config::kPipe, not used by the shipped configs: no gain measured on an H200):
//   S of tile t+1 is issued before P V of tile t so the softmax overlaps the MMAs.
// - CTAs are ordered heaviest query block first (causal work grows with the block index).
// - On sm90 (an sm90a build) padded head sizes 64, 128 and 256 run the same body with wgmma (S
//   and P V as warpgroup MMAs on shared-memory tiles), warp-specialised (Config::kWarpSpecialized:
//   a loader warpgroup stages each block's Q and fills the K/V stages by TMA) and persistent;
//   see Config and launch_default.
//
// Semantics are SPEC §3 per batch row: ragged total / query_start per row (batched chunked
// prefill and first-prompt padding in one launch), softcap, local window, head sink, smooth
// softmax. q is read as given (with RoPE, prep has rotated it into the output tensor, which is
// then q: launch.cu). A row whose geometry is invalid, or any row when the sticky error word
// is set, gets NaN outputs.
#include "prefill_mma.h"

#include <cuda.h>  // CUtensorMap (the encoder is fetched through the runtime, no -lcuda)
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "../core/errors.h"
#include "common.cuh"
#include "tma.cuh"
#include "prefill_tile.cuh"
#include "wgmma.cuh"

namespace gqa {
namespace cuda {
namespace pmma {

// Which threads run prefill_block: all of them (no warp specialisation), or the loader or the
// computing warpgroups of a warp-specialised CTA (each instantiation holds only its own code,
// so that each side is compiled for its own register budget).
enum class Role { kAll, kLoader, kCompute };

// Diagnostics (Args::timeline, set_prefill_timeline): thread 0 of each computing warpgroup of
// a warp-specialised kernel writes field `field` of its record for work item `work` (fields:
// kTimeline*). The address is recomputed at each stamp, so that no register stays live across
// the block for it; a null pointer costs one uniform branch a stamp.
enum TimelineField { kTimelineEntry, kTimelineQReady, kTimelineFirstDone, kTimelineLoopDone, kTimelineExit,
                     kTimelineGlobalNs, kTimelineSmTiles, kTimelineCtaWork, kTimelineFields };
template <class C>
__device__ __forceinline__ void timeline_put(const Args& a, int work, int field, unsigned long long value) {
  if (a.timeline == nullptr || (threadIdx.x & 127) != 0 || threadIdx.x >= C::kConsumerThreads) return;
  const int record = work * 4 + static_cast<int>(threadIdx.x >> 7);  // up to 4 computing warpgroups
  if (record < a.timeline_records) a.timeline[static_cast<int64_t>(record) * kTimelineFields + field] = value;
}
using detail::global_ns;
using detail::sm_clock;
using detail::sm_id;

// A 4 x 4 transpose of 32-bit words within each quad of lanes (lanes 4i .. 4i + 3), by two
// butterfly swaps: lane q's x[j] becomes lane j's x[q]. Every lane of the warp must take part.
__device__ __forceinline__ void quad_transpose(uint32_t (&x)[4], int lane) {
#pragma unroll
  for (int m = 1; m <= 2; m *= 2) {
    const bool upper = (lane & m) != 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (e & m) continue;
      // The pair (e, e + m): the lower lane keeps x[e] and takes its partner's x[e]; the upper
      // keeps x[e + m] and takes its partner's x[e + m].
      const uint32_t recv = __shfl_xor_sync(0xffffffffu, upper ? x[e] : x[e + m], m);
      if (upper) x[e] = recv;
      else x[e + m] = recv;
    }
  }
}

// One query block (work item `work`: heaviest first) of a CTA. `pipe` holds the warp-specialised
// CTA's mbarriers and its counts of the K/V tiles and Q tiles passed so far (a persistent CTA:
// the loader and the computing warpgroups walk the same items and skip the same ones, so their
// counts agree); `error` is the sticky error word as read at kernel start; `bc` is block_coords
// of `work` and `seqlen` seqlens_k of its batch row.
template <typename T, class C, bool kSplit, Role kRole>
__device__ __forceinline__ void prefill_block(const Args& a, unsigned char* const smem, Pipeline& pipe,
                                              const uint32_t error, const int work, const BlockCoords bc,
                                              const int seqlen) {
  using H = Half<T>;
  using WT = WarpTile<T, C>;
  constexpr int D = C::D, BN = C::BN, MT = C::MT, RB = C::kRowBytes, CH = C::kChunks;
  constexpr int NR = WT::NR, DT = WT::DT, KS = WT::KS;
  constexpr unsigned kFull = 0xffffffffu;

  const Params& p = a.p;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  const int kvh = bc.kvh, b = bc.b;
  const int G = p.group_size;
  const int nrows = p.query_len * G;
  const int m0 = bc.mblk * C::BM;
  const int wrow0 = m0 + warp * C::kWarpRows;

  constexpr bool computes = kRole != Role::kLoader;
  // The exits below are the same for every thread of the CTA (they depend on b and m0 only).
  const RowGeometry geo = row_geometry(p, seqlen);
  constexpr bool split_k = kSplit;  // then the merge writes every output row, these included
  if (error != 0u || geo.flags != 0u) {
    if (computes && !split_k) fill_warp_rows<T, C>(p, b, kvh, wrow0, nrows, H::kNaN2, lane);
    return;
  }
  const int valid_rows = geo.valid_queries * G;
  if (m0 >= valid_rows) {  // first-prompt padding only
    if (computes && !split_k) fill_warp_rows<T, C>(p, b, kvh, wrow0, nrows, 0u, lane);
    return;
  }
  constexpr bool stamps = C::kWarpSpecialized && kRole == Role::kCompute;
  if constexpr (stamps) {
    timeline_put<C>(a, work, kTimelineEntry, sm_clock());
    timeline_put<C>(a, work, kTimelineGlobalNs, global_ns());
  }

  // This block's Q tile: Q buffer q_slot % kQBuffers (Q slots are counted like the K/V ring).
  const int q_slot = pipe.q_ring++;
  const int q_buffer = q_slot % C::kQBuffers;
  unsigned char* const q_block = smem + q_buffer * C::kQBytes;
  // Byte offset of chunk `chunk` of row `row` (of the block) in the Q tile: row-swizzled rows,
  // or with wgmma a blocked 64-row tile per warpgroup.
  auto q_block_off = [&](int row, int chunk) -> uint32_t {
    if constexpr (C::kWgmma) return (row >> 6) * 64 * RB + wg::blocked_offset(row & 63, chunk, 64);
    else return swz<D>(row, chunk);
  };
  // This warp's rows of it (later its output staging).
  const int warp_row0 = warp * C::kWarpRows;
  unsigned char* const q_smem = q_block;
  auto q_off = [&](int row, int chunk) { return q_block_off(warp_row0 + row, chunk); };
  auto tile_off = [&](int row, int chunk) -> uint32_t {
    if constexpr (C::kWgmma) return wg::blocked_offset(row, chunk, C::kStageKeys);
    else return swz<D>(row, chunk);
  };
  const uint32_t q_base = smem_addr(q_block) + warp_row0 * RB;  // mma.sync: this warp's rows
  const uint32_t k_base = smem_addr(smem + C::kQBuffers * C::kQBytes);
  const uint32_t v_base = k_base + C::kStages * C::kTileBytes;

  // ---- K/V tile loader (all threads, or the WS loader warpgroup): chunk ld_c of rows ld_r + k*LD_STEP
  constexpr int LD_STEP = C::kLoaderThreads / CH;
  constexpr int LD_N = C::kStageKeys * CH / C::kLoaderThreads;
  const int ld_tid = C::kWarpSpecialized ? tid - C::kConsumerThreads : tid;
  const int ld_c = ld_tid % CH, ld_r = ld_tid / CH;
  const bool ld_col_ok = ld_c * 8 < p.head_dim;
  const int64_t tok = p.cache_strides.token;
  const int total = geo.total;
  // A row with no past, in a call that appends in this kernel (Args::append_new): its K/V come
  // from the new rows (in place, past == 0 means total == S: no padding), and the block that
  // owns a tile writes it to the caches. Uniform over the CTA.
  const bool row_new = C::kWarpSpecialized && a.append_new && geo.past == 0;
  // The owner of key tile j of a new row: the query block holding its first token's first
  // packed row (j * SK * G in [m0, m0 + BM)). It visits the tile (every row sees its own
  // position), and each tile has one. This block owns tiles [own_lo, own_hi).
  // So [own_lo, own_hi) = [ceil(m0 / (SK G)), ceil((m0 + BM) / (SK G))), taken as
  // ceil(ceil(n / G) / SK). The upper end is clamped to nrows (no int overflow): a new row has no
  // padding (total == S), so no tile starts at or past packed row nrows.
  int own_lo = 0, own_hi = 0;
  if (row_new) {
    auto tiles_before = [&](int n) {  // ceil(n / (SK G)) for n >= 0
      const int tokens = n > 0 ? a.div_g.divide(n - 1) + 1 : 0;
      return (tokens + C::kStageKeys - 1) / C::kStageKeys;
    };
    own_lo = tiles_before(m0);
    own_hi = tiles_before(min(m0 + C::BM, nrows));
  }
  auto owns_tile = [&](int tile) { return tile >= own_lo && tile < own_hi; };
  // Whether whole tiles (below the row's total) come by TMA: through the caches' maps, or the
  // new rows' for a new row.
  const bool tile_tma = a.use_tma && (!row_new || a.new_tma);
  // `append`: this block owns the tile; each thread then also copies its chunks of it to the
  // caches (a plain 16-byte load and store). The sources are worked out here, not kept live
  // through the loader's loop (its warpgroup has 40 registers a thread).
  auto load_tile = [&](int tile, int stage, bool append = false) {
    const int64_t kv_off = static_cast<int64_t>(b) * p.cache_strides.batch +
                           static_cast<int64_t>(kvh) * p.cache_strides.head + ld_c * 8;
    const T* k_src = static_cast<const T*>(p.key_cache) + kv_off;
    const T* v_src = static_cast<const T*>(p.value_cache) + kv_off;
    int64_t src_tok = tok;
    if (row_new) {  // (prefill_mma_appends: the key and value rows share their strides)
      const TokenStrides ns = p.key_strides;
      const int64_t off = static_cast<int64_t>(b) * ns.batch + static_cast<int64_t>(kvh) * ns.head + ld_c * 8;
      k_src = static_cast<const T*>(p.key) + off;
      v_src = static_cast<const T*>(p.value) + off;
      src_tok = ns.token;
    }
    const int n0 = tile * C::kStageKeys;
    auto copy_chunk = [&](int k) {
      const int row = ld_r + k * LD_STEP;
      const int j = n0 + row;
      const bool ok = ld_col_ok && j < total;
      const int64_t go = ok ? static_cast<int64_t>(j) * src_tok : 0;
      const uint32_t so = static_cast<uint32_t>(stage * C::kTileBytes) + tile_off(row, ld_c);
      cp_async16(k_base + so, k_src + go, ok ? 16u : 0u);
      cp_async16(v_base + so, v_src + go, ok ? 16u : 0u);
    };
    if constexpr (C::kWarpSpecialized) {
      // A rare tile there (the one across a row's total; every tile only where TMA cannot
      // run): a rolled loop, whose offsets ptxas does not keep in the loader's registers.
#pragma unroll 1
      for (int k = 0; k < LD_N; ++k) copy_chunk(k);
    } else {
#pragma unroll
      for (int k = 0; k < LD_N; ++k) copy_chunk(k);
    }
    if constexpr (C::kWarpSpecialized) {  // (a constexpr branch: no unreachable loop elsewhere)
      if (!append) return;
#pragma unroll 1  // (once a row)
      for (int k = 0; k < LD_N; ++k) {
        const int j = n0 + ld_r + k * LD_STEP;
        if (!ld_col_ok || j >= total) continue;
        const int64_t go = kv_off + static_cast<int64_t>(j) * tok;
        *reinterpret_cast<uint4*>(static_cast<T*>(p.key_cache) + go) = *reinterpret_cast<const uint4*>(k_src + j * src_tok);
        *reinterpret_cast<uint4*>(static_cast<T*>(p.value_cache) + go) = *reinterpret_cast<const uint4*>(v_src + j * src_tok);
      }
    }
  };

  // ---- key range of this CTA -----------------------------------------------------------------
  const int W = p.local_window;
  const int r_last = min(m0 + C::BM, valid_rows) - 1;
  const int pos_min = geo.query_start + a.div_g.divide(m0);
  const int pos_max = geo.query_start + a.div_g.divide(r_last);
  const int key_lo = W > 0 ? max(0, pos_min - W + 1) : 0;
  const int key_hi = min(total, pos_max + 1);
  constexpr int SK = C::kStageKeys;
  int t_first = key_lo / SK;
  int t_end = (key_hi + SK - 1) / SK;  // t_end - t_first >= 1: every valid row sees its own position
  // This row's partial of split `blockIdx.y` (split-K): index into [B, S, Hq, splits].
  auto partial_row = [&](int r) -> int64_t {
    const int s = a.div_g.divide(r), h = kvh * G + (r - s * G);
    return ((static_cast<int64_t>(b) * p.query_len + s) * p.q_heads + h) * a.splits + blockIdx.y;
  };
  if constexpr (split_k) {  // this CTA takes part blockIdx.y of the query block's tiles
    const int per = (t_end - t_first + a.splits - 1) / a.splits;
    const int lo = t_first + static_cast<int>(blockIdx.y) * per;
    const int hi = min(t_end, lo + per);
    if (lo >= hi) {  // an empty part: zero weight (lse -inf) and finite values for the merge
      for (int i = lane; computes && i < C::kWarpRows; i += 32) {
        const int r = wrow0 + i;
        if (r >= valid_rows) continue;
        const int64_t row = partial_row(r);
        a.partial_lse[row] = -INFINITY;
        for (int d = 0; d < p.head_dim; ++d) a.partial_out[row * p.head_dim + d] = 0.f;
      }
      return;
    }
    t_first = lo;
    t_end = hi;
  }
  const int n_tiles = t_end - t_first;
  // Stage tile `it` of the loop covers keys [n0(it), n0(it) + SK), last tile first.
  auto tile_n0 = [&](int it) { return (t_end - 1 - it) * SK; };
  // Whether some row of the CTA cannot see some key of the tile (causal, total, window).
  auto needs_mask = [&](int n0) {
    return (n0 + BN - 1 > pos_min) || (n0 + BN > total) || (W > 0 && n0 <= pos_max - W);
  };

  // ---- Q staging: rows [row0, row0 + rows) of the block into its Q tile, by `nthreads`
  // threads (t = 0 .. nthreads - 1, nthreads a multiple of the chunks per row). issue_q starts
  // cp.async copies (zero fill for padding rows and columns past head_dim) as one group; once
  // the caller has waited for that group, negate_q flips the sign of the same thread's chunks
  // (scale < 0; exact). RoPE on q, when asked for, was applied by prep (launch.cu).
  auto issue_q = [&](int row0, int rows, int t, int nthreads) {
    const TokenStrides qs = a.q_strides;
    const T* const qg = static_cast<const T*>(a.q) + static_cast<int64_t>(b) * qs.batch;
    const uint32_t dst = smem_addr(q_block);
    const int c = t % CH;
    const bool col_ok = c * 8 < p.head_dim;
    for (int row = row0 + t / CH; row < row0 + rows; row += nthreads / CH) {
      const int r = m0 + row;
      const bool ok = col_ok && r < valid_rows;
      const T* src = qg;
      if (ok) {
        const int tok = a.div_g.divide(r), h = kvh * G + (r - tok * G);
        src = qg + static_cast<int64_t>(tok) * qs.token + static_cast<int64_t>(h) * qs.head + c * 8;
      }
      cp_async16(dst + q_block_off(row, c), src, ok ? 16u : 0u);
    }
    cp_async_commit();
  };
  auto negate_q = [&](int row0, int rows, int t, int nthreads) {
    const int c = t % CH;
    for (int row = row0 + t / CH; row < row0 + rows; row += nthreads / CH) {
      if (m0 + row >= valid_rows || c * 8 >= p.head_dim) continue;
      uint4* const e = reinterpret_cast<uint4*>(q_block + q_block_off(row, c));
      uint4 v = *e;
      v.x ^= a.q_sign;
      v.y ^= a.q_sign;
      v.z ^= a.q_sign;
      v.w ^= a.q_sign;
      *e = v;
    }
  };

  if constexpr (!computes) {  // the loader warpgroup: the block's Q, then every tile in loop order
    // The Q tile: with two Q buffers first (the computing warpgroups finished its buffer's last
    // block long ago); with one, after the first stage, since its buffer frees only when the
    // computing warpgroups have done the previous block's last S (kEarlyQRelease).
    // By TMA when every row of the block is a real query row (a.q_tma: G divides 64 and q needs
    // no sign flip): one box a warpgroup's 64 rows and 64 columns, completing on q_full, so the
    // loader goes straight on to the K/V tiles. A Q load by cp.async held the loader (and so the
    // block's first K/V tile) until it landed, and the computing warpgroups waited for Q at 73%
    // of block starts (Nsight Compute, B2 L4096 D128: 3.8% of their time; 4.6% at D = 256).
    // Padding rows past valid_rows must read as zeros (their scores are not all masked), which
    // the cp.async path gives.
    auto stage_q = [&]() {
      if (q_slot >= C::kQBuffers)
        wg::mbarrier_wait(smem_addr(&pipe.q_empty[q_buffer]), ((q_slot / C::kQBuffers) - 1) & 1);
      if (a.q_tma && m0 + C::BM <= valid_rows) {
        const uint32_t q_full = smem_addr(&pipe.q_full[q_buffer]);
        if (ld_tid == 0) {
          // The computing warpgroups' generic accesses to this buffer (O staged in it) are
          // ordered before the async proxy's writes.
          wg::generic_to_async_proxy();
          wg::mbarrier_arrive_expect_bytes(q_full, C::kQBytes);
          const uint32_t dst = smem_addr(q_block);
#pragma unroll
          for (int wgt = 0; wgt < C::BM / 64; ++wgt) {
#pragma unroll
            for (int cb = 0; cb < D / 64; ++cb)
              if (a.l2_hints)
                detail::tma_load_4d_hint(dst + wgt * 64 * RB + cb * 64 * 128, &a.q_map, cb * 64, kvh * G,
                                         a.div_g.divide(m0 + wgt * 64), b, q_full, detail::l2_policy<detail::L2Evict::kFirst>());
              else
                wg::tma_load_4d(dst + wgt * 64 * RB + cb * 64 * 128, &a.q_map, cb * 64, kvh * G, a.div_g.divide(m0 + wgt * 64),
                                b, q_full);
          }
        } else {
          wg::mbarrier_arrive(q_full);
        }
        return;
      }
      issue_q(0, C::BM, ld_tid, C::kLoaderThreads);
      cp_async_wait<0>();
      if (a.q_sign != 0u) negate_q(0, C::BM, ld_tid, C::kLoaderThreads);
      wg::generic_to_async_proxy();  // for wgmma, as with the cp.async K/V tiles
      wg::mbarrier_arrive(smem_addr(&pipe.q_full[q_buffer]));
    };
    const int q_at = C::kQBuffers > 1 ? 0 : min(C::kEarlyQRelease ? (a.q_first ? 0 : 1) : C::kStages, n_tiles);
    // A cp.async tile is announced one tile late: each loader waits for its own copies, makes
    // them visible to the async proxy (wgmma) and only then arrives, so that the writer
    // fences, as the memory model asks; meanwhile the next tile is already in flight.
    int pending = -1;  // the cp.async tile not announced yet
    auto announce_pending = [&](bool newer_group) {
      if (pending < 0) return;
      if (newer_group) cp_async_wait<1>();
      else cp_async_wait<0>();
      wg::generic_to_async_proxy();
      wg::mbarrier_arrive(smem_addr(&pipe.s_full[pending % C::kStages]));  // pending: a ring index
      if constexpr (C::kSplitKV) wg::mbarrier_arrive(smem_addr(&pipe.v_full[pending % C::kStages]));
      pending = -1;
    };
    for (int it = 0; it < n_tiles; ++it) {
      if (it == q_at) stage_q();
      const int slot = pipe.ring + it;  // this tile's place in the stage ring
      const int stage = slot % C::kStages;
      const uint32_t full = smem_addr(&pipe.s_full[stage]);
      // Every loader thread waits for the stage to be free before it arrives on its "full"
      // barrier (an arrival may not land in the phase still being consumed).
      const bool reuse = slot >= C::kStages;
      const uint32_t reuse_parity = ((slot / C::kStages) - 1) & 1;
      if (reuse) wg::mbarrier_wait(smem_addr(&pipe.s_empty[stage]), reuse_parity);
      const int tile = t_end - 1 - it;
      // TMA only for tiles that lie wholly below `total`: keys past it must read as zeros (a
      // zero weight times a stale NaN is NaN), which only cp.async's zero fill gives.
      if (tile_tma && (tile + 1) * C::kStageKeys <= total) {
        // One operand (K, or V) of the stage by TMA onto the mbarrier `bar`, from the cache or
        // (a new row) from the new rows: the maps share coordinates.
        auto tma_operand = [&](bool is_v, uint32_t dst, uint32_t bar) {
          const CUtensorMap* map = row_new ? (is_v ? &a.v_new_map : &a.k_new_map) : (is_v ? &a.v_map : &a.k_map);
#pragma unroll
          for (int cb = 0; cb < D / 64; ++cb)  // 64-column blocks of the blocked tile
            if (a.l2_hints)
              detail::tma_load_4d_hint(dst + cb * C::kStageKeys * 128, map, cb * 64, tile * C::kStageKeys, kvh, b, bar,
                                       detail::l2_policy<detail::L2Evict::kLast>());
            else
              wg::tma_load_4d(dst + cb * C::kStageKeys * 128, map, cb * 64, tile * C::kStageKeys, kvh, b, bar);
        };
        const uint32_t k_dst = k_base + stage * C::kTileBytes, v_dst = v_base + stage * C::kTileBytes;
        if constexpr (C::kSplitKV) {
          if (ld_tid == 0) {
            wg::mbarrier_arrive_expect_bytes(full, C::kTileBytes);
            tma_operand(false, k_dst, full);
          } else {
            wg::mbarrier_arrive(full);
          }
          const uint32_t v_full = smem_addr(&pipe.v_full[stage]);
          if (reuse) wg::mbarrier_wait(smem_addr(&pipe.v_empty[stage]), reuse_parity);
          if (ld_tid == 0) {
            wg::mbarrier_arrive_expect_bytes(v_full, C::kTileBytes);
            tma_operand(true, v_dst, v_full);
          } else {
            wg::mbarrier_arrive(v_full);
          }
        } else {
          if (ld_tid == 0) {
            wg::mbarrier_arrive_expect_bytes(full, 2 * C::kTileBytes);
            tma_operand(false, k_dst, full);
            tma_operand(true, v_dst, full);
          } else {
            wg::mbarrier_arrive(full);
          }
        }
        announce_pending(false);
      } else {
        if (C::kSplitKV && reuse) wg::mbarrier_wait(smem_addr(&pipe.v_empty[stage]), reuse_parity);
        // (A TMA tile owned by this block is written to the caches by the computing
        // warpgroups; this one, by the loader as it loads.)
        load_tile(tile, stage, owns_tile(tile));
        cp_async_commit();
        announce_pending(true);
        pending = slot;
      }
    }
    announce_pending(false);
    if (q_at == n_tiles) stage_q();
    pipe.ring += n_tiles;
  } else {
    if constexpr (!C::kWarpSpecialized) {
      // This warp's Q rows first, then the first K/V stages, all in flight at once; Q's group
      // is the oldest, so waiting for all but the K/V groups waits for Q alone.
      issue_q(warp_row0, C::kWarpRows, lane, 32);
#pragma unroll
      for (int st = 0; st < C::kStages - 1; ++st) {
        if (st < n_tiles) load_tile(t_end - 1 - st, st);
        cp_async_commit();
      }
      cp_async_wait<C::kStages - 1>();
      if (a.q_sign != 0u) negate_q(warp_row0, C::kWarpRows, lane, 32);
      __syncwarp();
      if constexpr (C::kWgmma) wg::generic_to_async_proxy();  // Q is read by wgmma after the first barrier
    }

    WT w;
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      const int r = wrow0 + (i >> 1) * 16 + (lane >> 2) + (i & 1) * 8;
      if (r < valid_rows) {
        const int pos = geo.query_start + a.div_g.divide(r);
        w.row_hi[i] = min(pos + 1, total);
        w.row_lo[i] = W > 0 ? pos - W + 1 : 0;
      } else {  // padding / past the end: every key masked, the output row is discarded
        w.row_lo[i] = 0;
        w.row_hi[i] = 0;
      }
    }


    // ---- per-lane ldmatrix addressing ----------------------------------------------------------
    // A (Q, row-major) and V (trans): lanes 0-15 rows 0-15 of chunk 2k, lanes 16-31 chunk 2k+1.
    // K (non-trans, two n-tiles): lanes 0-7 keys 0-7 chunk 2k, 8-15 keys 0-7 chunk 2k+1,
    // 16-23 keys 8-15 chunk 2k, 24-31 keys 8-15 chunk 2k+1. Row offsets added later are
    // multiples of 8, so the swizzle phase (row & 7) = (lane & 7) is fixed per lane.
    w.key_col = (lane & 3) * 2;
    w.k2 = a.k2;
    w.tanh_k = a.tanh_k;
    if constexpr (!C::kWgmma) {
      const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8;
      const int k_row = (lane & 7) + ((lane >> 4) << 3);
      w.a_x = static_cast<uint32_t>((lane >> 4) ^ (lane & 7));
      w.k_x = static_cast<uint32_t>(((lane >> 3) & 1) ^ (lane & 7));
      w.a_lane = q_base + a_row * RB;
      w.k_lane = k_base + k_row * RB;
      w.v_lane = v_base + a_row * RB;
    }
    if constexpr (C::kQRegs) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int ks = 0; ks < KS; ++ks)
          ldsm_x4(w.a_lane + mt * 16 * RB + (((2u * ks) ^ w.a_x) << 4), w.qf[mt][ks]);
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int d = 0; d < DT; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) w.o[mt][d][e] = 0.f;
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      w.m_ref[i] = -INFINITY;
      w.l_sum[i] = 0.f;
    }
    const bool cap = a.softcap_on != 0;

    if constexpr (C::kWarpSpecialized) {
      // The loader staged this block's Q tile (and fenced it for the async proxy).
      wg::mbarrier_wait(smem_addr(&pipe.q_full[q_buffer]), (q_slot / C::kQBuffers) & 1);
      if constexpr (stamps) timeline_put<C>(a, work, kTimelineQReady, sm_clock());
      const uint32_t q_tile = smem_addr(q_block + (warp >> 2) * 64 * RB);
      // (The loader fenced its cp.async data for the async proxy before arriving; TMA writes
      // through the async proxy itself.)
      // Tile `it` of this block sits in place ring + it of the stage ring.
      const int ring = pipe.ring;
      auto k_tile = [&](int it) { return k_base + ((ring + it) % C::kStages) * C::kTileBytes; };
      auto v_tile = [&](int it) { return v_base + ((ring + it) % C::kStages) * C::kTileBytes; };
      // A TMA tile this block owns (Args::append_new) goes to the caches from its stage: thread
      // 0 stores each operand by TMA once it has landed, and waits for the store to have read
      // the stage before it hands the stage back. (Not the loader: a wait in its loop made
      // ptxas spill its 40 registers.)
      // Thread 0's share of the owned tiles: the whole ones (by TMA), [store_lo, store_hi).
      const int store_lo = own_lo;
      const int store_hi = tid == 0 && tile_tma ? min(own_hi, total / C::kStageKeys) : own_lo;
      auto stores = [&](int it) {
        const int tile = t_end - 1 - it;
        return tile >= store_lo && tile < store_hi;
      };
      auto store_owned = [&](int it, bool k, bool v) {
        if (!stores(it)) return;
        const int tile = t_end - 1 - it;
#pragma unroll
        for (int cb = 0; cb < D / 64; ++cb) {
          const uint32_t off = cb * C::kStageKeys * 128;
          if (a.l2_hints) {
            if (k) detail::tma_store_4d_hint(&a.k_map, k_tile(it) + off, cb * 64, tile * C::kStageKeys, kvh, b,
                                             detail::l2_policy<detail::L2Evict::kFirst>());
            if (v) detail::tma_store_4d_hint(&a.v_map, v_tile(it) + off, cb * 64, tile * C::kStageKeys, kvh, b,
                                             detail::l2_policy<detail::L2Evict::kFirst>());
          } else {
            if (k) detail::tma_store_4d(&a.k_map, k_tile(it) + off, cb * 64, tile * C::kStageKeys, kvh, b);
            if (v) detail::tma_store_4d(&a.v_map, v_tile(it) + off, cb * 64, tile * C::kStageKeys, kvh, b);
          }
        }
        detail::bulk_commit();
      };
      auto owned_read = [&](int it) {
        if (stores(it)) detail::bulk_wait_read();
      };
      auto wait_full = [&](int it) {
        wg::mbarrier_wait(smem_addr(&pipe.s_full[(ring + it) % C::kStages]), ((ring + it) / C::kStages) & 1);
        store_owned(it, true, !C::kSplitKV);
      };
      auto release = [&](int it) {
        owned_read(it);
        wg::mbarrier_arrive(smem_addr(&pipe.s_empty[(ring + it) % C::kStages]));
      };
      // Split K/V stages: s_full / s_empty are K's; V has its own pair.
      auto wait_v = [&](int it) {
        wg::mbarrier_wait(smem_addr(&pipe.v_full[(ring + it) % C::kStages]), ((ring + it) / C::kStages) & 1);
        store_owned(it, false, true);
      };
      auto release_v = [&](int it) {
        owned_read(it);
        wg::mbarrier_arrive(smem_addr(&pipe.v_empty[(ring + it) % C::kStages]));
      };
      // One Q tile (kEarlyQRelease): it goes back to the loader once the block's last S is done.
      auto release_q_after = [&](int it) {
        if (C::kEarlyQRelease && it == n_tiles - 1) wg::mbarrier_arrive(smem_addr(&pipe.q_empty[q_buffer]));
      };
      if constexpr (C::kSplitKV && C::kPipe) {  // S of tile it + 1 in flight with P V of tile it
        uint32_t p_even[MT][BN / 16][4], p_odd[MT][BN / 16][4];  // P of the even / odd tiles
        // Args::pingpong: warpgroup w waits for its turn on barrier kTurnBarrier + w, then
        // passes the turn on; both walk the same steps, so every wait has its arrival (the
        // first, warpgroup 1's, at kernel start).
        const bool pingpong = C::kConsumerThreads == 256 && a.pingpong != 0;
        wait_full(0);
        {
          const int n0 = tile_n0(0);
          auto after_s = [&] {
            release(0);
            release_q_after(0);
          };
          if constexpr (C::kOneStep) {
            w.template first_pipe_wg<true, true>(p_even, q_tile, k_tile(0), n0, after_s, needs_mask(n0), cap);
          } else {
            with_mask_and_cap(needs_mask(n0), cap, [&](auto mask, auto softcap) {
              w.template first_pipe_wg<decltype(mask)::value, decltype(softcap)::value>(p_even, q_tile, k_tile(0),
                                                                                        n0, after_s);
            });
          }
        }
        // The pipelined order only: the first tile's S and softmax, with no P V to overlap.
        if constexpr (stamps) timeline_put<C>(a, work, kTimelineFirstDone, sm_clock());
        auto turn = [&] {
          if (pingpong) wg::named_barrier_sync(kTurnBarrier + (warp >> 2), 256);
        };
        auto pass = [&] {
          if (pingpong) wg::named_barrier_arrive(kTurnBarrier + 1 - (warp >> 2), 256);
        };
        // P V of tile it (P in p_cur) with S and softmax of tile it + 1 (P into p_next). In the
        // one-step form (C::kOneStep) the mask and the softcap are run-time passes, and P of tile
        // it + 1 goes back into p_cur once P V of tile it has completed, so that the caller
        // passes the same two arrays at every tile.
        auto step = [&](int it, uint32_t (&p_cur)[MT][BN / 16][4], uint32_t (&p_next)[MT][BN / 16][4]) {
          wait_v(it);
          if (it + 1 < n_tiles) {
            wait_full(it + 1);
            const int n1 = tile_n0(it + 1);
            auto after_s = [&] {
              release(it + 1);
              release_q_after(it + 1);
            };
            if constexpr (C::kOneStep) {
              w.template tile_pipe_wg<true, true>(p_cur, p_next, q_tile, k_tile(it + 1), v_tile(it), n1, after_s,
                                                  turn, pass, needs_mask(n1), cap);
              wg::copy_registers(reinterpret_cast<uint32_t (&)[MT * BN / 4]>(p_cur),
                                 reinterpret_cast<const uint32_t (&)[MT * BN / 4]>(p_next));
            } else {
              with_mask_and_cap(needs_mask(n1), cap, [&](auto mask, auto softcap) {
                w.template tile_pipe_wg<decltype(mask)::value, decltype(softcap)::value>(
                    p_cur, p_next, q_tile, k_tile(it + 1), v_tile(it), n1, after_s, turn, pass);
              });
            }
          } else {
            w.pv_wg(p_cur, v_tile(it));
          }
          release_v(it);  // every wgmma that read V(it) has completed
        };
        if constexpr (C::kOneStep) {
          for (int it = 0; it < n_tiles; ++it) step(it, p_even, p_odd);
        } else {
          for (int it = 0; it < n_tiles; it += 2) {
            step(it, p_even, p_odd);
            if (it + 1 < n_tiles) step(it + 1, p_odd, p_even);
          }
        }
      } else if constexpr (C::kSplitKV) {  // plain order; K goes back right after S
        for (int it = 0; it < n_tiles; ++it) {
          wait_full(it);
          const int n0 = tile_n0(it);
          with_mask_and_cap(needs_mask(n0), cap, [&](auto mask, auto softcap) {
            w.template tile_wg<decltype(mask)::value, decltype(softcap)::value>(
                q_tile, k_tile(it), v_tile(it), n0,
                [&] {
                  release(it);
                  release_q_after(it);
                },
                [&] { wait_v(it); });
          });
          release_v(it);
        }
      } else {
        // Args::pingpong (auto at padded head size 256, route 14): the turns of the pipelined
        // order, taken for S and for P V of each tile.
        const bool pingpong = C::kConsumerThreads == 256 && a.pingpong != 0;
        auto turn = [&] {
          if (pingpong) wg::named_barrier_sync(kTurnBarrier + (warp >> 2), 256);
        };
        auto pass = [&] {
          if (pingpong) wg::named_barrier_arrive(kTurnBarrier + 1 - (warp >> 2), 256);
        };
        for (int it = 0; it < n_tiles; ++it) {
          wait_full(it);
          const int n0 = tile_n0(it);
          if constexpr (C::kOneStep) {  // one instantiation: the mask and the softcap at run time
            w.template tile_wg<true, true>(q_tile, k_tile(it), v_tile(it), n0, [&] { release_q_after(it); }, [] {},
                                           turn, pass, needs_mask(n0), cap);
          } else {
            with_mask_and_cap(needs_mask(n0), cap, [&](auto mask, auto softcap) {
              w.template tile_wg<decltype(mask)::value, decltype(softcap)::value>(
                  q_tile, k_tile(it), v_tile(it), n0, [&] { release_q_after(it); }, [] {}, turn, pass);
            });
          }
          release(it);
        }
      }
      pipe.ring += n_tiles;
      if constexpr (stamps) {
        timeline_put<C>(a, work, kTimelineLoopDone, sm_clock());
        timeline_put<C>(a, work, kTimelineSmTiles, (static_cast<unsigned long long>(sm_id()) << 32) | n_tiles);
        timeline_put<C>(a, work, kTimelineCtaWork, (static_cast<unsigned long long>(blockIdx.x) << 32) | work);
      }
    } else if constexpr (!C::kPipe) {
      int stage = 0;
      for (int it = 0; it < n_tiles; ++it) {
        cp_async_wait<C::kStages - 2>();
        if constexpr (C::kWgmma) wg::generic_to_async_proxy();  // the cp.async data, for wgmma
        __syncthreads();  // tile `it` visible to all; every warp is done with the stage refilled next
        {
          const int nt = it + C::kStages - 1;
          int ls = stage + C::kStages - 1;
          if (ls >= C::kStages) ls -= C::kStages;
          if (nt < n_tiles) load_tile(t_end - 1 - nt, ls);
          cp_async_commit();
        }
        const int n0s = tile_n0(it);
        if constexpr (C::kWgmma) {
          const uint32_t q_tile = smem_addr(smem + (warp >> 2) * 64 * RB);
          const uint32_t k_tile = k_base + stage * C::kTileBytes;
          const uint32_t v_tile = v_base + stage * C::kTileBytes;
          with_mask_and_cap(needs_mask(n0s), cap, [&](auto mask, auto softcap) {
            w.template tile_wg<decltype(mask)::value, decltype(softcap)::value>(q_tile, k_tile, v_tile, n0s);
          });
        } else {
#pragma unroll
          for (int u = C::kSub - 1; u >= 0; --u) {
            const int n0 = n0s + u * BN;
            if (C::kSub > 1 && (n0 >= key_hi || n0 + BN <= key_lo)) continue;  // no row sees it
            const uint32_t k_st = w.k_lane + stage * C::kTileBytes + u * BN * RB;
            const uint32_t v_st = w.v_lane + stage * C::kTileBytes + u * BN * RB;
            with_mask_and_cap(needs_mask(n0), cap, [&](auto mask, auto softcap) {
              w.template tile_plain<decltype(mask)::value, decltype(softcap)::value>(k_st, v_st, n0);
            });
          }
        }
        if (++stage == C::kStages) stage = 0;
      }
    } else {
      // Stages: iteration `it` reads V(it) and K(it+1) while tile it+2 streams in (>= 3 stages).
      static_assert(!C::kPipe || C::kStages >= 3, "the pipelined order keeps three tiles in flight");
      uint32_t pa[MT][BN / 16][4];
      cp_async_wait<C::kStages - 2>();
      __syncthreads();
      {
        const int n0 = tile_n0(0);
        if (cap) w.template first_pipe<true>(pa, w.k_lane, n0, needs_mask(n0));
        else w.template first_pipe<false>(pa, w.k_lane, n0, needs_mask(n0));
      }
      int stage = 0;  // stage of tile `it`
      for (int it = 0; it < n_tiles; ++it) {
        int s1 = stage + 1;
        if (s1 == C::kStages) s1 = 0;
        cp_async_wait<C::kStages - 3>();
        __syncthreads();  // tile it+1 visible; every warp is done with tile it-1's stage
        {
          const int nt = it + C::kStages - 1;
          int ls = stage + C::kStages - 1;
          if (ls >= C::kStages) ls -= C::kStages;
          if (nt < n_tiles) load_tile(t_end - 1 - nt, ls);
          cp_async_commit();
        }
        const uint32_t v_cur = w.v_lane + stage * C::kTileBytes;
        if (it + 1 < n_tiles) {
          const int n1 = tile_n0(it + 1);
          const uint32_t k_next = w.k_lane + s1 * C::kTileBytes;
          with_mask_and_cap(needs_mask(n1), cap, [&](auto mask, auto softcap) {
            w.template tile_pipe<decltype(mask)::value, decltype(softcap)::value>(pa, k_next, v_cur, n1);
          });
        } else {
          w.pv(pa, v_cur);
        }
        stage = s1;
      }
    }

    // ---- split-K: this part's normalised rows and their log-sum-exps, for the merge -------------
    if constexpr (split_k) {
#pragma unroll
      for (int i = 0; i < NR; ++i) {
        float l = w.l_sum[i];
        l += __shfl_xor_sync(kFull, l, 1);
        l += __shfl_xor_sync(kFull, l, 2);
        const int row = (i >> 1) * 16 + (lane >> 2) + (i & 1) * 8;
        const int r = wrow0 + row;
        if (r >= valid_rows) continue;  // padding (the merge writes its zeros) or past the end
        const bool seen = l > 0.f && w.m_ref[i] != -INFINITY;
        const float inv = seen ? 1.f / l : 0.f;
        const int64_t pr = partial_row(r);
        if ((lane & 3) == 0) a.partial_lse[pr] = seen ? w.m_ref[i] * a.k2 + __log2f(l) : -INFINITY;
        float* const dst = a.partial_out + pr * p.head_dim;
#pragma unroll
        for (int d = 0; d < DT; ++d) {
          const int col = d * 8 + (lane & 3) * 2;
          if (col < p.head_dim)
            *reinterpret_cast<float2*>(dst + col) =
                make_float2(w.o[i >> 1][d][2 * (i & 1)] * inv, w.o[i >> 1][d][2 * (i & 1) + 1] * inv);
        }
      }
      return;
    }

    // ---- normalise: sum, sink / smooth logits, 1/l ----------------------------------------------
    const bool has_sink = p.head_sink != nullptr;
    const bool smooth = p.smooth_softmax;
    float f[NR];
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      float l = w.l_sum[i];
      l += __shfl_xor_sync(kFull, l, 1);
      l += __shfl_xor_sync(kFull, l, 2);
      const int r = wrow0 + (i >> 1) * 16 + (lane >> 2) + (i & 1) * 8;
      if (has_sink || smooth) {
        const float mt2 = w.m_ref[i] * a.k2;  // -inf when the row saw no key
        float z = -INFINITY;
        if (has_sink && r < nrows) z = p.head_sink[kvh * G + a.div_g.remainder(r, a.div_g.divide(r))] * kLog2e;
        float top = mt2;
        if (has_sink) top = fmaxf(top, z);
        if (smooth) top = fmaxf(top, 0.f);
        const float c = mt2 == -INFINITY ? 0.f : fast_exp2(mt2 - top);
        float den = l * c;
        if (has_sink) den += fast_exp2(z - top);
        if (smooth) den += fast_exp2(-top);
        f[i] = den > 0.f ? c / den : 0.f;
      } else {
        f[i] = l > 0.f ? 1.f / l : 0.f;
      }
    }

    T* const out = static_cast<T*>(p.output) + static_cast<int64_t>(b) * p.output_strides.batch;
    if constexpr (C::kEarlyQRelease) {
      // ---- O -> global from registers (the Q tile went back to the loader after the last S) --
      // Each quad of lanes writes 16 contiguous bytes of a row: half a 32-byte sector. A row's
      // words are all packed before its first store, and the column check is taken once per row
      // when the head size is the padded one: with a check and a pack per store, ptxas put
      // every word in one register, so each store waited for the one before it to read it, and
      // the epilogue held 4.5% of the kernel's stall samples at B = 2, L = 4096 (route 11).
      const bool all_columns = p.head_dim == D;
      if (a.wide_o && all_columns) {
        // Args::wide_o: after the swaps lane q of a quad holds the words of 8-column chunks
        // 4k + q (from lanes 0-3 in column order) and stores each as 16 bytes. The swaps run
        // on every lane (a shuffle takes the whole warp); only the stores check the row.
        const uint64_t o_policy = a.l2_hints ? detail::l2_policy<detail::L2Evict::kFirst>() : 0;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int r = wrow0 + mt * 16 + (lane >> 2) + hh * 8;
            const bool valid = r < valid_rows;  // first-prompt padding rows are exactly 0
            const float fi = f[mt * 2 + hh];
            uint32_t words[DT / 4][4];
#pragma unroll
            for (int d = 0; d < DT; ++d)
              words[d / 4][d % 4] = valid ? H::pack(w.o[mt][d][2 * hh] * fi, w.o[mt][d][2 * hh + 1] * fi) : 0u;
#pragma unroll
            for (int k = 0; k < DT / 4; ++k) quad_transpose(words[k], lane);
            if (r >= nrows) continue;
            const int s = a.div_g.divide(r), h = kvh * G + (r - s * G);
            T* const row_out = out + static_cast<int64_t>(s) * p.output_strides.token +
                               static_cast<int64_t>(h) * p.output_strides.head + (lane & 3) * 8;
#pragma unroll
            for (int k = 0; k < DT / 4; ++k) {
              const uint4 v = make_uint4(words[k][0], words[k][1], words[k][2], words[k][3]);
              if (a.l2_hints)
                detail::st_global_v4_hint(row_out + k * 32, v, o_policy);
              else
                *reinterpret_cast<uint4*>(row_out + k * 32) = v;
            }
          }
        if constexpr (stamps) timeline_put<C>(a, work, kTimelineExit, sm_clock());
        return;
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int r = wrow0 + mt * 16 + (lane >> 2) + hh * 8;
          if (r >= nrows) continue;
          const int s = a.div_g.divide(r), h = kvh * G + (r - s * G);
          uint32_t* const row_out = reinterpret_cast<uint32_t*>(out + static_cast<int64_t>(s) * p.output_strides.token +
                                                                static_cast<int64_t>(h) * p.output_strides.head) +
                                    (lane & 3);  // row_out[d * 4]: columns d * 8 + (lane & 3) * 2, + 1
          const bool valid = r < valid_rows;  // first-prompt padding rows are exactly 0
          const float fi = f[mt * 2 + hh];
          uint32_t words[DT];
#pragma unroll
          for (int d = 0; d < DT; ++d)
            words[d] = valid ? H::pack(w.o[mt][d][2 * hh] * fi, w.o[mt][d][2 * hh + 1] * fi) : 0u;
          if (all_columns) {  // with the L2 priority of Args::l2_hints (a column-checked row has none)
            if (a.l2_hints) {
              const uint64_t o_policy = detail::l2_policy<detail::L2Evict::kFirst>();
#pragma unroll
              for (int d = 0; d < DT; ++d) detail::st_global_b32_hint(row_out + d * 4, words[d], o_policy);
            } else {
#pragma unroll
              for (int d = 0; d < DT; ++d) row_out[d * 4] = words[d];
            }
          } else {
#pragma unroll
            for (int d = 0; d < DT; ++d)
              if (d * 8 + (lane & 3) * 2 < p.head_dim) row_out[d * 4] = words[d];
          }
        }
      if constexpr (stamps) timeline_put<C>(a, work, kTimelineExit, sm_clock());
      return;
    }

    // ---- O -> this warp's staging rows (the Q rows) -> global, 16-byte stores ------------------
    __syncwarp();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int d = 0; d < DT; ++d)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int row = mt * 16 + (lane >> 2) + hh * 8;
          const float fi = f[mt * 2 + hh];
          *reinterpret_cast<uint32_t*>(q_smem + q_off(row, d) + (lane & 3) * 4) =
              H::pack(w.o[mt][d][2 * hh] * fi, w.o[mt][d][2 * hh + 1] * fi);
        }
    __syncwarp();
    {
#pragma unroll 4
      for (int i = lane; i < C::kWarpRows * CH; i += 32) {
        const int row = i / CH, c = i % CH;
        const int r = wrow0 + row;
        if (r >= nrows || c * 8 >= p.head_dim) continue;
        const int s = a.div_g.divide(r), h = kvh * G + (r - s * G);
        uint4 v = make_uint4(0u, 0u, 0u, 0u);  // first-prompt padding rows are exactly 0
        if (r < valid_rows) v = *reinterpret_cast<const uint4*>(q_smem + q_off(row, c));
        *reinterpret_cast<uint4*>(out + static_cast<int64_t>(s) * p.output_strides.token +
                                  static_cast<int64_t>(h) * p.output_strides.head + c * 8) = v;
      }
    }
    // This thread is done with the Q tile (its staging rows read back): the loader may refill it.
    if constexpr (C::kWarpSpecialized) wg::mbarrier_arrive(smem_addr(&pipe.q_empty[q_buffer]));
    if constexpr (stamps) timeline_put<C>(a, work, kTimelineExit, sm_clock());
  }
}

// A warp-specialised CTA's walk over its query blocks (one role's side of it). The loader picks
// each next block and hands it, with its seqlens_k, to every thread of the CTA through the
// Pipeline's two walk slots: item n of the CTA goes through slot n % 2, whose full
// barrier the picking lane arrives on and whose empty barrier every thread arrives on once it
// has read the item. So the loader is at most two items ahead of the computing warpgroups, and
// they read seqlens_k from shared memory: each warp loading it for itself a block ahead did
// not hide the load (ptxas moved the value to a uniform register right after it, R2UR waiting
// for the data, in every block's walk). The picking: with Args::dynamic_walk the next slot of
// the schedule from the counter (prep zeroes it), so that CTAs that run faster take more
// blocks; else round r of the CTA is slot r * gridDim.x + c, or gridDim.x - 1 - c in odd
// rounds (the blocks come heaviest first, and the snake keeps CTA 0 from taking the heaviest
// block of every round). A function, not a lambda in the kernel: ptxas once left such a lambda
// out of line (fp16, route 8), which serialised every wgmma across the call.
template <typename T, class C, bool kSplit, Role kRole>
__device__ __forceinline__ void walk_blocks(const Args& a, unsigned char* const smem, Pipeline& pipe,
                                            const uint32_t error) {
  const int c = static_cast<int>(blockIdx.x), g = static_cast<int>(gridDim.x);
  auto block_of_round = [&](int r) {
    if (!a.persistent) return r == 0 ? c : INT_MAX;
    return r * g + (r & 1 ? g - 1 - c : c);
  };
  // The work item of schedule slot `slot`: INT_MAX past the last slot, -1 for an empty slot of
  // a group's last round (Args::group_slots).
  auto work_of_slot = [&](int slot) {
    if (a.group_slots == 0) return slot < a.num_work ? slot : INT_MAX;
    if (slot >= a.num_slots) return INT_MAX;
    const int group = a.div_group_slots.divide(slot);
    const int local = a.div_group_slots.remainder(slot, group);
    const int group_work = a.pairs_per_group * a.num_mblocks;
    const int first = group * group_work;
    return local < min(group_work, a.num_work - first) ? first + local : -1;
  };
  // The loader's first warp picks and its lane 0 takes the counter's slots and publishes. (The
  // loader's 40 registers spill since this loop, with one picking thread as with a warp; see
  // csrc/kernels/NOTES.md, twentieth round.)
  const bool picker = kRole == Role::kLoader && (threadIdx.x >> 5) == C::kConsumerThreads / 32;
  const bool lane0 = (threadIdx.x & 31) == 0;
  int round = 0;  // the picker's, in the static walk
  for (int n = 0;; ++n) {
    const int k = n & 1;
    if (picker) {
      if (n >= 2) wg::mbarrier_wait(smem_addr(&pipe.walk_empty[k]), ((n >> 1) - 1) & 1);
      int work;
      do {
        int slot = 0;
        if (a.dynamic_walk) {
          if (lane0) slot = atomicAdd(a.p.work_counter, 1);
          slot = __shfl_sync(0xffffffffu, slot, 0);
        } else {
          slot = block_of_round(round++);
        }
        work = work_of_slot(slot);
      } while (work < 0);
      if (lane0) {
        const int seqlen = work != INT_MAX ? a.p.seqlens_k[block_coords(a, work).b] : 0;
        pipe.walk_slot[k] = make_int2(work, seqlen);
        wg::mbarrier_arrive(smem_addr(&pipe.walk_full[k]));
      }
    }
    wg::mbarrier_wait(smem_addr(&pipe.walk_full[k]), (n >> 1) & 1);
    const int2 item = pipe.walk_slot[k];
    wg::mbarrier_arrive(smem_addr(&pipe.walk_empty[k]));
    if (item.x == INT_MAX) return;
    prefill_block<T, C, kSplit, kRole>(a, smem, pipe, error, item.x, block_coords(a, item.x), item.y);
  }
}

// kSplit: the split-K form (a.splits > 1, partials for the merge), a separate instantiation so
// that the plain kernel keeps its registers. A CTA takes one query block (blockIdx.x), or with
// warp specialisation and a.persistent, one after another (walk_blocks), so that the loader
// streams the next block's K/V while the computing warpgroups finish the current one and no CTA
// pays a launch and its barrier set-up per block.
template <typename T, class C, bool kSplit>
__global__ void __launch_bounds__(C::kThreads, C::kMinBlocks)
    prefill_mma_kernel(const __grid_constant__ Args a) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  // wgmma's swizzle atoms must be 1024-byte aligned (kSmemBytes has the room).
  unsigned char* const smem =
      C::kWgmma ? smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u) : smem_raw;
  __shared__ uint32_t s_error;
  // WS only: the K/V stage and Q tile mbarriers.
  __shared__ __align__(8) uint64_t s_full[C::kStages], s_empty[C::kStages], q_full[C::kQBuffers],
      q_empty[C::kQBuffers], v_full[C::kSplitKV ? C::kStages : 1], v_empty[C::kSplitKV ? C::kStages : 1],
      walk_full[2], walk_empty[2];
  __shared__ int2 walk_slot[2];
  if (threadIdx.x == 0) {
    const uint32_t* const word = a.p.error_word;
    s_error = word != nullptr ? *reinterpret_cast<const volatile uint32_t*>(word) : 0u;
    if constexpr (C::kWarpSpecialized) {
      for (int s = 0; s < C::kStages; ++s) {
        wg::mbarrier_init(smem_addr(&s_full[s]), C::kLoaderThreads);
        wg::mbarrier_init(smem_addr(&s_empty[s]), C::kConsumerThreads);
        if constexpr (C::kSplitKV) {
          wg::mbarrier_init(smem_addr(&v_full[s]), C::kLoaderThreads);
          wg::mbarrier_init(smem_addr(&v_empty[s]), C::kConsumerThreads);
        }
      }
      for (int s = 0; s < C::kQBuffers; ++s) {
        wg::mbarrier_init(smem_addr(&q_full[s]), C::kLoaderThreads);
        wg::mbarrier_init(smem_addr(&q_empty[s]), C::kConsumerThreads);
      }
      for (int s = 0; s < 2; ++s) {
        wg::mbarrier_init(smem_addr(&walk_full[s]), 1);
        wg::mbarrier_init(smem_addr(&walk_empty[s]), C::kThreads);
      }
    }
  }
  __syncthreads();
  const uint32_t error = s_error;
  Pipeline pipe{s_full, s_empty, q_full, q_empty, v_full, v_empty};
  pipe.walk_full = walk_full;
  pipe.walk_empty = walk_empty;
  pipe.walk_slot = walk_slot;
  if constexpr (C::kWarpSpecialized) {
    if (threadIdx.x >= C::kConsumerThreads) {  // the loader warpgroup
      wg::release_registers<C::kLoaderRegs>();
      walk_blocks<T, C, kSplit, Role::kLoader>(a, smem, pipe, error);
      return;
    }
    wg::claim_registers<C::kConsumerRegs>();
    if constexpr (C::kConsumerThreads == 256) {
      if (a.pingpong && threadIdx.x >= 128) wg::named_barrier_arrive(kTurnBarrier, 256);  // warpgroup 0 goes first
    }
    walk_blocks<T, C, kSplit, Role::kCompute>(a, smem, pipe, error);
    // The cache writes of owned tiles (Args::append_new) finish before the CTA leaves.
    if (a.append_new && threadIdx.x == 0) detail::bulk_wait_all();
  } else {
    const int work = static_cast<int>(blockIdx.x);
    const BlockCoords bc = block_coords(a, work);
    prefill_block<T, C, kSplit, Role::kAll>(a, smem, pipe, error, work, bc, a.p.seqlens_k[bc.b]);
  }
}

// ---------------------------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------------------------

// The tile shapes per padded head size: the fastest measured on an H200 (bf16, causal,
// Hq/Hkv = 32/8; B=2 L=4096, B=8 L=1024, B=1 L=16384) among 8-21 candidates each. Four warps of
// 32 rows (each K/V fragment read from shared memory feeds two m-tiles) and two CTAs per SM, so
// one CTA's barrier stalls are covered by the other; D=128 takes two 32-key sub-tiles per stage
// (one barrier per 64 keys, registers sized for 32).
using Cfg64 = Config<64, 4, 2, 64, 2, true, 2, false>;
using Cfg128 = Config<128, 4, 2, 32, 2, false, 2, false, 2>;
using Cfg256 = Config<256, 4, 1, 32, 2, false, 2, false>;
// wgmma configs: two warpgroups (128 rows), 64-key tiles, two stages, all threads load (cp.async
// and one CTA-wide barrier per tile): the split-K form and the "wgmma" route.
using Cfg64W = Config<64, 8, 1, 64, 2, false, 1, false, 1, true>;
using Cfg128W = Config<128, 8, 1, 64, 2, false, 1, false, 1, true>;
// The default on sm90a for padded head sizes 64, 128 and 256: warp-specialised (a loader
// warpgroup stages Q and feeds the computing warpgroups through mbarrier stages, by TMA),
// two stages, persistent CTAs; 128-key tiles at 64 and 128; three computing warpgroups at 64,
// two at 128 and 256.
// Measured on an H200 (bf16, causal, 32/8 heads, L = 4096 / 16384) against the other orders
// built and timed side by side: 64-key tiles (-7 to -10%), three stages of 64 keys, the
// pipelined order (S of the next tile with P V of this one), ping-pong between the computing
// warpgroups, and cp.async instead of TMA in the loader (-25%); see csrc/kernels/NOTES.md.
using Cfg64WS = Config<64, 8, 1, 128, 2, false, 1, false, 1, true, true>;
// D = 64 (route 6; auto takes it as Cfg64WS3One below): three computing warpgroups (192 rows a
// block), so that two can be on the tensor cores while the third is in its softmax; with two,
// D = 64 was bound by that chain (tensor pipe 34% busy). H200, B=2 L=4096: 391 against 313
// TFLOP/s with two.
using Cfg64WS3 = Config<64, 12, 1, 128, 2, false, 1, false, 1, true, true>;
// D = 128 (route 5, and auto below 2048 tokens until the nineteenth round) with its exponentials ahead of the row maxima
// (Config::kExpAhead): H200, bf16, causal, 32/8 heads, 1.013x the same kernel without them at
// B=8 L=1024 (interleaved A/B, fourteenth round; the same bits).
using Cfg128WS = Config<128, 8, 1, 128, 2, false, 1, false, 1, true, true, true>;
// D = 256 (route 5; auto takes Cfg256WS80 below): O alone is 128 registers a thread, so 64-key
// tiles (S 32 more) and two stages (193 KB of shared memory, room for one Q tile): 467 against
// 260 TFLOP/s for mma.sync.
using Cfg256WS = Config<256, 8, 1, 64, 2, false, 1, false, 1, true, true>;
// Experimental (routes 7 and 8): the same kernels with K and V on separate stage barriers (K back
// to the loader right after S, V after P V), in the plain order (7) and in the pipelined order
// (8: S of tile t + 1 in flight during the softmax of tile t; with one barrier pair per stage and
// two stages, that order left the loader no slack and measured 353 against 465 TFLOP/s; D = 64
// and 128 only).
using Cfg64WS3KV = Config<64, 12, 1, 128, 2, false, 1, false, 1, true, 2>;
using Cfg128WSKV = Config<128, 8, 1, 128, 2, false, 1, false, 1, true, 2>;
using Cfg256WSKV = Config<256, 8, 1, 64, 2, false, 1, false, 1, true, 2>;
using Cfg64WSKVP = Config<64, 8, 1, 128, 2, false, 1, true, 1, true, 2>;
using Cfg128WSKVP = Config<128, 8, 1, 128, 2, false, 1, true, 1, true, 2>;
// Route 11 and auto at padded head size 128 from 2048 tokens: Cfg128WSKVP (route 10, with its
// turns) with three K/V stages. That leaves room for one Q tile (225 KB), so the block's Q goes
// back after its last S and O is written from registers, as at D = 256. Why: the profile of
// route 10 put 12% of a computing warp's loop at its top, waiting for K and V; a third stage
// gives each load one more tile of lead. H200, bf16, causal, 32/8 heads, interleaved A/B over
// route 10: 1.020 at B=2 L=4096, 1.023 at B=1 L=8192, 1.059 at B=1 L=16384. With the
// exponentials ahead of the row maxima (every pipelined kernel's tile_pipe_wg, fourteenth
// round), over route 5: 1.05 at B=4 L=2048, 0.98 at B=8 L=1024 (hence 2048 tokens).
using Cfg128WSKVP3 = Config<128, 8, 1, 128, 3, false, 1, true, 1, true, 2>;
// Auto at padded head size 128 below 2048 tokens (and route 15 at any length): Cfg128WSKVP3
// with one instantiation of its loop's step (Config::kOneStep): 9.0k SASS instructions against
// 19.5k, one step body a block against two of each (mask, softcap) variant. Measured in the
// nineteenth round as a test of the eighteenth's instruction-fetch diagnosis: the block edges of
// B=2 L=4096 did not move, but short prompts gained (launch_default says how much).
using Cfg128WSKVP3One = Config<128, 8, 1, 128, 3, false, 1, true, 1, true, 2, false, true>;
// Route 9 and auto at D = 256: Cfg256WS with 80-key tiles, so that each tile's fixed
// costs (the full-barrier wait, the row max / sum shuffles and the rescale vote, the mask
// choice) spread over 25% more keys. Two stages of 80 keys are 160 KB, with the 64 KB Q tile
// and the alignment 225 KB of the 227 KB (96 keys would need 257 KB); S is 40 registers a
// thread (P 20) next to O's 128. One barrier pair per stage (WS = 1), as route 5: with split
// K/V barriers (route 7) D = 256 measured within 1% of route 5, and keeping the route 5
// kernel otherwise unchanged lets an A/B of routes 5 and 9 measure the tile size alone.
// Exponentials ahead of the row maxima (fourteenth round): 1.030x the same kernel without them
// at B=2 L=4096, 1.043x at B=1 L=8192 (interleaved A/B; the same bits).
using Cfg256WS80 = Config<256, 8, 1, 80, 2, false, 1, false, 1, true, true, true>;
// The plain-order kernels with one instantiation of their tile (Config::kOneStep): auto's at
// D = 64 (6.7k SASS instructions against 9.1k); at D = 256 route 15 only (it spills 16 bytes).
using Cfg256WS80One = Config<256, 8, 1, 80, 2, false, 1, false, 1, true, true, true, true>;
using Cfg64WS3One = Config<64, 12, 1, 128, 2, false, 1, false, 1, true, true, false, true>;

std::atomic<int> g_route{0};  // set_prefill_route
std::atomic<int> g_q_loader{0};  // set_prefill_q_loader: 0 TMA where it can run, 1 cp.async always
std::atomic<int> g_append{0};  // set_prefill_append: 0 in the kernel where it can, 1 by prep always
// set_prefill_timeline: the records and their count (nullptr: off). Set from one thread
// between calls (a diagnostic), so a pointer and a count read separately cannot tear usefully.
std::atomic<unsigned long long*> g_timeline{nullptr};
std::atomic<int> g_timeline_records{0};

using detail::device_attribute;
using detail::sm90a_kernels_usable;

inline bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

using detail::encode_cache_map;
using detail::encode_query_map;
// Both caches' maps into `a`, in boxes of `box_keys` keys.
bool encode_cache_maps(Args& a, int box_keys) {
  return encode_cache_map(&a.k_map, a.p.key_cache, a.p, box_keys) &&
         encode_cache_map(&a.v_map, a.p.value_cache, a.p, box_keys);
}
inline bool strides8(const TokenStrides& s) { return s.batch % 8 == 0 && s.token % 8 == 0 && s.head % 8 == 0; }

// Fills `a` and returns the padded head size, or 0 when the case is not covered.
inline int prepare(const Params& p, const void* q, TokenStrides q_strides, Args& a) {
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) return 0;
  const int D = p.head_dim;
  if (D <= 0 || D % 8 != 0 || D > 256) return 0;
  if (p.batch <= 0 || p.query_len <= 0 || p.kv_heads <= 0 || p.group_size <= 0) return 0;
  if (static_cast<int64_t>(p.kv_heads) * p.group_size != p.q_heads) return 0;
  if (q == nullptr || p.key_cache == nullptr || p.value_cache == nullptr || p.output == nullptr ||
      p.seqlens_k == nullptr)
    return 0;
  if (!aligned16(q) || !aligned16(p.key_cache) || !aligned16(p.value_cache) || !aligned16(p.output))
    return 0;
  if (!strides8(q_strides) || !strides8(p.cache_strides) || !strides8(p.output_strides)) return 0;
  if (!std::isfinite(p.scale) || p.scale == 0.f) return 0;
  if (!(p.softcap >= 0.f) || !std::isfinite(p.softcap)) return 0;
  if (static_cast<int64_t>(p.query_len) * p.group_size > INT_MAX) return 0;
  a.p = p;
  a.q = q;
  a.q_strides = q_strides;
  a.q_sign = p.scale < 0.f ? 0x80008000u : 0u;
  const float scale = std::fabs(p.scale);
  a.softcap_on = p.softcap > 0.f ? 1 : 0;
  a.k2 = p.softcap > 0.f ? p.softcap : scale * kLog2e;  // softcap: log2(e) is in the transformed score
  // Clamped: with a subnormal softcap the quotient overflows, and inf * a zero score is NaN.
  a.tanh_k = p.softcap > 0.f ? std::fmin(2.f * kLog2e * scale / p.softcap, FLT_MAX) : 0.f;
  return D <= 64 ? 64 : D <= 128 ? 128 : 256;
}

// persistent: one CTA per SM walks the query blocks (warp-specialised configs, which fit one
// CTA per SM); otherwise one CTA per query block (then the hardware balances the causal load).
template <typename T, class C, bool kSplit = false>
bool launch_config(Args& a, cudaStream_t stream, bool persistent = false) {
  static_assert(!kSplit || !C::kWarpSpecialized, "the split form takes one CTA per (block, part)");
  const Params& p = a.p;
  const int64_t nrows = static_cast<int64_t>(p.query_len) * p.group_size;
  const int64_t mblocks = (nrows + C::BM - 1) / C::BM;
  const int64_t grid = mblocks * p.kv_heads * p.batch;
  if (grid <= 0 || grid > INT_MAX) return false;
  a.num_mblocks = static_cast<int32_t>(mblocks);
  const int pairs = p.kv_heads * p.batch;
  if (a.pairs_per_group <= 0 || a.pairs_per_group > pairs) a.pairs_per_group = pairs;
  a.num_work = static_cast<int32_t>(grid);
  int64_t ctas = grid;
  a.persistent = 0;
  if (persistent && C::kWarpSpecialized) {
    const int sms = device_attribute<cudaDevAttrMultiProcessorCount>();
    if (sms > 0 && ctas > sms) ctas = sms;
    a.persistent = 1;
  }
  if (!a.persistent || a.p.work_counter == nullptr) a.dynamic_walk = 0;
  a.group_slots = 0;
  a.num_slots = a.num_work;
  if (a.persistent && a.align_groups && a.pairs_per_group < pairs) {
    const int64_t group_work = int64_t{a.pairs_per_group} * mblocks;
    const int64_t slots = (group_work + ctas - 1) / ctas * ctas;
    const int64_t groups = (pairs + a.pairs_per_group - 1) / a.pairs_per_group;
    if (slots * groups <= INT_MAX) {
      a.group_slots = static_cast<int32_t>(slots);
      a.num_slots = static_cast<int32_t>(slots * groups);
    }
  }

  auto kernel = prefill_mma_kernel<T, C, kSplit>;
  // The dynamic shared-memory opt-in is per function and device: do it once per device.
  static std::atomic<uint64_t> configured{0};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) throw std::runtime_error(std::string("gqa prefill_mma: cudaGetDevice: ") + cudaGetErrorString(err));
  const uint64_t bit = device < 64 ? (1ull << device) : 0ull;
  if (bit == 0 || (configured.load(std::memory_order_relaxed) & bit) == 0) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
    if (err == cudaSuccess)
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                 cudaSharedmemCarveoutMaxShared);
    if (err != cudaSuccess)
      throw std::runtime_error(std::string("gqa prefill_mma: cudaFuncSetAttribute: ") + cudaGetErrorString(err));
    configured.fetch_or(bit, std::memory_order_relaxed);
  }
  a.div_g = make_fast_divisor(p.group_size);
  a.div_kv_heads = make_fast_divisor(p.kv_heads);
  a.div_group_work = make_fast_divisor(a.pairs_per_group * a.num_mblocks);  // <= num_work
  a.div_in_group = make_fast_divisor(a.pairs_per_group);
  a.div_last_in_group = make_fast_divisor(pairs - (pairs - 1) / a.pairs_per_group * a.pairs_per_group);
  a.div_group_slots = make_fast_divisor(a.group_slots > 0 ? a.group_slots : 1);

  const dim3 blocks(static_cast<unsigned>(ctas), static_cast<unsigned>(a.splits));  // y: key-range splits
  kernel<<<blocks, C::kThreads, C::kSmemBytes, stream>>>(a);
  err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("gqa prefill_mma: kernel launch: ") + cudaGetErrorString(err));
  return true;
}

// Routes (set_prefill_route): 0 auto, 1 mma.sync, 2 plain wgmma, 3 warp-specialised wgmma
// (TMA) with one CTA per query block, 4 the same with cp.async in the loader (the fallback when
// the driver has no TMA encoder), 5 warp-specialised with persistent CTAs (auto's choice: at
// least as fast as 3 on every row measured on an H200, +4% at B=8 L=1024; auto now takes other
// kernels, launch_default says which), 6 as 5 with three computing warpgroups at padded head size 64 (at
// 128 the same with 64-key tiles, the most that fits 152 registers, measured within 2% of 5:
// removed), 7 and 8 as 5 and 6 with split K/V stage barriers, in the plain and the pipelined
// order, 9 as 5 with 80-key tiles at padded head size 256 (Cfg256WS80, auto's kernel there),
// route 5's kernels at 64 and 128, 10 as 8 with the computing warpgroups taking turns to issue
// their MMAs, 11 as 10 with three K/V stages at padded head size 128 (auto's kernel there for
// prompts of 2048 tokens or more; route 10's kernels elsewhere); experimental, auto's kernels
// (route 11's at 128 at any length) with L2 priorities and the (row, kv head) pairs walked in
// groups whose K/V fit in L2 (route 12, Args::l2_hints and pairs_per_group); 13 as 12 with
// each group in whole rounds of the grid (Args::align_groups, as auto groups); 14 the
// plain-order kernels of routes 5 and 9 with the computing warpgroups taking turns
// (Args::pingpong, as auto at 256); 15 auto's kernels with one instantiation of their step
// (Config::kOneStep, as auto at 64 and at 128 below 2048 tokens; at 128 at every length, at
// 256 too); 16 auto with O stored from registers in 4-byte words (auto: 16-byte chunks,
// Args::wide_o); 17 auto with each block's Q staged before its first K/V tile (Args::q_first);
// 18 auto with the static walk over the query blocks (auto: the dynamic walk,
// Args::dynamic_walk).
// The warp-specialised configs: TMA maps in boxes of the config's stage keys.
template <typename T, class C>
bool launch_ws(Args& a, cudaStream_t stream, int route) {
  a.use_tma = route != 4 && encode_cache_maps(a, C::kStageKeys) ? 1 : 0;
  a.new_tma = a.append_new && a.use_tma &&
                      detail::encode_new_rows_map(&a.k_new_map, a.p.key, a.p.key_strides, a.p, C::kStageKeys) &&
                      detail::encode_new_rows_map(&a.v_new_map, a.p.value, a.p.value_strides, a.p, C::kStageKeys)
                  ? 1
                  : 0;
  a.q_tma = a.use_tma && a.q_sign == 0u && g_q_loader.load(std::memory_order_relaxed) == 0 &&
                    encode_query_map(&a.q_map, a.q, a.q_strides, a.p)
                ? 1
                : 0;
  return launch_config<T, C>(a, stream, route == 0 || route >= 5);
}

// The prompt length from which auto takes the pipelined kernel at padded head size 128.
constexpr int kLongPromptForPipelinedWs = 2048;

template <typename T, bool kSplit>
bool launch_default(Args& a, int dpad, cudaStream_t stream) {
  const int route = g_route.load(std::memory_order_relaxed);
  const bool sm90 = route != 1 && sm90a_kernels_usable();
  // The split form exists for the plain wgmma kernel only (a short chunk: no long loop for warp
  // specialisation to pay off); D = 256 has no plain wgmma form (it takes mma.sync there, and
  // for route 2), but a warp-specialised one (the default: 467 against 260 TFLOP/s for mma.sync
  // at B=2 L=4096 on an H200).
  if (sm90 && (dpad == 64 || dpad == 128) && (kSplit || route == 2))
    return dpad == 64 ? launch_config<T, Cfg64W, kSplit>(a, stream) : launch_config<T, Cfg128W, kSplit>(a, stream);
  if constexpr (!kSplit) {
    if (sm90 && route != 2) {
      if (route == 7) {
        if (dpad == 64) return launch_ws<T, Cfg64WS3KV>(a, stream, route);
        if (dpad == 128) return launch_ws<T, Cfg128WSKV>(a, stream, route);
        if (dpad == 256) return launch_ws<T, Cfg256WSKV>(a, stream, route);
      }
      // Experimental route 14 (x_plain_pp): the plain-order kernels of routes 5 (64, 128) and 9
      // (256) with the computing warpgroups taking turns to issue S and P V (Args::pingpong),
      // which auto does at 256 (below).
      if (route == 14) {
        a.pingpong = 1;
        if (dpad == 256) return launch_ws<T, Cfg256WS80>(a, stream, route);
        return dpad == 64 ? launch_ws<T, Cfg64WS>(a, stream, route) : launch_ws<T, Cfg128WS>(a, stream, route);
      }
      // Auto at padded head size 128 takes the pipelined order for long prompts: long query
      // blocks, where its overlap of softmax and P V pays, and not for short ones, where the
      // blocks' fill and drain weigh more. H200, bf16, causal, 32/8 heads, interleaved A/B
      // (benchmarks/ab_prefill_routes.py), route 8 over route 5: 0.94 at B=8 L=1024, 0.98 at
      // B=4 L=2048, 1.03 at B=2 L=4096, 1.08 at B=1 L=8192, 1.14 at B=1 L=16384. Its two
      // computing warpgroups take turns to issue their MMAs (route 10, thirteenth round:
      // 1.010-1.016x route 8); since the fourteenth round with three K/V stages and the
      // exponentials ahead (route 11, Cfg128WSKVP3), which moved the threshold to 2048 tokens.
      // L2 priorities (Args::l2_hints) at padded head size 128, where auto's kernels keep the K/V
      // that the query blocks of a head read again. H200, bf16, causal, 32/8 heads, interleaved
      // A/B against the same kernels without them (sixteenth round): 1.05-1.08x at B=8 L=1024
      // (DRAM reads 185 -> 147 MB), 0.98-1.00x from 2048 tokens on, 0.99-1.00x at 64 and 256.
      // The fixed routes keep the plain copies (the A/B baselines).
      const bool experimental = route == 12 || route == 13;
      // Route 15 (x_one_step) is auto with one instantiation of each kernel's step, taking the
      // pipelined kernel at padded head size 128 at every length.
      // Auto stores O from registers in 16-byte chunks (Args::wide_o); route 16 (x_narrow_o) is
      // auto with the 4-byte stores, the A/B baseline. H200, bf16, causal, 32/8 heads,
      // interleaved A/B (nineteenth round, route x_wide_o against the former auto): 1.057 at
      // B=8 L=1024, 1.003-1.009 at L >= 4096 (D = 128); 1.058 at B=2 L=4096 and 1.026 at B=1
      // L=8192 (D = 256, where the epilogue fell from 9,200 to 5,450 cycles a block). Route 15
      // keeps the 4-byte stores too, as it was measured (its same-bits test pairs it with fixed
      // routes, which all do).
      const bool auto_kernels = route == 0 || route == 16 || route == 17 || route == 18;
      const bool auto_like = auto_kernels || route == 15;
      a.wide_o = route == 0 || route == 17 || route == 18 ? 1 : 0;
      a.q_first = route == 17 ? 1 : 0;
      // The dynamic walk (Args::dynamic_walk) for auto and the routes that vary it; route 18
      // (x_static_walk) is auto with the static walk, the A/B baseline.
      a.dynamic_walk = auto_like && route != 18 ? 1 : 0;
      a.l2_hints = (auto_like && dpad == 128) || experimental ? 1 : 0;
      // The (row, kv head) pairs in groups whose K/V take at most 32 MB of the 50 MB L2
      // (Args::pairs_per_group): routes 12 and 13, and auto at 128 once the K/V of all pairs
      // reach 64 MB in pairs of 4 MB or more, where the plain order streams them from DRAM again
      // for every round of query blocks. Each group in whole rounds of the grid
      // (Args::align_groups; route 13 and auto): a round that straddled two groups dealt one
      // group's lightest blocks next to the other's heaviest (3.5% load imbalance at B=1
      // L=16384 in a simulation of the schedule). H200, bf16, causal, 32/8 heads, interleaved
      // A/B against route 11 (seventeenth round): route 13 1.016x at B=1 L=16384 (route 12
      // 0.979x), 1.050x at B=2 L=8192 (0.983x), 1.068x at B=2 L=16384, 1.070x at B=1 L=32768.
      const int64_t pair_kv_bytes = int64_t{2} * a.p.query_len * dpad * sizeof(T);
      const int64_t all_kv_bytes = pair_kv_bytes * a.p.kv_heads * a.p.batch;
      const bool auto_groups = auto_like && dpad == 128 && pair_kv_bytes >= (int64_t{4} << 20) &&
                               all_kv_bytes >= (int64_t{64} << 20);
      const bool group_pairs = experimental || auto_groups;
      a.align_groups = route == 13 || auto_groups ? 1 : 0;
      if (group_pairs)
        a.pairs_per_group = static_cast<int32_t>(std::max<int64_t>(1, (int64_t{32} << 20) / pair_kv_bytes));
      // Auto below 2048 tokens and route 15 at any length: the pipelined kernel with one
      // instantiation of its step (Cfg128WSKVP3One). Interleaved A/B against the former auto
      // (route 5's plain-order kernel below 2048 tokens, Cfg128WSKVP3 from there), H200, bf16,
      // causal, 32/8 heads, nineteenth round: 1.032 at B=8 L=1024, 1.033 at B=16 L=1024, 1.023
      // at B=4 L=1536, 1.001 at B=8 L=512; from 2048 tokens 0.994-0.995 (B=4 L=2048, B=2
      // L=4096) and 1.011 (B=1 L=8192), so the two copies stay there.
      if (dpad == 128 && ((auto_kernels && a.p.query_len < kLongPromptForPipelinedWs) || route == 15)) {
        a.pingpong = 1;
        return launch_ws<T, Cfg128WSKVP3One>(a, stream, route);
      }
      if (dpad == 128 && (auto_kernels || route == 11 || experimental)) {
        a.pingpong = 1;
        return launch_ws<T, Cfg128WSKVP3>(a, stream, route);
      }
      if ((route == 10 || route == 11) && (dpad == 64 || dpad == 128)) {
        a.pingpong = 1;
        return dpad == 64 ? launch_ws<T, Cfg64WSKVP>(a, stream, route) : launch_ws<T, Cfg128WSKVP>(a, stream, route);
      }
      if (route == 8 || route == 10 || route == 11) {
        if (dpad == 64) return launch_ws<T, Cfg64WSKVP>(a, stream, route);
        if (dpad == 128) return launch_ws<T, Cfg128WSKVP>(a, stream, route);
        // D = 256: the pipelined order spills (O alone is 128 registers): route 7's kernel.
        if (dpad == 256) return launch_ws<T, Cfg256WSKV>(a, stream, route);
      }
      // Route 9's 80-key tiles exist at D = 256 only (at 64 and 128 it takes route 5's kernels
      // below); auto takes them there. H200, bf16, causal, 32/8 heads, interleaved A/B against
      // route 5: 523 against 498 TFLOP/s at B=2 L=4096, 592 against 558 at B=1 L=8192 (a
      // cross-block carry of route 8's pipeline, wip/prefill-xblock, measured 0.93x route 8).
      // Auto's two computing warpgroups take turns to issue S and P V there, so that each one's
      // softmax runs under the other's MMAs (route 14 against route 9, seventeenth round:
      // 1.010x at B=2 L=4096, 1.017x at B=1 L=8192).
      // D = 256 with one instantiation of its tile spills 16 bytes: 0.983 at B=2 L=4096 and
      // 0.987 at B=1 L=8192 against auto's Cfg256WS80 (nineteenth round); route 15 only.
      if (route == 15 && dpad == 256) {
        a.pingpong = 1;
        return launch_ws<T, Cfg256WS80One>(a, stream, route);
      }
      if ((route == 9 || auto_like || experimental) && dpad == 256) {
        a.pingpong = route == 9 ? 0 : 1;
        return launch_ws<T, Cfg256WS80>(a, stream, route);
      }
      // D = 64: auto (and route 15) take route 6's kernel with one instantiation of its tile
      // (Cfg64WS3One): 1.015 at B=8 L=1024, 1.012 at B=2 L=4096, 1.000 at B=1 L=16384
      // (nineteenth round, interleaved A/B, as above).
      if (dpad == 64) {
        if (auto_like) return launch_ws<T, Cfg64WS3One>(a, stream, route);
        return route == 6 || experimental ? launch_ws<T, Cfg64WS3>(a, stream, route)
                                          : launch_ws<T, Cfg64WS>(a, stream, route);
      }
      if (dpad == 128) return launch_ws<T, Cfg128WS>(a, stream, route);
      if (dpad == 256) return launch_ws<T, Cfg256WS>(a, stream, route);
    }
  }
  // Only the warp-specialised kernels append (prefill_mma_appends promised prep one of them).
  if (a.append_new) throw std::runtime_error("gqa prefill_mma: internal error: an append without its kernel");
  switch (dpad) {
    case 64: return launch_config<T, Cfg64, kSplit>(a, stream);
    case 128: return launch_config<T, Cfg128, kSplit>(a, stream);
    case 256: return launch_config<T, Cfg256, kSplit>(a, stream);
    default: return false;
  }
}

template <typename T>
bool launch_typed(Args& a, int dpad, cudaStream_t stream) {
  return a.splits > 1 ? launch_default<T, true>(a, dpad, stream) : launch_default<T, false>(a, dpad, stream);
}

}  // namespace pmma

void set_prefill_route(int route) { pmma::g_route.store(route, std::memory_order_relaxed); }
void set_prefill_append(int append) { pmma::g_append.store(append, std::memory_order_relaxed); }
void set_prefill_timeline(unsigned long long* records, int count) {
  pmma::g_timeline_records.store(records != nullptr ? count : 0, std::memory_order_relaxed);
  pmma::g_timeline.store(records, std::memory_order_relaxed);
}

bool prefill_mma_appends(const Params& p, int splits) {
  using namespace pmma;
  if (g_append.load(std::memory_order_relaxed) != 0) return false;
  if (!p.inplace || p.do_rotary || splits > 1 || p.key == nullptr || p.value == nullptr) return false;
  // launch_default's warp-specialised kernels (every route but mma.sync and plain wgmma).
  const int route = g_route.load(std::memory_order_relaxed);
  if (route == 1 || route == 2 || !sm90a_kernels_usable()) return false;
  // The new rows are read with 16-byte copies (the cp.async tiles), K and V with one set of
  // strides (packed QKV, or two tensors of one shape).
  const TokenStrides ks = p.key_strides, vs = p.value_strides;
  return aligned16(p.key) && aligned16(p.value) && strides8(ks) && ks.batch == vs.batch && ks.token == vs.token &&
         ks.head == vs.head;
}
void set_prefill_q_loader(int loader) { pmma::g_q_loader.store(loader, std::memory_order_relaxed); }

bool prefill_mma_covers(const Params& p, const void* q, TokenStrides q_strides) {
  pmma::Args a{};
  return pmma::prepare(p, q, q_strides, a) != 0;
}

bool launch_prefill_mma(const Params& p, const void* q, TokenStrides q_strides, float* partial_out,
                        float* partial_lse, int splits, bool append_new, void* stream) {
  pmma::Args a{};
  const int dpad = pmma::prepare(p, q, q_strides, a);
  if (dpad == 0) {
    if (append_new) throw std::runtime_error("gqa prefill_mma: internal error: an append without its kernel");
    return false;
  }
  a.append_new = append_new ? 1 : 0;
  a.splits = splits > 1 ? splits : 1;
  a.partial_out = partial_out;
  a.partial_lse = partial_lse;
  a.timeline = pmma::g_timeline.load(std::memory_order_relaxed);
  a.timeline_records = a.timeline != nullptr ? pmma::g_timeline_records.load(std::memory_order_relaxed) : 0;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (p.dtype == DType::kFloat16) return pmma::launch_typed<__half>(a, dpad, s);
  return pmma::launch_typed<__nv_bfloat16>(a, dpad, s);
}


}  // namespace cuda
}  // namespace gqa
