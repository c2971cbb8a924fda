// rmsnorm_qkv: out[T, N] = linear(rms_norm(x) * norm_weight, W[N, H], bias[N]).
//
// The norm writes each token's normalised row straight into the activation buffer of the
// weight-streaming product (skinny_gemm_impl.h), which then reads W once per token tile: for
// decode-sized T that is W exactly once, at memory bandwidth. The same kernel serves the final
// norm + lm_head.
#include <cstdint>

#include "cpu_kernels.h"
#include "rms_norm_impl.h"
#include "skinny_gemm_impl.h"

namespace orca {
namespace cpu {

template <typename T>
void rmsnorm_qkv(const T* x,            // [T, H]
                 const T* norm_weight,  // [H]
                 const T* qkv_weight,   // [N, H]
                 const T* qkv_bias,     // [N] or nullptr
                 T* out,                // [T, N]
                 int64_t n_tokens, int64_t hidden, int64_t n_out, float eps) {
  if (n_tokens <= 0 || n_out <= 0) return;
  const detail::Activations a = detail::prepare_activations<T>(n_tokens, hidden, [=](int64_t t, float* dst) {
    detail::rms_normalize_row(x + t * hidden, norm_weight, dst, hidden, eps);
  });
  detail::stream_weights<T>(a, qkv_weight, qkv_bias, nullptr, out, n_tokens, hidden, n_out, detail::Epilogue::kBias);
}

template void rmsnorm_qkv<float>(const float*, const float*, const float*, const float*, float*,
                                 int64_t, int64_t, int64_t, float);
template void rmsnorm_qkv<bf16>(const bf16*, const bf16*, const bf16*, const bf16*, bf16*, int64_t,
                                int64_t, int64_t, float);

}  // namespace cpu
}  // namespace orca
