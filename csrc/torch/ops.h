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
#include <tuple>
#include <vector>

namespace orca {

at::Tensor rms_norm(const at::Tensor& x,       // [T, H]
                    const at::Tensor& weight,  // [H]
                    double eps);               // -> [T, H]

// batch_invariant: one code path for every T, so a row's result never depends on the other rows.
// CPU: our weight-streaming kernel even above a lowered crossover (cpu_ops.h; by default every T
// runs on it, so the switch changes nothing there); CUDA: rms_norm, then the fixed-chunk cuBLAS
// product of `linear(..., batch_invariant=true)` instead of the fused decode kernel / one GEMM.
at::Tensor rmsnorm_qkv(const at::Tensor& x,                        // [T, H]
                       const at::Tensor& norm_weight,              // [H]
                       const at::Tensor& qkv_weight,               // [N, H], N = Nq*D + 2*Nkv*D
                       const std::optional<at::Tensor>& qkv_bias,  // [N] or None
                       double eps, bool batch_invariant);          // -> [T, N]

void slab_write(at::Tensor k_cache,       // [S, Hkv, D], written in place
                at::Tensor v_cache,       // [S, Hkv, D], written in place
                const at::Tensor& k,      // [T, Hkv, D]
                const at::Tensor& v,      // [T, Hkv, D]
                const at::Tensor& slots);  // [T] int32 or int64

// Each row's maximum and the first column holding it (a row with a NaN: NaN and its first NaN);
// float32 rows on the CPU (the greedy token of each request's logits).
std::tuple<at::Tensor, at::Tensor> row_argmax(const at::Tensor& x);  // [R, V] -> (index [R] int64, value [R] float32)

// The step between rmsnorm_qkv and attention, fused (CPU only; no CUDA kernel): rotates the q and k
// heads of qkv by each token's cos/sin (half-split rotary embedding in float32, rounded once),
// writes rotated k and v into the caches at slots[t] (as slab_write), returns rotated q. Results
// are bit-identical to the unfused rope + slab_write path. Hkv and D come from the caches; D even.
at::Tensor rope_slab_write(const at::Tensor& qkv,      // [T, (Hq + 2*Hkv) * D]
                           const at::Tensor& cos,      // [T, D/2] float32
                           const at::Tensor& sin,      // [T, D/2] float32
                           at::Tensor k_cache,         // [S, Hkv, D], written in place
                           at::Tensor v_cache,         // [S, Hkv, D], written in place
                           const at::Tensor& slots,    // [T] int32 or int64
                           int64_t n_q_heads,          // Hq
                           int64_t n_kv_heads);        // Hkv; -> q [T, Hq, D]

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
  bool batch_invariant = false;           // no decode splits: a row depends only on its request
};

// Checks the indices and shapes, then builds the plan (on CUDA: enqueues the work-list kernel on
// the current stream; the plan snapshots the index values in stream order). items_per_sm and
// decode_stages are the runtime knobs of the CUDA tensor-core path (RaggedAttentionTuning); they
// are validated on every device and do nothing on CPU. batch_invariant: the work list has no
// decode splits (each row's result depends only on its own request's kv_len, never on the
// batch); it needs decode_stages == 0. On CPU it selects the tile path (cpu_ops.h).
std::shared_ptr<RaggedAttentionPlan> ragged_attention_plan(const at::Tensor& q_start,   // [B] int32 or int64
                                                           const at::Tensor& q_len,     // [B]
                                                           const at::Tensor& kv_start,  // [B]
                                                           const at::Tensor& kv_len,    // [B]
                                                           int64_t n_tokens,            // T
                                                           int64_t n_slots,             // S
                                                           int64_t n_q_heads, int64_t n_kv_heads,
                                                           int64_t head_dim, at::ScalarType dtype,
                                                           int64_t items_per_sm, int64_t decode_stages,
                                                           bool batch_invariant);

// `plan` (may be null): built by ragged_attention_plan from these very index tensors, for these
// shapes and this batch_invariant; ValueError otherwise.
at::Tensor ragged_attention(const at::Tensor& q,         // [T, Hq, D]
                            const at::Tensor& k_cache,   // [S, Hkv, D]
                            const at::Tensor& v_cache,   // [S, Hkv, D]
                            const at::Tensor& q_start,   // [B] int32 or int64
                            const at::Tensor& q_len,     // [B]
                            const at::Tensor& kv_start,  // [B]
                            const at::Tensor& kv_len,    // [B]
                            double scale,
                            const RaggedAttentionPlan* plan,  // may be null
                            bool batch_invariant);            // -> [T, Hq, D]

// out = x * weight^T + bias (+ residual, added before the one rounding). CPU: our weight-streaming
// kernels up to a per-dtype crossover in T, ATen above it (cpu_ops.h); other devices: ATen.
// batch_invariant: a row's result depends only on that row. CPU: our kernels at every T (they are
// T-independent); CUDA: cuBLAS on fixed-shape row chunks (cuda_ops::linear_batch_invariant).
at::Tensor linear(const at::Tensor& x,                        // [T, K]
                  const at::Tensor& weight,                   // [N, K]
                  const std::optional<at::Tensor>& bias,      // [N] or None
                  const std::optional<at::Tensor>& residual,  // [T, N] or None; -> [T, N]
                  bool batch_invariant);

// out = silu(gate) * up with [gate | up] = x * gate_up_weight^T + gate_up_bias, the SwiGLU MLP's
// fused gate_up projection (I gate rows on top of I up rows). Dispatch as for linear.
at::Tensor linear_silu_mul(const at::Tensor& x,                            // [T, K]
                           const at::Tensor& gate_up_weight,               // [2I, K]
                           const std::optional<at::Tensor>& gate_up_bias,  // [2I] or None; -> [T, I]
                           bool batch_invariant);

// ---- Quantized weights (ggml block formats, kept as a GGUF stores them) -------------------------
// qweight is uint8 [N, row_bytes], each row K / block_elems blocks of ggml type `qtype` (the formats
// and kernel contract: docs/DESIGN.md section 4; supported ids: quant_types()). CPU: the
// weight-streaming kernels of csrc/cpu/quant_kernels.h, batch-invariant at every T (so
// batch_invariant changes nothing there); int8_activations selects their int8-activation products
// (cpu::QuantActivations::kInt8) for the formats that have them; CUDA: cuda_ops::quant_*, which
// always take the activations in their own dtype (int8_activations changes nothing there).
at::Tensor quant_linear(const at::Tensor& x,                        // [T, K]
                        const at::Tensor& qweight,                  // [N, row_bytes] uint8
                        int64_t qtype, int64_t k,
                        const std::optional<at::Tensor>& bias,      // [N] or None
                        const std::optional<at::Tensor>& residual,  // [T, N] or None; -> [T, N]
                        bool batch_invariant, bool int8_activations);

// silu(gate) * up of the fused gate_up projection: qweight holds I gate rows, then I up rows.
at::Tensor quant_linear_silu_mul(const at::Tensor& x,                    // [T, K]
                                 const at::Tensor& qweight,              // [2I, row_bytes] uint8
                                 int64_t qtype, int64_t k,
                                 const std::optional<at::Tensor>& bias,  // [2I] or None; -> [T, I]
                                 bool batch_invariant, bool int8_activations);

// quant_linear(rms_norm(x) * norm_weight, qweight, bias): the fused norm + projection (QKV, and the
// final norm + lm_head). CUDA: rms_norm, then quant_linear.
at::Tensor quant_rmsnorm_qkv(const at::Tensor& x,                    // [T, K]
                             const at::Tensor& norm_weight,          // [K]
                             const at::Tensor& qweight,              // [N, row_bytes] uint8
                             int64_t qtype, int64_t k,
                             const std::optional<at::Tensor>& bias,  // [N] or None
                             double eps, bool batch_invariant,       // -> [T, N]
                             bool int8_activations);

// Rows token_ids of the dequantized [V, K] table, in `dtype`. CPU: every id is checked against [0, V).
at::Tensor quant_embedding(const at::Tensor& qweight,    // [V, row_bytes] uint8
                           int64_t qtype, int64_t k,
                           const at::Tensor& token_ids,  // [T] int64 (or int32)
                           at::ScalarType dtype);        // -> [T, K]

// The ggml type ids the quantized ops accept, ascending.
std::vector<int64_t> quant_types();
// The ggml type ids whose CPU products int8_activations changes on this build and CPU.
std::vector<int64_t> quant_int8_types();

// Slab compaction: for each row (src, dst, n) of `moves`, in order, rows [src, src+n) of every
// pool are copied to [dst, dst+n) as if through a temporary. Any dtype; moves stay on the CPU.
void slab_move(at::Tensor pools,          // [P, S, ...] contiguous, moved in place
               const at::Tensor& moves);  // [M, 3] int64, CPU

// True when this build dispatches CUDA tensors to the CUDA kernels.
bool built_with_cuda();

}  // namespace orca
