// Schemas and backend impls of torch.ops.gqa.*. This directory is the only place that
// includes torch headers; everything below it sees a plain Params struct.
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include "../core/errors.h"
#include "../cpu/gqa_cpu.h"
#include "backend.h"
#include "cpu_output_cache.h"
#include "params_builder.h"

namespace gqa {
namespace {

// The tag Python looks for to turn a data-dependent failure into gqa_torch.GQAError.
std::string error_tag(uint32_t flags) { return c10::str("[gqa-error-flags=", flags, "] "); }

void run_cpu_checked(const Params& p) {
  uint32_t flags = 0;
  const std::string problem = cpu::validate_rows(p, &flags);
  TORCH_CHECK_VALUE(problem.empty(), error_tag(flags), "gqa: ", problem);
  cpu::run(p);
}

// CPU outputs come from the recycling cache (cpu_output_cache.h): a functional call's fresh
// present is otherwise mapped and zeroed by the kernel page by page, at more than the
// attention's cost.
at::Tensor empty_output(at::IntArrayRef shape, const at::TensorOptions& options) {
  return options.device().is_cpu() ? empty_cpu_output(shape, options) : at::empty(shape, options);
}

using Opt = c10::optional<at::Tensor>;

OpInputs make_inputs(const at::Tensor& query, const Opt& key, const Opt& value, const at::Tensor* past_key,
                     const at::Tensor* past_value, const at::Tensor& seqlens_k, const Opt& cos_cache,
                     const Opt& sin_cache, const Opt& position_ids, const Opt& head_sink, int64_t num_heads,
                     int64_t kv_num_heads, double scale, bool do_rotary, bool rotary_interleaved,
                     int64_t local_window_size, double softcap, bool smooth_softmax, int64_t kv_layout) {
  return OpInputs{query,     key,          value,        past_key,      past_value,         seqlens_k,
                  cos_cache, sin_cache,    position_ids, head_sink,     num_heads,          kv_num_heads,
                  scale,     do_rotary,    rotary_interleaved,          local_window_size,  softcap,
                  smooth_softmax,          kv_layout};
}

// Functional op, for any backend: validate, allocate outputs, then run on `device_kind`.
std::tuple<at::Tensor, at::Tensor, at::Tensor> functional_impl(
    const at::Tensor& query, const Opt& key, const Opt& value, const Opt& past_key, const Opt& past_value,
    const at::Tensor& seqlens_k, int64_t total_sequence_length, const Opt& cos_cache, const Opt& sin_cache,
    const Opt& position_ids, const Opt& head_sink, int64_t num_heads, int64_t kv_num_heads, double scale,
    bool do_rotary, bool rotary_interleaved, int64_t local_window_size, double softcap, bool smooth_softmax,
    int64_t kv_layout) {
  const OpInputs in = make_inputs(query, key, value, past_key ? &*past_key : nullptr,
                                  past_value ? &*past_value : nullptr, seqlens_k, cos_cache, sin_cache,
                                  position_ids, head_sink, num_heads, kv_num_heads, scale, do_rotary,
                                  rotary_interleaved, local_window_size, softcap, smooth_softmax, kv_layout);
  Params p = build_params(in, /*inplace=*/false, total_sequence_length);
  at::Tensor output = empty_output({p.batch, p.query_len, int64_t(p.q_heads) * p.head_dim}, query.options());
  const auto shape = cache_shape(p.batch, p.kv_heads, p.capacity, p.head_dim, kv_layout);
  at::Tensor present_key = empty_output(shape, query.options());
  at::Tensor present_value = empty_output(shape, query.options());
  set_cache(p, present_key, present_value);
  set_output(p, output);
  if (query.is_cuda()) {
    run_cuda(p, query, /*synchronous_check=*/true);
  } else {
    run_cpu_checked(p);
  }
  return {output, present_key, present_value};
}

at::Tensor inplace_impl(const at::Tensor& query, const Opt& key, const Opt& value, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, const at::Tensor& seqlens_k, const Opt& cos_cache,
                        const Opt& sin_cache, const Opt& position_ids, const Opt& head_sink, int64_t num_heads,
                        int64_t kv_num_heads, double scale, bool do_rotary, bool rotary_interleaved,
                        int64_t local_window_size, double softcap, bool smooth_softmax, int64_t kv_layout) {
  const OpInputs in = make_inputs(query, key, value, &key_cache, &value_cache, seqlens_k, cos_cache, sin_cache,
                                  position_ids, head_sink, num_heads, kv_num_heads, scale, do_rotary,
                                  rotary_interleaved, local_window_size, softcap, smooth_softmax, kv_layout);
  Params p = build_params(in, /*inplace=*/true, -1);
  at::Tensor output = empty_output({p.batch, p.query_len, int64_t(p.q_heads) * p.head_dim}, query.options());
  set_cache(p, key_cache, value_cache);
  set_output(p, output);
  if (query.is_cuda()) {
    run_cuda(p, query, /*synchronous_check=*/false);
  } else {
    run_cpu_checked(p);
  }
  // The caches changed behind autograd's back: like PyTorch's own in-place ops, bump their
  // version counters, so that backward through a graph that saved a cache before this call
  // raises instead of reading the new values. (Inference tensors have no counter.)
  for (const at::Tensor* cache : {&key_cache, &value_cache})
    if (!cache->is_inference()) torch::autograd::impl::bump_version(*cache);
  return output;
}

}  // namespace

TORCH_LIBRARY(gqa, m) {
  m.def(
      "group_query_attention(Tensor query, Tensor? key, Tensor? value, Tensor? past_key, Tensor? past_value, "
      "Tensor seqlens_k, int total_sequence_length, Tensor? cos_cache=None, Tensor? sin_cache=None, "
      "Tensor? position_ids=None, Tensor? head_sink=None, *, int num_heads, int kv_num_heads, "
      "float scale=0.0, bool do_rotary=False, bool rotary_interleaved=False, int local_window_size=-1, "
      "float softcap=0.0, bool smooth_softmax=False, int kv_layout=0) -> (Tensor, Tensor, Tensor)");
  m.def(
      "group_query_attention_(Tensor query, Tensor? key, Tensor? value, Tensor(a!) key_cache, "
      "Tensor(b!) value_cache, Tensor seqlens_k, Tensor? cos_cache=None, Tensor? sin_cache=None, "
      "Tensor? position_ids=None, Tensor? head_sink=None, *, int num_heads, int kv_num_heads, "
      "float scale=0.0, bool do_rotary=False, bool rotary_interleaved=False, int local_window_size=-1, "
      "float softcap=0.0, bool smooth_softmax=False, int kv_layout=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(gqa, CPU, m) {
  m.impl("group_query_attention", &functional_impl);
  m.impl("group_query_attention_", &inplace_impl);
}

TORCH_LIBRARY_IMPL(gqa, CUDA, m) {
  m.impl("group_query_attention", &functional_impl);
  m.impl("group_query_attention_", &inplace_impl);
}

// The ops have no backward. Without this, an output of inputs that require grad would backprop
// as if it did not depend on them (PyTorch only warns): now its backward raises "derivative for
// gqa::... is not implemented". The forward runs as before.
TORCH_LIBRARY_IMPL(gqa, Autograd, m) {
  m.impl("group_query_attention", torch::autograd::autogradNotImplementedFallback());
  m.impl("group_query_attention_", torch::autograd::autogradNotImplementedFallback());
}

}  // namespace gqa
