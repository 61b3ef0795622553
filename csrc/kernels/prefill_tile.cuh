// The prefill kernels' building blocks; prefill_mma.cu (whose opening comment describes the
// design) holds the kernel, its walk over the query blocks and its launch. Here: Config (the
// tile shapes), Args (the kernel's one parameter), the device helpers, the warp-specialised
// CTA's Pipeline, and WarpTile (one warp's registers and the steps of one K/V tile: S = Q K^T,
// the online softmax, O += P V, on mma.sync or wgmma). Included by prefill_mma.cu only.
#pragma once

#include "prefill_mma.h"

#include <cuda.h>  // CUtensorMap
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../core/fast_div.h"
#include "common.cuh"
#include "wgmma.cuh"

namespace gqa {
namespace cuda {
namespace pmma {

using detail::kLog2e;
// Named barriers of the computing warpgroups' turns (Args::pingpong): 5 and 6 (0 is
// __syncthreads, 1-4 the warpgroups' own, wg::warpgroup_barrier).
constexpr int kTurnBarrier = 5;

// A row's exponent base is moved only when its running max grows by more than this many
// log2 units; until then P may reach 2^kRescaleThreshold (harmless in fp32 / fp16 / bf16).
constexpr float kRescaleThreshold = 8.f;

// D: head size the tiles are laid out for (64/128/256; smaller real sizes are zero padded).
// WARPS warps of 16*MT rows each; BN keys per K/V tile; STAGES shared-memory stages;
// QREGS: Q fragments live in registers for the whole loop (else re-read from shared memory);
// MINB: min CTAs per SM for the register allocator; PIPE: software-pipelined tile order;
// SUB: BN-key sub-tiles per stage (one barrier per BN*SUB keys, registers sized by BN).
// WGMMA: the S and P V products run as Hopper warpgroup MMAs (wgmma.cuh) on blocked,
// 128-byte-swizzled tiles; the softmax is the same code (the wgmma accumulator layout of a
// warp's 16 rows is the mma.sync one).
// WS: warp specialisation (wgmma only): one more warpgroup streams K/V into stages guarded by
// mbarriers (full: landed; empty: released by every computing thread), by TMA (cp.async for the
// tile that crosses the row's total, which must read as zeros, and everywhere when the driver
// has no TMA encoder), so the computing warpgroups never meet at a CTA-wide barrier; the register
// file is split between them (setmaxnreg). With wgmma, the default on sm90 (launch_default).
template <int D_, int WARPS_, int MT_, int BN_, int STAGES_, bool QREGS_, int MINB_, bool PIPE_, int SUB_ = 1,
          bool WGMMA_ = false, int WS_ = 0, bool EXP_AHEAD_ = false, bool ONE_STEP_ = false>
struct Config {
  static constexpr int D = D_;
  static constexpr int kWarps = WARPS_;
  static constexpr int MT = MT_;
  static constexpr int BN = BN_;
  static constexpr int kStages = STAGES_;
  static constexpr bool kQRegs = QREGS_;
  static constexpr int kMinBlocks = MINB_;
  static constexpr bool kPipe = PIPE_;  // S of tile t+1 issued before P V of tile t
  static constexpr int kSub = SUB_;     // BN-key sub-tiles per shared-memory stage
  static constexpr int kStageKeys = BN_ * SUB_;
  // The plain wgmma order's unmasked tiles take softmax_ahead() (the pipelined order's always
  // do). Not where it spills: three computing warpgroups at D = 64 (152 registers a thread).
  static constexpr bool kExpAhead = EXP_AHEAD_;
  // One instantiation of the step (route 15): the mask and the softcap are run-time passes,
  // and in the pipelined order P of the next tile is copied back into the current tile's
  // registers after each step, so that a block runs (and the SM fetches) one step body
  // instead of one for each (mask, softcap) variant (two each in the pipelined order).
  static constexpr bool kOneStep = ONE_STEP_;
  static constexpr bool kWarpSpecialized = WS_ != 0;
  // WS_ == 2: K and V of a stage have their own mbarriers, so that K is handed back as soon as
  // S = Q K^T is done and V after P V (one pair for both: a stage frees only after P V).
  static constexpr bool kSplitKV = WS_ == 2;
  static constexpr int kConsumerThreads = 32 * WARPS_;  // the warps that compute (all, without WS)
  static constexpr int kLoaderThreads = WS_ ? 128 : kConsumerThreads;
  static constexpr int kThreads = kConsumerThreads + (WS_ ? 128 : 0);
  // WS register split (setmaxnreg): the CTA starts with 64 K / kThreads registers a thread (168
  // for 384 threads, 128 for 512); the loader gives back down to 40 and the computing
  // warpgroups take what that frees: 128 * 40 + 256 * 232 = 64,512 = 384 * 168, and
  // 128 * 40 + 384 * 152 <= 512 * 128.
  static constexpr int kLoaderRegs = 40, kConsumerRegs = WARPS_ == 12 ? 152 : 232;
  static constexpr int kWarpRows = 16 * MT_;
  static constexpr int BM = kWarpRows * WARPS_;
  static constexpr int kChunks = D / 8;  // 16-byte chunks per row
  static constexpr int kRowBytes = D * 2;
  static constexpr int kQBytes = BM * kRowBytes;              // one Q tile (the block's rows)
  static constexpr int kTileBytes = kStageKeys * kRowBytes;  // one stage of K (or V)
  static constexpr bool kWgmma = WGMMA_;
  // WS: the loader stages the next block's Q while the computing warpgroups finish the current
  // one, into a second Q tile where two fit next to the stages (D <= 128); else one.
  static constexpr int kQBuffers = WS_ && 2 * kQBytes + 2 * kStages * kTileBytes + 1024 <= 227 * 1024 ? 2 : 1;
  // With one Q tile (D = 256), the computing warpgroups give it back as soon as the block's last
  // S = Q K^T is done, and write O straight from registers (no staging in the Q tile), so that
  // the loader stages the next block's Q during the last tile's softmax and P V and the
  // epilogue, not after them (then every block start waited for a Q load).
  static constexpr bool kEarlyQRelease = WS_ && kQBuffers == 1;
  // wgmma tiles need 1024-byte-aligned swizzle atoms: room to align the dynamic base.
  static constexpr int kSmemBytes = kQBuffers * kQBytes + 2 * kStages * kTileBytes + (WGMMA_ ? 1024 : 0);
  static_assert(D % 64 == 0, "the swizzle needs at least 8 chunks per row");
  static_assert(BN % 16 == 0, "BN must be a multiple of 16");
  static_assert((kStageKeys * kChunks) % kLoaderThreads == 0, "every loader copies the same number of chunks");
  static_assert(!WS_ || (WGMMA_ && (WARPS_ == 8 || WARPS_ == 12) && (!PIPE_ || WS_ == 2)),
                "warp specialisation: two or three wgmma warpgroups and a loader (pipelined: split K/V)");
  static_assert(!PIPE_ || (SUB_ == 1 && (!WGMMA_ || WS_ == 2)),
                "the pipelined order: mma.sync, or wgmma with split K/V stages; whole stages");
  static_assert(kStages >= 2, "at least double buffering");
  static_assert(!ONE_STEP_ || (WGMMA_ && (WS_ == 1 || (WS_ == 2 && PIPE_))),
                "one step: the warp-specialised wgmma kernels of the pipelined order or of one barrier pair a stage");
  // 80-key tiles (route 9, D = 256): S is one m64n80 wgmma, P V five k16 steps; a blocked tile
  // of 80 rows is 10 whole 8-row atoms a column block (10 KB, so every atom stays 1024-byte
  // aligned), and the TMA box of 80 keys is within its 256-row limit. Nothing else in the
  // kernel takes BN for a power of two: tile indices are divisions by kStageKeys, and the
  // masks compare key indices (a 128-row block's edges need not fall on tile edges).
  static_assert(!WGMMA_ || (MT_ == 1 && (BN_ == 64 || BN_ == 80 || BN_ == 128) && SUB_ == 1 && !QREGS_ &&
                            WARPS_ % 4 == 0 && (D_ == 64 || D_ == 128 || D_ == 256)),
                "wgmma: warpgroups of 64 rows, 64-, 80- or 128-key tiles, D = 64, 128 or 256");
  static_assert(!WGMMA_ || kSmemBytes <= 227 * 1024, "the shared memory of one CTA on sm90");
  // The mma.sync configurations are what every GPU but sm90 runs: 99 KB a block is the least of
  // them (sm86, sm89, sm120).
  static_assert(WGMMA_ || kSmemBytes <= 99 * 1024, "the shared memory of one CTA on every sm80+ GPU");
};

// Everything the kernel reads, passed by value as one __grid_constant__ parameter.
struct Args {
  Params p;
  const void* q;
  TokenStrides q_strides;
  uint32_t q_sign;      // 0x80008000 when scale < 0: q is negated on load (exact), |scale| used
  int32_t num_mblocks;  // query blocks per (batch row, KV head)
  int32_t num_work;     // query blocks in all: num_mblocks * kv_heads * batch
  int32_t persistent;   // warp-specialised only: gridDim.x CTAs walk all blocks (else one each)
  int32_t softcap_on;
  float k2;             // log2-domain multiplier of the (transformed) score
  float tanh_k;         // softcap: 2*log2e*|scale|/softcap, so tanh(y) = 1 - 2/(2^(s*tanh_k)+1)
  int32_t splits;       // key-range splits per query block (grid.y); > 1: partials for the merge
  float* partial_out;   // [B, S, Hq, splits, D], each split's normalised output
  float* partial_lse;   // [B, S, Hq, splits], log2 domain; -inf where a split saw no key
  int32_t use_tma;      // warp-specialised only: whole K/V tiles by TMA through the maps below
  // Warp-specialised only: the loader stages a block's Q tile by TMA through q_map when all of
  // its rows are real (else, and when q_sign != 0, by cp.async); see stage_q.
  int32_t q_tma;
  // Warp-specialised, in place, no RoPE only (prefill_mma_appends): a row with no past (its
  // keys are exactly this call's S new tokens) reads K/V from p.key / p.value instead of the
  // caches, and each tile of it is written to the caches by one query block, its owner (the
  // block holding the tile's first token), from the stage it loaded; prep skips those rows.
  int32_t append_new;
  int32_t new_tma;      // append_new: the new rows' tiles by TMA through k_new_map / v_new_map
  // Kernels with two computing warpgroups only (the pipelined order: routes 10, 11 and auto at
  // 128 on long prompts; the plain order: auto at 256, route 14): the warpgroups take turns
  // issuing each step's MMAs (named barriers kTurnBarrier + warpgroup), so that one's group
  // runs whole on the tensor cores while the other is in its softmax.
  int32_t pingpong;
  // L2 eviction priorities of the warp-specialised kernels' copies (auto at padded head size
  // 128, routes 12 and 13): last for the K/V tiles that every query block of a head reads
  // again, first for the streams read or written once (Q, O, the appended cache rows); 0:
  // normal for all.
  int32_t l2_hints;
  // (row, kv head) pairs whose query blocks are walked together (block_coords); all of them
  // unless auto (at padded head size 128, all K/V from 64 MB in pairs of 4 MB or more) or
  // routes 12 and 13 set fewer, so that the K/V of a group fit in L2.
  int32_t pairs_per_group;
  // Auto where it groups, and route 13 (x_group_rounds): each group of pairs takes whole rounds
  // of the persistent grid (group_slots work slots, a multiple of gridDim.x, the last round
  // part empty), so that no round deals one group's lightest blocks next to the next group's
  // heaviest; num_slots = group_slots * groups. 0: no padding (the slots are the work items).
  int32_t align_groups;
  int32_t group_slots;
  int32_t num_slots;
  // The divisors of the walk and of a block's rows (set by launch_config): the group size, the
  // KV heads, a group's query blocks (pairs_per_group * num_mblocks), its pairs (all groups but
  // a partial last one, and that one) and group_slots (1 when 0).
  FastDivisor div_g, div_kv_heads, div_group_work, div_in_group, div_last_in_group, div_group_slots;
  // O from registers (C::kEarlyQRelease) in 16-byte stores: the lanes of a quad swap words so
  // that each stores a whole 8-column chunk (auto); 0: one 4-byte store a word, each quad
  // writing half a 32-byte sector (the fixed routes, and route 16 as auto's A/B baseline).
  int32_t wide_o;
  // One Q buffer (C::kEarlyQRelease) only: the loader stages a block's Q before its first K/V
  // tile (route 17, x_q_first) instead of after it (auto), so that Q is not queued behind that
  // tile's copies; either way it first waits for the previous block's last S.
  int32_t q_first;
  // Persistent warp-specialised kernels (auto): the loader takes each next query block from
  // p.work_counter (prep zeroes it) and hands it to the computing warpgroups (Pipeline's walk
  // slots), so that CTAs that run faster take more blocks; 0: the static walk (every CTA its
  // fixed rounds; the fixed routes, and route 18 as auto's A/B baseline).
  int32_t dynamic_walk;
  // Diagnostics (set_prefill_timeline; nullptr: off): the warp-specialised kernels' computing
  // warpgroups stamp each query block into records of kTimelineFields 64-bit words, record
  // work * 4 + warpgroup, up to timeline_records of them (block_timeline.py reads them).
  unsigned long long* timeline;
  int32_t timeline_records;
  // The caches as TMA maps (encode_cache_map): [B][Hkv][C][D] in 64-column x SK-key boxes.
  CUtensorMap k_map;
  CUtensorMap v_map;
  // The new keys and values (encode_new_rows_map): the same boxes and coordinates.
  CUtensorMap k_new_map;
  CUtensorMap v_new_map;
  // q as a TMA map (encode_query_map): boxes of 64 packed rows (G heads x 64 / G tokens).
  CUtensorMap q_map;
};

// ---------------------------------------------------------------------------------------------
// Device helpers
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// 16-byte global -> shared copy; bytes = 0 reads nothing and writes 16 zero bytes.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

using detail::fast_exp2;

__device__ __forceinline__ float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// The storage type's mma / packing / conversions, from common.cuh (shared with the decode
// kernels), plus the bit pattern of two quiet NaNs for filling outputs.
template <typename T>
struct Half {
  static constexpr uint32_t kNaN2 = std::is_same<T, __half>::value ? 0x7E007E00u : 0x7FC07FC0u;
  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    detail::mma16816<T>(c, a, b0, b1);
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) { return detail::pack2<T>(lo, hi); }
  static __device__ __forceinline__ float to_float(T x) { return detail::to_f(x); }
  static __device__ __forceinline__ T from_float(float x) { return detail::from_f<T>(x); }
};

// Byte offset of 16-byte chunk `chunk` of row `row` in a swizzled tile of D-element rows.
template <int D>
__device__ __forceinline__ uint32_t swz(int row, int chunk) {
  return static_cast<uint32_t>(row * (D * 2) + ((chunk ^ (row & 7)) << 4));
}

// Writes `word2` (two halves) into every element of this warp's rows of the output.
template <typename T, class C>
__device__ __forceinline__ void fill_warp_rows(const Params& p, int b, int kvh, int wrow0, int nrows,
                                               uint32_t word2, int lane) {
  const int G = p.group_size;
  T* const out = static_cast<T*>(p.output);
  const uint4 v = make_uint4(word2, word2, word2, word2);
#pragma unroll 4
  for (int i = lane; i < C::kWarpRows * C::kChunks; i += 32) {
    const int row = i / C::kChunks, c = i % C::kChunks;
    const int r = wrow0 + row;
    if (r >= nrows || c * 8 >= p.head_dim) continue;
    const int s = r / G, h = kvh * G + (r - s * G);
    T* dst = out + static_cast<int64_t>(b) * p.output_strides.batch +
             static_cast<int64_t>(s) * p.output_strides.token +
             static_cast<int64_t>(h) * p.output_strides.head + c * 8;
    *reinterpret_cast<uint4*>(dst) = v;
  }
}

// ---------------------------------------------------------------------------------------------
// The kernel
// ---------------------------------------------------------------------------------------------

// Runs body(mask, cap) with both flags as compile-time constants (std::true_type or
// std::false_type), so that every tile loop reaches its four tile variants through one call.
template <class Body>
__device__ __forceinline__ void with_mask_and_cap(bool mask, bool cap, Body&& body) {
  if (mask) {
    if (cap) body(std::true_type{}, std::true_type{});
    else body(std::true_type{}, std::false_type{});
  } else {
    if (cap) body(std::false_type{}, std::true_type{});
    else body(std::false_type{}, std::false_type{});
  }
}

// Query block `work` -> (query block, kv head, batch row), heaviest query blocks first.
struct BlockCoords {
  int mblk, kvh, b;
};
// The (row, kv head) pairs go in groups of Args::pairs_per_group: every query block of a group
// comes before the next group, and within a group one query block of each pair at a time.
__device__ __forceinline__ BlockCoords block_coords(const Args& a, int work) {
  const int pairs = a.p.kv_heads * a.p.batch;
  const int group_first = a.div_group_work.divide(work) * a.pairs_per_group;
  const bool partial = pairs - group_first < a.pairs_per_group;  // the last group, short
  const FastDivisor in_group = partial ? a.div_last_in_group : a.div_in_group;
  const int rest = work - group_first * a.num_mblocks;
  const int wave = in_group.divide(rest);
  const int pair = group_first + in_group.remainder(rest, wave);
  const int b = a.div_kv_heads.divide(pair);
  return {a.num_mblocks - 1 - wave, a.div_kv_heads.remainder(pair, b), b};
}

// The warp-specialised CTA's mbarriers: K/V stages (full: landed; empty: every computing thread
// is done with it) and Q tiles (the same, per Q buffer), and each role's count of the stages
// and Q tiles it has passed (a persistent CTA carries them from block to block).
struct Pipeline {
  uint64_t* s_full;  // with split K/V (Config::kSplitKV): K's
  uint64_t* s_empty;
  uint64_t* q_full;
  uint64_t* q_empty;
  uint64_t* v_full;  // split K/V only: V's
  uint64_t* v_empty;
  int ring = 0;    // K/V tiles so far
  int q_ring = 0;  // Q tiles so far
  // The walk's hand-off (walk_blocks): two slots of (work item, its seqlens_k), each with a full
  // barrier (the loader's picking lane arrives) and an empty one (every thread of the CTA
  // arrives once it has read the slot).
  uint64_t* walk_full = nullptr;
  uint64_t* walk_empty = nullptr;
  int2* walk_slot = nullptr;
};

// Per-warp register state and the three steps of one K/V tile: S = Q K^T, softmax -> P,
// O += P V. Rows: thread holds rows i = 2*mt + half, virtual row wrow0 + 16*mt + lane/4 + 8*half.
template <typename T, class C>
struct WarpTile {
  using H = Half<T>;
  static constexpr int D = C::D, BN = C::BN, MT = C::MT, RB = C::kRowBytes;
  static constexpr int NT = BN / 8;  // 8-key n-tiles per K/V tile
  static constexpr int DT = D / 8;   // 8-wide d-tiles of the output
  static constexpr int KS = D / 16;  // k-steps of Q K^T
  static constexpr int NR = 2 * MT;  // rows per thread
  static constexpr unsigned kFull = 0xffffffffu;

  uint32_t qf[C::kQRegs ? MT : 1][C::kQRegs ? KS : 1][4];
  float o[MT][DT][4];
  float m_ref[NR], l_sum[NR];
  int row_lo[NR], row_hi[NR];  // visible keys of each row: [row_lo, row_hi)
  uint32_t a_lane, a_x, k_lane, k_x, v_lane;
  int key_col;
  float k2, tanh_k;

  __device__ __forceinline__ void compute_s(float (&sc)[MT][NT][4], uint32_t k_st) const {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[mt][n][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      uint32_t af[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (C::kQRegs) {
#pragma unroll
          for (int e = 0; e < 4; ++e) af[mt][e] = qf[mt][ks][e];
        } else {
          ldsm_x4(a_lane + mt * 16 * RB + (((2u * ks) ^ a_x) << 4), af[mt]);
        }
      }
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t bf[4];
        ldsm_x4(k_st + np * 16 * RB + (((2u * ks) ^ k_x) << 4), bf);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          H::mma(sc[mt][2 * np], af[mt], bf[0], bf[1]);
          H::mma(sc[mt][2 * np + 1], af[mt], bf[2], bf[3]);
        }
      }
    }
  }

  // Softcap and mask, in place: the scores as softmax() and softmax_ahead() take them. A pass
  // compiled in (kMask, kCap) may still be skipped at run time (mask, cap: C::kOneStep).
  template <bool kMask, bool kCap>
  __device__ __forceinline__ void shape_scores(float (&sc)[MT][NT][4], int n0, bool mask = true,
                                               bool cap = true) const {
    if (kCap && cap) {
      each_score(sc, [&](float& score, int, int, int) {
        // log2(e) * tanh(y), y = score * |scale| / softcap (k2 is the softcap itself, so that
        // softcap * log2(e) cannot overflow). For small |y|, 1 - 2/(e^2y + 1) cancels to
        // nothing (a large softcap made every logit ~0), so there an odd Taylor polynomial is
        // used (relative error < 1e-9 below 1/16).
        const float u = score * tanh_k;  // 2 y log2(e)
        const float y = u * (0.5f / kLog2e);
        const float y2 = y * y;
        const float series = y * fmaf(y2, fmaf(y2, 2.f / 15.f, -1.f / 3.f), 1.f);
        const float closed = 1.f - 2.f * fast_rcp(fast_exp2(u) + 1.f);
        score = kLog2e * (fabsf(y) < 0.0625f ? series : closed);
      });
    }
    if (kMask && mask) {
      each_score(sc, [&](float& score, int mt, int n, int e) {
        const int j = n0 + n * 8 + key_col + (e & 1);
        const int i = mt * 2 + (e >> 1);
        if (j < row_lo[i] || j >= row_hi[i]) score = -INFINITY;
      });
    }
  }

  // body(score, mt, n, e) for each score this thread holds, unrolled.
  template <class Body>
  static __device__ __forceinline__ void each_score(float (&sc)[MT][NT][4], Body&& body) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) body(sc[mt][n][e], mt, n, e);
  }

  // Online softmax of one tile of scores (softcap and mask first): P (packed halves) out, and
  // the per-row factor by which O must be rescaled (returns whether any row of the warp moved).
  template <bool kMask, bool kCap>
  __device__ __forceinline__ bool softmax(float (&sc)[MT][NT][4], uint32_t (&pa)[MT][BN / 16][4],
                                          int n0, float (&alpha)[NR], bool mask = true, bool cap = true) {
    shape_scores<kMask, kCap>(sc, n0, mask, cap);
    float mx[NR], nb[NR], rs[NR];
    row_max(sc, mx);
    const bool move = bases_must_move(mx);
    move_bases(mx, move, alpha, nb);
    // P in place of the scores, then packed (exponentiate() keeps the scores for
    // softmax_ahead(); here that cost the mma.sync kernels 4-8 more bytes of spill).
#pragma unroll
    for (int i = 0; i < NR; ++i) rs[i] = 0.f;
    each_score(sc, [&](float& score, int mt, int, int e) {
      const int i = mt * 2 + (e >> 1);
      score = fast_exp2(fmaf(score, k2, nb[i]));
      rs[i] += score;
    });
#pragma unroll
    for (int i = 0; i < NR; ++i) l_sum[i] = fmaf(l_sum[i], alpha[i], rs[i]);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < BN / 16; ++j) {
        pa[mt][j][0] = H::pack(sc[mt][2 * j][0], sc[mt][2 * j][1]);
        pa[mt][j][1] = H::pack(sc[mt][2 * j][2], sc[mt][2 * j][3]);
        pa[mt][j][2] = H::pack(sc[mt][2 * j + 1][0], sc[mt][2 * j + 1][1]);
        pa[mt][j][3] = H::pack(sc[mt][2 * j + 1][2], sc[mt][2 * j + 1][3]);
      }
    return move;
  }

  // Each row's max over this tile: four interleaved partials a row in the thread (the first
  // four n-tiles start them), then across the row's four lanes. Four short chains, not one of
  // NT dependent FMNMX a row (on the critical path of softmax()); a full pairwise tree kept 32
  // more values live and spilled at fp16.
  __device__ __forceinline__ void row_max(const float (&sc)[MT][NT][4], float (&mx)[NR]) const {
    static_assert(NT >= 4, "four partials a row");
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float part[4];
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const float pair = fmaxf(sc[mt][n][2 * h], sc[mt][n][2 * h + 1]);
          part[n & 3] = n < 4 ? pair : fmaxf(part[n & 3], pair);
        }
        mx[2 * mt + h] = fmaxf(fmaxf(part[0], part[1]), fmaxf(part[2], part[3]));
      }
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(kFull, mx[i], 1));
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(kFull, mx[i], 2));
    }
  }

  // P = exp2(s k2 + nb) of each row, packed into pa, and each row's sum of P. The scores stay
  // as they are: softmax_ahead() may need them again.
  __device__ __forceinline__ void exponentiate(const float (&sc)[MT][NT][4], const float (&nb)[NR],
                                               uint32_t (&pa)[MT][BN / 16][4], float (&rs)[NR]) const {
#pragma unroll
    for (int i = 0; i < NR; ++i) rs[i] = 0.f;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < BN / 16; ++j) {
        float pe[2][4];
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int i = mt * 2 + (e >> 1);
            pe[u][e] = fast_exp2(fmaf(sc[mt][2 * j + u][e], k2, nb[i]));
            rs[i] += pe[u][e];  // one chain: the MUFU issue rate, not the add, paces it
          }
        pa[mt][j][0] = H::pack(pe[0][0], pe[0][1]);
        pa[mt][j][1] = H::pack(pe[0][2], pe[0][3]);
        pa[mt][j][2] = H::pack(pe[1][0], pe[1][1]);
        pa[mt][j][3] = H::pack(pe[1][2], pe[1][3]);
      }
  }

  // Whether any row of the warp must move its base: its max grew by more than
  // kRescaleThreshold (false for a row whose max and base are both -inf: NaN compares false).
  __device__ __forceinline__ bool bases_must_move(const float (&mx)[NR]) const {
    bool grow = false;
#pragma unroll
    for (int i = 0; i < NR; ++i) grow |= (mx[i] - m_ref[i]) * k2 > kRescaleThreshold;
    return __any_sync(kFull, grow);
  }

  // The rows' bases, moved to their maxima when `move` (every row of the warp at once): the
  // factor alpha by which O and l_sum scale, and the exponent offset nb of P = exp2(s k2 + nb).
  __device__ __forceinline__ void move_bases(const float (&mx)[NR], bool move, float (&alpha)[NR],
                                             float (&nb)[NR]) {
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      const float mn = move ? fmaxf(m_ref[i], mx[i]) : m_ref[i];
      alpha[i] = mn == -INFINITY ? 1.f : fast_exp2((m_ref[i] - mn) * k2);
      m_ref[i] = mn;
      nb[i] = mn == -INFINITY ? 0.f : -mn * k2;
    }
  }

  // softmax() for the steady state, where a row's base rarely moves: P is first taken against
  // the current bases, so that the exponentials (paced by the MUFU issue rate) run alongside the
  // row maxima, the shuffles and the vote instead of after them; only when the vote says a base
  // moves are they taken again. Both ways give softmax()'s bits: unmoved bases make its alpha 1
  // and its l_sum update an exact add. (An unmoved base of -inf gives nb 0, as in softmax().)
  template <bool kMask, bool kCap>
  __device__ __forceinline__ bool softmax_ahead(float (&sc)[MT][NT][4], uint32_t (&pa)[MT][BN / 16][4],
                                                int n0, float (&alpha)[NR], bool mask = true, bool cap = true) {
    shape_scores<kMask, kCap>(sc, n0, mask, cap);
    float nb[NR], rs[NR], mx[NR];
#pragma unroll
    for (int i = 0; i < NR; ++i) nb[i] = m_ref[i] == -INFINITY ? 0.f : -m_ref[i] * k2;
    exponentiate(sc, nb, pa, rs);
    row_max(sc, mx);
    if (!bases_must_move(mx)) {
#pragma unroll
      for (int i = 0; i < NR; ++i) {
        alpha[i] = 1.f;
        l_sum[i] += rs[i];
      }
      return false;
    }
    move_bases(mx, true, alpha, nb);
    exponentiate(sc, nb, pa, rs);
#pragma unroll
    for (int i = 0; i < NR; ++i) l_sum[i] = fmaf(l_sum[i], alpha[i], rs[i]);
    return true;
  }

  __device__ __forceinline__ void rescale(const float (&alpha)[NR]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int d = 0; d < DT; ++d) {
        o[mt][d][0] *= alpha[2 * mt];
        o[mt][d][1] *= alpha[2 * mt];
        o[mt][d][2] *= alpha[2 * mt + 1];
        o[mt][d][3] *= alpha[2 * mt + 1];
      }
  }

  __device__ __forceinline__ void pv(const uint32_t (&pa)[MT][BN / 16][4], uint32_t v_st) {
#pragma unroll
    for (int j = 0; j < BN / 16; ++j)
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t bf[4];
        ldsm_x4_trans(v_st + j * 16 * RB + (((2u * dp) ^ a_x) << 4), bf);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          H::mma(o[mt][2 * dp], pa[mt][j], bf[0], bf[1]);
          H::mma(o[mt][2 * dp + 1], pa[mt][j], bf[2], bf[3]);
        }
      }
  }

  // ---- the wgmma engine (C::kWgmma): this warp's warpgroup computes its 64 rows at once;
  // q_tile / k_tile / v_tile are shared-window addresses of blocked tiles (wgmma.cuh).
  __device__ __forceinline__ void compute_s_wg(float (&sc)[MT][NT][4], uint32_t q_tile, uint32_t k_tile) const {
    float (&acc)[BN / 2] = reinterpret_cast<float (&)[BN / 2]>(sc);
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
    issue_s_wg(sc, q_tile, k_tile);
    wg::wait_all();
  }
  // Issues and commits S = Q K^T into a zeroed sc (no wait).
  __device__ __forceinline__ void issue_s_wg(float (&sc)[MT][NT][4], uint32_t q_tile, uint32_t k_tile) const {
    static_assert(MT * NT * 4 == BN / 2, "S is one m64nBN accumulator");
    float (&acc)[BN / 2] = reinterpret_cast<float (&)[BN / 2]>(sc);
    wg::fence_operands();
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
      wg::ss_m64<T, BN>(acc, wg::k_major(q_tile, 64, ks), wg::k_major(k_tile, C::kStageKeys, ks), ks > 0);
    wg::commit();
  }

  // Issues O += P V (no fence, commit or wait). D = 256 runs as two n128 halves: columns 128h..
  // of O are accumulator floats 64h.. (the wgmma accumulator holds 8-column groups in order)
  // and V's 64-column blocks 2h, 2h + 1.
  __device__ __forceinline__ void issue_pv_wg(const uint32_t (&pa)[MT][BN / 16][4], uint32_t v_tile) {
    constexpr int N = D < 128 ? D : 128;
    float (&acc)[D / N][N / 2] = reinterpret_cast<float (&)[D / N][N / 2]>(o);
#pragma unroll
    for (int h = 0; h < D / N; ++h)
#pragma unroll
      for (int j = 0; j < BN / 16; ++j)
        wg::rs_m64<T, N>(acc[h], pa[0][j], wg::mn_major(v_tile + h * N * C::kStageKeys * 2, C::kStageKeys, j), 1);
  }
  __device__ __forceinline__ void pv_wg(const uint32_t (&pa)[MT][BN / 16][4], uint32_t v_tile) {
    wg::fence_operands();
    issue_pv_wg(pa, v_tile);
    wg::commit();
    wg::wait_all();
  }

  template <bool kMask, bool kCap>
  __device__ __forceinline__ void tile_wg(uint32_t q_tile, uint32_t k_tile, uint32_t v_tile, int n0) {
    tile_wg<kMask, kCap>(q_tile, k_tile, v_tile, n0, [] {}, [] {});
  }
  // The same with hooks: after_s() once S is complete (K is no longer read), before_pv() before
  // P V is issued (split K/V stages: waits for V).
  template <bool kMask, bool kCap, class AfterS, class BeforePV>
  __device__ __forceinline__ void tile_wg(uint32_t q_tile, uint32_t k_tile, uint32_t v_tile, int n0,
                                          AfterS&& after_s, BeforePV&& before_pv) {
    tile_wg<kMask, kCap>(q_tile, k_tile, v_tile, n0, after_s, before_pv, [] {}, [] {});
  }
  // The same with turn() and pass() bracketing the issue of S and of P V (Args::pingpong in the
  // plain order): the two computing warpgroups issue S, S, P V, P V, ..., so that each one's
  // softmax runs while the other's MMAs hold the tensor cores.
  // mask and cap skip a compiled-in pass at run time (C::kOneStep's single instantiation).
  template <bool kMask, bool kCap, class AfterS, class BeforePV, class Turn, class Pass>
  __device__ __forceinline__ void tile_wg(uint32_t q_tile, uint32_t k_tile, uint32_t v_tile, int n0,
                                          AfterS&& after_s, BeforePV&& before_pv, Turn&& turn, Pass&& pass,
                                          bool mask = true, bool cap = true) {
    float sc[MT][NT][4];
    uint32_t pa[MT][BN / 16][4];
    float alpha[NR];
    {
      float (&acc)[BN / 2] = reinterpret_cast<float (&)[BN / 2]>(sc);
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
      turn();
      issue_s_wg(sc, q_tile, k_tile);
      pass();
      wg::wait_all();
    }
    after_s();
    bool rescale_o;
    if constexpr (C::kExpAhead && !kMask) rescale_o = softmax_ahead<kMask, kCap>(sc, pa, n0, alpha);
    else if constexpr (C::kExpAhead && C::kOneStep)  // the unmasked tiles ahead, as above
      rescale_o = mask ? softmax<kMask, kCap>(sc, pa, n0, alpha, true, cap)
                       : softmax_ahead<kMask, kCap>(sc, pa, n0, alpha, false, cap);
    else rescale_o = softmax<kMask, kCap>(sc, pa, n0, alpha, mask, cap);
    if (rescale_o) rescale(alpha);
    before_pv();
    turn();
    wg::fence_operands();
    issue_pv_wg(pa, v_tile);
    wg::commit();
    pass();
    wg::wait_all();
  }

  // The pipelined wgmma order (C::kPipe with split K/V stages): S of the next tile and P V of
  // this one are issued back to back as two groups, so that the next softmax runs while P V is
  // on the tensor cores; only the rescale of O waits for P V. P of the next tile goes to other
  // registers (pn), since those of this tile (pa) are P V's A operand until it completes; the
  // caller swaps the two arrays from tile to tile. (With one array and a copy after the wait,
  // ptxas merged the copy into the packing and so sank the exponentials below the P V wait.)
  // after_s() runs once S of the next tile is complete (its K is no longer read).
  // turn() and pass() bracket the issue of the two groups (Args::pingpong).
  // mask and cap skip a compiled-in pass at run time (C::kOneStep's single instantiation).
  template <bool kMask, bool kCap, class AfterS, class Turn, class Pass>
  __device__ __forceinline__ void tile_pipe_wg(uint32_t (&pa)[MT][BN / 16][4], uint32_t (&pn)[MT][BN / 16][4],
                                               uint32_t q_tile, uint32_t k_next, uint32_t v_cur, int n0_next,
                                               AfterS&& after_s, Turn&& turn, Pass&& pass, bool mask = true,
                                               bool cap = true) {
    static_assert(MT * NT * 4 == BN / 2, "S is one m64nBN accumulator");
    float sc[MT][NT][4];
    float (&acc)[BN / 2] = reinterpret_cast<float (&)[BN / 2]>(sc);
    float (&oacc)[D / 2] = reinterpret_cast<float (&)[D / 2]>(o);
    uint32_t (&pflat)[BN / 4] = reinterpret_cast<uint32_t (&)[BN / 4]>(pa);
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
    // Every register write to the operands happens before the fence (else ptxas serialises).
    wg::pin_registers(acc);
    wg::pin_registers(oacc);
    wg::pin_registers(pflat);
    turn();
    wg::fence_operands();
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
      wg::ss_m64<T, BN>(acc, wg::k_major(q_tile, 64, ks), wg::k_major(k_next, C::kStageKeys, ks), ks > 0);
    wg::commit();
    wg::fence_operands();  // P V is a group of its own, so that S can be waited for alone
    issue_pv_wg(pa, v_cur);
    wg::commit();
    pass();
    wg::wait_pending<1>();  // S is ready; P V may still run
    wg::pin_registers(acc);
    after_s();
    float alpha[NR];
    const bool rescale_o = softmax_ahead<kMask, kCap>(sc, pn, n0_next, alpha, mask, cap);
    // The softmax must stay above the wait for P V or nothing overlaps: ptxas does not move
    // arithmetic across the warpgroup barrier (register pins alone did not hold it).
    wg::pin_registers(reinterpret_cast<uint32_t (&)[BN / 4]>(pn));
    wg::pin_registers(alpha);
    wg::pin_registers(m_ref);
    wg::pin_registers(l_sum);
    wg::warpgroup_barrier();
    wg::wait_pending<0>();  // P V done: O and pa are free
    wg::pin_registers(pflat);  // pa stays live until here (P V reads it asynchronously)
    wg::pin_registers(oacc);
    if (rescale_o) rescale(alpha);
  }

  // The pipelined order's first step: S and softmax of the first tile (P into pa).
  template <bool kMask, bool kCap, class AfterS>
  __device__ __forceinline__ void first_pipe_wg(uint32_t (&pa)[MT][BN / 16][4], uint32_t q_tile, uint32_t k_tile,
                                                int n0, AfterS&& after_s, bool mask = true, bool cap = true) {
    float sc[MT][NT][4];
    float alpha[NR];
    compute_s_wg(sc, q_tile, k_tile);
    after_s();
    softmax<kMask, kCap>(sc, pa, n0, alpha, mask, cap);  // O is still zero: nothing to rescale
  }

  // One whole tile, plain order: S, softmax, rescale, P V.
  template <bool kMask, bool kCap>
  __device__ __forceinline__ void tile_plain(uint32_t k_st, uint32_t v_st, int n0) {
    float sc[MT][NT][4];
    uint32_t pa[MT][BN / 16][4];
    float alpha[NR];
    compute_s(sc, k_st);
    if (softmax<kMask, kCap>(sc, pa, n0, alpha)) rescale(alpha);
    pv(pa, v_st);
  }

  // Pipelined order: S of the next tile is issued before P V of the current one, and the next
  // softmax is independent of that P V, so its FP32/MUFU work interleaves with the MMAs.
  template <bool kMask, bool kCap>
  __device__ __forceinline__ void tile_pipe(uint32_t (&pa)[MT][BN / 16][4], uint32_t k_next, uint32_t v_cur,
                                            int n0_next) {
    float sc[MT][NT][4];
    float alpha[NR];
    compute_s(sc, k_next);
    pv(pa, v_cur);
    if (softmax<kMask, kCap>(sc, pa, n0_next, alpha)) rescale(alpha);
  }

  template <bool kCap>
  __device__ __forceinline__ void first_pipe(uint32_t (&pa)[MT][BN / 16][4], uint32_t k_st, int n0,
                                             bool mask) {
    float sc[MT][NT][4];
    float alpha[NR];
    compute_s(sc, k_st);
    if (mask)
      softmax<true, kCap>(sc, pa, n0, alpha);
    else
      softmax<false, kCap>(sc, pa, n0, alpha);
  }
};

}  // namespace pmma
}  // namespace cuda
}  // namespace gqa
