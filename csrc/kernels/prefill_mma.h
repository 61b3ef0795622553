// Tensor-core flash-attention prefill for fp16/bf16: mma.sync m16n8k16 (sm80+), and on sm90
// in an sm90a build warp-specialised wgmma kernels fed by TMA.
// Torch-free: callable from any host code that has filled a gqa::Params.
#pragma once

#include "../core/params.h"

namespace gqa {
namespace cuda {

// Enqueues the attention of every query row of the call on `stream` (a cudaStream_t), reading
// K/V from p.key_cache/p.value_cache (already appended by prep) and writing p.output in place.
// `q` with `q_strides` (elements: batch, token, head; D contiguous) may point into a packed QKV
// tensor, or be p.output itself (each block reads its q rows before it writes the same rows of
// output); it is read as is (RoPE, when the call asks for it, is the caller's: prep).
//
// Returns false, launching nothing, when this kernel does not cover the case (fp32, a head size
// that is not a multiple of 8 or is above 256, pointers or strides not 16-byte aligned, ...):
// the caller then uses the simple prefill kernel. Throws std::runtime_error on a launch failure.
// With splits > 1 every query block's key range is cut into `splits` parts, each CTA writes its
// rows' normalised partial outputs and log-sum-exps ([B, S, Hq, splits, D] and [B, S, Hq,
// splits], empty parts as -inf) instead of the output, and the caller runs the merge.
//
// append_new (only where prefill_mma_appends said so, and prep was told to skip those rows):
// a row with no past reads its K/V from p.key / p.value, and the kernel writes them to the
// caches itself, each tile once, from the shared memory it loaded them into; rows with a past
// read the caches as prep left them.
bool launch_prefill_mma(const Params& p, const void* q, TokenStrides q_strides, float* partial_out,
                        float* partial_lse, int splits, bool append_new, void* stream);

// Whether launch_prefill_mma can take the cache append of rows with no past (in place, no
// RoPE, one key-range part, a warp-specialised kernel on this device, 16-byte aligned new
// rows, and set_prefill_append at 0). It takes the place of prep's copy: 67 MB moved at B=2,
// L=4096, D=128, 18 us on an H200, before the attention kernel could start.
bool prefill_mma_appends(const Params& p, int splits);

// Who writes the new rows of an in-place prefill with no RoPE to the caches: 0 (auto) the
// attention kernel where prefill_mma_appends allows, 1 prep always (A/B timing, tests).
void set_prefill_append(int append);

// Whether launch_prefill_mma would take this case (the same checks, nothing launched).
bool prefill_mma_covers(const Params& p, const void* q, TokenStrides q_strides);

// Which variant of the kernel prefill takes (tests and benchmarks pin one):
//   0 auto: on an sm90 device in an sm90a build, the warp-specialised wgmma kernel with
//           persistent CTAs (route 6's at padded head size 64; at 128 route 11's for prompts
//           of 2048 tokens or more, route 5's below; route 9's at 256) or, for a split key
//           range, the plain wgmma kernel (64, 128); mma.sync otherwise;
//   1 mma.sync always; 2 the plain wgmma kernel where it can run (64, 128);
//   3 the warp-specialised kernel, one CTA per query block; 4 the same with cp.async instead
//   of TMA in its loader (the fallback when the driver has no TMA encoder); 5 the same as 3
//   with persistent CTAs; 6 as 5 with three computing warpgroups at padded head size 64 (route
//   5's kernels elsewhere); 7 as 5 (6 at 64) with separate K and V stage barriers; 8 as 7 in
//   the pipelined order (the softmax of one tile overlaps P V of the previous; at 256 route
//   7's kernel, since the pipelined one spills there); 9 as 5 with 80-key K/V tiles at padded
//   head size 256 (auto's kernel there; route 5's kernels at 64 and 128); 10 route 8's kernel
//   with its two computing warpgroups taking turns to issue each step's MMAs (at 256, route 7's);
//   11 as 10 with three K/V stages and one Q tile at padded head size 128 (route 10's kernels
//   elsewhere). The pipelined kernels, route 5's kernel at padded head size 128 and route 9's
//   at 256 exponentiate each tile's scores against the rows' current bases before the row
//   maxima are known, and again only when a base moves (softmax_ahead: the same bits either
//   way).
void set_prefill_route(int route);

// How the warp-specialised kernels' loader stages each query block's Q tile: 0 (auto) by TMA
// where it can (G divides 64, scale >= 0, every row of the block a real query row; cp.async for
// the others), 1 by cp.async always (kept for A/B timing and as the tested fallback).
void set_prefill_q_loader(int loader);

// Diagnostics (benchmarks/block_timeline.py): the warp-specialised kernels' computing
// warpgroups stamp each query block into `records` (device memory, `count` records of 8
// 64-bit words: SM clock at entry, with Q staged, after the first tile (the pipelined order
// only; 0 elsewhere), after the tile loop and at exit; the global timer at entry; SM id << 32 |
// key tiles; CTA << 32 | work item), record work * 4 + warpgroup.
// nullptr turns it off (the default). Process-wide, like the other switches.
void set_prefill_timeline(unsigned long long* records, int count);

}  // namespace cuda
}  // namespace gqa
