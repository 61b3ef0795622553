#include "params_builder.h"


#include <cmath>
#include <limits>

namespace gqa {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

std::string shape_str(const at::Tensor& t) { return c10::str(t.sizes()); }

void check_fits_int32(int64_t value, const char* what) {
  TORCH_CHECK_VALUE(value <= kInt32Max, "gqa: ", what, " = ", value,
                    " overflows 32-bit indexing; expected at most ", kInt32Max);
}

void check_same_device(const at::Tensor& t, const at::Tensor& query, const char* name) {
  TORCH_CHECK_VALUE(t.device() == query.device(), "gqa: ", name, ": expected a tensor on ",
                    query.device(), " (the device of query), got one on ", t.device());
}

void check_float_dtype(const at::Tensor& t, const at::Tensor& query, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == query.scalar_type(), "gqa: ", name,
                   ": expected dtype ", query.scalar_type(), " (the dtype of query), got ",
                   t.scalar_type());
}

// A [B, S, hidden] activation whose hidden dim is contiguous; batch/token strides are free.
void check_activation(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == 3, "gqa: ", name, ": expected a 3-D tensor [batch, sequence, hidden], got shape ",
                    shape_str(t));
  TORCH_CHECK_VALUE(t.size(2) <= 1 || t.stride(2) == 1, "gqa: ", name,
                    ": expected the hidden dimension to be contiguous (stride 1), got strides ",
                    c10::str(t.strides()));
}

// A rank-4 cache in the given layout whose head dim is contiguous.
void check_cache(const at::Tensor& t, const at::Tensor& query, const char* name, int64_t batch,
                 int64_t kv_heads, int64_t head_dim, int64_t kv_layout) {
  check_same_device(t, query, name);
  check_float_dtype(t, query, name);
  const char* layout = kv_layout == 0 ? "BNSH [batch, kv_num_heads, capacity, head_size]"
                                      : "BSNH [batch, capacity, kv_num_heads, head_size]";
  TORCH_CHECK_VALUE(t.dim() == 4, "gqa: ", name, ": expected a 4-D ", layout, " tensor, got shape ",
                    shape_str(t));
  const int64_t heads_dim = kv_layout == 0 ? 1 : 2;
  TORCH_CHECK_VALUE(t.size(0) == batch && t.size(heads_dim) == kv_heads && t.size(3) == head_dim,
                    "gqa: ", name, ": expected ", layout, " with batch=", batch,
                    ", kv_num_heads=", kv_heads, ", head_size=", head_dim, ", got shape ",
                    shape_str(t));
  TORCH_CHECK_VALUE(t.size(3) <= 1 || t.stride(3) == 1, "gqa: ", name,
                    ": expected the head_size dimension to be contiguous (stride 1), got strides ",
                    c10::str(t.strides()));
}

TokenStrides activation_strides(const at::Tensor& t, int64_t head_dim) {
  return TokenStrides{t.stride(0), t.stride(1), head_dim};
}

TokenStrides cache_strides(const at::Tensor& t, int64_t kv_layout) {
  return kv_layout == 0 ? TokenStrides{t.stride(0), t.stride(2), t.stride(1)}
                        : TokenStrides{t.stride(0), t.stride(1), t.stride(2)};
}

}  // namespace

DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: break;
  }
  TORCH_CHECK_TYPE(false, "gqa: unsupported dtype ", t);
}

std::vector<int64_t> cache_shape(int64_t batch, int64_t kv_heads, int64_t capacity,
                                 int64_t head_dim, int64_t kv_layout) {
  if (kv_layout == 0) return {batch, kv_heads, capacity, head_dim};
  return {batch, capacity, kv_heads, head_dim};
}

Params build_params(const OpInputs& in, bool inplace, int64_t total_sequence_length) {
  const at::Tensor& query = in.query;
  Params p;

  // ---- attributes -----------------------------------------------------------------------
  TORCH_CHECK_VALUE(in.num_heads > 0, "gqa: num_heads: expected a positive head count, got ", in.num_heads);
  TORCH_CHECK_VALUE(in.kv_num_heads > 0, "gqa: kv_num_heads: expected a positive head count, got ",
                    in.kv_num_heads);
  TORCH_CHECK_VALUE(in.num_heads % in.kv_num_heads == 0, "gqa: num_heads: expected a multiple of kv_num_heads (",
                    in.kv_num_heads, "), got ", in.num_heads);
  TORCH_CHECK_VALUE(in.local_window_size == -1 || in.local_window_size > 0,
                    "gqa: local_window_size: expected -1 (off) or a positive window, got ", in.local_window_size);
  check_fits_int32(in.local_window_size, "local_window_size");
  TORCH_CHECK_VALUE(std::isfinite(in.softcap) && in.softcap >= 0.0,
                    "gqa: softcap: expected a finite value >= 0 (0 = off), got ", in.softcap);
  // Both are used as float32 (as in ORT, whose attributes are floats): a value that is finite as
  // a double but not as a float would turn into inf (NaN outputs), and a positive softcap that
  // rounds to 0 would silently switch the cap off.
  TORCH_CHECK_VALUE(in.softcap == 0.0 || (std::isfinite(static_cast<float>(in.softcap)) &&
                                          static_cast<float>(in.softcap) > 0.f),
                    "gqa: softcap: expected 0 (off) or a value float32 can hold (",
                    std::numeric_limits<float>::denorm_min(), " to ", std::numeric_limits<float>::max(),
                    "), got ", in.softcap);
  TORCH_CHECK_VALUE(std::isfinite(in.scale), "gqa: scale: expected a finite value (0 = 1/sqrt(head_size)), got ",
                    in.scale);
  TORCH_CHECK_VALUE(std::isfinite(static_cast<float>(in.scale)),
                    "gqa: scale: expected a value float32 can hold (|scale| <= ", std::numeric_limits<float>::max(),
                    "), got ", in.scale);
  TORCH_CHECK_VALUE(in.kv_layout == 0 || in.kv_layout == 1,
                    "gqa: kv_layout: expected 0 (BNSH) or 1 (BSNH), got ", in.kv_layout);

  // ---- query / key / value --------------------------------------------------------------
  TORCH_CHECK_TYPE(query.scalar_type() == at::kFloat || query.scalar_type() == at::kHalf ||
                       query.scalar_type() == at::kBFloat16,
                   "gqa: query: expected dtype float32, float16 or bfloat16, got ", query.scalar_type());
  check_activation(query, "query");
  TORCH_CHECK_VALUE(in.key.has_value() == in.value.has_value(),
                    "gqa: key/value: expected both present or both absent (packed QKV), got key ",
                    in.key.has_value() ? "present" : "absent", " and value ",
                    in.value.has_value() ? "present" : "absent");
  const bool packed = !in.key.has_value();
  const int64_t batch = query.size(0);
  const int64_t seq = query.size(1);
  const int64_t hidden = query.size(2);
  const int64_t heads_in_query = packed ? in.num_heads + 2 * in.kv_num_heads : in.num_heads;
  TORCH_CHECK_VALUE(hidden > 0 && hidden % heads_in_query == 0, "gqa: query: expected hidden size ",
                    packed ? "(num_heads + 2*kv_num_heads)*head_size = (" : "num_heads*head_size = (",
                    heads_in_query, ")*head_size, got ", hidden, " (shape ", shape_str(query), ")");
  const int64_t head_dim = hidden / heads_in_query;
  TORCH_CHECK_VALUE(batch > 0, "gqa: query: expected batch >= 1, got shape ", shape_str(query));
  TORCH_CHECK_VALUE(seq > 0, "gqa: query: expected sequence length >= 1, got shape ", shape_str(query));
  check_fits_int32(batch, "batch");
  check_fits_int32(seq, "sequence length");
  check_fits_int32(batch * in.num_heads * seq, "batch*num_heads*sequence_length");

  p.batch = static_cast<int32_t>(batch);
  p.query_len = static_cast<int32_t>(seq);
  p.q_heads = static_cast<int32_t>(in.num_heads);
  p.kv_heads = static_cast<int32_t>(in.kv_num_heads);
  p.group_size = p.q_heads / p.kv_heads;
  p.head_dim = static_cast<int32_t>(head_dim);
  p.packed_qkv = packed;
  p.inplace = inplace;
  p.kv_layout = static_cast<int32_t>(in.kv_layout);
  p.dtype = to_dtype(query.scalar_type());
  p.query = query.data_ptr();
  p.query_strides = activation_strides(query, head_dim);

  if (packed) {
    const size_t elem = query.element_size();
    p.key = static_cast<const char*>(p.query) + elem * in.num_heads * head_dim;
    p.value = static_cast<const char*>(p.query) + elem * (in.num_heads + in.kv_num_heads) * head_dim;
    p.key_strides = p.query_strides;
    p.value_strides = p.query_strides;
  } else {
    const at::Tensor* kv[2] = {&*in.key, &*in.value};
    const char* names[2] = {"key", "value"};
    for (int i = 0; i < 2; ++i) {
      const at::Tensor& t = *kv[i];
      check_same_device(t, query, names[i]);
      check_float_dtype(t, query, names[i]);
      check_activation(t, names[i]);
      TORCH_CHECK_VALUE(t.size(0) == batch && t.size(1) == seq && t.size(2) == in.kv_num_heads * head_dim,
                        "gqa: ", names[i], ": expected shape [", batch, ", ", seq, ", ",
                        in.kv_num_heads * head_dim, "] ([batch, sequence_length of query, kv_num_heads*head_size]), got ",
                        shape_str(t));
    }
    p.key = in.key->data_ptr();
    p.value = in.value->data_ptr();
    p.key_strides = activation_strides(*in.key, head_dim);
    p.value_strides = activation_strides(*in.value, head_dim);
  }

  // ---- caches ---------------------------------------------------------------------------
  const char* key_name = inplace ? "key_cache" : "past_key";
  const char* value_name = inplace ? "value_cache" : "past_value";
  TORCH_CHECK_VALUE((in.past_key != nullptr) == (in.past_value != nullptr), "gqa: ", key_name, "/",
                    value_name, ": expected both present or both absent, got ", key_name, " ",
                    in.past_key ? "present" : "absent", " and ", value_name, " ",
                    in.past_value ? "present" : "absent");
  int64_t past_rows = 0;
  if (in.past_key != nullptr) {
    check_cache(*in.past_key, query, key_name, batch, in.kv_num_heads, head_dim, in.kv_layout);
    check_cache(*in.past_value, query, value_name, batch, in.kv_num_heads, head_dim, in.kv_layout);
    TORCH_CHECK_VALUE(in.past_key->sizes() == in.past_value->sizes(), "gqa: ", value_name,
                      ": expected the shape of ", key_name, " ", shape_str(*in.past_key), ", got ",
                      shape_str(*in.past_value));
    TORCH_CHECK_VALUE(in.past_key->strides() == in.past_value->strides(), "gqa: ", value_name,
                      ": expected the strides of ", key_name, " ", c10::str(in.past_key->strides()),
                      ", got ", c10::str(in.past_value->strides()));
    past_rows = in.past_key->size(in.kv_layout == 0 ? 2 : 1);
    check_fits_int32(past_rows, inplace ? "cache capacity" : "past capacity");
  }
  if (inplace) {
    TORCH_CHECK_VALUE(in.past_key != nullptr, "gqa: key_cache: expected a cache tensor, got none");
    TORCH_CHECK_VALUE(past_rows > 0, "gqa: key_cache: expected a capacity >= 1, got shape ",
                      shape_str(*in.past_key));
    p.capacity = static_cast<int32_t>(past_rows);
    p.past_capacity = 0;
  } else {
    TORCH_CHECK_VALUE(total_sequence_length >= 0,
                      "gqa: total_sequence_length: expected a value >= 0, got ", total_sequence_length);
    check_fits_int32(total_sequence_length, "total_sequence_length");
    p.past_capacity = static_cast<int32_t>(past_rows);
    p.capacity = static_cast<int32_t>(std::max(past_rows, total_sequence_length));
    p.first_prompt = past_rows == 0 && seq == total_sequence_length;
    if (in.past_key != nullptr && past_rows > 0) {
      p.past_key = in.past_key->data_ptr();
      p.past_value = in.past_value->data_ptr();
      p.past_strides = cache_strides(*in.past_key, in.kv_layout);
    }
  }

  // ---- seqlens_k --------------------------------------------------------------------------
  const at::Tensor& seqlens = in.seqlens_k;
  check_same_device(seqlens, query, "seqlens_k");
  TORCH_CHECK_TYPE(seqlens.scalar_type() == at::kInt, "gqa: seqlens_k: expected dtype int32, got ",
                   seqlens.scalar_type());
  const bool shape_ok = (seqlens.dim() == 1 && seqlens.size(0) == batch) ||
                        (seqlens.dim() == 2 && seqlens.size(0) == batch && seqlens.size(1) == 1) ||
                        (seqlens.dim() == 0 && batch == 1);
  TORCH_CHECK_VALUE(shape_ok, "gqa: seqlens_k: expected shape [", batch, "] or [", batch,
                    ", 1]", batch == 1 ? " or a scalar" : "", ", got ", shape_str(seqlens));
  TORCH_CHECK_VALUE(seqlens.is_contiguous(), "gqa: seqlens_k: expected a contiguous tensor, got strides ",
                    c10::str(seqlens.strides()));
  p.seqlens_k = seqlens.data_ptr<int32_t>();

  // ---- rotary -------------------------------------------------------------------------------
  p.do_rotary = in.do_rotary;
  p.rotary_interleaved = in.rotary_interleaved;
  if (in.do_rotary) {
    TORCH_CHECK_VALUE(in.cos_cache.has_value() && in.sin_cache.has_value(),
                      "gqa: cos_cache/sin_cache: expected both when do_rotary=True, got cos_cache ",
                      in.cos_cache.has_value() ? "present" : "absent", " and sin_cache ",
                      in.sin_cache.has_value() ? "present" : "absent");
    const at::Tensor& cos = *in.cos_cache;
    const at::Tensor& sin = *in.sin_cache;
    check_same_device(cos, query, "cos_cache");
    check_same_device(sin, query, "sin_cache");
    TORCH_CHECK_VALUE(cos.dim() == 2, "gqa: cos_cache: expected a 2-D tensor [max_positions, rotary_dim/2], got shape ",
                      shape_str(cos));
    TORCH_CHECK_VALUE(sin.sizes() == cos.sizes(), "gqa: sin_cache: expected the shape of cos_cache ",
                      shape_str(cos), ", got ", shape_str(sin));
    TORCH_CHECK_TYPE(sin.scalar_type() == cos.scalar_type(), "gqa: sin_cache: expected the dtype of cos_cache ",
                     cos.scalar_type(), ", got ", sin.scalar_type());
    const bool dtype_ok = cos.scalar_type() == at::kFloat ||
                          (cos.scalar_type() == query.scalar_type() && query.scalar_type() != at::kFloat);
    TORCH_CHECK_TYPE(dtype_ok, "gqa: cos_cache: expected dtype float32",
                     query.scalar_type() != at::kFloat ? c10::str(" or ", query.scalar_type()) : std::string(),
                     ", got ", cos.scalar_type());
    TORCH_CHECK_VALUE(cos.is_contiguous() && sin.is_contiguous(),
                      "gqa: cos_cache/sin_cache: expected contiguous tensors, got strides ",
                      c10::str(cos.strides()), " and ", c10::str(sin.strides()));
    const int64_t rotary_dim = 2 * cos.size(1);
    TORCH_CHECK_VALUE(rotary_dim >= 2 && rotary_dim <= head_dim,
                      "gqa: cos_cache: expected width rotary_dim/2 with 2 <= rotary_dim <= head_size (",
                      head_dim, "), got width ", cos.size(1), " (shape ", shape_str(cos), ")");
    TORCH_CHECK_VALUE(cos.size(0) > 0, "gqa: cos_cache: expected at least one position row, got shape ",
                      shape_str(cos));
    check_fits_int32(cos.size(0), "cos_cache rows");
    p.rotary_dim = static_cast<int32_t>(rotary_dim);
    p.max_positions = static_cast<int32_t>(cos.size(0));
    p.rotary_dtype = to_dtype(cos.scalar_type());
    p.cos_cache = cos.data_ptr();
    p.sin_cache = sin.data_ptr();
  }
  if (in.position_ids.has_value()) {
    const at::Tensor& pos = *in.position_ids;
    check_same_device(pos, query, "position_ids");
    TORCH_CHECK_TYPE(pos.scalar_type() == at::kLong, "gqa: position_ids: expected dtype int64, got ",
                     pos.scalar_type());
    TORCH_CHECK_VALUE(pos.dim() == 2 && pos.size(0) == batch && pos.size(1) == seq,
                      "gqa: position_ids: expected shape [", batch, ", ", seq, "] ([batch, sequence_length]), got ",
                      shape_str(pos));
    TORCH_CHECK_VALUE(pos.is_contiguous(), "gqa: position_ids: expected a contiguous tensor, got strides ",
                      c10::str(pos.strides()));
    // Positions only steer RoPE; without it they are accepted and ignored, as in ORT.
    if (in.do_rotary) p.position_ids = pos.data_ptr<int64_t>();
  }
  if (in.head_sink.has_value()) {
    const at::Tensor& sink = *in.head_sink;
    check_same_device(sink, query, "head_sink");
    TORCH_CHECK_TYPE(sink.scalar_type() == at::kFloat, "gqa: head_sink: expected dtype float32, got ",
                     sink.scalar_type());
    TORCH_CHECK_VALUE(sink.dim() == 1 && sink.size(0) == in.num_heads, "gqa: head_sink: expected shape [",
                      in.num_heads, "] ([num_heads]), got ", shape_str(sink));
    TORCH_CHECK_VALUE(sink.is_contiguous(), "gqa: head_sink: expected a contiguous tensor");
    p.head_sink = sink.data_ptr<float>();
  }

  p.scale = in.scale == 0.0 ? static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)))
                            : static_cast<float>(in.scale);
  p.softcap = static_cast<float>(in.softcap);
  p.local_window = static_cast<int32_t>(in.local_window_size);
  p.smooth_softmax = in.smooth_softmax;
  return p;
}

void set_cache(Params& p, const at::Tensor& key_cache, const at::Tensor& value_cache) {
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.cache_strides = cache_strides(key_cache, p.kv_layout);
}

void set_output(Params& p, const at::Tensor& output) {
  p.output = output.data_ptr();
  p.output_strides = TokenStrides{output.stride(0), output.stride(1), p.head_dim};
}

}  // namespace gqa
