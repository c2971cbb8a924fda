// Torch-facing CUDA glue, compiled only when the installed torch has CUDA (ORCA_WITH_CUDA).
// ops.cpp has already checked ranks, shapes and dtypes, that every tensor is on one CUDA device,
// made every input contiguous and given the index tensors one type. Each function then does:
// device guard -> current stream -> dtype dispatch (fp16, bf16, fp32) -> launcher in csrc/cuda.
// Index *values* are never read on the host (that would sync): the kernels skip bad indices.
#pragma once
#include <ATen/core/Tensor.h>
#include <optional>

#include "ops.h"  // RaggedAttentionPlan

namespace orca::cuda_ops {

at::Tensor rms_norm(const at::Tensor& x,        // [T, H]
                    const at::Tensor& weight,   // [H]
                    double eps);                // -> [T, H]

at::Tensor rmsnorm_qkv(const at::Tensor& x,                      // [T, H]
                       const at::Tensor& norm_weight,            // [H]
                       const at::Tensor& qkv_weight,             // [N, H]
                       const std::optional<at::Tensor>& qkv_bias, // [N]
                       double eps, bool batch_invariant);        // -> [T, N]

// x W^T + b by cuBLAS on fixed-shape row chunks, so every row's arithmetic is the same whatever
// T is (the CUDA branch of orca::linear(..., batch_invariant=true); see kInvariantRows).
at::Tensor linear_batch_invariant(const at::Tensor& x,                    // [T, K]
                  const at::Tensor& weight,               // [N, K]
                  const std::optional<at::Tensor>& bias);  // [N] -> [T, N]

void slab_write(at::Tensor& k_cache,       // [S, Hkv, D]
                at::Tensor& v_cache,       // [S, Hkv, D]
                const at::Tensor& k,       // [T, Hkv, D]
                const at::Tensor& v,       // [T, Hkv, D]
                const at::Tensor& slots);  // [T] int32 or int64

at::Tensor ragged_attention(const at::Tensor& q,         // [T, Hq, D]
                            const at::Tensor& k_cache,   // [S, Hkv, D]
                            const at::Tensor& v_cache,   // [S, Hkv, D]
                            const at::Tensor& q_start,   // [B], one index type for all four
                            const at::Tensor& q_len,     // [B]
                            const at::Tensor& kv_start,  // [B]
                            const at::Tensor& kv_len,    // [B]
                            double scale, bool batch_invariant);  // -> [T, Hq, D]

void slab_move(at::Tensor& pools,         // [P, S, ...] on the GPU
               const at::Tensor& moves);  // [M, 3] int64 on the CPU, ranges checked

// Fills plan.workspace and enqueues the work-list kernel when (dtype, head_dim) runs on tensor
// cores and the batch is not empty; otherwise leaves it undefined (no device plan needed).
void build_ragged_attention_plan(RaggedAttentionPlan& plan);

// ragged_attention from a plan that ops.cpp has matched to these tensors.
at::Tensor ragged_attention_with_plan(const at::Tensor& q,        // [T, Hq, D]
                                      const at::Tensor& k_cache,  // [S, Hkv, D]
                                      const at::Tensor& v_cache,  // [S, Hkv, D]
                                      const RaggedAttentionPlan& plan,
                                      double scale);              // -> [T, Hq, D]

// ---- quantized weights (GGUF blocks; cuda_quant_ops.cpp) -----------------------------------------
// qtype is the ggml type id; ops.cpp has checked it, K against the block size and row_bytes, and
// the shapes, dtypes and devices. Batch-invariant at every T (launchers.h, quant section).
at::Tensor quant_linear(const at::Tensor& x,                         // [T, K]
                        const at::Tensor& qweight,                   // [N, row_bytes] uint8
                        int64_t qtype, int64_t k,
                        const std::optional<at::Tensor>& bias,       // [N]
                        const std::optional<at::Tensor>& residual);  // [T, N] -> [T, N]
at::Tensor quant_linear_silu_mul(const at::Tensor& x, const at::Tensor& qweight,  // [2I, row_bytes]
                                 int64_t qtype, int64_t k,
                                 const std::optional<at::Tensor>& bias);  // [2I] -> [T, I]
at::Tensor quant_embedding(const at::Tensor& qweight, int64_t qtype, int64_t k,
                           const at::Tensor& token_ids,              // [T] int64
                           at::ScalarType dtype);                    // -> [T, K]

}  // namespace orca::cuda_ops
