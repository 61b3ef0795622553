// The CPU backend's inner loops (lane_kernels.cpp): the scores of a block of query rows against a
// tile of keys, the online softmax's exponentials, and the weighted sum of the values. One
// table of them per instruction set, picked once from the CPU's features.
#pragma once

namespace gqa {
namespace cpu {

constexpr int kKeyTile = 64;   // keys scored together (converted to fp32 once)
constexpr int kRowBlock = 4;   // query rows that share each K and V load
constexpr int kMaxLanes = 16;  // fp32 lanes of the widest instruction set's registers
// A transposed key tile's row: the tile's keys and one register of padding, which a last
// partial chunk of keys may read (zeros there).
constexpr int kKeyTileT = kKeyTile + kMaxLanes;

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
  // x[j] = e^(x[j] - max) for j < n, where every x[j] <= max; returns their sum. Exponents
  // below -87 are clamped (a weight of 1e-38 next to the max's 1).
  float (*exp_and_sum)(float* x, int n, float max);
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
