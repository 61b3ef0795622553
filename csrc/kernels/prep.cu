// Prep: one launch that checks every row, latches errors, and writes the caches.
//   - in-place op: the S new K rows (after RoPE) and V rows at [past_b, past_b + S);
//   - functional op: the whole present, rows [0, past_b) copied from the past, the new rows,
//     zeros in every other row up to C (first prompt: all S new rows at 0..S-1).
// A CTA that finds the error word already set writes nothing; a row that violates a bound
// ORs its flags into the word, and then no CTA of the call writes anything (every CTA checks
// every row; explicit positions are checked by validate_rows_kernel first when there are
// many). The query is normally not touched here: the attention kernels apply RoPE to it on
// load. With `rope_q` (prefill on the tensor-core kernel) the new tokens' query rows are
// rotated here instead, into the output tensor (which has q's shape and which the attention
// kernel then reads q from, block by block, before it writes that block's output over it):
// one bandwidth-bound pass instead of a rotation on every attention block's critical path.
#include <algorithm>
#include <stdexcept>

#include "kernels.h"

namespace gqa {
namespace cuda {
namespace detail {
namespace {

constexpr int kPrepThreads = 256;

// Flags of one row from its geometry; rotary positions too when they follow from it (no
// position_ids: positions past_b .. past_b + S - 1, first prompt 0 .. S - 1).
__device__ __forceinline__ uint32_t geometry_flags(const Params& p, const RowGeometry& g) {
  uint32_t flags = g.flags;
  if (flags == 0 && p.do_rotary && p.position_ids == nullptr) {
    const int64_t first = g.past;
    const int64_t last = static_cast<int64_t>(g.past) + p.query_len - 1;
    if (!position_in_range(p, first) || !position_in_range(p, last)) flags |= kErrPosition;
  }
  return flags;
}

// Block-wide: flags of row b (`own`) and of the whole call (`any`). Every row's geometry is
// checked, and every explicit position_ids entry when `check_positions`. Every thread of the
// block must call it.
__device__ void call_flags_block(const Params& p, int b, bool check_positions, uint32_t& own, uint32_t& any) {
  __shared__ uint32_t s_own, s_any;
  if (threadIdx.x == 0) {
    s_own = 0;
    s_any = 0;
  }
  __syncthreads();
  uint32_t mine = 0, all = 0;
  for (int bb = threadIdx.x; bb < p.batch; bb += blockDim.x) {
    const uint32_t f = geometry_flags(p, row_geometry(p, p.seqlens_k[bb]));
    all |= f;
    if (bb == b) mine |= f;
  }
  if (check_positions && p.do_rotary && p.position_ids != nullptr) {
    // As on CPU, a row whose bounds already fail is not checked for positions (its flags are
    // those of its bounds).
    const int64_t n = static_cast<int64_t>(p.batch) * p.query_len;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      if (!position_in_range(p, p.position_ids[i])) {
        const int row = static_cast<int>(i / p.query_len);
        if (row_geometry(p, p.seqlens_k[row]).flags != 0) continue;
        all |= kErrPosition;
        if (row == b) mine |= kErrPosition;
      }
    }
  }
  if (all) atomicOr(&s_any, all);
  if (mine) atomicOr(&s_own, mine);
  __syncthreads();
  own = s_own;
  any = s_any;
}

template <typename T>
__device__ __forceinline__ void copy_row(T* dst, const T* src, int D, int lane, bool vec) {
  if (vec) {
    const int n = D * static_cast<int>(sizeof(T)) / 16;
    for (int i = lane; i < n; i += 32) reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
  } else {
    for (int d = lane; d < D; d += 32) dst[d] = src[d];
  }
}

template <typename T>
__device__ __forceinline__ void zero_row(T* dst, int D, int lane, bool vec) {
  if (vec) {
    const int n = D * static_cast<int>(sizeof(T)) / 16;
    for (int i = lane; i < n; i += 32) reinterpret_cast<uint4*>(dst)[i] = make_uint4(0, 0, 0, 0);
  } else {
    for (int d = lane; d < D; d += 32) dst[d] = from_f<T>(0.f);
  }
}

// One CTA per row: the row's geometry and all its explicit positions (used before prep when
// the calls's positions are too many for every prep CTA to re-read).
__global__ void __launch_bounds__(kPrepThreads) validate_rows_kernel(const __grid_constant__ Params p) {
  pdl_wait();
  pdl_launch_dependents();
  const int b = blockIdx.x;
  const RowGeometry g = row_geometry(p, p.seqlens_k[b]);
  uint32_t flags = geometry_flags(p, g);
  int pos_bad = 0;
  if (g.flags == 0 && p.do_rotary && p.position_ids != nullptr) {  // bounds first, as on CPU
    const int64_t* ids = p.position_ids + static_cast<int64_t>(b) * p.query_len;
    for (int s = threadIdx.x; s < p.query_len; s += blockDim.x) {
      if (!position_in_range(p, ids[s])) pos_bad = 1;
    }
  }
  if (__syncthreads_or(pos_bad)) flags |= kErrPosition;
  if (flags != 0 && threadIdx.x == 0) atomicOr(p.error_word, flags);
}

// grid: (ceil(span / rows_per_cta), B); span = S (in place) or C (functional). Items are
// (token row, kv head) pairs. `flat` (every row of the call 16-byte aligned, the rotary part
// whole chunks, the cos/sin tables aligned: launch_prep_t checks): every item's 16-byte units
// spread over all the CTA's threads. Otherwise one warp per item, element by element where
// the rows are not aligned.
// (At least 2 CTAs an SM: left to itself ptxas capped the registers at 64 and spilled.)
template <typename T>
__global__ void __launch_bounds__(kPrepThreads, 2)
    prep_kernel(const __grid_constant__ Params p, int rows_per_cta, int check_positions, int vec_cache, int vec_past,
                int rope_q, int flat, int skip_new_rows) {
  pdl_wait();
  pdl_launch_dependents();
  const int b = blockIdx.y;
  const int lane = threadIdx.x & 31;
  if (p.work_counter != nullptr && b == 0 && blockIdx.x == 0 && threadIdx.x == 0) *p.work_counter = 0;
  const int warp = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;

  const RowGeometry g = row_geometry(p, p.seqlens_k[b]);
  const uint32_t word = threadIdx.x == 0 ? read_error_word(p.error_word) : 0u;
  uint32_t own = 0, any = 0;
  call_flags_block(p, b, check_positions != 0, own, any);
  const int word_set = __syncthreads_or(word != 0u);
  // A bad row latches its flags; then no CTA of the call writes anything, so the caches never
  // hold half of a failed call.
  if (own != 0 && blockIdx.x == 0 && threadIdx.x == 0) atomicOr(p.error_word, own);
  if (any != 0 || word_set) return;
  // In place with no past, the attention kernel reads the new rows and appends them itself
  // (prefill_mma_appends); nothing else is left to do here for such a row (no RoPE).
  if (skip_new_rows && g.past == 0) return;

  const int S = p.query_len;
  const int D = p.head_dim;
  const int Hkv = p.kv_heads;
  const int span = p.inplace ? S : p.capacity;
  const int t_begin = blockIdx.x * rows_per_cta;
  const int t_end = min(span, t_begin + rows_per_cta);
  const int items = (t_end - t_begin) * Hkv;
  const TokenStrides cs = p.cache_strides;

  // Item `item` of this CTA: token row t of the span and kv head h; the cache row it fills
  // (dest) and what fills it: new token s_new (>= 0), past row t, or zeros.
  struct Item {
    int t, h, dest, s_new;
    bool from_past;
  };
  auto item_at = [&](int item) {
    Item it{t_begin + item / Hkv, item % Hkv, 0, -1, false};
    it.dest = it.t;
    if (p.inplace) {
      it.dest = g.past + it.t;
      it.s_new = it.t;
    } else if (p.first_prompt) {
      if (it.t < S) it.s_new = it.t;
    } else if (it.t < g.past) {
      it.from_past = true;
    } else if (it.t < g.past + S) {
      it.s_new = it.t - g.past;
    }
    return it;
  };
  const TokenStrides ks = p.key_strides, vs = p.value_strides, qs = p.query_strides, os = p.output_strides;
  const int G = p.group_size;
  auto cache_off = [&](const Item& it) { return b * cs.batch + static_cast<int64_t>(it.dest) * cs.token + it.h * cs.head; };
  auto key_src = [&](const Item& it) {
    return static_cast<const T*>(p.key) + b * ks.batch + static_cast<int64_t>(it.s_new) * ks.token + it.h * ks.head;
  };
  auto value_src = [&](const Item& it) {
    return static_cast<const T*>(p.value) + b * vs.batch + static_cast<int64_t>(it.s_new) * vs.token + it.h * vs.head;
  };
  // The G query heads of kv head h at the new token, and their output rows.
  auto query_src = [&](const Item& it, int gq) {
    return static_cast<const T*>(p.query) + b * qs.batch + static_cast<int64_t>(it.s_new) * qs.token +
           static_cast<int64_t>(it.h * G + gq) * qs.head;
  };
  auto query_dst = [&](const Item& it, int gq) {
    return static_cast<T*>(p.output) + b * os.batch + static_cast<int64_t>(it.s_new) * os.token +
           static_cast<int64_t>(it.h * G + gq) * os.head;
  };

  const bool has_past = p.past_key != nullptr;  // (none: the past rows read as zeros)
  auto past_off = [&](const Item& it) {
    const TokenStrides ps = p.past_strides;
    return b * ps.batch + static_cast<int64_t>(it.t) * ps.token + it.h * ps.head;
  };

  if (flat) {
    // 16-byte units; consecutive threads take consecutive units of a row, so that their loads
    // (rows, cos/sin) coalesce. Moves first (new V, new K without RoPE, past rows, zeros),
    // several a thread in flight at once; then the RoPE units (new K, and the query rows with
    // rope_q).
    const int esize = static_cast<int>(sizeof(T));
    const int chunks = D * esize / 16;
    const int moves = items * 2 * chunks;
    if (p.inplace && kPrepThreads % (2 * chunks) == 0) {  // (else the general loop)
      // In place every item is a new row (token t into cache row past + t), so each thread
      // keeps one unit column (K or V, chunk c) and walks the items `step` apart with its two
      // pointers, eight loads in flight. The general loop below recomputes every unit's item,
      // row kind and 64-bit offsets (about 90 instructions a 16-byte move: Nsight Compute saw
      // the kernel at 40% of DRAM bandwidth with 42% of its issue slots busy, B2 L4096 D128).
      // K units with RoPE are the RoPE loop's.
      const int r = static_cast<int>(threadIdx.x) % (2 * chunks);
      const bool is_k = r < chunks;
      if (!(is_k && p.do_rotary)) {
        constexpr int kInFlight = 8;
        const int c = is_k ? r : r - chunks;
        const TokenStrides ss = is_k ? ks : vs;
        const int step = kPrepThreads / (2 * chunks);  // items between this thread's units
        const int dt = step / Hkv, dh = step - dt * Hkv;
        int item = static_cast<int>(threadIdx.x) / (2 * chunks);
        int h = item % Hkv;
        const int t = t_begin + item / Hkv;
        const T* src = static_cast<const T*>(is_k ? p.key : p.value) + b * ss.batch + static_cast<int64_t>(t) * ss.token +
                       h * ss.head + c * (16 / esize);
        T* dst = static_cast<T*>(is_k ? p.key_cache : p.value_cache) + b * cs.batch +
                 static_cast<int64_t>(g.past + t) * cs.token + h * cs.head + c * (16 / esize);
        // Element steps: `step` items on, and back over Hkv heads to the next token.
        const int64_t src_step = dt * ss.token + dh * ss.head, src_wrap = ss.token - Hkv * ss.head;
        const int64_t dst_step = dt * cs.token + dh * cs.head, dst_wrap = cs.token - Hkv * cs.head;
        while (item < items) {
          uint4 v[kInFlight];
          T* to[kInFlight];
#pragma unroll
          for (int k = 0; k < kInFlight; ++k) {
            to[k] = nullptr;
            if (item >= items) continue;
            v[k] = *reinterpret_cast<const uint4*>(src);
            to[k] = dst;
            item += step;
            h += dh;
            src += src_step;
            dst += dst_step;
            if (h >= Hkv) {
              h -= Hkv;
              src += src_wrap;
              dst += dst_wrap;
            }
          }
#pragma unroll
          for (int k = 0; k < kInFlight; ++k)
            if (to[k] != nullptr) *reinterpret_cast<uint4*>(to[k]) = v[k];
        }
      }
    } else {
      constexpr int kInFlight = 4;
      for (int base = threadIdx.x; base < moves; base += kInFlight * kPrepThreads) {
        uint4 v[kInFlight];
        uint4* dst[kInFlight];
#pragma unroll
        for (int k = 0; k < kInFlight; ++k) {
          v[k] = make_uint4(0u, 0u, 0u, 0u);
          dst[k] = nullptr;
          const int i = base + k * kPrepThreads;
          if (i >= moves) continue;
          const int item = i / (2 * chunks);
          const int r = i - item * 2 * chunks;
          const bool is_k = r < chunks;
          const int c = is_k ? r : r - chunks;
          const Item it = item_at(item);
          const T* src = nullptr;
          if (it.s_new >= 0) {
            if (is_k && p.do_rotary) continue;  // a RoPE unit
            src = is_k ? key_src(it) : value_src(it);
          } else if (it.from_past && has_past) {
            src = static_cast<const T*>(is_k ? p.past_key : p.past_value) + past_off(it);
          }
          dst[k] = reinterpret_cast<uint4*>(static_cast<T*>(is_k ? p.key_cache : p.value_cache) + cache_off(it)) + c;
          if (src != nullptr) v[k] = reinterpret_cast<const uint4*>(src)[c];
        }
#pragma unroll
        for (int k = 0; k < kInFlight; ++k)
          if (dst[k] != nullptr) *dst[k] = v[k];
      }
    }
    const int k_units = p.do_rotary ? rope_vec_units(p, esize, true) : 0;  // the whole K row
    const int q_units = rope_q ? rope_vec_units(p, esize, true) : 0;       // per query head
    const int per_item = k_units + G * q_units;
    for (int i = threadIdx.x; i < items * per_item; i += kPrepThreads) {
      const int item = i / per_item;
      const int u = i - item * per_item;
      const Item it = item_at(item);
      if (it.s_new < 0) continue;
      const int64_t pos = rotary_position(p, g, b, it.s_new);
      if (u < k_units) {
        rope_unit_vec<T>(p, key_src(it), static_cast<T*>(p.key_cache) + cache_off(it), true, pos, u);
      } else {
        const int gq = (u - k_units) / q_units;
        rope_unit_vec<T>(p, query_src(it, gq), query_dst(it, gq), true, pos, u - k_units - gq * q_units);
      }
    }
    return;
  }

  for (int item = warp; item < items; item += nwarps) {
    const Item it = item_at(item);
    const int s_new = it.s_new;
    T* kd = static_cast<T*>(p.key_cache) + cache_off(it);
    T* vd = static_cast<T*>(p.value_cache) + cache_off(it);
    if (s_new >= 0) {
      const int64_t pos = p.do_rotary ? rotary_position(p, g, b, s_new) : 0;
      rope_row<T>(p, key_src(it), p.do_rotary, pos, lane, 32, [&](int d, T v) { kd[d] = v; });
      copy_row(vd, value_src(it), D, lane, false);
      for (int gq = 0; rope_q && gq < G; ++gq) {  // the query rows, rotated into the output
        T* const dst = query_dst(it, gq);
        rope_row<T>(p, query_src(it, gq), true, pos, lane, 32, [&](int d, T v) { dst[d] = v; });
      }
    } else if (it.from_past && has_past) {
      copy_row(kd, static_cast<const T*>(p.past_key) + past_off(it), D, lane, vec_past != 0);
      copy_row(vd, static_cast<const T*>(p.past_value) + past_off(it), D, lane, vec_past != 0);
    } else {
      zero_row(kd, D, lane, vec_cache != 0);
      zero_row(vd, D, lane, vec_cache != 0);
    }
  }
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }
bool strides16(const TokenStrides& s, int esize) {
  const int64_t per = 16 / esize;
  return s.batch % per == 0 && s.token % per == 0 && s.head % per == 0;
}

template <typename T>
void launch_prep_t(const Params& p, bool check_positions, bool rope_q, bool skip_new_rows, cudaStream_t stream) {
  const int esize = static_cast<int>(sizeof(T));
  const bool row16 = (p.head_dim * esize) % 16 == 0;
  const bool vec_cache = row16 && aligned16(p.key_cache) && aligned16(p.value_cache) && strides16(p.cache_strides, esize);
  const bool vec_past = vec_cache && p.past_key != nullptr && aligned16(p.past_key) && aligned16(p.past_value) &&
                        strides16(p.past_strides, esize);
  // The flat form needs every row it may touch in 16-byte units: new K (after RoPE) and V,
  // q and the output with rope_q, the past (functional), the cache (zero rows).
  const bool rope_vec = rope_vec_ok(p, esize, p.do_rotary);
  const bool new_rows16 = vec_cache && rope_vec && aligned16(p.key) && strides16(p.key_strides, esize) &&
                          aligned16(p.value) && strides16(p.value_strides, esize);
  const bool rotate_q = rope_q && p.do_rotary;
  const bool q_rows16 = !rotate_q || (rope_vec_ok(p, esize, true) && aligned16(p.query) &&
                                    strides16(p.query_strides, esize) && aligned16(p.output) &&
                                    strides16(p.output_strides, esize));
  const bool past16 = p.inplace || p.first_prompt || p.past_key == nullptr || vec_past;
  const bool flat = new_rows16 && q_rows16 && past16;
  const int span = p.inplace ? p.query_len : p.capacity;
  // Flat: about one item a thread (fewer CTAs, each paying its row checks once); by warps, 32
  // items a CTA.
  const int items_per_cta = flat ? kPrepThreads : 32;
  const int rows_per_cta = std::max(1, items_per_cta / p.kv_heads);
  // At least one CTA per row even with nothing to write (a functional present of capacity 0):
  // the row checks and the error latch live here.
  const dim3 grid(std::max(1, (span + rows_per_cta - 1) / rows_per_cta), p.batch);
  launch_kernel("prep_kernel", prep_kernel<T>, grid, dim3(kPrepThreads), 0, stream, p, rows_per_cta,
                check_positions ? 1 : 0, vec_cache ? 1 : 0, vec_past ? 1 : 0, rotate_q ? 1 : 0, flat ? 1 : 0,
                skip_new_rows ? 1 : 0);
}

}  // namespace

bool pdl_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("GQA_DISABLE_PDL");
    return !(v != nullptr && v[0] == '1');
  }();
  return enabled;
}

void launch_validate_rows(const Params& p, cudaStream_t stream) {
  launch_kernel("validate_rows_kernel", validate_rows_kernel, dim3(p.batch), dim3(kPrepThreads), 0, stream, p);
}

void launch_prep(const Params& p, bool check_positions, cudaStream_t stream, bool rope_q, bool skip_new_rows) {
  if (skip_new_rows && (!p.inplace || p.do_rotary))
    throw std::runtime_error("gqa prep: internal error: only in-place rows without RoPE can be skipped");
  switch (p.dtype) {
    case DType::kFloat32: launch_prep_t<float>(p, check_positions, rope_q, skip_new_rows, stream); break;
    case DType::kFloat16: launch_prep_t<__half>(p, check_positions, rope_q, skip_new_rows, stream); break;
    default: launch_prep_t<__nv_bfloat16>(p, check_positions, rope_q, skip_new_rows, stream); break;
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace gqa
