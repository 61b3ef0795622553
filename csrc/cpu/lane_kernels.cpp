// The CPU backend's inner loops, written once for W fp32 lanes with GCC's and Clang's vector
// extension, and compiled for three instruction sets: AVX-512 (W = 16), AVX2 with FMA (W = 8)
// and the baseline (W = 4: SSE2 on x86-64, NEON on AArch64). Extensions are built without
// -march, so lane_kernels() picks the set at run time.
//
// Why explicit vectors: from plain loops over lane arrays (the form before), GCC built the
// AVX-512 code of the score and exponential loops from scalar FMAs and lane inserts, and the
// score loop alone took 45% of a CPU prefill call (2-core Zen 4, B1 32/8/128 S1024 fp32: 458 ms,
// 43 ms with these kernels). Why W per set: W is one native register in each, so the register
// blocking below (eight accumulators; sixteen in AVX-512's wide loops) fits every set; one
// 16-lane type for all, as first written, spilled on AVX2 and SSE2 (1,089 and 752 ms on that
// call).

#include "lane_kernels.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

// The AVX2 and AVX-512 sets, beside the baseline: with GCC on x86-64 Linux (its target attributes
// and run-time CPU checks).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && \
    !defined(GQA_NO_MULTIVERSION)
#define GQA_X86_LANE_SETS 1
#endif

namespace gqa {
namespace cpu {
namespace {

#define GQA_LANES_INLINE inline __attribute__((always_inline))
// (a lambda's body is a function of its own: inlined too, so that it gets the caller's set)
#define GQA_LAMBDA_INLINE __attribute__((always_inline))

// An fp16's value, exactly (the D % W tails of the fp16 kernels): a normal one has its exponent
// rebiased (fp16's bias 15, fp32's 127), Inf and NaN keep an all-ones exponent, and a subnormal
// one (or zero) is its mantissa times 2^-24, exact in fp32 (and unaffected by a
// denormals-are-zero mode, since no fp32 subnormal is formed).
GQA_LANES_INLINE float fp16_to_fp32(uint16_t h) {
  const uint32_t exponent = h & 0x7c00u;
  uint32_t bits = ((h & 0x7fffu) << 13) + ((127u - 15u) << 23);
  if (exponent == 0x7c00u) bits += (127u - 15u) << 23;
  if (exponent == 0) {
    const float subnormal = static_cast<float>(h & 0x3ffu) * 0x1p-24f;
    std::memcpy(&bits, &subnormal, sizeof(bits));
  }
  bits |= static_cast<uint32_t>(h & 0x8000u) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <int W>
struct VectorTypes;
template <>
struct VectorTypes<2> {  // the last step of a lane fold
  typedef float Float __attribute__((vector_size(8)));
};
template <>
struct VectorTypes<4> {
  typedef float Float __attribute__((vector_size(16)));
  typedef int32_t Int __attribute__((vector_size(16)));
  typedef uint16_t Half __attribute__((vector_size(8)));  // W bf16 values
};
template <>
struct VectorTypes<8> {
  typedef float Float __attribute__((vector_size(32)));
  typedef int32_t Int __attribute__((vector_size(32)));
  typedef uint16_t Half __attribute__((vector_size(16)));
};
template <>
struct VectorTypes<16> {
  typedef float Float __attribute__((vector_size(64)));
  typedef int32_t Int __attribute__((vector_size(64)));
  typedef uint16_t Half __attribute__((vector_size(32)));
};

template <int W>
struct Kernels {
  static_assert(W <= kMaxLanes, "kKeyTileT's padding holds one register of the widest set");
  static_assert(kRowBlock == 4, "the kernels keep four rows' accumulators");
  using V = typename VectorTypes<W>::Float;
  using IntV = typename VectorTypes<W>::Int;

  // Unaligned: through memcpy.
  static GQA_LANES_INLINE V load(const float* src) {
    V v;
    std::memcpy(&v, src, sizeof(v));
    return v;
  }
  static GQA_LANES_INLINE void store(float* dst, const V& v) { std::memcpy(dst, &v, sizeof(v)); }

  // W lanes of a cache row, fp32, bf16 or fp16, widened to fp32 in the register, so that a
  // 16-bit row is read once, in place, with no fp32 copy written and read back.
  static GQA_LANES_INLINE V load_row(const float* src) { return load(src); }
  // A bf16 is the high half of an fp32: zero-extended to 32 bits a lane, shifted left 16.
  static GQA_LANES_INLINE V load_row(const Bf16Bits* src) {
    typename VectorTypes<W>::Half half;
    std::memcpy(&half, src, sizeof(half));
    const IntV bits = __builtin_convertvector(half, IntV) << 16;
    V v;
    std::memcpy(&v, &bits, sizeof(v));
    return v;
  }
  // An fp16: one instruction, F16C's vcvtph2ps (in AVX-512F too), written as inline assembly
  // because its intrinsic cannot be inlined into these target-free bodies (and the compilers'
  // own fp16 vector conversion goes lane by lane). Only the x86 sets have it: the baseline has
  // no fp16 kernels, and its callers widen fp16 tiles once instead (integer lane operations
  // were measured 2x slower there: B8 decode 23 against 11 ms).
  static GQA_LANES_INLINE V load_row(const Fp16Bits* src) {
    static_assert(W >= 8, "F16C and AVX-512 registers only");
    typename VectorTypes<W>::Half half;
    std::memcpy(&half, src, sizeof(half));
    V v;
    asm("vcvtph2ps %1, %0" : "=v"(v) : "vm"(half));
    return v;
  }
  static GQA_LANES_INLINE float row_element(const float* row, int i) { return row[i]; }
  static GQA_LANES_INLINE float row_element(const Bf16Bits* row, int i) {
    const uint32_t bits = static_cast<uint32_t>(row[i].bits) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  }
  static GQA_LANES_INLINE float row_element(const Fp16Bits* row, int i) { return fp16_to_fp32(row[i].bits); }

  // Lane reductions as a tree of register halves (folded through memcpy, which compilers turn
  // into lane extracts): a vector stored and read back lane by lane stalls on store forwarding.
  template <int N, typename Op>
  static GQA_LANES_INLINE float fold(const typename VectorTypes<N>::Float& v, Op op) {
    if constexpr (N == 2) {
      return op(v[0], v[1]);
    } else {
      typename VectorTypes<N / 2>::Float low, high;
      std::memcpy(&low, &v, sizeof(low));
      std::memcpy(&high, reinterpret_cast<const char*>(&v) + sizeof(low), sizeof(high));
      return fold<N / 2>(op(low, high), op);
    }
  }
  static GQA_LANES_INLINE float sum(const V& v) {
    return fold<W>(v, [](const auto& a, const auto& b) GQA_LAMBDA_INLINE { return a + b; });
  }
  static GQA_LANES_INLINE float max_of(const V& v) {
    return fold<W>(v, [](const auto& a, const auto& b) GQA_LAMBDA_INLINE { return a > b ? a : b; });
  }

  // Two keys at a time: eight independent accumulators, enough to cover the FMA latency.
  // E: the key rows' element: float, Bf16Bits or Fp16Bits.
  template <typename E>
  static GQA_LANES_INLINE void score_block(const float* __restrict queries, const E* const* keys, int count,
                                           int D, float* __restrict scores) {
    const int vector_end = D / W * W;
    auto finish = [&](const V (&dots)[kRowBlock], const E* __restrict k, int j) GQA_LAMBDA_INLINE {
      for (int r = 0; r < kRowBlock; ++r) {
        float total = sum(dots[r]);
        for (int t = vector_end; t < D; ++t) total += queries[r * D + t] * row_element(k, t);  // D % W tail
        scores[r * kKeyTile + j] = total;
      }
    };
    int j = 0;
    for (; j + 2 <= count; j += 2) {
      const E* __restrict k0 = keys[j];
      const E* __restrict k1 = keys[j + 1];
      V dots0[kRowBlock] = {}, dots1[kRowBlock] = {};
      for (int d = 0; d < vector_end; d += W) {
        const V key0 = load_row(k0 + d), key1 = load_row(k1 + d);
        for (int r = 0; r < kRowBlock; ++r) {
          const V q = load(queries + r * D + d);
          dots0[r] += q * key0;
          dots1[r] += q * key1;
        }
      }
      finish(dots0, k0, j);
      finish(dots1, k1, j + 1);
    }
    if (j < count) {
      const E* __restrict k = keys[j];
      V dots[kRowBlock] = {};
      for (int d = 0; d < vector_end; d += W) {
        const V key = load_row(k + d);
        for (int r = 0; r < kRowBlock; ++r) dots[r] += load(queries + r * D + d) * key;
      }
      finish(dots, k, j);
    }
  }

  // Registers of lanes the loops below keep per row: two, or with AVX-512's 32 registers four
  // where D is 128 or more, when the four rows' accumulators and the loads beside them take 21
  // registers. Four hid more of the FMAs' latency at head size 256 (28.6 against 30.9 ms, B1
  // 16/8/256 prefill of 1,024 tokens on 2 Zen 5 threads), were level at 128 and lost 11% at 64.
  static constexpr int kWideChunks = W == 16 ? 4 : 2;
  static constexpr int kWideMinD = 128;

  // The first min(W, n) lanes of v to dst: a whole register where n >= W (no memcpy call of a
  // run-time size), since a score row holds only its tile's keys.
  static GQA_LANES_INLINE void store_scores(const V& v, float* dst, int n) {
    if (n >= W) {
      store(dst, v);
      return;
    }
    float lane[W];
    store(lane, v);
    std::memcpy(dst, lane, sizeof(float) * n);
  }

  // The wide form of score_block_t below: chunks of keys [j, j + N W), the last of which may run
  // past `end` into the tile's padding. (The two- and one-register loops stay written out below:
  // this template with N = 2 and its P·V twin ran a 2,048-token prefill at head size 64 in 31.4
  // ms, against 26.7 for those loops.)
  template <int N>
  static GQA_LANES_INLINE void score_chunks_t(const float* __restrict queries, const float* __restrict key_t,
                                              int begin, int end, int j, int D, float* __restrict scores) {
    V dots[N][kRowBlock] = {};
    for (int d = 0; d < D; ++d) {
      const float* row = key_t + static_cast<size_t>(d) * kKeyTileT + j;
      V keys[N];
      for (int c = 0; c < N; ++c) keys[c] = load(row + c * W);
      for (int r = 0; r < kRowBlock; ++r) {
        const float q = queries[r * D + d];
        for (int c = 0; c < N; ++c) dots[c][r] += q * keys[c];
      }
    }
    for (int c = 0; c < N; ++c) {
      const int first = j + c * W;
      if (first >= end) break;
      for (int r = 0; r < kRowBlock; ++r)
        store_scores(dots[c][r], scores + r * kKeyTile + (first - begin), end - first);
    }
  }

  // Keys along the lanes: each column d is one broadcast of q_r[d] times a row of key_t, and no
  // lane sums are left at the end. Two chunks of W keys at a time where the keys reach that far.
  static GQA_LANES_INLINE void score_block_t(const float* __restrict queries, const float* __restrict key_t,
                                             int begin, int end, int D, float* __restrict scores) {
    auto write = [&](const V (&dots)[kRowBlock], int j) GQA_LAMBDA_INLINE {
      for (int r = 0; r < kRowBlock; ++r) store_scores(dots[r], scores + r * kKeyTile + (j - begin), end - j);
    };
    int j = begin;
    if (D >= kWideMinD)
      for (; j + (kWideChunks - 1) * W < end; j += kWideChunks * W)
        score_chunks_t<kWideChunks>(queries, key_t, begin, end, j, D, scores);
    for (; j + W < end; j += 2 * W) {
      V low[kRowBlock] = {}, high[kRowBlock] = {};
      for (int d = 0; d < D; ++d) {
        const float* row = key_t + static_cast<size_t>(d) * kKeyTileT + j;
        const V keys_low = load(row), keys_high = load(row + W);
        for (int r = 0; r < kRowBlock; ++r) {
          const float q = queries[r * D + d];
          low[r] += q * keys_low;
          high[r] += q * keys_high;
        }
      }
      write(low, j);
      write(high, j + W);
    }
    if (j < end) {
      V dots[kRowBlock] = {};
      for (int d = 0; d < D; ++d) {
        const V keys = load(key_t + static_cast<size_t>(d) * kKeyTileT + j);
        for (int r = 0; r < kRowBlock; ++r) dots[r] += queries[r * D + d] * keys;
      }
      write(dots, j);
    }
  }

  // The wide form of accumulate_block below: columns [d, d + N W) of the four rows.
  template <int N, typename E>
  static GQA_LANES_INLINE void accumulate_chunks(float* __restrict acc, const float* __restrict weights,
                                                 const E* const* values, int count, int d, int D) {
    V tile_sum[N][kRowBlock] = {};
    for (int j = 0; j < count; ++j) {
      V v[N];
      for (int c = 0; c < N; ++c) v[c] = load_row(values[j] + d + c * W);
      for (int r = 0; r < kRowBlock; ++r) {
        const float w = weights[r * kKeyTile + j];
        for (int c = 0; c < N; ++c) tile_sum[c][r] += w * v[c];
      }
    }
    for (int r = 0; r < kRowBlock; ++r)
      for (int c = 0; c < N; ++c) {
        float* out = acc + r * D + d + c * W;
        store(out, load(out) + tile_sum[c][r]);
      }
  }

  // Chunks of D are outermost so the accumulators stay in registers across the keys, two chunks
  // at a time where D allows. The tile's sum is added to acc at the end: a blocked sum, whose
  // fp32 error grows far slower with the context length than that of one running sum.
  template <typename E>  // the value rows' element: float, Bf16Bits or Fp16Bits
  static GQA_LANES_INLINE void accumulate_block(float* __restrict acc, const float* __restrict weights,
                                                const E* const* values, int count, int D) {
    auto add_to_acc = [&](const V& tile_sum, int r, int d) GQA_LAMBDA_INLINE {
      store(acc + r * D + d, load(acc + r * D + d) + tile_sum);
    };
    int d = 0;
    if (D >= kWideMinD)
      for (; d + kWideChunks * W <= D; d += kWideChunks * W)
        accumulate_chunks<kWideChunks, E>(acc, weights, values, count, d, D);
    for (; d + 2 * W <= D; d += 2 * W) {
      V low[kRowBlock] = {}, high[kRowBlock] = {};
      for (int j = 0; j < count; ++j) {
        const V v_low = load_row(values[j] + d), v_high = load_row(values[j] + d + W);
        for (int r = 0; r < kRowBlock; ++r) {
          const float w = weights[r * kKeyTile + j];
          low[r] += w * v_low;
          high[r] += w * v_high;
        }
      }
      for (int r = 0; r < kRowBlock; ++r) {
        add_to_acc(low[r], r, d);
        add_to_acc(high[r], r, d + W);
      }
    }
    for (; d + W <= D; d += W) {
      V tile_sum[kRowBlock] = {};
      for (int j = 0; j < count; ++j) {
        const V v = load_row(values[j] + d);
        for (int r = 0; r < kRowBlock; ++r) tile_sum[r] += weights[r * kKeyTile + j] * v;
      }
      for (int r = 0; r < kRowBlock; ++r) add_to_acc(tile_sum[r], r, d);
    }
    for (; d < D; ++d)  // D % W tail
      for (int r = 0; r < kRowBlock; ++r)
        for (int j = 0; j < count; ++j) acc[r * D + d] += weights[r * kKeyTile + j] * row_element(values[j], d);
  }

  // e^x for x in [-87, 0]: x = n ln2 + r with |r| <= ln2/2, e^r by its Taylor series to r^7,
  // 2^n from the exponent bits; relative error about 1e-7. n is rounded by adding and taking
  // away 1.5 x 2^23 (exact for |x log2 e| < 2^22).
  static GQA_LANES_INLINE V exp_bounded(V x) {
    constexpr float kRound = 12582912.f;  // 1.5 x 2^23
    const V n = (x * 1.44269504f + kRound) - kRound;
    const V r = (x - n * 0.693145752f) - n * 1.42860677e-06f;  // ln2 in two parts
    constexpr float kTaylor[] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};
    V e = V{} + 1.f / 5040;  // Horner, from r^7 down
    for (float c : kTaylor) e = e * r + c;
    const IntV bits = (__builtin_convertvector(n, IntV) + 127) << 23;
    V two_to_n;
    std::memcpy(&two_to_n, &bits, sizeof(two_to_n));
    return e * two_to_n;
  }

  // e^(v - max), where every v <= max; 0 where v - max < -87 (e^-87 is 1.6e-38, nothing next to
  // the max's 1), which also covers v = -inf.
  static GQA_LANES_INLINE V exp_shifted(V v, float max) {
    v -= max;
    const auto underflow = v < -87.f;
    const V e = exp_bounded(underflow ? V{} - 87.f : v);
    return underflow ? V{} : e;
  }

  // Whole registers from the one holding the first visible score to the one holding the last:
  // the score rows hold kKeyTile floats, a multiple of W. The invisible lanes of those registers
  // are set to -inf first, so the max and the exponentials need no lane masks (e^-inf is 0 here).
  static GQA_LANES_INLINE void softmax_block(float* __restrict scores, int count, const int* visible_begin,
                                             const int* visible_end, RunningSoftmax* states, float* __restrict acc,
                                             int D) {
    static_assert(kKeyTile % W == 0, "score rows are whole registers");
    constexpr float kNegInf = -__builtin_inff();
    for (int r = 0; r < kRowBlock; ++r) {
      float* row = scores + r * kKeyTile;
      const int begin = visible_begin[r], end = std::min(visible_end[r], count);
      const int chunk_begin = begin < end ? begin / W * W : count;
      const int chunk_end = begin < end ? (end + W - 1) / W * W : count;
      for (int j = 0; j < chunk_begin; j += W) store(row + j, V{});
      for (int j = chunk_end; j < count; j += W) store(row + j, V{});
      if (begin >= end) continue;
      std::fill(row + chunk_begin, row + begin, kNegInf);
      std::fill(row + end, row + chunk_end, kNegInf);

      V top = V{} + kNegInf;
      for (int j = chunk_begin; j < chunk_end; j += W) {
        const V v = load(row + j);
        top = v > top ? v : top;
      }
      RunningSoftmax& state = states[r];
      const float new_max = std::max(state.max, max_of(top));
      V total = {};
      for (int j = chunk_begin; j < chunk_end; j += W) {
        const V weight = exp_shifted(load(row + j), new_max);
        store(row + j, weight);
        total += weight;
      }
      const float keep = state.max == kNegInf ? 0.f : exp_shifted(V{} + state.max, new_max)[0];
      if (keep != 1.f) {
        float* acc_row = acc + r * D;
        int d = 0;
        for (; d + W <= D; d += W) store(acc_row + d, load(acc_row + d) * keep);
        for (; d < D; ++d) acc_row[d] *= keep;
      }
      state.sum = state.sum * keep + sum(total);
      state.max = new_max;
    }
  }
};

// The entry points of a set (name, target attribute, lane count): each compiles Kernels<W>'s
// always-inlined bodies for its instruction set. The fp16 ones exist in the x86 sets only.
#define GQA_LANE_KERNEL_FUNCTIONS(NAME, TARGET, W)                                                           \
  TARGET void NAME##_score_block(const float* queries, const float* const* keys, int count, int D,           \
                                 float* scores) {                                                            \
    Kernels<W>::score_block(queries, keys, count, D, scores);                                                \
  }                                                                                                          \
  TARGET void NAME##_score_block_t(const float* queries, const float* key_t, int begin, int end, int D,      \
                                   float* scores) {                                                          \
    Kernels<W>::score_block_t(queries, key_t, begin, end, D, scores);                                        \
  }                                                                                                          \
  TARGET void NAME##_accumulate_block(float* acc, const float* weights, const float* const* values,          \
                                      int count, int D) {                                                    \
    Kernels<W>::accumulate_block(acc, weights, values, count, D);                                            \
  }                                                                                                          \
  TARGET void NAME##_score_block_bf16(const float* queries, const Bf16Bits* const* keys, int count,          \
                                      int D, float* scores) {                                                \
    Kernels<W>::score_block(queries, keys, count, D, scores);                                                \
  }                                                                                                          \
  TARGET void NAME##_accumulate_block_bf16(float* acc, const float* weights,                                 \
                                           const Bf16Bits* const* values, int count, int D) {                \
    Kernels<W>::accumulate_block(acc, weights, values, count, D);                                            \
  }                                                                                                          \
  TARGET void NAME##_softmax_block(float* scores, int count, const int* visible_begin,                       \
                                   const int* visible_end, RunningSoftmax* states, float* acc, int D) {      \
    Kernels<W>::softmax_block(scores, count, visible_begin, visible_end, states, acc, D);                    \
  }

#define GQA_LANE_KERNEL_FP16_FUNCTIONS(NAME, TARGET, W)                                                      \
  TARGET void NAME##_score_block_fp16(const float* queries, const Fp16Bits* const* keys, int count,          \
                                      int D, float* scores) {                                                \
    Kernels<W>::score_block(queries, keys, count, D, scores);                                                \
  }                                                                                                          \
  TARGET void NAME##_accumulate_block_fp16(float* acc, const float* weights,                                 \
                                           const Fp16Bits* const* values, int count, int D) {                \
    Kernels<W>::accumulate_block(acc, weights, values, count, D);                                            \
  }

#define GQA_LANE_KERNEL_TABLE(NAME, SCORE_FP16, ACCUMULATE_FP16)                                             \
  const LaneKernels NAME##_kernels = {NAME##_score_block,           NAME##_score_block_t,                    \
                                      NAME##_accumulate_block,      NAME##_score_block_bf16,                 \
                                      NAME##_accumulate_block_bf16, SCORE_FP16,                              \
                                      ACCUMULATE_FP16,              NAME##_softmax_block,                    \
                                      #NAME};

GQA_LANE_KERNEL_FUNCTIONS(baseline, , 4)
GQA_LANE_KERNEL_TABLE(baseline, nullptr, nullptr)

#ifdef GQA_X86_LANE_SETS
#define GQA_AVX2 __attribute__((target("avx2,fma,f16c")))
GQA_LANE_KERNEL_FUNCTIONS(avx2, GQA_AVX2, 8)
GQA_LANE_KERNEL_FP16_FUNCTIONS(avx2, GQA_AVX2, 8)
GQA_LANE_KERNEL_TABLE(avx2, avx2_score_block_fp16, avx2_accumulate_block_fp16)
#define GQA_AVX512 __attribute__((target("avx512f")))
GQA_LANE_KERNEL_FUNCTIONS(avx512, GQA_AVX512, 16)
GQA_LANE_KERNEL_FP16_FUNCTIONS(avx512, GQA_AVX512, 16)
GQA_LANE_KERNEL_TABLE(avx512, avx512_score_block_fp16, avx512_accumulate_block_fp16)
#endif

std::atomic<int> g_pinned{0};  // an index of kLaneKernelNames

}  // namespace

void set_lane_kernels(int index) { g_pinned.store(index, std::memory_order_relaxed); }

const LaneKernels& lane_kernels() {
#ifdef GQA_X86_LANE_SETS
  // (AVX-512 and AVX2 here include the operating system's support for their registers.)
  static const bool has_avx512 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  static const bool has_avx2 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0 && __builtin_cpu_supports("fma") != 0 &&
           __builtin_cpu_supports("f16c") != 0;
  }();
  switch (g_pinned.load(std::memory_order_relaxed)) {
    case 1: return baseline_kernels;
    case 2: if (has_avx2) return avx2_kernels; break;
    case 3: if (has_avx512) return avx512_kernels; break;
    default: break;
  }
  if (has_avx512) return avx512_kernels;
  if (has_avx2) return avx2_kernels;
#endif
  return baseline_kernels;
}

}  // namespace cpu
}  // namespace gqa
