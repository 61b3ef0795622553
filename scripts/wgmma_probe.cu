// A standalone probe of the sm90a wgmma conventions a Hopper prefill kernel (issue 6) relies
// on, checked against a CPU reference in one short device run:
//   1. SS, K-major A and B, 128-byte swizzle:      D[64x64] = A[64x64] . B[64x64]^T
//   2. SS, K-major A, MN-major B (transposed):     D = A . V, V stored [k][n] (n contiguous)
//   3. RS, A from registers (the mma.sync A-fragment layout), MN-major B: the P.V step
// Each at N = 64 and N = 128 (two 64-wide blocks of B, so both byte offsets of the MN-major
// descriptor matter). For the MN-major descriptor both assignments of the two byte offsets are
// tried and the one that matches is reported; the output layout it assumes is written below.
//
//   nvcc -gencode arch=compute_90a,code=sm_90a -O2 -o /tmp/wgmma_probe scripts/wgmma_probe.cu && /tmp/wgmma_probe
//   cuobjdump --dump-sass /tmp/wgmma_probe | grep -c HGMMA
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <sys/wait.h>
#include <vector>

namespace {

constexpr int kM = 64, kK = 64;  // one warpgroup, four k-steps of 16; N is 64 or 128

// 128-byte swizzle: 16-byte chunk c of a 128-byte row r sits at chunk c ^ (r % 8); atoms of
// 8 rows (1024 bytes) must be 1024-byte aligned.
__device__ __forceinline__ int swizzled(int row, int col) {  // element offset in a [rows][64] block
  const int chunk = (col >> 3) ^ (row & 7);
  return row * 64 + chunk * 8 + (col & 7);
}

__device__ __forceinline__ uint64_t descriptor(const void* smem, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  uint64_t d = 0;
  d |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFF) << 16;
  d |= static_cast<uint64_t>((sbo_bytes >> 4) & 0x3FFF) << 32;
  d |= static_cast<uint64_t>(1) << 62;  // 128-byte swizzle
  return d;
}

__device__ __forceinline__ void fence_operands() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void generic_to_async_proxy() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

template <int N, int kTransB>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  if constexpr (N == 64) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, %35;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransB));
  } else {
    static_assert(N == 128, "N");
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, %67;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransB));
  }
}

template <int N, int kTransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b, int accumulate) {
  if constexpr (N == 64) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %38, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(kTransB), "r"(accumulate));
  } else {
    static_assert(N == 128, "N");
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %70, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, %69;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(kTransB), "r"(accumulate));
  }
}

__device__ __forceinline__ uint32_t pack_bf16(__nv_bfloat16 lo, __nv_bfloat16 hi) {
  return static_cast<uint32_t>(__bfloat16_as_ushort(lo)) | (static_cast<uint32_t>(__bfloat16_as_ushort(hi)) << 16);
}

// mode 0: SS, B K-major ([n][k]); mode 1: SS, B MN-major ([k][n]); mode 2: RS, B MN-major.
// swap: exchange the two byte offsets of the MN-major descriptor.
template <int N>
__global__ void probe(const __nv_bfloat16* a_g, const __nv_bfloat16* b_g, float* d_g, int mode, int swap) {
  __shared__ __align__(1024) __nv_bfloat16 a_s[kM * kK];
  __shared__ __align__(1024) __nv_bfloat16 b_s[N * kK];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // K-major A: rows m of 64 k-elements (128 bytes); one 64-wide column block.
  for (int i = tid; i < kM * kK; i += 128) a_s[swizzled(i / kK, i % kK)] = a_g[i];
  if (mode == 0) {  // [n][k]: N rows of 128 bytes
    for (int i = tid; i < N * kK; i += 128) b_s[swizzled(i / kK, i % kK)] = b_g[i];
  } else {  // [k][n]: N/64 blocks of [64 k-rows][64 n], 8192 bytes apart
    for (int i = tid; i < N * kK; i += 128) {
      const int k = i / N, n = i % N;
      b_s[(n / 64) * kK * 64 + swizzled(k, n % 64)] = b_g[i];
    }
  }
  if (tid == 0 && ((__cvta_generic_to_shared(a_s) | __cvta_generic_to_shared(b_s)) & 1023) != 0)
    printf("    shared tiles are not 1024-byte aligned: the swizzle atoms are misplaced\n");
  generic_to_async_proxy();
  __syncthreads();

  float d[N / 2];
  for (int i = 0; i < N / 2; ++i) d[i] = 0.f;
  fence_operands();
  for (int ks = 0; ks < kK / 16; ++ks) {
    const uint64_t da = descriptor(a_s + ks * 16, 16, 1024);  // k-step: +32 bytes inside the row
    if (mode == 0) {
      wgmma_ss<N, 0>(d, da, descriptor(b_s + ks * 16, 16, 1024), ks > 0);
      continue;
    }
    // MN-major B: 16 k-rows per step = 2 atoms of 8 rows, 1024 bytes apart; n blocks 8192 apart.
    const __nv_bfloat16* b_step = b_s + ks * 16 * 64;
    const uint32_t between_n_blocks = kK * 128, between_k_atoms = 1024;
    const uint64_t db = swap ? descriptor(b_step, between_k_atoms, between_n_blocks)
                             : descriptor(b_step, between_n_blocks, between_k_atoms);
    if (mode == 1) {
      wgmma_ss<N, 1>(d, da, db, ks > 0);
    } else {
      // The mma.sync A fragment: rows 16*warp + lane/4 (+8), k 16*ks + 2*(lane%4) (+1, +8, +9).
      const int r = 16 * warp + lane / 4, c = 16 * ks + 2 * (lane % 4);
      uint32_t a[4];
      a[0] = pack_bf16(a_g[r * kK + c], a_g[r * kK + c + 1]);
      a[1] = pack_bf16(a_g[(r + 8) * kK + c], a_g[(r + 8) * kK + c + 1]);
      a[2] = pack_bf16(a_g[r * kK + c + 8], a_g[r * kK + c + 9]);
      a[3] = pack_bf16(a_g[(r + 8) * kK + c + 8], a_g[(r + 8) * kK + c + 9]);
      fence_operands();
      wgmma_rs<N, 1>(d, a, db, ks > 0);
    }
  }
  commit();
  wait_all();
  // Assumed accumulator layout: d[4j + {0,1}] = row 16*warp + lane/4, columns 8j + 2*(lane%4)
  // + {0,1}; d[4j + {2,3}] = the same columns of row + 8.
  for (int j = 0; j < N / 8; ++j) {
    const int r = 16 * warp + lane / 4, c = 8 * j + 2 * (lane % 4);
    d_g[r * N + c] = d[4 * j + 0];
    d_g[r * N + c + 1] = d[4 * j + 1];
    d_g[(r + 8) * N + c] = d[4 * j + 2];
    d_g[(r + 8) * N + c + 1] = d[4 * j + 3];
  }
}

template <int N>
double run(int mode, int swap, const std::vector<__nv_bfloat16>& a, const std::vector<__nv_bfloat16>& b,
           const std::vector<float>& ref) {
  __nv_bfloat16 *a_d, *b_d;
  float* d_d;
  cudaMalloc(&a_d, a.size() * 2);
  cudaMalloc(&b_d, b.size() * 2);
  cudaMalloc(&d_d, kM * N * 4);
  cudaMemcpy(a_d, a.data(), a.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(b_d, b.data(), b.size() * 2, cudaMemcpyHostToDevice);
  cudaMemset(d_d, 0xFF, kM * N * 4);  // NaN: unwritten outputs show
  probe<N><<<1, 128>>>(a_d, b_d, d_d, mode, swap);
  const cudaError_t e = cudaDeviceSynchronize();
  std::vector<float> out(kM * N);
  cudaMemcpy(out.data(), d_d, out.size() * 4, cudaMemcpyDeviceToHost);
  cudaFree(a_d);
  cudaFree(b_d);
  cudaFree(d_d);
  if (e != cudaSuccess) {
    std::printf("    CUDA error: %s\n", cudaGetErrorString(e));
    std::exit(2);  // the context is gone
  }
  double worst = 0;
  for (int i = 0; i < kM * N; ++i) worst = std::isnan(out[i]) ? INFINITY : std::fmax(worst, std::fabs(out[i] - ref[i]));
  return worst;
}

// One probe: N, mode (0 SS K-major B, 1 SS MN-major B, 2 RS MN-major B), swap (the MN-major
// byte-offset convention). Returns 0 when it matches the reference.
template <int N>
int check(int mode, int swap) {
  std::vector<__nv_bfloat16> a(kM * kK), b_nk(N * kK), b_kn(kK * N);
  std::vector<float> af(kM * kK), bf(N * kK);
  std::srand(N);
  auto rnd = [] { return static_cast<float>(std::rand()) / RAND_MAX * 2.f - 1.f; };
  for (int i = 0; i < kM * kK; ++i) {
    a[i] = __float2bfloat16(rnd());
    af[i] = __bfloat162float(a[i]);
  }
  for (int n = 0; n < N; ++n)
    for (int k = 0; k < kK; ++k) {
      const __nv_bfloat16 v = __float2bfloat16(rnd());
      b_nk[n * kK + k] = v;
      b_kn[k * N + n] = v;
      bf[n * kK + k] = __bfloat162float(v);
    }
  std::vector<float> ref(kM * N);
  for (int m = 0; m < kM; ++m)
    for (int n = 0; n < N; ++n) {
      double acc = 0;
      for (int k = 0; k < kK; ++k) acc += static_cast<double>(af[m * kK + k]) * bf[n * kK + k];
      ref[m * N + n] = static_cast<float>(acc);
    }
  const double tol = 1e-3;
  const double e = run<N>(mode, swap, a, mode == 0 ? b_nk : b_kn, ref);
  if (mode == 0) {
    std::printf("m64n%dk16 SS, K-major B:  max |err| %.3g  %s\n", N, e, e < tol ? "OK" : "FAIL");
  } else {
    std::printf("m64n%dk16 %s, MN-major B, %s: max |err| %.3g  %s\n", N, mode == 1 ? "SS" : "RS",
                swap ? "LBO = k-atom stride, SBO = n-block stride" : "LBO = n-block stride, SBO = k-atom stride", e,
                e < tol ? "OK" : "FAIL");
  }
  return e < tol ? 0 : 1;
}

}  // namespace

// Without arguments: every probe, each in a child process (a wrong descriptor can fault, which
// ends the CUDA context, and the other probes must still run). With "N mode swap": that probe.
int main(int argc, char** argv) {
  if (argc == 4) {
    const int n = std::atoi(argv[1]), mode = std::atoi(argv[2]), swap = std::atoi(argv[3]);
    return n == 64 ? check<64>(mode, swap) : check<128>(mode, swap);
  }
  int failures = 0;
  for (int n : {64, 128})
    for (int mode = 0; mode <= 2; ++mode)
      for (int swap = 0; swap <= (mode == 0 ? 0 : 1); ++swap) {
        const std::string cmd = std::string(argv[0]) + " " + std::to_string(n) + " " + std::to_string(mode) + " " +
                                std::to_string(swap);
        std::fflush(stdout);
        const int rc = std::system(cmd.c_str());
        if (rc != 0) {
          ++failures;
          if (!WIFEXITED(rc) || WEXITSTATUS(rc) != 1) std::printf("    (probe \"%s\" faulted)\n", cmd.c_str());
        }
      }
  std::printf("%d probe(s) failed; exactly one MN-major convention per N and mode is expected to pass\n", failures);
  return 0;
}
