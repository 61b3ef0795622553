// Tensor-core flash-attention prefill (mma.sync m16n8k16, sm80+) for fp16/bf16.
// Torch-free: callable from any host code that has filled a gqa::Params.
#pragma once

#include "../core/params.h"

namespace gqa {
namespace cuda {

// Enqueues the attention of every query row of the call on `stream` (a cudaStream_t), reading
// K/V from p.key_cache/p.value_cache (already appended by prep) and writing p.output in place.
// `q` with `q_strides` (elements: batch, token, head; D contiguous) may point into a packed QKV
// tensor; with `rotate_q` RoPE is applied to q on load (p.rotary_* / cos / sin / position_ids).
//
// Returns false, launching nothing, when this kernel does not cover the case (fp32, a head size
// that is not a multiple of 8 or is above 256, pointers or strides not 16-byte aligned, ...):
// the caller then uses the simple prefill kernel. Throws std::runtime_error on a launch failure.
// With splits > 1 every query block's key range is cut into `splits` parts, each CTA writes its
// rows' normalised partial outputs and log-sum-exps ([B, S, Hq, splits, D] and [B, S, Hq,
// splits], empty parts as -inf) instead of the output, and the caller runs the merge.
bool launch_prefill_mma(const Params& p, const void* q, TokenStrides q_strides, bool rotate_q, float* partial_out,
                        float* partial_lse, int splits, void* stream);

// Which variant of the kernel prefill takes (tests and benchmarks pin one):
//   0 auto: the Hopper wgmma variant for padded head size 128 on an sm90 device when the build
//           targets sm90a (measured faster there; slower at 64), mma.sync otherwise;
//   1 mma.sync always; 2 wgmma whenever it can run (padded head size 64 or 128, sm90, sm90a build);
//   3 (experimental) the pipelined wgmma order where wgmma can run; 4 and 5 (experimental) routes
//   2 and 3 with 128-key tiles; 6 and 7 (experimental) routes 2 and 3 warp-specialised; 8
//   (experimental) route 7 with the two computing warpgroups taking turns (ping-pong); 9 and 10
//   (experimental) routes 7 and 8 loading whole K/V tiles by TMA.
void set_prefill_route(int route);

}  // namespace cuda
}  // namespace gqa
