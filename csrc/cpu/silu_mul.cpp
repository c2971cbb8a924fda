// silu_mul: out[T, I] = silu(gate) * up for the fused gate_up output [T, 2I] of a SwiGLU MLP.
//
// Why not ATen's silu: it splits the flattened [T, I] range over threads at T-dependent points
// and runs vector code up to each split and scalar code (a different exp) after it, so the same
// element can round differently as T changes. Here one thread handles a whole row, from its first
// column, so an element's arithmetic depends only on its column index and on I.
// exp(-|g|) comes from exp2_nonpos (plain arithmetic that vectorizes); silu(g) = g / (1 + e^-g)
// for g >= 0 and g e^g / (1 + e^g) for g < 0, so the exponent is never positive.
#include <cmath>
#include <cstdint>

#include "cpu_kernels.h"
#include "vec.h"

namespace orca {
namespace cpu {

template <typename T>
void silu_mul(const T* gate_up,  // [T, 2I]
              T* out,            // [T, I]
              int64_t n_tokens, int64_t n_inter) {
  constexpr float kLog2e = 1.4426950408889634f;
  const bool parallel = n_tokens > 1 && n_tokens * n_inter >= (int64_t{1} << 15);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t t = 0; t < n_tokens; ++t) {
    const T* __restrict gate = gate_up + t * 2 * n_inter;
    const T* __restrict up = gate + n_inter;
    T* __restrict o = out + t * n_inter;
    for (int64_t i = 0; i < n_inter; ++i) {
      const float g = to_float(gate[i]);
      const float e = detail::exp2_nonpos(-std::fabs(g) * kLog2e);  // exp(-|g|) in (0, 1]
      const float num = g >= 0.0f ? g : g * e;
      o[i] = from_float<T>(num / (1.0f + e) * to_float(up[i]));
    }
  }
}

template void silu_mul<float>(const float*, float*, int64_t, int64_t);
template void silu_mul<bf16>(const bf16*, bf16*, int64_t, int64_t);

}  // namespace cpu
}  // namespace orca
