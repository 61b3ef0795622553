// The data-dependent error flags (SPEC §4) and the per-row geometry they guard.
// Shared by the CPU backend, the CUDA kernels and (through the extension module) Python, so
// the bits and their wording live in exactly one place.
#pragma once

#include <cstdint>

#include "params.h"

#if defined(__CUDACC__)
#define GQA_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define GQA_HOST_DEVICE inline
#endif

namespace gqa {

enum ErrorFlag : uint32_t {
  kErrTotalOverflow = 1u,    // seqlens_k + 1 overflows int32
  kErrPastNegative = 2u,     // past length < 0
  kErrQueryNegative = 4u,    // query start < 0
  kErrPastCapacity = 8u,     // past length > past capacity (functional op)
  kErrCapacity = 16u,        // total length > cache capacity
  kErrPosition = 32u,        // a rotary position outside the cos/sin rows
};
constexpr int kNumErrorFlags = 6;

// Human wording of each flag, in bit order. Python decodes with the same strings.
inline const char* error_flag_message(int bit) {
  switch (bit) {
    case 0: return "seqlens_k + 1 overflows int32";
    case 1: return "past length (seqlens_k + 1 - new tokens) is negative";
    case 2: return "query start (seqlens_k + 1 - query tokens) is negative";
    case 3: return "past length exceeds the past_key/past_value capacity";
    case 4: return "total length (seqlens_k + 1) exceeds the cache capacity";
    case 5: return "a rotary position is outside the cos_cache/sin_cache rows";
    default: return "unknown flag";
  }
}

// Where one batch row stands. Pure function of seqlens_k[b] and shapes.
struct RowGeometry {
  int32_t total;        // valid keys after this call
  int32_t past;         // keys already in the cache before this call (new rows start here)
  int32_t query_start;  // position of query token 0
  int32_t valid_queries;  // query rows that attend (first prompt: min(S, total); else S)
  uint32_t flags;       // 0 when the row is valid
};

GQA_HOST_DEVICE RowGeometry row_geometry(const Params& p, int32_t seqlen_k) {
  RowGeometry g{};
  const int64_t total = static_cast<int64_t>(seqlen_k) + 1;
  uint32_t flags = 0;
  if (total > INT32_MAX) flags |= kErrTotalOverflow;
  if (p.first_prompt) {
    // New tokens sit at 0..S-1; rows s >= total are right padding.
    if (total < 1) flags |= kErrPastNegative;
    if (total > p.capacity) flags |= kErrCapacity;
    g.past = 0;
    g.query_start = 0;
    g.valid_queries = total < p.query_len ? static_cast<int32_t>(total < 0 ? 0 : total) : p.query_len;
  } else {
    const int64_t past = total - p.query_len;
    if (past < 0) flags |= kErrPastNegative | kErrQueryNegative;
    if (!p.inplace && past > p.past_capacity) flags |= kErrPastCapacity;
    if (total > p.capacity) flags |= kErrCapacity;
    g.past = static_cast<int32_t>(past);
    g.query_start = static_cast<int32_t>(past);
    g.valid_queries = p.query_len;
  }
  g.total = static_cast<int32_t>(total);
  g.flags = flags;
  return g;
}

// Rotary position of new token s (query and key share it: S == Sk).
GQA_HOST_DEVICE int64_t rotary_position(const Params& p, const RowGeometry& g, int b, int s) {
  if (p.position_ids != nullptr) return p.position_ids[static_cast<int64_t>(b) * p.query_len + s];
  return static_cast<int64_t>(g.past) + s;
}

GQA_HOST_DEVICE bool position_in_range(const Params& p, int64_t pos) {
  return pos >= 0 && pos < p.max_positions;
}

}  // namespace gqa
