// Tensors → Params: every host-checkable rule of SPEC §4, then the plain struct.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include "../core/params.h"

namespace gqa {

// The inputs both operators share, as they arrive from the dispatcher.
struct OpInputs {
  const at::Tensor& query;
  const c10::optional<at::Tensor>& key;
  const c10::optional<at::Tensor>& value;
  const at::Tensor* past_key;    // functional: optional past; in-place: the caches (required)
  const at::Tensor* past_value;
  const at::Tensor& seqlens_k;
  const c10::optional<at::Tensor>& cos_cache;
  const c10::optional<at::Tensor>& sin_cache;
  const c10::optional<at::Tensor>& position_ids;
  const c10::optional<at::Tensor>& head_sink;
  int64_t num_heads;
  int64_t kv_num_heads;
  double scale;
  bool do_rotary;
  bool rotary_interleaved;
  int64_t local_window_size;
  double softcap;
  bool smooth_softmax;
  int64_t kv_layout;
};

// Validates everything that does not need device data and fills shapes, attributes and the
// input pointers. `total_sequence_length` is used by the functional op only (pass -1 for the
// in-place op). Cache/output pointers are filled by the caller (set_cache / set_output).
Params build_params(const OpInputs& in, bool inplace, int64_t total_sequence_length);

// Shape of a cache of `capacity` rows in the given layout.
std::vector<int64_t> cache_shape(int64_t batch, int64_t kv_heads, int64_t capacity,
                                 int64_t head_dim, int64_t kv_layout);

// Points Params at the cache being written (present or in-place) and at the output.
void set_cache(Params& p, const at::Tensor& key_cache, const at::Tensor& value_cache);
void set_output(Params& p, const at::Tensor& output);

DType to_dtype(at::ScalarType t);

}  // namespace gqa
