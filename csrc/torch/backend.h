// The CUDA side of the torch glue: workspace, the per-device error word, the sync switch.
// Built as a stub that raises a clear error when the extension was built without CUDA.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "../core/params.h"

namespace gqa {

// True when this build compiled the CUDA kernels.
bool built_with_cuda();

// Plans, carves one workspace from the caching allocator and launches on the current stream.
// With `synchronous_check` (or the global switch) and outside graph capture it then reads the
// error word, clears it and raises when a flag is set.
void run_cuda(Params& p, const at::Tensor& query, bool synchronous_check);

// The sticky error word of a device, as a 1-element int32 tensor aliasing its fixed address.
// Allocated on first use (outside graph capture).
at::Tensor error_word(int64_t device_index);

// Whether the CUDA kernels can run on a device: 0 they can, 1 it is older than compute
// capability 8.0, 2 this build has no code for it (kernels/launch.h, DeviceSupport; always 2 in
// a CPU-only build). Asked of the runtime once per device, outside graph capture (inside, an
// unasked device reads 0 and stays unasked).
int64_t cuda_device_support(int64_t device_index);

// Tests: how many lanes of decode arrival counters on a device are held, one for each stream
// that ran a decode call there and one for each capture of one whose graphs are not all
// destroyed yet (cuda_backend.cpp). 0 in a CPU-only build.
int64_t arrival_lanes_held(int64_t device_index);

// Tuning hook for benchmarks (never needed for correctness): decode calls use `max_splits`
// splits (1..128) of at least `min_split_keys` keys instead of the plan's choice; 0 keeps
// the plan's value. Process-wide.
void set_decode_split_override(int64_t max_splits, int64_t min_split_keys);

// Tests: a budget of dynamic shared memory a block (bytes) below the device's, so that an H100
// or H200 runs the paths that GPUs with less shared memory and no sm90a kernels take
// (kernels/launch.h); 0: the device's own. Process-wide; no-op in a CPU-only build.
void set_smem_limit_override(int64_t bytes);

// Tests and benchmarks: pins the fp16/bf16 prefill kernel by route name, or "auto" (the
// default). The names are kRoutes in cuda_backend.cpp (an unknown name's error lists them),
// their kernels and auto's choices are described in kernels/prefill_mma.h; the wgmma routes
// run on sm90 only. No-op in a CPU-only build.
void set_prefill_route(const std::string& route);

// Tests and benchmarks: how the warp-specialised prefill kernels stage Q, "auto" (the default:
// by TMA where it can) or "cp_async" (kernels/prefill_mma.h). No-op in a CPU-only build.
void set_prefill_q_loader(const std::string& loader);

// Diagnostics: the prefill kernels' per-block timeline (kernels/prefill_mma.h) into `records`,
// an int64 CUDA tensor [n, 8] that the caller keeps alive while it is set; nullopt turns it off.
// No-op in a CPU-only build (after the checks).
void set_prefill_timeline(const std::optional<at::Tensor>& records);

// Diagnostics: the tensor-core decode kernel's per-CTA stamps (kernels/launch.h,
// set_decode_timeline) into `records`, as set_prefill_timeline but [n, 16]. Only a build with
// GQA_DECODE_TIMELINE=1 in the environment has the stamps; elsewhere a tensor is refused (after
// the checks).
void set_decode_timeline(const std::optional<at::Tensor>& records);

// Tests and benchmarks: who writes the new rows of an in-place prefill without RoPE to the
// caches, "auto" (the default: the attention kernel, for rows with no past, where it can) or
// "prep" (always prep's copy; kernels/prefill_mma.h). No-op in a CPU-only build.
void set_prefill_append(const std::string& append);
// The CPU backend's instruction set for its inner loops (cpu/lane_kernels.h): "auto", "baseline",
// "avx2" or "avx512"; a set this CPU or build lacks runs as auto.
void set_cpu_kernels(const std::string& name);

// Tests and benchmarks: the tensor-core decode kernel's loader, "auto" (the default: see
// kernels/launch.h), "cp_async", "tma" or "regs_k" (where they can run). No-op in a CPU-only
// build.
void set_decode_loader(const std::string& loader);

// Tests and benchmarks: how the tensor-core decode kernel's key-range splits are merged, "auto"
// (the default: see kernels/launch.h), "kernel" (the merge kernel always) or "arrival" (inside
// the launch, by the last split CTA to finish, wherever the stream has arrival counters).
// No-op in a CPU-only build.
void set_decode_merge(const std::string& merge);

// Tests and benchmarks: the order in which the tensor-core decode kernel takes the batch's
// rows, "auto" (the default: see kernels/launch.h), "rows" (row order) or "longest_first"
// (decreasing visible length). No-op in a CPU-only build.
void set_decode_schedule(const std::string& schedule);

// Tests and benchmarks: which build of the tensor-core decode kernel runs, "auto" (the default:
// one compiled without RoPE, softcap, local windows, head sinks and smooth softmax for the
// calls that use none of them) or "general" (the kernel with every feature, always). No-op in a
// CPU-only build.
void set_decode_features(const std::string& features);

// Tests and benchmarks: when the tensor-core decode kernel issues its split's first K/V tiles,
// "auto" (the default: right after it may read the caches, before the error word and the row
// checks) or "off" (after them). No-op in a CPU-only build.
void set_decode_early_tiles(const std::string& early);

// Tests and benchmarks: whether the tensor-core decode kernel asks L2 for its split's first
// keys and its query rows before the PDL wait, "auto" (the default: where the call's caches
// hold at most 8 MB of K and V), "off" or "on" (always). No-op in a CPU-only build.
void set_decode_l2_prefetch(const std::string& prefetch);

// Tests and benchmarks: how much L2 fetches from memory around each TMA copy of K and V in the
// tensor-core decode kernel (the TMA maps' L2 promotion), "auto" (the default: the aligned 128
// bytes around each), "sectors" (only those read), "128B" or "256B". Its cp.async copies and its
// K loads into registers always ask for 128 bytes.
// No-op in a CPU-only build.
void set_decode_l2_fetch(const std::string& fetch);

// Tests and benchmarks: the grid and item weight of the decode kernel's balanced partition
// where the plan takes it (Plan::shares): grid "auto" (the plan's: one CTA an SM), "items" (one
// CTA a row, kv head and head chunk), "two_per_sm" or "cut" (the plan's, with the items of equal
// rows cut as any others are, never one CTA an item); item_keys the keys' worth each item weighs
// besides its keys, -1 for the plan's (Plan::share_item_keys). No-op in a CPU-only build.
void set_decode_shares(const std::string& grid, int64_t item_keys);

// Global debugging switch: every CUDA call checks the error word synchronously.
void set_synchronous_errors(bool enabled);
bool synchronous_errors();

}  // namespace gqa
