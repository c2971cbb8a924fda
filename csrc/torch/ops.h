// Tensor-level entry points of the kernels, the functions orca_ext._C exposes. Each one checks
// ranks, shapes, dtypes and devices (csrc/torch/checks.h), makes its inputs contiguous, gives the
// index tensors one type, then dispatches on the device: CPU tensors to csrc/torch/cpu_ops.cpp,
// CUDA tensors to csrc/torch/cuda_ops.cpp (compiled only when the installed torch has CUDA).
// Bad input raises c10::ValueError (Python ValueError) with a message naming the argument.
// Semantics: docs/DESIGN.md section 4, the kernel contract.
#pragma once
#include <ATen/core/Tensor.h>

#include <array>
#include <memory>
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

// The attention work list of one set of per-request indices, built once per forward pass and
// read by the ragged_attention of every layer (all layers share the indices). On CUDA's
// tensor-core path it holds the device plan of csrc/cuda/launchers.h; on CPU and on the CUDA-core
// path only the shapes and indices (those paths need no work list).
struct RaggedAttentionPlan {
  at::Tensor workspace;                   // [bytes] uint8 on the device, or undefined (no device plan)
  std::array<at::Tensor, 4> index;        // q_start, q_len, kv_start, kv_len: one type, contiguous
  std::array<const void*, 4> source{};    // data of the tensors the plan was built from
  at::ScalarType dtype = at::kFloat;      // of q, k_cache, v_cache
  at::Device device = at::kCPU;
  int64_t n_tokens = 0, n_requests = 0, n_slots = 0, n_q_heads = 0, n_kv_heads = 0, head_dim = 0;
  int64_t items_per_sm = 16, decode_stages = 0;  // RaggedAttentionTuning (CUDA only)
};

// Checks the indices and shapes, then builds the plan (on CUDA: enqueues the work-list kernel on
// the current stream; the plan snapshots the index values in stream order). items_per_sm and
// decode_stages are the runtime knobs of the CUDA tensor-core path (RaggedAttentionTuning); they
// are validated on every device and do nothing on CPU.
std::shared_ptr<RaggedAttentionPlan> ragged_attention_plan(const at::Tensor& q_start,   // [B] int32 or int64
                                                           const at::Tensor& q_len,     // [B]
                                                           const at::Tensor& kv_start,  // [B]
                                                           const at::Tensor& kv_len,    // [B]
                                                           int64_t n_tokens,            // T
                                                           int64_t n_slots,             // S
                                                           int64_t n_q_heads, int64_t n_kv_heads,
                                                           int64_t head_dim, at::ScalarType dtype,
                                                           int64_t items_per_sm, int64_t decode_stages);

// `plan` (may be null): built by ragged_attention_plan from these very index tensors, for these
// shapes; ValueError otherwise.
at::Tensor ragged_attention(const at::Tensor& q,         // [T, Hq, D]
                            const at::Tensor& k_cache,   // [S, Hkv, D]
                            const at::Tensor& v_cache,   // [S, Hkv, D]
                            const at::Tensor& q_start,   // [B] int32 or int64
                            const at::Tensor& q_len,     // [B]
                            const at::Tensor& kv_start,  // [B]
                            const at::Tensor& kv_len,    // [B]
                            double scale,
                            const RaggedAttentionPlan* plan);  // -> [T, Hq, D]

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
