// The CPU backend of gqa (SPEC §3). Host pointers only; from torch it uses nothing but ATen's
// thread pool and c10's half types.
//
// A call runs in passes, because attention reads keys that this call appends:
//   1. cache, over (row, kv head): functional past copy and zero fill, RoPE on the new keys,
//      append of the new K/V rows (when each head has one query tile, each pass-2 task does
//      this for its own keys instead, just before it reads them);
//   2. attention, over (row, kv head, query tile[, key split]): RoPE on the queries, then an
//      online softmax over key tiles. All G query heads of a kv head go together, so each K/V
//      row is read once per tile;
//   3. only when (row, kv head, query tile) tasks cannot keep the threads busy (decode with a
//      small batch): the keys were split in pass 2, and the partial results are merged here
//      by their log-sum-exp.

#include "gqa_cpu.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "../core/errors.h"
#include "lane_kernels.h"

namespace gqa {
namespace cpu {
namespace {

constexpr int kMaxQueryTile = 64;      // query tokens per attention task
constexpr int kMaxRowsPerTask = 256;   // query tokens x group heads per task (bounds scratch)
constexpr int kMinKeysPerSplit = 512;  // a shorter key split costs more than it saves
// Tasks of at least this many row blocks score against a transposed key tile (score_block_t):
// the transpose costs about what the dot products' lane sums of three or four blocks do.
constexpr int kTransposeMinBlocks = 4;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The inner loops (scores, exponentials, weighted values) are lane_kernels.cpp's, one set per
// instruction set. widen converts the 16-bit types: plain C++ that GCC vectorises, also built
// for AVX2 and AVX-512 on x86-64 and chosen at load time by CPU feature (an "arch=" clone would
// test the CPU model instead), because extensions are built without -march.
// -DGQA_NO_MULTIVERSION turns this off (e.g. to test the portable code, or under sanitizers).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && \
    !defined(GQA_NO_MULTIVERSION)
#define GQA_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define GQA_MULTIVERSION
#endif

template <typename T>
GQA_MULTIVERSION void widen(const T* src, int n, float* dst) {
  for (int i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
void widen<float>(const float* src, int n, float* dst) {
  std::memcpy(dst, src, sizeof(float) * n);
}

// ---- element access and RoPE ------------------------------------------------------------------

template <typename T>
const T* head_row(const void* base, const TokenStrides& st, int64_t b, int64_t t, int64_t h) {
  return static_cast<const T*>(base) + b * st.batch + t * st.token + h * st.head;
}

template <typename T>
T* head_row(void* base, const TokenStrides& st, int64_t b, int64_t t, int64_t h) {
  return static_cast<T*>(base) + b * st.batch + t * st.token + h * st.head;
}

// Rotates the first R dims of x: pairs (i, i + R/2), or (2i, 2i + 1) when interleaved.
void rotate(float* x, const float* cos_row, const float* sin_row, int rotary_dim,
            bool interleaved) {
  const int half = rotary_dim / 2;
  for (int i = 0; i < half; ++i) {
    const int i0 = interleaved ? 2 * i : i;
    const int i1 = interleaved ? 2 * i + 1 : i + half;
    const float x0 = x[i0], x1 = x[i1];
    x[i0] = x0 * cos_row[i] - x1 * sin_row[i];
    x[i1] = x0 * sin_row[i] + x1 * cos_row[i];
  }
}

// Loads the head row at `src` into x (D floats), rotated for `pos` when do_rotary, and rounded
// to T once as the stored value would be. `cos_sin` holds R floats of scratch.
template <typename T>
void load_rotated(const Params& p, const T* src, int64_t pos, float* cos_sin, float* x) {
  widen(src, p.head_dim, x);
  if (!p.do_rotary) return;
  const int half = p.rotary_dim / 2;
  auto load_cos_sin = [&](auto type_tag) {  // the tables are fp32 or the query's half type
    using R = decltype(type_tag);
    widen(static_cast<const R*>(p.cos_cache) + pos * half, half, cos_sin);
    widen(static_cast<const R*>(p.sin_cache) + pos * half, half, cos_sin + half);
  };
  switch (p.rotary_dtype) {
    case DType::kFloat32: load_cos_sin(float{}); break;
    case DType::kFloat16: load_cos_sin(c10::Half{}); break;
    case DType::kBFloat16: load_cos_sin(c10::BFloat16{}); break;
  }
  rotate(x, cos_sin, cos_sin + half, p.rotary_dim, p.rotary_interleaved);
  if constexpr (!std::is_same_v<T, float>)
    for (int d = 0; d < p.head_dim; ++d) x[d] = static_cast<float>(static_cast<T>(x[d]));
}

// ---- task runner ----------------------------------------------------------------------------

// Runs task(i, scratch) for i in [0, count) on ATen's intra-op threads. Tasks are handed out
// one at a time from a shared counter: causal query tiles differ widely in cost, and
// parallel_for's equal contiguous chunks would leave threads idle. One scratch per worker.
template <typename Task>
void run_tasks(int64_t count, const Task& task) {
  if (count <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(count, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> scratch;
    for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) task(i, scratch);
  });
}

// ---- pass 1: the cache ----------------------------------------------------------------------

// Cache rows [rows_begin, rows_end) of one (row, kv head): copy the past and zero the rest
// (functional op), and append the new K (rotated) and V that fall in the range (the new tokens
// sit at rows [past, past + S)).
template <typename T>
void fill_cache_rows(const Params& p, int b, int kv_head, int64_t rows_begin, int64_t rows_end,
                     std::vector<float>& scratch) {
  const RowGeometry g = row_geometry(p, p.seqlens_k[b]);
  const int D = p.head_dim;
  const size_t row_bytes = sizeof(T) * D;
  auto cache_row = [&](void* cache, int64_t j) {
    return head_row<T>(cache, p.cache_strides, b, j, kv_head);
  };

  if (!p.inplace) {
    for (int64_t j = rows_begin; j < rows_end; ++j) {
      if (j >= g.past && j < g.past + p.query_len) continue;  // new rows, written below
      if (j < g.past && p.past_key != nullptr) {
        std::memcpy(cache_row(p.key_cache, j),
                    head_row<T>(p.past_key, p.past_strides, b, j, kv_head), row_bytes);
        std::memcpy(cache_row(p.value_cache, j),
                    head_row<T>(p.past_value, p.past_strides, b, j, kv_head), row_bytes);
      } else {  // all-zero bits are 0.0 in fp32, fp16 and bf16
        std::memset(cache_row(p.key_cache, j), 0, row_bytes);
        std::memset(cache_row(p.value_cache, j), 0, row_bytes);
      }
    }
  }

  scratch.resize(2 * static_cast<size_t>(D));
  float* key = scratch.data();
  const int64_t s_first = std::max<int64_t>(0, rows_begin - g.past);
  const int64_t s_last = std::min<int64_t>(p.query_len, rows_end - g.past);
  for (int64_t s = s_first; s < s_last; ++s) {
    const int64_t j = static_cast<int64_t>(g.past) + s;
    const T* key_src = head_row<T>(p.key, p.key_strides, b, s, kv_head);
    if (p.do_rotary) {
      load_rotated(p, key_src, rotary_position(p, g, b, static_cast<int>(s)), key + D, key);
      T* dst = cache_row(p.key_cache, j);
      for (int d = 0; d < D; ++d) dst[d] = static_cast<T>(key[d]);
    } else {
      std::memcpy(cache_row(p.key_cache, j), key_src, row_bytes);
    }
    std::memcpy(cache_row(p.value_cache, j),
                head_row<T>(p.value, p.value_strides, b, s, kv_head), row_bytes);
  }
}

// ---- pass 2: attention ----------------------------------------------------------------------

// How the attention pass divides its work.
struct Split {
  int query_tile = 1;  // query tokens per task
  int query_tiles = 0;
  int key_splits = 1;  // > 1: partial results go to a buffer that pass 3 merges
};

Split choose_split(const Params& p) {
  Split split;
  const int64_t wanted = 2 * std::max(1, at::get_num_threads());  // slack for uneven tasks
  const int64_t row_heads = static_cast<int64_t>(p.batch) * p.kv_heads;
  const int64_t tiles_per_head = std::max<int64_t>(1, (wanted + row_heads - 1) / row_heads);
  split.query_tile = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>({(p.query_len + tiles_per_head - 1) / tiles_per_head, kMaxQueryTile,
                            kMaxRowsPerTask / p.group_size})));
  split.query_tiles = (p.query_len + split.query_tile - 1) / split.query_tile;

  const int64_t tasks = row_heads * split.query_tiles;
  if (tasks > 0 && tasks < wanted) {
    int64_t longest = 0;
    for (int b = 0; b < p.batch; ++b) longest = std::max(longest, p.seqlens_k[b] + int64_t{1});
    split.key_splits = static_cast<int>(std::max<int64_t>(
        1, std::min(longest / kMinKeysPerSplit, (wanted + tasks - 1) / tasks)));
  }
  return split;
}

// softcap: scores of a row visible in [visible_begin, visible_end) become
// softcap * tanh(score / softcap) before the softmax sees them.
void apply_softcap(float softcap, float* scores, int visible_begin, int visible_end) {
  for (int j = visible_begin; j < visible_end; ++j) scores[j] = softcap * std::tanh(scores[j] / softcap);
}

// Writes acc / denominator, where the denominator also counts the extra logits that have no
// value vector: the head sink and smooth softmax's logit 0.
template <typename T>
void finish_row(const Params& p, int q_head, RunningSoftmax state, const float* acc, T* out) {
  const bool has_sink = p.head_sink != nullptr;
  const float sink = has_sink ? p.head_sink[q_head] : 0.f;
  float top = state.max;
  if (has_sink) top = std::max(top, sink);
  if (p.smooth_softmax) top = std::max(top, 0.f);
  const float keep = state.max == kNegInf ? 0.f : std::exp(state.max - top);
  float denom = state.sum * keep;
  if (has_sink) denom += std::exp(sink - top);
  if (p.smooth_softmax) denom += std::exp(-top);
  // No visible key and no extra logit: the output is 0, never NaN.
  const float factor = denom > 0.f ? keep / denom : 0.f;
  for (int d = 0; d < p.head_dim; ++d) out[d] = static_cast<T>(acc[d] * factor);
}

// Partial results of key splits: per (row, q head, token, split), D values, then max and sum.
int64_t partial_offset(const Params& p, const Split& split, int b, int q_head, int s, int k) {
  const int64_t slot =
      ((static_cast<int64_t>(b) * p.q_heads + q_head) * p.query_len + s) * split.key_splits + k;
  return slot * (p.head_dim + 2);
}

// The keys that query tokens [s_begin, s_end) of a row see run from the first token's window
// start to the last token; key split k takes the k-th share of them, in whole tiles.
struct KeySpan {
  int64_t begin = 0, end = 0;
  int64_t share = 0;  // keys per split
  int64_t share_begin(int key_split) const { return begin + key_split * share; }
};

KeySpan key_span(const Params& p, const RowGeometry& g, const Split& split, int s_begin, int s_end) {
  const int64_t first_pos = static_cast<int64_t>(g.query_start) + s_begin;
  KeySpan span;
  span.begin = p.local_window > 0 ? std::max<int64_t>(0, first_pos - p.local_window + 1) : 0;
  span.end = std::min<int64_t>(g.total, first_pos + (s_end - s_begin));
  const int64_t tiles = (std::max<int64_t>(0, span.end - span.begin) + kKeyTile - 1) / kKeyTile;
  span.share = (tiles + split.key_splits - 1) / split.key_splits * kKeyTile;
  return span;
}

// The lane kernels for 16-bit cache rows read in place, by format.
void score_block16(const LaneKernels& k, const float* queries, const Bf16Bits* const* keys, int count, int D,
                   float* scores) {
  k.score_block_bf16(queries, keys, count, D, scores);
}
void score_block16(const LaneKernels& k, const float* queries, const Fp16Bits* const* keys, int count, int D,
                   float* scores) {
  k.score_block_fp16(queries, keys, count, D, scores);
}
void accumulate_block16(const LaneKernels& k, float* acc, const float* weights, const Bf16Bits* const* values,
                        int count, int D) {
  k.accumulate_block_bf16(acc, weights, values, count, D);
}
void accumulate_block16(const LaneKernels& k, float* acc, const float* weights, const Fp16Bits* const* values,
                        int count, int D) {
  k.accumulate_block_fp16(acc, weights, values, count, D);
}

// Query tokens [s_begin, s_end) of row b, all G query heads of kv_head, over the key_split-th
// part of the keys those tokens can see.
template <typename T>
void attend_task(const Params& p, const Split& split, int b, int kv_head, int s_begin,
                 int s_end, int key_split, float* partials, std::vector<float>& scratch) {
  const RowGeometry g = row_geometry(p, p.seqlens_k[b]);
  const int D = p.head_dim, G = p.group_size, W = p.local_window;
  const int first_head = kv_head * G;
  auto out_row = [&](int s, int h) { return head_row<T>(p.output, p.output_strides, b, s, h); };

  // First-prompt padding tokens get an output of exactly 0 (pass 3 writes it when split).
  const int s_valid_end = std::min(s_end, g.valid_queries);
  if (split.key_splits == 1)
    for (int s = std::max(s_begin, s_valid_end); s < s_end; ++s)
      for (int h = first_head; h < first_head + G; ++h)
        std::memset(out_row(s, h), 0, sizeof(T) * D);
  if (s_begin >= s_valid_end) return;

  // Rows are (token, head) pairs, token-major, padded with zero rows up to a multiple of
  // kRowBlock. Tasks of few row blocks (decode) read the cache rows in place: fp32 ones, and
  // bf16 and fp16 ones through the 16-bit kernels, which widen them in registers (except fp16 in
  // the baseline set, which has no such kernels and widens K and V tiles into fp32 tiles). Tasks
  // of kTransposeMinBlocks row blocks or more (prefill) convert each tile once for all their
  // blocks, cheaper than widening each row for each block: K transposed (key_t) and, for 16-bit
  // caches, V into an fp32 tile. Scratch: queries, accumulators, those tiles, a block of scores,
  // cos/sin.
  constexpr bool kConvert = !std::is_same_v<T, float>;
  using Bits = std::conditional_t<std::is_same_v<T, c10::BFloat16>, Bf16Bits, Fp16Bits>;
  const LaneKernels& kernels = lane_kernels();
  const int rows = (s_valid_end - s_begin) * G;
  const int padded_rows = (rows + kRowBlock - 1) / kRowBlock * kRowBlock;
  const size_t row_floats = static_cast<size_t>(padded_rows) * D;
  const bool transposed = padded_rows / kRowBlock >= kTransposeMinBlocks;
  const bool rows16 = kConvert && !transposed &&
                      (std::is_same_v<Bits, Bf16Bits> || kernels.score_block_fp16 != nullptr);
  const size_t tile_floats = static_cast<size_t>(kKeyTile) * D;
  const size_t key_tile_floats = kConvert && !transposed && !rows16 ? tile_floats : 0;
  const size_t value_tile_floats = kConvert && !rows16 ? tile_floats : 0;
  const size_t key_t_floats = transposed ? static_cast<size_t>(D) * kKeyTileT : 0;
  const size_t scratch_floats =
      2 * row_floats + key_tile_floats + value_tile_floats + key_t_floats + kRowBlock * kKeyTile + D;
  if (scratch.size() < scratch_floats) scratch.resize(scratch_floats);
  float* queries = scratch.data();
  float* acc = queries + row_floats;
  float* key_tile = acc + row_floats;
  float* value_tile = key_tile + key_tile_floats;
  float* key_t = value_tile + value_tile_floats;  // (transposed) the tile's keys, column by column
  float* scores = key_t + key_t_floats;
  float* cos_sin = scores + kRowBlock * kKeyTile;
  std::fill(queries, queries + 2 * row_floats, 0.f);
  std::vector<RunningSoftmax> states(padded_rows);
  const float* key_rows[kKeyTile];
  const float* value_rows[kKeyTile];
  const Bits* key_rows16[kKeyTile];
  const Bits* value_rows16[kKeyTile];

  // Queries are rotated and rounded to T, as a fused kernel that writes q back would; the
  // scale is folded in after.
  for (int row = 0; row < rows; ++row) {
    const int s = s_begin + row / G;
    float* q = queries + static_cast<size_t>(row) * D;
    load_rotated(p, head_row<T>(p.query, p.query_strides, b, s, first_head + row % G),
                 rotary_position(p, g, b, s), cos_sin, q);
    for (int d = 0; d < D; ++d) q[d] *= p.scale;
  }

  const int64_t first_pos = static_cast<int64_t>(g.query_start) + s_begin;
  const KeySpan span = key_span(p, g, split, s_begin, s_valid_end);
  const int64_t keys_begin = span.share_begin(key_split);
  const int64_t keys_end = std::min(span.end, keys_begin + span.share);

  for (int64_t tile_begin = keys_begin; tile_begin < keys_end; tile_begin += kKeyTile) {
    const int count = static_cast<int>(std::min<int64_t>(kKeyTile, keys_end - tile_begin));
    for (int j = 0; j < count; ++j) {
      const T* k = head_row<T>(p.key_cache, p.cache_strides, b, tile_begin + j, kv_head);
      const T* v = head_row<T>(p.value_cache, p.cache_strides, b, tile_begin + j, kv_head);
      if (transposed) {
        for (int d = 0; d < D; ++d) key_t[static_cast<size_t>(d) * kKeyTileT + j] = static_cast<float>(k[d]);
      } else if (rows16) {
        key_rows16[j] = reinterpret_cast<const Bits*>(k);
      } else if constexpr (kConvert) {
        key_rows[j] = key_tile + j * D;
        widen(k, D, key_tile + j * D);
      } else {
        key_rows[j] = k;
      }
      if (rows16) {
        value_rows16[j] = reinterpret_cast<const Bits*>(v);
      } else if constexpr (kConvert) {
        value_rows[j] = value_tile + j * D;
        widen(v, D, value_tile + j * D);
      } else {
        value_rows[j] = v;
      }
    }
    if (transposed) {  // the columns a last chunk may read past the tile's keys
      const int pad_end = std::min(count + kMaxLanes, kKeyTileT);
      for (int d = 0; d < D; ++d) {
        float* row = key_t + static_cast<size_t>(d) * kKeyTileT;
        std::fill(row + count, row + pad_end, 0.f);
      }
    }

    for (int block = 0; block < padded_rows; block += kRowBlock) {
      // Each row sees keys j <= pos, and j > pos - W with a window; the block computes
      // scores for the union [begin, end) of what its rows see in this tile.
      int visible_begin[kRowBlock] = {}, visible_end[kRowBlock] = {};
      int begin = count, end = 0;
      for (int r = 0; r < kRowBlock && block + r < rows; ++r) {
        const int64_t pos = first_pos + (block + r) / G;
        const int64_t window_start = W > 0 ? pos - W + 1 : 0;
        visible_begin[r] = static_cast<int>(std::max<int64_t>(0, window_start - tile_begin));
        visible_end[r] = static_cast<int>(std::min<int64_t>(count, pos + 1 - tile_begin));
        if (visible_begin[r] >= visible_end[r]) continue;
        begin = std::min(begin, visible_begin[r]);
        end = std::max(end, visible_end[r]);
      }
      if (begin >= end) continue;

      float* block_acc = acc + static_cast<size_t>(block) * D;
      const float* block_queries = queries + static_cast<size_t>(block) * D;
      if (transposed)
        kernels.score_block_t(block_queries, key_t, begin, end, D, scores);
      else if (rows16)
        score_block16(kernels, block_queries, key_rows16 + begin, end - begin, D, scores);
      else
        kernels.score_block(block_queries, key_rows + begin, end - begin, D, scores);
      for (int r = 0; r < kRowBlock; ++r) {  // scores start at key `begin`
        visible_begin[r] = std::clamp(visible_begin[r] - begin, 0, end - begin);
        visible_end[r] = std::clamp(visible_end[r] - begin, visible_begin[r], end - begin);
        if (p.softcap > 0.f) apply_softcap(p.softcap, scores + r * kKeyTile, visible_begin[r], visible_end[r]);
      }
      kernels.softmax_block(scores, end - begin, visible_begin, visible_end, &states[block], block_acc, D);
      if (rows16)
        accumulate_block16(kernels, block_acc, scores, value_rows16 + begin, end - begin, D);
      else
        kernels.accumulate_block(block_acc, scores, value_rows + begin, end - begin, D);
    }
  }

  for (int row = 0; row < rows; ++row) {
    const int s = s_begin + row / G, q_head = first_head + row % G;
    const float* row_acc = acc + static_cast<size_t>(row) * D;
    if (split.key_splits == 1) {
      finish_row(p, q_head, states[row], row_acc, out_row(s, q_head));
    } else {
      float* part = partials + partial_offset(p, split, b, q_head, s, key_split);
      std::memcpy(part, row_acc, sizeof(float) * D);
      part[D] = states[row].max;
      part[D + 1] = states[row].sum;
    }
  }
}

// ---- pass 3: merge key splits ---------------------------------------------------------------

template <typename T>
void merge_splits(const Params& p, const Split& split, int b, int q_head, int s,
                  const float* partials, std::vector<float>& scratch) {
  const int D = p.head_dim;
  T* out = head_row<T>(p.output, p.output_strides, b, s, q_head);
  if (s >= row_geometry(p, p.seqlens_k[b]).valid_queries) {  // first-prompt padding
    std::memset(out, 0, sizeof(T) * D);
    return;
  }
  RunningSoftmax merged;
  for (int k = 0; k < split.key_splits; ++k)
    merged.max = std::max(merged.max, partials[partial_offset(p, split, b, q_head, s, k) + D]);
  scratch.assign(D, 0.f);
  for (int k = 0; k < split.key_splits; ++k) {
    const float* part = partials + partial_offset(p, split, b, q_head, s, k);
    if (part[D] == kNegInf) continue;  // this split saw no key
    const float weight = std::exp(part[D] - merged.max);
    merged.sum += part[D + 1] * weight;
    for (int d = 0; d < D; ++d) scratch[d] += part[d] * weight;
  }
  finish_row(p, q_head, merged, scratch.data(), out);
}

// The cache rows a fused task fills before it attends: the key_split-th of key_splits ranges
// that cover [0, capacity), each holding the keys that its split reads.
template <typename T>
void fill_split_rows(const Params& p, const Split& split, int b, int kv_head, int key_split,
                     std::vector<float>& scratch) {
  const RowGeometry g = row_geometry(p, p.seqlens_k[b]);
  const KeySpan span = key_span(p, g, split, 0, std::min(p.query_len, g.valid_queries));
  auto boundary = [&](int k) {
    if (k == 0) return int64_t{0};
    if (k == split.key_splits) return static_cast<int64_t>(p.capacity);
    return std::min<int64_t>(p.capacity, span.share_begin(k));
  };
  fill_cache_rows<T>(p, b, kv_head, boundary(key_split), boundary(key_split + 1), scratch);
}

template <typename T>
void run_typed(const Params& p) {
  const int64_t row_heads = static_cast<int64_t>(p.batch) * p.kv_heads;
  if (row_heads == 0) return;
  const Split split = choose_split(p);
  // With one query tile a head, no task reads cache rows another task writes once each task
  // fills the rows of its own keys, so it fills them just before it reads them back from cache
  // (the functional op's copy of the past then costs one pass over memory, not two). Several
  // query tiles read each other's new rows, so the cache pass runs over all heads first.
  const bool fused = split.query_tiles == 1;
  if (!fused) {
    run_tasks(row_heads, [&](int64_t i, std::vector<float>& scratch) {
      fill_cache_rows<T>(p, static_cast<int>(i / p.kv_heads), static_cast<int>(i % p.kv_heads), 0,
                         p.capacity, scratch);
    });
  }

  std::vector<float> partials;
  if (split.key_splits > 1) partials.resize(partial_offset(p, split, p.batch, 0, 0, 0));
  // Index order: the last query tiles (the most keys under causality) first, so expensive
  // tasks start early and cheap ones fill the tail.
  const int64_t tasks = row_heads * split.query_tiles * split.key_splits;
  run_tasks(tasks, [&](int64_t i, std::vector<float>& scratch) {
    const int key_split = static_cast<int>(i % split.key_splits);
    const int64_t rest = i / split.key_splits;
    const int kv_head = static_cast<int>(rest % p.kv_heads);
    const int b = static_cast<int>(rest / p.kv_heads % p.batch);
    const int tile = split.query_tiles - 1 - static_cast<int>(rest / row_heads);
    const int s_begin = tile * split.query_tile;
    const int s_end = std::min(p.query_len, s_begin + split.query_tile);
    if (fused) fill_split_rows<T>(p, split, b, kv_head, key_split, scratch);
    attend_task<T>(p, split, b, kv_head, s_begin, s_end, key_split, partials.data(), scratch);
  });

  if (split.key_splits == 1) return;
  run_tasks(static_cast<int64_t>(p.batch) * p.q_heads * p.query_len,
            [&](int64_t i, std::vector<float>& scratch) {
              const int s = static_cast<int>(i % p.query_len);
              const int q_head = static_cast<int>(i / p.query_len % p.q_heads);
              const int b = static_cast<int>(i / p.query_len / p.q_heads);
              merge_splits<T>(p, split, b, q_head, s, partials.data(), scratch);
            });
}

// ---- validation -----------------------------------------------------------------------------

// " (error flag 8, 16: <wording>; <wording>)", the wording shared with CUDA and Python.
std::string flag_words(uint32_t flags) {
  std::string numbers, words;
  for (int bit = 0; bit < kNumErrorFlags; ++bit) {
    if (!(flags & (1u << bit))) continue;
    numbers += (numbers.empty() ? "" : ", ") + std::to_string(1u << bit);
    words += (words.empty() ? "" : "; ") + std::string(error_flag_message(bit));
  }
  return " (error flag " + numbers + ": " + words + ")";
}

std::string describe_row_error(const Params& p, int b, const RowGeometry& g) {
  const int64_t seqlen = p.seqlens_k[b], total = seqlen + 1;
  const std::string total_text = " gives total length " + std::to_string(total);
  std::string m = "seqlens_k[" + std::to_string(b) + "] = " + std::to_string(seqlen);
  if (g.flags & kErrTotalOverflow) {
    m += ", so seqlens_k + 1 = " + std::to_string(total) + " does not fit in int32";
  } else if (p.first_prompt && (g.flags & kErrPastNegative)) {
    m += total_text + ", but a row holds at least 1 token";
  } else if (g.flags & (kErrPastNegative | kErrQueryNegative)) {
    m += total_text + ", which is less than the " + std::to_string(p.query_len) +
         " new tokens of this call";
  } else if (g.flags & kErrPastCapacity) {
    m += " gives past length " + std::to_string(total - p.query_len) + " (total length minus the " +
         std::to_string(p.query_len) + " new tokens), which exceeds the past_key/past_value " +
         "capacity " + std::to_string(p.past_capacity);
  } else {
    m += total_text + ", which exceeds the cache capacity " + std::to_string(p.capacity);
  }
  return m + flag_words(g.flags);
}

}  // namespace

std::string validate_rows(const Params& p, uint32_t* flags) {
  std::string first_problem;
  uint32_t all_flags = 0;
  for (int b = 0; b < p.batch; ++b) {
    const RowGeometry g = row_geometry(p, p.seqlens_k[b]);
    std::string problem;
    if (g.flags != 0) {
      all_flags |= g.flags;
      problem = describe_row_error(p, b, g);
    } else if (p.do_rotary) {
      // Every new token is rotated on the key side, first-prompt padding included.
      for (int s = 0; s < p.query_len && problem.empty(); ++s) {
        const int64_t pos = rotary_position(p, g, b, s);
        if (position_in_range(p, pos)) continue;
        all_flags |= kErrPosition;
        const std::string outside = " is outside the cos_cache/sin_cache rows [0, " +
                                    std::to_string(p.max_positions) + ")";
        const std::string row = std::to_string(b), token = std::to_string(s);
        if (p.position_ids != nullptr) {
          problem = "position_ids[" + row + ", " + token + "] = " + std::to_string(pos) + outside +
                    flag_words(kErrPosition);
        } else {
          problem = "seqlens_k[" + row + "] = " + std::to_string(p.seqlens_k[b]) + " gives rotary position " +
                    std::to_string(pos) + " of row " + row + " (token " + token + "), which" + outside +
                    flag_words(kErrPosition);
        }
      }
    }
    if (first_problem.empty()) first_problem = problem;
  }
  if (flags != nullptr) *flags = all_flags;
  return first_problem;
}

void run(const Params& p) {
  switch (p.dtype) {
    case DType::kFloat32: run_typed<float>(p); break;
    case DType::kFloat16: run_typed<c10::Half>(p); break;
    case DType::kBFloat16: run_typed<c10::BFloat16>(p); break;
  }
}

}  // namespace cpu
}  // namespace gqa
