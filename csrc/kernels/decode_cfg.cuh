// The tensor-core decode kernel's loaders and their shared-memory layouts (DecodeCfg), apart
// from the kernel (decode_mma.cuh) so that host code that chooses between the kernels
// (launch.cu: whether a configuration fits the device's shared memory) can read the sizes
// without compiling the kernel. No torch here.
#pragma once

#include <cstddef>

namespace gqa {
namespace cuda {
namespace detail {

// The loaders (set_decode_loader, launch.h, picks one): the CTA copies whole tiles by cp.async;
// each warp's lane 0 loads its 16 keys of K and V by TMA; or (kLoadTmaV) V by TMA and K by plain
// 16-byte loads straight into the mma B fragments. On an H200, with the decode grid's CTAs and
// nothing computed (scripts/decode_bw_probe.cu), TMA slices and K by loads with V by TMA both
// stream 4.5-4.58 TB/s when L2 fetches 128 bytes around each read (Work::l2_fetch; TMA stopped near
// 4.3 with the 256-byte promotion it had until the twenty-seventh round), and cp.async 4.33.
// kLoadTmaFourWarps is the TMA loader with four warps a CTA at head size 256 as at the others (see
// DecodeCfg), for grids of at most one CTA an SM; kLoadCpAsyncShallow the cp.async loader with
// three stages instead of five at head size 64, for the same grids when their splits are short;
// kLoadCpAsyncOneAhead the cp.async loader's ring with one tile in flight ahead instead of kStages
// - 1, at head sizes 80 and 96 for grids of one wave at two CTAs an SM; kLoadTmaOneAhead the same
// for the TMA loader, at head size 128 for grids of more CTAs than SMs with splits of 1,024-4,096
// keys and at 80 and 96 for one wave at two CTAs an SM; and kLoadTmaShallow the TMA loader with
// three stages instead of five at head size 64, so that four CTAs share an SM, for grids of more
// than three CTAs an SM with short splits in row order (launch_decode_mma_d); kLoadTmaWide the TMA
// loader at head size 64 with 32 keys a warp a stage instead of 16, in three stages of twice the
// bytes (the same bytes in flight), so that each warp's online-softmax step (the row maxima, the
// rescale of O, the barrier wait) serves twice the keys. kLoadCpAsyncNarrow is the cp.async
// loader with fewer warps a CTA, for GPUs whose blocks cannot hold the usual stages (99 KB on
// sm86, sm89 and sm120): two warps at head sizes 96 and 128 (32-key stages, 56 KB, where four
// take 107-108 KB), one warp at 256 (16-key stages, 59 KB, where two take 108 KB).
enum DecodeLoader : int {
  kLoadCpAsync = 0,
  kLoadTma = 1,
  kLoadTmaV = 2,
  kLoadTmaFourWarps = 3,
  kLoadCpAsyncShallow = 4,
  kLoadCpAsyncOneAhead = 5,
  kLoadTmaOneAhead = 6,
  kLoadTmaShallow = 7,
  kLoadTmaWide = 8,
  kLoadCpAsyncNarrow = 9
};

// Four warps and 64-key stages; at D = 256 two warps and 32-key stages (kLoadTmaFourWarps
// aside), whose ~100 KB of stages let two CTAs share an SM. A variant with two warps, 32-key
// stages and 6-8 stages was measured slower on every decode row (H200). At D = 256 four warps
// take about 200 KB, so one CTA an SM: where the grid is one wave at that (B = 1), they read
// the stages in half the rounds and merge with twice the threads (thirty-ninth round, H200,
// interleaved, us, four warps by TMA / two warps by cp.async, auto's before: B1 32/8/256 L1024
// 9.01-9.08 / 11.47-11.57 (cuDNN 10.8), L8192 26.2-26.3 / 30.1-30.2, 16/8 L1024 7.78-7.79 /
// 9.64-9.68, 8/4 L1024 6.79-6.81 / 8.91-8.93, 28/4 L4096 13.42-13.46 / 14.49-14.62).
// kTma: the stages hold 128-byte-swizzled slices (tma.cuh) instead of padded rows; kRegK: of V
// only, and more of them in the same bytes.
template <int D, int kLoader = kLoadCpAsync>
struct DecodeCfg {
  static constexpr bool kTma = kLoader == kLoadTma || kLoader == kLoadTmaV || kLoader == kLoadTmaFourWarps ||
                               kLoader == kLoadTmaOneAhead || kLoader == kLoadTmaShallow || kLoader == kLoadTmaWide;
  static constexpr bool kRegK = kLoader == kLoadTmaV;
  static constexpr bool kWide = kLoader == kLoadTmaWide;
  static constexpr bool kNarrow = kLoader == kLoadCpAsyncNarrow;
  static constexpr int kWarps = kNarrow ? (D >= 256 ? 1 : 2) : (D >= 256 && kLoader != kLoadTmaFourWarps) ? 2 : 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kSliceKeys = kWide ? 32 : 16;  // keys a warp takes from each stage
  static constexpr int kTile = kSliceKeys * kWarps;  // keys per pipeline stage
  static constexpr int kStride = D + 8;  // smem row pitch in elements: +16 B makes ldmatrix conflict-free
  // kTma: a slice row is D / 64 boxes of 64 columns, rounded up: at head sizes 80 and 96 the
  // second box's columns past D lie outside the tensor map, so TMA fills them with zeros
  // without reading memory, and the mmas never read them.
  static constexpr int kBoxes = (D + 63) / 64;
  static constexpr size_t kSliceBytes = kSliceKeys * kBoxes * 64 * 2;  // kTma: one warp's keys of K (or V)
  static constexpr size_t kStageBytes =
      kTma ? (kRegK ? 1 : 2) * kWarps * kSliceBytes : 2 * kTile * kStride * 2;  // K (unless kRegK) and V
  // Two CTAs per SM keep ~100 KB of stages each; deeper pipelines where the rows are short.
  // kLoadCpAsyncShallow: three stages at head size 64, for short splits of CTAs that have their
  // SM to itself, where fewer tiles a CTA in flight read faster; kLoadTmaShallow: three TMA
  // stages at 64 (about 51 KB), so that four CTAs share an SM (launch_decode_mma_d). TMA at 80
  // and 96 takes three, as at 128: its slices are 128 columns wide (kBoxes).
  static constexpr bool kShallow = kLoader == kLoadCpAsyncShallow || kLoader == kLoadTmaShallow;
  static constexpr int kStages = kRegK                  ? (D <= 64 ? 8 : 5)
                                 : (kShallow || kWide) ? 3
                                            : (D <= 64 ? 5 : (D <= 96 && !kTma ? 4 : 3));
  // Tiles in flight ahead of the one being computed. kLoadCpAsyncOneAhead and kLoadTmaOneAhead:
  // one, in the ring (and the shared memory, so as many CTAs an SM) of kLoadCpAsync and kLoadTma.
  static constexpr bool kOneAhead = kLoader == kLoadCpAsyncOneAhead || kLoader == kLoadTmaOneAhead;
  static constexpr int kAhead = kOneAhead ? 1 : kStages - 1;
  static constexpr int kKChunks = kRegK ? D / 32 : 1;  // kRegK: 16-byte K chunks a lane holds a key
  static constexpr int kChunks = D / 8;  // 16-byte chunks per row
  static constexpr bool kQInRegs = D <= 128;
  static constexpr size_t kQBytes = 16 * kStride * 2;
  static constexpr size_t kNewBytes = 2 * D * 2;
  static constexpr size_t kAlignPad = kTma ? 1024 : 0;  // the swizzled stages start 1024-byte aligned
  static constexpr size_t kSmem = kQBytes + kAlignPad + kStages * kStageBytes + kNewBytes;
  static_assert(D % 16 == 0, "tensor-core decode needs D % 16 == 0");
  static_assert(!kRegK || D == 64 || D == 128, "K fragments in registers: D = 64 or 128 (the register budget)");
  static_assert(kStages >= 3, "pipeline depth");
  static_assert(!kWide || D == 64, "32-key slices: head size 64 only (the stages' bytes)");
  static_assert(!kNarrow || D == 96 || D == 128 || D == 256, "the narrow cp.async loader: head sizes 96, 128 and 256");
  // The stages, once drained, hold the warps' combine buffer [kWarps][16][D] (floats).
  static_assert(kWarps * 16 * D * 4 <= kStages * kStageBytes, "the combine buffer must fit in the stages");
};

// The most dynamic shared memory the decode kernel's configurations ask for at head size D
// among the loaders a device can run: with `tma` (sm90a_kernels_usable) every one of them, else
// the cp.async ones of the usual widths (launch_decode_mma_d chooses; kLoadCpAsyncNarrow only
// where these do not fit, launch.cu's decode_mma_fits). A grid of one CTA an SM asks for more than half
// an SM besides, within the device's limit.
template <int D>
constexpr size_t decode_max_smem(bool tma) {
  const auto larger = [](size_t a, size_t b) { return a > b ? a : b; };
  size_t bytes = larger(DecodeCfg<D, kLoadCpAsync>::kSmem,
                        larger(DecodeCfg<D, kLoadCpAsyncShallow>::kSmem, DecodeCfg<D, kLoadCpAsyncOneAhead>::kSmem));
  if (!tma) return bytes;
  bytes = larger(bytes, larger(DecodeCfg<D, kLoadTma>::kSmem,
                               larger(DecodeCfg<D, kLoadTmaOneAhead>::kSmem, DecodeCfg<D, kLoadTmaShallow>::kSmem)));
  if constexpr (D == 64 || D == 128) bytes = larger(bytes, DecodeCfg<D, kLoadTmaV>::kSmem);
  if constexpr (D == 64) bytes = larger(bytes, DecodeCfg<D, kLoadTmaWide>::kSmem);
  if constexpr (D == 256) bytes = larger(bytes, DecodeCfg<D, kLoadTmaFourWarps>::kSmem);
  return bytes;
}

// What fits a block limit of `limit` bytes (0: unknown, take it as enough) at head size D, the one
// rule that launch.cu (tensor cores or the generic kernel) and launch_decode_mma_d (which loader)
// both follow: kFitsAll, every loader the device may run; kFitsNarrow, only kLoadCpAsyncNarrow
// (head sizes 96, 128 and 256); kFitsNone, no configuration.
enum DecodeSmemFit : int { kFitsAll = 0, kFitsNarrow = 1, kFitsNone = 2 };
template <int D>
constexpr DecodeSmemFit decode_smem_fit(bool tma, int limit) {
  if (limit <= 0 || decode_max_smem<D>(tma) <= static_cast<size_t>(limit)) return kFitsAll;
  if constexpr (D == 96 || D == 128 || D == 256)
    if (DecodeCfg<D, kLoadCpAsyncNarrow>::kSmem <= static_cast<size_t>(limit)) return kFitsNarrow;
  return kFitsNone;
}

}  // namespace detail
}  // namespace cuda
}  // namespace gqa
