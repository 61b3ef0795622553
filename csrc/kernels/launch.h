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

}  // namespace cuda
}  // namespace gqa
