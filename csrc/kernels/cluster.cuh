// Thread-block clusters (sm90): the launch attribute, whether a cluster shape can run, and the
// device side (cluster barrier, distributed shared memory). The decode kernel uses them to
// merge its key-range splits inside the launch (decode_mma.cuh) instead of in a second kernel.
#pragma once

#include "common.cuh"

namespace gqa {
namespace cuda {
namespace detail {

// ------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------

// The largest cluster an sm90 part runs (8 is the portable limit; up to 16 with the
// non-portable opt-in, which this sets).
constexpr int kMaxClusterSize = 16;

// Whether `Kernel` can run with clusters of `cluster_x` CTAs along x at this launch shape on
// the current device: the driver's own answer (cudaOccupancyMaxActiveClusters > 0), asked once
// per device and cluster size. The kernel's shared-memory limit must already be raised
// (ensure_smem). Never throws; a refusal means "launch without clusters".
template <auto Kernel>
bool cluster_shape_runs(int cluster_x, dim3 block, size_t smem) {
  if (cluster_x < 2 || cluster_x > kMaxClusterSize) return false;
  static std::atomic<int8_t> known[64][kMaxClusterSize + 1];  // 0 unknown, 1 runs, -1 does not
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return false;
  const int8_t k = known[dev][cluster_x].load(std::memory_order_relaxed);
  if (k != 0) return k > 0;
  bool ok = device_attribute<cudaDevAttrComputeCapabilityMajor>() >= 9;
  if (ok && cluster_x > 8) {
    ok = cudaFuncSetAttribute(Kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess;
  }
  if (ok) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(cluster_x);
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute attr[2];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = cluster_x;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    attr[1].id = cudaLaunchAttributeClusterSchedulingPolicyPreference;
    attr[1].val.clusterSchedulingPolicyPreference = cudaClusterSchedulingPolicySpread;  // as launch_kernel_clustered
    cfg.attrs = attr;
    cfg.numAttrs = 2;
    int clusters = 0;
    ok = cudaOccupancyMaxActiveClusters(&clusters, Kernel, &cfg) == cudaSuccess && clusters > 0;
  }
  (void)cudaGetLastError();  // a refusal is an answer, not a sticky error
  known[dev][cluster_x].store(ok ? 1 : -1, std::memory_order_relaxed);
  return ok;
}

// How many CTAs of `Kernel` one SM holds at this block size and shared memory (the driver's
// occupancy answer, asked once per device; 0 if it cannot say).
template <auto Kernel>
int resident_ctas_per_sm(dim3 block, size_t smem) {
  static std::atomic<int> known[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
  int v = known[dev].load(std::memory_order_relaxed);
  if (v == 0) {
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, Kernel, static_cast<int>(block.x * block.y * block.z), smem) !=
        cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    known[dev].store(v, std::memory_order_relaxed);
  }
  return v;
}

// ------------------------------------------------------------------------------------------
// Device side (sm90; elsewhere these trap, and the host never launches a cluster there)
// ------------------------------------------------------------------------------------------

// Every thread of every CTA of the cluster arrives; the release/acquire pair orders each CTA's
// shared-memory writes before the barrier with the other CTAs' reads after it. Warp-uniform.
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
  __trap();
#endif
}

// A cluster barrier that orders nothing: for "every CTA is done reading the others' shared
// memory" (loads whose values were used are complete), where cluster_sync's release would
// also wait for this thread's global stores to be visible GPU-wide (MEMBAR.ALL.GPU in SASS).
__device__ __forceinline__ void cluster_sync_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
#else
  __trap();
#endif
}

// The address, in the cluster's shared window, of `local` (a shared-memory address of this
// CTA) in the CTA of cluster rank `rank`.
__device__ __forceinline__ uint32_t cluster_map(uint32_t local, uint32_t rank) {
  uint32_t remote = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
#else
  __trap();
#endif
  return remote;
}

// Loads from another CTA's shared memory (an address from cluster_map). Volatile, so that they
// stay after the cluster_sync that published the data; those issued back to back overlap their
// round trips.
__device__ __forceinline__ float cluster_load_f32(uint32_t addr) {
  float v = 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr));
#endif
  return v;
}

__device__ __forceinline__ uint32_t cluster_load_u32(uint32_t addr) {
  uint32_t v = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(addr));
#endif
  return v;
}

__device__ __forceinline__ float4 cluster_load_f32x4(uint32_t addr) {
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr));
#endif
  return v;
}

}  // namespace detail
}  // namespace cuda
}  // namespace gqa
