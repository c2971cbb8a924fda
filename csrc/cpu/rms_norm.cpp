// rms_norm: out[T, H] = rms_norm(x) * weight, norm in float32. Rows are independent, so the
// work is split over tokens; small inputs stay on the calling thread because waking the
// OpenMP team costs more than normalising a few decode rows.
#include <cstdint>

#include "cpu_kernels.h"
#include "rms_norm_impl.h"

namespace orca {
namespace cpu {

template <typename T>
void rms_norm(const T* x,       // [T, H]
              const T* weight,  // [H]
              T* out,           // [T, H]
              int64_t n_tokens, int64_t hidden, float eps) {
  const bool parallel = n_tokens > 1 && n_tokens * hidden >= (int64_t{1} << 15);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t t = 0; t < n_tokens; ++t) {
    const T* __restrict xr = x + t * hidden;
    const T* __restrict w = weight;
    T* __restrict o = out + t * hidden;
    const float inv = detail::rms_inv(xr, hidden, eps);
    for (int64_t k = 0; k < hidden; ++k) o[k] = from_float<T>(to_float(xr[k]) * inv * to_float(w[k]));
  }
}

template void rms_norm<float>(const float*, const float*, float*, int64_t, int64_t, float);
template void rms_norm<bf16>(const bf16*, const bf16*, bf16*, int64_t, int64_t, float);

}  // namespace cpu
}  // namespace orca
