// Memory for the CPU ops' large outputs (a functional call's presents, a long prompt's output),
// recycled between calls.
//
// Why: a present of tens of MB allocated with at::empty is fresh memory every call. glibc maps
// it anew, and the kernel zeroes it page by page on first touch, which cost a functional decode
// loop more than its attention (bench_cpu: B = 8 with 4,096 keys of past, 34 ms a call, 19 with
// memory kept between calls). The tensors these functions return keep freed blocks in a small
// cache that the next call's outputs reuse, already mapped.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>

namespace gqa {

// Blocks below this size come from PyTorch's CPU allocator: glibc reuses its heap for them.
constexpr size_t kMinRecycledBytes = size_t{8} << 20;

// A CPU tensor of `shape` like at::empty(shape, options); from the recycling cache when it is
// kMinRecycledBytes or more (with the cache disabled, a fresh block that is freed with the
// tensor). Contents are unspecified.
at::Tensor empty_cpu_output(at::IntArrayRef shape, const at::TensorOptions& options);

struct CpuOutputCacheInfo {
  size_t limit_bytes = 0;    // the most the cache holds (0: disabled)
  size_t cached_bytes = 0;   // freed blocks held now
  size_t cached_blocks = 0;
  uint64_t hits = 0;         // large outputs served from a cached block
  uint64_t misses = 0;       // large outputs that needed fresh memory
};

CpuOutputCacheInfo cpu_output_cache_info();

// Frees every cached block (blocks still in use return to the cache when freed, if it has room).
void release_cpu_output_cache();

// The most the cache may hold; 0 disables it and frees what it holds.
void set_cpu_output_cache_limit(size_t bytes);

}  // namespace gqa
