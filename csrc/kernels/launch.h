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

// Decode splits combined inside the decode kernel through thread-block clusters (default on,
// where the device supports it); off, a merge kernel combines them. For tests and benchmarks.
void set_decode_cluster_reduction(bool enabled);

}  // namespace cuda
}  // namespace gqa
