// One row of RMS normalisation in float32, shared by rms_norm and rmsnorm_qkv.
#pragma once
#include <cmath>
#include <cstdint>

#include "cpu_kernels.h"

namespace orca {
namespace cpu {
namespace detail {

// 1 / sqrt(mean(x^2) + eps) of one row, accumulated in float32.
template <typename T>
inline float rms_inv(const T* __restrict x,  // [H]
                     int64_t hidden, float eps) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t k = 0; k < hidden; ++k) {
    const float v = to_float(x[k]);
    ss += v * v;
  }
  return 1.0f / std::sqrt(ss / static_cast<float>(hidden) + eps);
}

// dst[H] = x * rms_inv(x) * weight, in float32 (the input of the QKV product).
template <typename T>
inline void rms_normalize_row(const T* __restrict x,       // [H]
                              const T* __restrict weight,  // [H]
                              float* __restrict dst,       // [H]
                              int64_t hidden, float eps) {
  const float inv = rms_inv(x, hidden, eps);
  for (int64_t k = 0; k < hidden; ++k) dst[k] = to_float(x[k]) * inv * to_float(weight[k]);
}

}  // namespace detail
}  // namespace cpu
}  // namespace orca
