// Internal launchers, one per kernel family; launch.cu chooses among them. Each enqueues on
// `stream`, never synchronises, and throws std::runtime_error on a launch failure.
#pragma once

#include <cuda_runtime.h>

#include "common.cuh"

namespace gqa {
namespace cuda {
namespace detail {

// Head sizes with a templated tensor-core path (fp16/bf16).
inline bool is_fast_head_dim(int d) { return d == 64 || d == 80 || d == 96 || d == 128 || d == 256; }

// prep.cu: row checks, error latch, RoPE + append of the new K/V, functional past copy and
// zero fill. `check_positions`: this launch checks every rotary position itself (otherwise
// launch_validate_rows ran just before it). `rope_q` (with p.do_rotary): the new query rows,
// rotated, go into p.output (for launch_prefill_mma to read q from there, unrotated).
void launch_validate_rows(const Params& p, cudaStream_t stream);
// skip_new_rows (in place, no RoPE): rows with no past are left to the attention kernel
// (prefill_mma_appends); their checks still run here.
void launch_prep(const Params& p, bool check_positions, cudaStream_t stream, bool rope_q = false,
                 bool skip_new_rows = false);

// decode_*.cu: S == 1 on tensor cores. `fused`: in-place op, the kernel also validates the
// rows and appends the new K/V itself (no prep launch). Returns whether the kernel merged its
// splits itself (the last split CTA to finish); otherwise, with several splits, launch_merge
// follows.
bool launch_decode_mma_bf16(const Params& p, const Work& w, bool fused, cudaStream_t stream);
bool launch_decode_mma_fp16(const Params& p, const Work& w, bool fused, cudaStream_t stream);

// generic.cu: any dtype, any even head size, any alignment (CUDA cores), S == 1 with split-K
// or S > 1; and the split-K merge.
void launch_generic(const Params& p, const Work& w, cudaStream_t stream);
void launch_merge(const Params& p, const Work& w, cudaStream_t stream);

}  // namespace detail
}  // namespace cuda
}  // namespace gqa
