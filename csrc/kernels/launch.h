// The CUDA backend's entry point, callable from host code that includes no CUDA or torch
// headers. The workspace is plan.workspace.total_bytes of device memory, 256-byte aligned.
#pragma once

#include "../core/params.h"
#include "../core/plan.h"

namespace gqa {
namespace cuda {

// Enqueues the whole call on `stream` (a cudaStream_t): prep (row metadata, error latch,
// RoPE, cache append, functional past copy), then attention. Never synchronises.
// Throws std::runtime_error on a launch failure.
void launch(const Params& params, const Plan& plan, void* workspace, void* stream);

// Whether the CUDA kernels can run on the current device: kDeviceTooOld below compute
// capability 8.0 (they need bf16 mma.sync and cp.async), kDeviceNoCode where this build has no
// code for the device's architecture (the build's TORCH_CUDA_ARCH_LIST). Asks the runtime, so
// call it once per device.
enum DeviceSupport : int { kDeviceSupported = 0, kDeviceTooOld = 1, kDeviceNoCode = 2 };
DeviceSupport current_device_support();

// Tests: a budget of dynamic shared memory a block below the device's (0: the device's own),
// under which an H100 or H200 plans (decode_tma_kernels) and runs what GPUs with less of it and
// without the sm90a kernels run (sm86, sm89 and sm120 at 99 KB: the tensor-core decode kernel
// with two warps a CTA at head sizes 96 and 128, one at 256; launch.cu, decode_mma_fits; the
// mma.sync prefill). A kernel that asks for more than the budget throws.
void set_smem_limit_override(int bytes);

// Tests and benchmarks: the tensor-core decode kernel's loader. 0 auto (on an sm90 device in an
// sm90a build: TMA onto per-warp mbarriers at head sizes 80, 96, 128 and 256, with one tile in
// flight ahead at 128 where more CTAs than SMs stream splits of 1,024-4,096 keys and at 80 and 96
// where the grid is one wave at two CTAs an SM, at 256 with four warps a CTA where the grid is one
// wave at one CTA an SM; at 64 TMA in three stages where more than three CTAs an SM stream short
// key ranges in row order, else TMA with 32 keys a warp a stage where the splits hold 512 keys of
// capacity or more; cp.async otherwise, in three stages at 64, and at 80 and 96 where the grid is
// one wave at one CTA an SM (at 96 of splits of fewer than 512 keys), or without TMA with one tile
// in flight ahead where it is one wave at two CTAs an SM), 1 cp.async always (two warps a CTA at
// 256, five stages at 64, three tiles ahead at 80 and 96), 2 TMA where it can run (five stages at
// 64, two tiles ahead at 80, 96 and 128, as auto picks the warps at 256), 3 ("regs_k") K by plain
// loads into the mma fragments and V by TMA where that can run (head sizes 64 and 128), 4
// ("tma_four_warps") as 2, with four warps a CTA at 256 whatever the grid, 5 ("cp_async_shallow")
// cp.async in three stages at 64 whatever the grid, 6 ("cp_async_one_ahead") cp.async one tile
// ahead at 80 and 96 whatever the grid (5 and 6 elsewhere as 1), 7 ("tma_one_ahead") TMA one tile
// ahead at 80, 96 and 128 whatever the grid, 8 ("tma_shallow") TMA in three stages at 64 whatever
// the grid, 9 ("tma_wide") TMA with 32 keys a warp a stage at 64 whatever the grid (7, 8 and 9
// elsewhere as 2). Where a block cannot hold the four warps' stages (99 KB: sm86, sm89, sm120, or
// set_smem_limit_override), head sizes 96 and 128 take two cp.async warps a CTA whatever the pin.
void set_decode_loader(int loader);
// set_decode_loader's values by name, in the order of the names cuda_backend.cpp accepts.
enum DecodeLoaderPin : int {
  kPinLoaderAuto = 0,
  kPinCpAsync = 1,
  kPinTma = 2,
  kPinRegsK = 3,
  kPinTmaFourWarps = 4,
  kPinCpAsyncShallow = 5,
  kPinCpAsyncOneAhead = 6,
  kPinTmaOneAhead = 7,
  kPinTmaShallow = 8,
  kPinTmaWide = 9,
  kDecodeLoaderPins = 10  // how many
};

// Whether the decode kernel's TMA loaders can run on a device of compute capability major
// `sm_major`: an sm90 device, a build with sm90a code, and no budget set by
// set_smem_limit_override (which stands in for a GPU without them). The plan reads it as
// DeviceInfo::decode_tma_kernels: four warps a CTA at head size 256, and the balanced partition.
bool decode_tma_kernels(int sm_major);

// Tests and benchmarks: how the tensor-core decode kernel's splits are merged. 0 auto (up to
// 16 splits, inside the launch by the last split CTA to finish, where the stream has arrival
// counters; else the merge kernel), 1 the merge kernel always, 2 the last CTA to finish
// wherever the stream has arrival counters.
void set_decode_merge(int merge);

// Tests and benchmarks: the order in which the tensor-core decode kernel takes the batch's
// rows. 0 auto (longest first where the plan says so, Plan::longest_first: two rows or more,
// more CTAs than SMs and long splits), 1 row order always, 2 longest first always (batches of
// up to one row a thread of the CTA; larger ones keep row order), 3 as auto, but a batch of
// equal rows keeps the plan's splits (auto takes Plan::equal_rows_splits), 4 as auto, but two
// CTAs an SM where auto keeps to one (Plan::one_cta_per_sm), 5 as auto, but a ragged batch in
// one wave where auto takes two (Plan::ragged_two_waves). The generic kernel keeps row order.
void set_decode_schedule(int schedule);

// Tests and benchmarks: which build of the tensor-core decode kernel runs. 0 auto (one compiled
// without RoPE, softcap, local windows, head sinks and smooth softmax for the calls that use
// none of them; decode_mma.cuh, kPlain), 1 the general kernel always.
void set_decode_features(int features);

// Tests and benchmarks: when the tensor-core decode kernel issues its split's first tiles. 0
// auto (right after the PDL wait, before the error word and the row checks, for a valid row),
// 1 after the checks.
void set_decode_early_tiles(int early);

// Tests and benchmarks: whether the tensor-core decode kernel asks L2 for its split's first
// keys and its query rows before the PDL wait (decode_mma.cuh, Work::l2_prefetch). 0 auto
// (where the call's caches hold at most kL2PrefetchMaxBytes of K and V), 1 off, 2 always.
void set_decode_l2_prefetch(int prefetch);

// Tests and benchmarks: how much L2 fetches from memory around each TMA copy of K and V in the
// tensor-core decode kernel (Work::l2_fetch: the TMA maps' L2 promotion). 0 auto (128 bytes), 1
// the sectors asked for, 2 the aligned 128 bytes, 3 the aligned 256 bytes. The kernel's cp.async
// copies and regs_k's K loads always ask for 128 bytes (decode_mma.cuh says why).
void set_decode_l2_fetch(int fetch);

// Tests and benchmarks: the balanced partition's grid and item weight (Plan::shares, where the
// plan takes it; gqa::set_decode_shares's "force" makes the plan take it at head sizes 64 and 128,
// where without the TMA loaders the launch runs its 16 splits an item, and passes 0 here). grid: 0
// the plan's (one CTA an SM), 1 one CTA a (row, kv head, head chunk) item, 2 two CTAs an SM, 3 the
// plan's with equal rows' items cut as any others are (not one CTA an item where they nearly fill
// the grid: Work::share_whole_items); item_keys: the keys' worth each item weighs besides its keys
// (Plan::share_item_keys), -1 the plan's.
void set_decode_shares(int grid, int item_keys);

// Diagnostics (benchmarks/decode_timeline.py): the tensor-core decode kernel's per-CTA stamps
// (decode_mma.cuh, DecodeTimelineField) into `records` ([count][16]), nullptr: off. Read when
// a call is enqueued, as the switches are. The kernels stamp only in a build with
// GQA_DECODE_TIMELINE defined (decode_timeline_built).
void set_decode_timeline(unsigned long long* records, int count);
bool decode_timeline_built();

}  // namespace cuda
}  // namespace gqa
