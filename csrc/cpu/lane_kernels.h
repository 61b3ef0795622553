// The CPU backend's inner loops (lane_kernels.cpp): the scores of a block of query rows against a
// tile of keys, the online softmax's exponentials, and the weighted sum of the values. One
// table of them per instruction set, picked once from the CPU's features.
#pragma once

#include <cstdint>

namespace gqa {
namespace cpu {

constexpr int kKeyTile = 64;   // keys scored together (converted to fp32 once)
constexpr int kRowBlock = 4;   // query rows that share each K and V load
constexpr int kMaxLanes = 16;  // fp32 lanes of the widest instruction set's registers
// A transposed key tile's row: the tile's keys and one register of padding, which a last
// partial chunk of keys may read (zeros there).
constexpr int kKeyTileT = kKeyTile + kMaxLanes;

// A cache element of a 16-bit float format, as its raw bits: the kernels below read such rows in
// place and widen them to fp32 in registers. Distinct types, so that overloads pick the format.
struct Bf16Bits {
  uint16_t bits;
};
struct Fp16Bits {
  uint16_t bits;
};

// A query row's online softmax: its running max, and the sum of e^(score - max) so far.
struct RunningSoftmax {
  float max = -__builtin_inff();
  float sum = 0.f;
};

struct LaneKernels {
  // scores[r * kKeyTile + j] = q_r . key_j for j < count, for the kRowBlock rows of `queries`
  // (row stride D), each key a row of D floats.
  void (*score_block)(const float* queries, const float* const* keys, int count, int D, float* scores);
  // The same from a transposed key tile, key_t[d * kKeyTileT + j] (key j's column d), for the
  // keys [begin, end): scores[r * kKeyTile + (j - begin)]. Columns from end to the next multiple
  // of the lane count past it must hold finite values.
  void (*score_block_t)(const float* queries, const float* key_t, int begin, int end, int D, float* scores);
  // acc_r += sum_j weights[r * kKeyTile + j] * value_j for j < count, for the kRowBlock rows of
  // `acc` (row stride D). The tile is summed on its own, then added.
  void (*accumulate_block)(float* acc, const float* weights, const float* const* values, int count, int D);
  // score_block and accumulate_block over bf16 or fp16 cache rows, read in place. The fp16 ones
  // are null in the baseline set (no F16C there).
  void (*score_block_bf16)(const float* queries, const Bf16Bits* const* keys, int count, int D, float* scores);
  void (*accumulate_block_bf16)(float* acc, const float* weights, const Bf16Bits* const* values, int count,
                                int D);
  void (*score_block_fp16)(const float* queries, const Fp16Bits* const* keys, int count, int D, float* scores);
  void (*accumulate_block_fp16)(float* acc, const float* weights, const Fp16Bits* const* values, int count,
                                int D);
  // The online softmax's step for the kRowBlock rows of a block over one tile: row r's raw
  // scores scores[r * kKeyTile + j], j < count, become weights e^(score - max) against the row's
  // new running max, where max takes in the scores visible to it, j in [visible_begin[r],
  // visible_end[r]); the other weights become 0 (a row that sees nothing is left unchanged, all
  // weights 0). When a row's max grows, its accumulator (acc + r * D, D floats) and sum are
  // rescaled. A weight below e^-87 (1.6e-38, next to the max's 1) is 0.
  void (*softmax_block)(float* scores, int count, const int* visible_begin, const int* visible_end,
                        RunningSoftmax* states, float* acc, int D);
  const char* name;  // the instruction set, for tests and diagnostics
};

// The table for this CPU: AVX-512, AVX2 with FMA, or the baseline (SSE2 on x86-64, NEON on
// AArch64); the baseline only when built with -DGQA_NO_MULTIVERSION or outside GCC on x86-64.
const LaneKernels& lane_kernels();

// Tests: pins a set by its index in kLaneKernelNames ("auto", the default, picks by CPU
// features). A set that this CPU or build lacks runs as auto; lane_kernels().name tells which.
constexpr const char* kLaneKernelNames[] = {"auto", "baseline", "avx2", "avx512"};
void set_lane_kernels(int index);

}  // namespace cpu
}  // namespace gqa
