// Tensor-level entry points of the kernels, the functions orca_ext._C exposes. Each one checks
// ranks, shapes, dtypes and devices (csrc/torch/checks.h), makes its inputs contiguous, gives the
// index tensors one type, then dispatches on the device: CPU tensors to csrc/torch/cpu_ops.cpp,
// CUDA tensors to csrc/torch/cuda_ops.cpp (compiled only when the installed torch has CUDA).
// Bad input raises c10::ValueError (Python ValueError) with a message naming the argument.
// Semantics: docs/DESIGN.md section 4, the kernel contract.
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>

namespace orca {

at::Tensor rms_norm(const at::Tensor& x,       // [T, H]
                    const at::Tensor& weight,  // [H]
                    double eps);               // -> [T, H]

at::Tensor rmsnorm_qkv(const at::Tensor& x,                        // [T, H]
                       const at::Tensor& norm_weight,              // [H]
                       const at::Tensor& qkv_weight,               // [N, H], N = Nq*D + 2*Nkv*D
                       const std::optional<at::Tensor>& qkv_bias,  // [N] or None
                       double eps);                                // -> [T, N]

void slab_write(at::Tensor k_cache,       // [S, Hkv, D], written in place
                at::Tensor v_cache,       // [S, Hkv, D], written in place
                const at::Tensor& k,      // [T, Hkv, D]
                const at::Tensor& v,      // [T, Hkv, D]
                const at::Tensor& slots);  // [T] int32 or int64

at::Tensor ragged_attention(const at::Tensor& q,         // [T, Hq, D]
                            const at::Tensor& k_cache,   // [S, Hkv, D]
                            const at::Tensor& v_cache,   // [S, Hkv, D]
                            const at::Tensor& q_start,   // [B] int32 or int64
                            const at::Tensor& q_len,     // [B]
                            const at::Tensor& kv_start,  // [B]
                            const at::Tensor& kv_len,    // [B]
                            double scale);               // -> [T, Hq, D]

// out = x * weight^T + bias (+ residual, added before the one rounding). CPU: our weight-streaming
// kernels up to a per-dtype crossover in T, ATen above it (cpu_ops.h); other devices: ATen.
at::Tensor linear(const at::Tensor& x,                        // [T, K]
                  const at::Tensor& weight,                   // [N, K]
                  const std::optional<at::Tensor>& bias,      // [N] or None
                  const std::optional<at::Tensor>& residual);  // [T, N] or None; -> [T, N]

// out = silu(gate) * up with [gate | up] = x * gate_up_weight^T + gate_up_bias, the SwiGLU MLP's
// fused gate_up projection (I gate rows on top of I up rows). Dispatch as for linear.
at::Tensor linear_silu_mul(const at::Tensor& x,                            // [T, K]
                           const at::Tensor& gate_up_weight,               // [2I, K]
                           const std::optional<at::Tensor>& gate_up_bias);  // [2I] or None; -> [T, I]

// True when this build dispatches CUDA tensors to the CUDA kernels.
bool built_with_cuda();

}  // namespace orca
