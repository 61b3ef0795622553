// The one plain struct that describes a call of either operator.
// No torch here: csrc/torch fills it from tensors, and the CPU backend and the CUDA kernels
// read it. Every strided access goes through the strides stored here, so BSH inputs, packed
// QKV, BNSH and BSNH caches are all read and written in place.
#pragma once

#include <cstdint>

namespace gqa {

enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Strides are in elements. A tensor of rows indexed (batch, token, head) starts each head's
// D contiguous values at base + b*batch + t*token + h*head.
struct TokenStrides {
  int64_t batch = 0;
  int64_t token = 0;
  int64_t head = 0;
};

struct Params {
  // ---- shapes -------------------------------------------------------------------------
  int32_t batch = 0;           // B
  int32_t query_len = 0;       // S (new query tokens == new key tokens this call)
  int32_t q_heads = 0;         // Hq
  int32_t kv_heads = 0;        // Hkv
  int32_t group_size = 0;      // G = Hq / Hkv
  int32_t head_dim = 0;        // D
  int32_t past_capacity = 0;   // P: rows of past_key/past_value (functional op), 0 if absent
  int32_t capacity = 0;        // C: rows of the cache that is written (present or in-place)
  int32_t rotary_dim = 0;      // R (0 unless do_rotary)
  int32_t max_positions = 0;   // rows of cos/sin

  // ---- mode ---------------------------------------------------------------------------
  bool inplace = false;        // group_query_attention_ (caches mutated) vs functional
  bool first_prompt = false;   // functional only: no past and S == total_sequence_length
  bool packed_qkv = false;     // key/value are views into the query tensor
  int32_t kv_layout = 0;       // 0 BNSH, 1 BSNH (only the strides below depend on it)

  // ---- attributes ---------------------------------------------------------------------
  float scale = 0.f;           // already resolved: never 0 here
  float softcap = 0.f;         // 0 = off
  int32_t local_window = -1;   // -1 = off, else W > 0
  bool smooth_softmax = false;
  bool do_rotary = false;
  bool rotary_interleaved = false;

  DType dtype = DType::kFloat32;         // query/key/value/caches/output
  DType rotary_dtype = DType::kFloat32;  // cos/sin

  // ---- data (device or host pointers, per backend) ------------------------------------
  const void* query = nullptr;  TokenStrides query_strides;
  const void* key = nullptr;    TokenStrides key_strides;    // never null: packed points into query
  const void* value = nullptr;  TokenStrides value_strides;
  const void* past_key = nullptr;    TokenStrides past_strides;   // functional op, may be null
  const void* past_value = nullptr;  // same strides as past_key
  void* key_cache = nullptr;    TokenStrides cache_strides;   // present (functional) or in-place cache
  void* value_cache = nullptr;  // same strides as key_cache
  void* output = nullptr;       TokenStrides output_strides;  // [B, S, Hq*D]

  const int32_t* seqlens_k = nullptr;     // [B]
  const void* cos_cache = nullptr;        // [max_positions, R/2], contiguous
  const void* sin_cache = nullptr;
  const int64_t* position_ids = nullptr;  // [B, S] contiguous, or null
  const float* head_sink = nullptr;       // [Hq] or null

  uint32_t* error_word = nullptr;         // CUDA only: the sticky per-device flags
  // CUDA prefill only: the query-block counter of the warp-specialised kernels' dynamic walk,
  // in the call's workspace (WorkspaceLayout::work_counter); prep zeroes it.
  int32_t* work_counter = nullptr;
  // CUDA decode only: zeroed counters that stay zero between calls, one per (row, kv head,
  // head chunk) up to arrival_slots, private to the stream the call runs on (cuda_backend.cpp);
  // null when that stream has none. With them the decode splits merge inside their launch.
  uint32_t* arrival_counters = nullptr;
  int32_t arrival_slots = 0;
};

inline int dtype_size(DType t) { return t == DType::kFloat32 ? 4 : 2; }

}  // namespace gqa
