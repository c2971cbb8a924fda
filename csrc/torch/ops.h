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

// batch_invariant: one code path for every T, so a row's result never depends on the other rows
// (CPU: always the fused kernel; CUDA: rms_norm, then `linear` below).
at::Tensor rmsnorm_qkv(const at::Tensor& x,                        // [T, H]
                       const at::Tensor& norm_weight,              // [H]
                       const at::Tensor& qkv_weight,               // [N, H], N = Nq*D + 2*Nkv*D
                       const std::optional<at::Tensor>& qkv_bias,  // [N] or None
                       double eps, bool batch_invariant);          // -> [T, N]

// The batch-invariant linear layer: out = x W^T + b, where each row's result depends only on that
// row (CPU: the fused kernel's product without the norm; CUDA: cuBLAS on fixed-shape row chunks).
at::Tensor linear(const at::Tensor& x,                    // [T, K]
                  const at::Tensor& weight,               // [N, K]
                  const std::optional<at::Tensor>& bias);  // [N] or None -> [T, N]

void slab_write(at::Tensor k_cache,       // [S, Hkv, D], written in place
                at::Tensor v_cache,       // [S, Hkv, D], written in place
                const at::Tensor& k,      // [T, Hkv, D]
                const at::Tensor& v,      // [T, Hkv, D]
                const at::Tensor& slots);  // [T] int32 or int64

// out = silu(gate_up[:, :I]) * gate_up[:, I:], batch-invariant (CPU: one thread per whole row;
// CUDA: ATen's elementwise kernels, which compute every element the same way).
at::Tensor silu_mul(const at::Tensor& gate_up);  // [T, 2I] -> [T, I]

at::Tensor ragged_attention(const at::Tensor& q,         // [T, Hq, D]
                            const at::Tensor& k_cache,   // [S, Hkv, D]
                            const at::Tensor& v_cache,   // [S, Hkv, D]
                            const at::Tensor& q_start,   // [B] int32 or int64
                            const at::Tensor& q_len,     // [B]
                            const at::Tensor& kv_start,  // [B]
                            const at::Tensor& kv_len,    // [B]
                            double scale,
                            bool batch_invariant);       // -> [T, Hq, D]

// Slab compaction: for each row (src, dst, n) of `moves`, in order, rows [src, src+n) of every
// pool are copied to [dst, dst+n) as if through a temporary. Any dtype; moves stay on the CPU.
void slab_move(at::Tensor pools,          // [P, S, ...] contiguous, moved in place
               const at::Tensor& moves);  // [M, 3] int64, CPU

// True when this build dispatches CUDA tensors to the CUDA kernels.
bool built_with_cuda();

}  // namespace orca
