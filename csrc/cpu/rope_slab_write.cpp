// rope_slab_write: the step between the QKV projection and attention, in one pass over the
// projection's output. Rotates every q and k head (half-split rotary embedding), writes the
// rotated k rows and the v rows into the KV pools at each token's slot, and returns rotated q.
//
// Rounding matches the unfused path (apply_rope in float32, then slab_write) bit for bit: each
// product x1*cos, x2*sin, x2*cos, x1*sin is rounded to float32 on its own before the one
// subtraction or addition, as ATen's separate elementwise ops do, and the sum is rounded once to
// T. CMakeLists.txt compiles this file with -ffp-contract=off so that the compiler cannot fuse a
// product and a sum into an FMA (which rounds once and would change the last bit).
#include <cstdint>
#include <cstring>

#include "cpu_kernels.h"

namespace orca {
namespace cpu {
namespace {

// out[i] = x1*cos - x2*sin, out[half+i] = x2*cos + x1*sin over one head [x1 | x2].
template <typename T>
inline void rotate_head(const T* x, const float* cos, const float* sin, T* out, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = to_float(x[i]), x2 = to_float(x[half + i]);
    const float x1c = x1 * cos[i], x2s = x2 * sin[i];
    const float x2c = x2 * cos[i], x1s = x1 * sin[i];
    out[i] = from_float<T>(x1c - x2s);
    out[half + i] = from_float<T>(x2c + x1s);
  }
}

// Rotated elements from which the work is split across threads. Measured on the dev machine
// (2 cores, AVX2, 2026-11-30; 12 rotated heads x 64 per token): 2 threads are no faster up to
// 64 tokens (48K elements), 1.1-1.5x faster from 96-128 tokens, in both dtypes.
constexpr int64_t kParallelElements = int64_t{1} << 16;

}  // namespace

template <typename T, typename I>
void rope_slab_write(const T* qkv,      // [T, (Hq + 2*Hkv) * D]
                     const float* cos,  // [T, D/2]
                     const float* sin,  // [T, D/2]
                     T* k_cache,        // [S, Hkv, D]
                     T* v_cache,        // [S, Hkv, D]
                     const I* slots,    // [T]
                     T* q_out,          // [T, Hq, D]
                     int64_t n_tokens, int64_t n_q_heads, int64_t n_kv_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  const int64_t row = (n_q_heads + 2 * n_kv_heads) * head_dim;
  const int64_t kv_row = n_kv_heads * head_dim;
  // One work item per q head, per k head, and one for the token's v row: Hq + Hkv + 1 per token.
  const int64_t items_per_token = n_q_heads + n_kv_heads + 1;
  const int64_t n_items = n_tokens * items_per_token;
  // A decode step rotates a few thousand elements per layer (~1 us): waking the OpenMP team
  // costs more than that. The rotation, not the copy, sets the time (bf16 costs more per element
  // than float32, so the threshold counts elements, not bytes); split from kParallelElements.
  const bool parallel = n_tokens > 1 && n_tokens * (n_q_heads + n_kv_heads) * head_dim >= kParallelElements;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t item = 0; item < n_items; ++item) {
    const int64_t t = item / items_per_token, j = item % items_per_token;
    const T* src = qkv + t * row;
    const float* c = cos + t * half;
    const float* s = sin + t * half;
    const int64_t slot = static_cast<int64_t>(slots[t]);
    if (j < n_q_heads) {
      rotate_head(src + j * head_dim, c, s, q_out + (t * n_q_heads + j) * head_dim, half);
    } else if (j < n_q_heads + n_kv_heads) {
      const int64_t h = j - n_q_heads;
      rotate_head(src + (n_q_heads + h) * head_dim, c, s, k_cache + slot * kv_row + h * head_dim, half);
    } else {
      std::memcpy(v_cache + slot * kv_row, src + (n_q_heads + n_kv_heads) * head_dim,
                  static_cast<size_t>(kv_row) * sizeof(T));
    }
  }
}

#define ORCA_ROPE_SLAB_WRITE(T, I)                                                                    \
  template void rope_slab_write<T, I>(const T*, const float*, const float*, T*, T*, const I*, T*, int64_t, \
                                      int64_t, int64_t, int64_t);
ORCA_ROPE_SLAB_WRITE(float, int32_t)
ORCA_ROPE_SLAB_WRITE(float, int64_t)
ORCA_ROPE_SLAB_WRITE(bf16, int32_t)
ORCA_ROPE_SLAB_WRITE(bf16, int64_t)
#undef ORCA_ROPE_SLAB_WRITE

}  // namespace cpu
}  // namespace orca
