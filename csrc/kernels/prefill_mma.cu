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
          bool WGMMA_ = false, int WS_ = 0, bool EXP_AHEAD_ = false>
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
  // 80-key tiles (route 9, D = 256): S is one m64n80 wgmma, P V five k16 steps; a blocked tile
  // of 80 rows is 10 whole 8-row atoms a column block (10 KB, so every atom stays 1024-byte
  // aligned), and the TMA box of 80 keys is within its 256-row limit. Nothing else in the
  // kernel takes BN for a power of two: tile indices are divisions by kStageKeys, and the
  // masks compare key indices (a 128-row block's edges need not fall on tile edges).
  static_assert(!WGMMA_ || (MT_ == 1 && (BN_ == 64 || BN_ == 80 || BN_ == 128) && SUB_ == 1 && !QREGS_ &&
                            WARPS_ % 4 == 0 && (D_ == 64 || D_ == 128 || D_ == 256)),
                "wgmma: warpgroups of 64 rows, 64-, 80- or 128-key tiles, D = 64, 128 or 256");
  static_assert(!WGMMA_ || kSmemBytes <= 227 * 1024, "the shared memory of one CTA on sm90");
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
  // The pipelined kernel with two computing warpgroups only (routes 10, 11): the warpgroups take
  // turns issuing each step's MMAs (named barriers kTurnBarrier + warpgroup), so that one's
  // group runs whole on the tensor cores while the other is in its softmax.
  int32_t pingpong;
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

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

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
__device__ __forceinline__ BlockCoords block_coords(const Args& a, int work) {
  const int per_block = a.p.kv_heads * a.p.batch;
  const int wave = work / per_block;
  const int rem = work - wave * per_block;
  return {a.num_mblocks - 1 - wave, rem % a.p.kv_heads, rem / a.p.kv_heads};
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

  // Softcap and mask, in place: the scores as softmax() and softmax_ahead() take them.
  template <bool kMask, bool kCap>
  __device__ __forceinline__ void shape_scores(float (&sc)[MT][NT][4], int n0) const {
    if constexpr (kCap) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            // log2(e) * tanh(y), y = score * |scale| / softcap (k2 is the softcap itself, so
            // that softcap * log2(e) cannot overflow). For small |y|, 1 - 2/(e^2y + 1) cancels
            // to nothing (a large softcap made every logit ~0), so there an odd Taylor
            // polynomial is used (relative error < 1e-9 below 1/16).
            const float u = sc[mt][n][e] * tanh_k;  // 2 y log2(e)
            const float y = u * (0.5f / kLog2e);
            const float y2 = y * y;
            const float series = y * fmaf(y2, fmaf(y2, 2.f / 15.f, -1.f / 3.f), 1.f);
            const float closed = 1.f - 2.f * fast_rcp(fast_exp2(u) + 1.f);
            sc[mt][n][e] = kLog2e * (fabsf(y) < 0.0625f ? series : closed);
          }
    }
    if constexpr (kMask) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int j = n0 + n * 8 + key_col + (e & 1);
            const int i = mt * 2 + (e >> 1);
            if (j < row_lo[i] || j >= row_hi[i]) sc[mt][n][e] = -INFINITY;
          }
    }
  }

  // Online softmax of one tile of scores (softcap and mask first): P (packed halves) out, and
  // the per-row factor by which O must be rescaled (returns whether any row of the warp moved).
  template <bool kMask, bool kCap>
  __device__ __forceinline__ bool softmax(float (&sc)[MT][NT][4], uint32_t (&pa)[MT][BN / 16][4],
                                          int n0, float (&alpha)[NR]) {
    shape_scores<kMask, kCap>(sc, n0);
    float mx[NR], nb[NR], rs[NR];
    row_max(sc, mx);
    const bool move = bases_must_move(mx);
    move_bases(mx, move, alpha, nb);
    // P in place of the scores, then packed (exponentiate() keeps the scores for
    // softmax_ahead(); here that cost the mma.sync kernels 4-8 more bytes of spill).
#pragma unroll
    for (int i = 0; i < NR; ++i) rs[i] = 0.f;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = mt * 2 + (e >> 1);
          sc[mt][n][e] = fast_exp2(fmaf(sc[mt][n][e], k2, nb[i]));
          rs[i] += sc[mt][n][e];
        }
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
                                                int n0, float (&alpha)[NR]) {
    shape_scores<kMask, kCap>(sc, n0);
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
    static_assert(MT * NT * 4 == BN / 2, "S is one m64nBN accumulator");
    float (&acc)[BN / 2] = reinterpret_cast<float (&)[BN / 2]>(sc);
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
    wg::fence_operands();
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
      wg::ss_m64<T, BN>(acc, wg::k_major(q_tile, 64, ks), wg::k_major(k_tile, C::kStageKeys, ks), ks > 0);
    wg::commit();
    wg::wait_all();
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
    float sc[MT][NT][4];
    uint32_t pa[MT][BN / 16][4];
    float alpha[NR];
    compute_s_wg(sc, q_tile, k_tile);
    after_s();
    bool rescale_o;
    if constexpr (C::kExpAhead && !kMask) rescale_o = softmax_ahead<kMask, kCap>(sc, pa, n0, alpha);
    else rescale_o = softmax<kMask, kCap>(sc, pa, n0, alpha);
    if (rescale_o) rescale(alpha);
    before_pv();
    pv_wg(pa, v_tile);
  }

  // The pipelined wgmma order (C::kPipe with split K/V stages): S of the next tile and P V of
  // this one are issued back to back as two groups, so that the next softmax runs while P V is
  // on the tensor cores; only the rescale of O waits for P V. P of the next tile goes to other
  // registers (pn), since those of this tile (pa) are P V's A operand until it completes; the
  // caller swaps the two arrays from tile to tile. (With one array and a copy after the wait,
  // ptxas merged the copy into the packing and so sank the exponentials below the P V wait.)
  // after_s() runs once S of the next tile is complete (its K is no longer read).
  // turn() and pass() bracket the issue of the two groups (Args::pingpong).
  template <bool kMask, bool kCap, class AfterS, class Turn, class Pass>
  __device__ __forceinline__ void tile_pipe_wg(uint32_t (&pa)[MT][BN / 16][4], uint32_t (&pn)[MT][BN / 16][4],
                                               uint32_t q_tile, uint32_t k_next, uint32_t v_cur, int n0_next,
                                               AfterS&& after_s, Turn&& turn, Pass&& pass) {
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
    const bool rescale_o = softmax_ahead<kMask, kCap>(sc, pn, n0_next, alpha);
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
                                                int n0, AfterS&& after_s) {
    float sc[MT][NT][4];
    float alpha[NR];
    compute_s_wg(sc, q_tile, k_tile);
    after_s();
    softmax<kMask, kCap>(sc, pa, n0, alpha);  // O is still zero: nothing to rescale
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

// Which threads run prefill_block: all of them (no warp specialisation), or the loader or the
// computing warpgroups of a warp-specialised CTA (each instantiation holds only its own code,
// so that each side is compiled for its own register budget).
enum class Role { kAll, kLoader, kCompute };

// One query block (work item `work`: heaviest first) of a CTA. `pipe` holds the warp-specialised
// CTA's mbarriers and its counts of the K/V tiles and Q tiles passed so far (a persistent CTA:
// the loader and the computing warpgroups walk the same items and skip the same ones, so their
// counts agree); `error` is the sticky error word as read at kernel start; `seqlen` is
// seqlens_k of the block's batch row (the caller loads it a block ahead).
template <typename T, class C, bool kSplit, Role kRole>
__device__ __forceinline__ void prefill_block(const Args& a, unsigned char* const smem, Pipeline& pipe,
                                              const uint32_t error, const int work, const int seqlen) {
  using H = Half<T>;
  using WT = WarpTile<T, C>;
  constexpr int D = C::D, BN = C::BN, MT = C::MT, RB = C::kRowBytes, CH = C::kChunks;
  constexpr int NR = WT::NR, DT = WT::DT, KS = WT::KS;
  constexpr unsigned kFull = 0xffffffffu;

  const Params& p = a.p;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  const BlockCoords bc = block_coords(a, work);
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
  int own_lo = 0, own_hi = 0;
  if (row_new) {
    const int64_t per = static_cast<int64_t>(C::kStageKeys) * G;  // packed rows a tile's tokens hold
    own_lo = static_cast<int>((m0 + per - 1) / per);
    own_hi = static_cast<int>((static_cast<int64_t>(m0) + C::BM + per - 1) / per);
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
  const int pos_min = geo.query_start + m0 / G;
  const int pos_max = geo.query_start + r_last / G;
  const int key_lo = W > 0 ? max(0, pos_min - W + 1) : 0;
  const int key_hi = min(total, pos_max + 1);
  constexpr int SK = C::kStageKeys;
  int t_first = key_lo / SK;
  int t_end = (key_hi + SK - 1) / SK;  // t_end - t_first >= 1: every valid row sees its own position
  // This row's partial of split `blockIdx.y` (split-K): index into [B, S, Hq, splits].
  auto partial_row = [&](int r) -> int64_t {
    const int s = r / G, h = kvh * G + (r - s * G);
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
        const int tok = r / G, h = kvh * G + (r - tok * G);
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
              wg::tma_load_4d(dst + wgt * 64 * RB + cb * 64 * 128, &a.q_map, cb * 64, kvh * G, (m0 + wgt * 64) / G,
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
    const int q_at = C::kQBuffers > 1 ? 0 : min(C::kEarlyQRelease ? 1 : C::kStages, n_tiles);
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
        const int pos = geo.query_start + r / G;
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
          if (k) detail::tma_store_4d(&a.k_map, k_tile(it) + off, cb * 64, tile * C::kStageKeys, kvh, b);
          if (v) detail::tma_store_4d(&a.v_map, v_tile(it) + off, cb * 64, tile * C::kStageKeys, kvh, b);
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
          with_mask_and_cap(needs_mask(n0), cap, [&](auto mask, auto softcap) {
            w.template first_pipe_wg<decltype(mask)::value, decltype(softcap)::value>(p_even, q_tile, k_tile(0), n0,
                                                                                      after_s);
          });
        }
        // P V of tile it (P in p_cur) with S and softmax of tile it + 1 (P into p_next).
        auto step = [&](int it, uint32_t (&p_cur)[MT][BN / 16][4], uint32_t (&p_next)[MT][BN / 16][4]) {
          wait_v(it);
          if (it + 1 < n_tiles) {
            wait_full(it + 1);
            const int n1 = tile_n0(it + 1);
            with_mask_and_cap(needs_mask(n1), cap, [&](auto mask, auto softcap) {
              w.template tile_pipe_wg<decltype(mask)::value, decltype(softcap)::value>(
                  p_cur, p_next, q_tile, k_tile(it + 1), v_tile(it), n1,
                  [&] {
                    release(it + 1);
                    release_q_after(it + 1);
                  },
                  [&] {
                    if (pingpong) wg::named_barrier_sync(kTurnBarrier + (warp >> 2), 256);
                  },
                  [&] {
                    if (pingpong) wg::named_barrier_arrive(kTurnBarrier + 1 - (warp >> 2), 256);
                  });
            });
          } else {
            w.pv_wg(p_cur, v_tile(it));
          }
          release_v(it);  // every wgmma that read V(it) has completed
        };
        for (int it = 0; it < n_tiles; it += 2) {
          step(it, p_even, p_odd);
          if (it + 1 < n_tiles) step(it + 1, p_odd, p_even);
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
        for (int it = 0; it < n_tiles; ++it) {
          wait_full(it);
          const int n0 = tile_n0(it);
          with_mask_and_cap(needs_mask(n0), cap, [&](auto mask, auto softcap) {
            w.template tile_wg<decltype(mask)::value, decltype(softcap)::value>(
                q_tile, k_tile(it), v_tile(it), n0, [&] { release_q_after(it); }, [] {});
          });
          release(it);
        }
      }
      pipe.ring += n_tiles;
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
        if (has_sink && r < nrows) z = p.head_sink[kvh * G + r % G] * kLog2e;
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
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int r = wrow0 + mt * 16 + (lane >> 2) + hh * 8;
          if (r >= nrows) continue;
          const int s = r / G, h = kvh * G + (r - s * G);
          uint32_t* const row_out = reinterpret_cast<uint32_t*>(out + static_cast<int64_t>(s) * p.output_strides.token +
                                                                static_cast<int64_t>(h) * p.output_strides.head) +
                                    (lane & 3);  // column d * 8 + (lane & 3) * 2 is word d * 4
          const bool valid = r < valid_rows;  // first-prompt padding rows are exactly 0
          const float fi = f[mt * 2 + hh];
          uint32_t words[DT];
#pragma unroll
          for (int d = 0; d < DT; ++d)
            words[d] = valid ? H::pack(w.o[mt][d][2 * hh] * fi, w.o[mt][d][2 * hh + 1] * fi) : 0u;
          if (all_columns) {
#pragma unroll
            for (int d = 0; d < DT; ++d) row_out[d * 4] = words[d];
          } else {
#pragma unroll
            for (int d = 0; d < DT; ++d)
              if (d * 8 + (lane & 3) * 2 < p.head_dim) row_out[d * 4] = words[d];
          }
        }
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
        const int s = r / G, h = kvh * G + (r - s * G);
        uint4 v = make_uint4(0u, 0u, 0u, 0u);  // first-prompt padding rows are exactly 0
        if (r < valid_rows) v = *reinterpret_cast<const uint4*>(q_smem + q_off(row, c));
        *reinterpret_cast<uint4*>(out + static_cast<int64_t>(s) * p.output_strides.token +
                                  static_cast<int64_t>(h) * p.output_strides.head + c * 8) = v;
      }
    }
    // This thread is done with the Q tile (its staging rows read back): the loader may refill it.
    if constexpr (C::kWarpSpecialized) wg::mbarrier_arrive(smem_addr(&pipe.q_empty[q_buffer]));
  }
}

// A warp-specialised CTA's walk over its query blocks (one role's side of it), with the next
// block's seqlens_k already in flight. A function, not a lambda in the kernel: ptxas once left
// such a lambda out of line (fp16, route 8), which serialised every wgmma across the call.
template <typename T, class C, bool kSplit, Role kRole>
__device__ __forceinline__ void walk_blocks(const Args& a, unsigned char* const smem, Pipeline& pipe,
                                            const uint32_t error) {
  const int c = static_cast<int>(blockIdx.x), g = static_cast<int>(gridDim.x);
  auto block_of_round = [&](int r) {
    if (!a.persistent) return r == 0 ? c : INT_MAX;
    return r * g + (r & 1 ? g - 1 - c : c);
  };
  int work = block_of_round(0);
  int seqlen = work < a.num_work ? a.p.seqlens_k[block_coords(a, work).b] : 0;
  for (int r = 0; work < a.num_work; ++r) {
    const int next = block_of_round(r + 1);
    const int next_seqlen = next < a.num_work ? a.p.seqlens_k[block_coords(a, next).b] : 0;
    prefill_block<T, C, kSplit, kRole>(a, smem, pipe, error, work, seqlen);
    work = next;
    seqlen = next_seqlen;
  }
}

// kSplit: the split-K form (a.splits > 1, partials for the merge), a separate instantiation so
// that the plain kernel keeps its registers. A CTA takes one query block (blockIdx.x), or with
// warp specialisation and a.persistent, one per round: round r of CTA c is block r * gridDim.x
// + c, or gridDim.x - 1 - c in odd rounds (the blocks come heaviest first, and the snake keeps
// CTA 0 from taking the heaviest block of every round), so that the loader streams the next
// block's K/V while the computing warpgroups finish the current one and no CTA pays a launch and
// its barrier set-up per block.
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
      q_empty[C::kQBuffers], v_full[C::kSplitKV ? C::kStages : 1], v_empty[C::kSplitKV ? C::kStages : 1];
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
    }
  }
  __syncthreads();
  const uint32_t error = s_error;
  Pipeline pipe{s_full, s_empty, q_full, q_empty, v_full, v_empty};
  if constexpr (C::kWarpSpecialized) {
    if (threadIdx.x >= C::kConsumerThreads) {  // the loader warpgroup
      wg::release_registers<C::kLoaderRegs>();
      walk_blocks<T, C, kSplit, Role::kLoader>(a, smem, pipe, error);
      return;
    }
    wg::claim_registers<C::kConsumerRegs>();
    if constexpr (C::kSplitKV && C::kPipe && C::kConsumerThreads == 256) {
      if (a.pingpong && threadIdx.x >= 128) wg::named_barrier_arrive(kTurnBarrier, 256);  // warpgroup 0 goes first
    }
    walk_blocks<T, C, kSplit, Role::kCompute>(a, smem, pipe, error);
    // The cache writes of owned tiles (Args::append_new) finish before the CTA leaves.
    if (a.append_new && threadIdx.x == 0) detail::bulk_wait_all();
  } else {
    const int work = static_cast<int>(blockIdx.x);
    prefill_block<T, C, kSplit, Role::kAll>(a, smem, pipe, error, work, a.p.seqlens_k[block_coords(a, work).b]);
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
// D = 64 (auto, and route 6): three computing warpgroups (192 rows a block), so that two can be
// on the tensor cores while the third is in its softmax; with two, D = 64 was bound by that
// chain (tensor pipe 34% busy). H200, B=2 L=4096: 391 against 313 TFLOP/s with two.
using Cfg64WS3 = Config<64, 12, 1, 128, 2, false, 1, false, 1, true, true>;
// D = 128 (route 5, and auto below 2048 tokens) with its exponentials ahead of the row maxima
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

std::atomic<int> g_route{0};  // set_prefill_route
std::atomic<int> g_q_loader{0};  // set_prefill_q_loader: 0 TMA where it can run, 1 cp.async always
std::atomic<int> g_append{0};  // set_prefill_append: 0 in the kernel where it can, 1 by prep always

using detail::device_attribute;
using detail::device_is_sm90;
using detail::kBuiltSm90a;

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
  a.num_work = static_cast<int32_t>(grid);
  int64_t ctas = grid;
  a.persistent = 0;
  if (persistent && C::kWarpSpecialized) {
    const int sms = device_attribute<cudaDevAttrMultiProcessorCount>();
    if (sms > 0 && ctas > sms) ctas = sms;
    a.persistent = 1;
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
// least as fast as 3 on every row measured on an H200, +4% at B=8 L=1024; at padded head size
// 64 auto takes 6's kernel), 6 as 5 with three computing warpgroups at padded head size 64 (at
// 128 the same with 64-key tiles, the most that fits 152 registers, measured within 2% of 5:
// removed), 7 and 8 as 5 and 6 with split K/V stage barriers, in the plain and the pipelined
// order, 9 as 5 with 80-key tiles at padded head size 256 (Cfg256WS80, auto's kernel there),
// route 5's kernels at 64 and 128, 10 as 8 with the computing warpgroups taking turns to issue
// their MMAs, 11 as 10 with three K/V stages at padded head size 128 (auto's kernel there for
// prompts of 2048 tokens or more; route 10's kernels elsewhere).
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
  const bool sm90 = kBuiltSm90a && route != 1 && device_is_sm90();
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
      // Auto at padded head size 128 takes the pipelined order for long prompts: long query
      // blocks, where its overlap of softmax and P V pays, and not for short ones, where the
      // blocks' fill and drain weigh more. H200, bf16, causal, 32/8 heads, interleaved A/B
      // (benchmarks/ab_prefill_routes.py), route 8 over route 5: 0.94 at B=8 L=1024, 0.98 at
      // B=4 L=2048, 1.03 at B=2 L=4096, 1.08 at B=1 L=8192, 1.14 at B=1 L=16384. Its two
      // computing warpgroups take turns to issue their MMAs (route 10, thirteenth round:
      // 1.010-1.016x route 8); since the fourteenth round with three K/V stages and the
      // exponentials ahead (route 11, Cfg128WSKVP3), which moved the threshold to 2048 tokens.
      if (dpad == 128 && ((route == 0 && a.p.query_len >= kLongPromptForPipelinedWs) || route == 11)) {
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
      if ((route == 9 || route == 0) && dpad == 256) return launch_ws<T, Cfg256WS80>(a, stream, route);
      if (dpad == 64)
        return route == 0 || route == 6 ? launch_ws<T, Cfg64WS3>(a, stream, route) : launch_ws<T, Cfg64WS>(a, stream, route);
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

bool prefill_mma_appends(const Params& p, int splits) {
  using namespace pmma;
  if (g_append.load(std::memory_order_relaxed) != 0) return false;
  if (!p.inplace || p.do_rotary || splits > 1 || p.key == nullptr || p.value == nullptr) return false;
  // launch_default's warp-specialised kernels (every route but mma.sync and plain wgmma).
  const int route = g_route.load(std::memory_order_relaxed);
  if (!kBuiltSm90a || route == 1 || route == 2 || !device_is_sm90()) return false;
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
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (p.dtype == DType::kFloat16) return pmma::launch_typed<__half>(a, dpad, s);
  return pmma::launch_typed<__nv_bfloat16>(a, dpad, s);
}


}  // namespace cuda
}  // namespace gqa
