// Torch-facing CPU glue: index-value checks -> dtype dispatch (float32, bfloat16) -> raw-pointer
// kernels in csrc/cpu. ops.cpp has already checked ranks, shapes, dtypes and devices, made every
// input contiguous and given the index tensors one type (int32 or int64).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace orca::cpu_ops {

at::Tensor rms_norm(const at::Tensor& x,       // [T, H]
                    const at::Tensor& weight,  // [H]
                    double eps);               // -> [T, H]

at::Tensor rmsnorm_qkv(const at::Tensor& x,                        // [T, H]
                       const at::Tensor& norm_weight,              // [H]
                       const at::Tensor& qkv_weight,               // [N, H]
                       const std::optional<at::Tensor>& qkv_bias,  // [N]
                       double eps, bool batch_invariant);          // -> [T, N]

// Checks every slot against [0, S) before writing (a ValueError names the bad slot).
void slab_write(at::Tensor& k_cache,       // [S, Hkv, D]
                at::Tensor& v_cache,       // [S, Hkv, D]
                const at::Tensor& k,       // [T, Hkv, D]
                const at::Tensor& v,       // [T, Hkv, D]
                const at::Tensor& slots);  // [T] int32 or int64

std::tuple<at::Tensor, at::Tensor> row_argmax(const at::Tensor& x);  // [R, V] float32 contiguous, V >= 1

// Checks every slot against [0, S) before writing (a ValueError names the bad slot).
at::Tensor rope_slab_write(const at::Tensor& qkv,      // [T, (Hq + 2*Hkv) * D]
                           const at::Tensor& cos,      // [T, D/2] float32
                           const at::Tensor& sin,      // [T, D/2] float32
                           at::Tensor& k_cache,        // [S, Hkv, D]
                           at::Tensor& v_cache,        // [S, Hkv, D]
                           const at::Tensor& slots,    // [T] int32 or int64
                           int64_t n_q_heads);         // -> q [T, Hq, D]

// Checks every request's rows and slots against q and the cache before computing.
at::Tensor ragged_attention(const at::Tensor& q,         // [T, Hq, D]
                            const at::Tensor& k_cache,   // [S, Hkv, D]
                            const at::Tensor& v_cache,   // [S, Hkv, D]
                            const at::Tensor& q_start,   // [B], one index type for all four
                            const at::Tensor& q_len,     // [B]
                            const at::Tensor& kv_start,  // [B]
                            const at::Tensor& kv_len,    // [B]
                            double scale, bool batch_invariant);  // -> [T, Hq, D]

// Ranges were checked by ops.cpp.
void slab_move(at::Tensor& pools,         // [P, S, ...]
               const at::Tensor& moves);  // [M, 3] int64, CPU, contiguous

at::Tensor linear(const at::Tensor& x,                        // [T, K]
                  const at::Tensor& weight,                   // [N, K]
                  const std::optional<at::Tensor>& bias,      // [N]
                  const std::optional<at::Tensor>& residual,  // [T, N]; -> [T, N]
                  bool batch_invariant);

at::Tensor linear_silu_mul(const at::Tensor& x,                            // [T, K]
                           const at::Tensor& gate_up_weight,               // [2I, K]
                           const std::optional<at::Tensor>& gate_up_bias,  // [2I]; -> [T, I]
                           bool batch_invariant);

// The quantized ops (csrc/cpu/quant_kernels.h). ops.cpp has checked qtype, k and row_bytes.
// int8_activations: cpu::QuantActivations::kInt8 (else kFloat32).
at::Tensor quant_linear(const at::Tensor& x,                        // [T, K]
                        const at::Tensor& qweight,                  // [N, row_bytes] uint8
                        int64_t qtype, int64_t k,
                        const std::optional<at::Tensor>& bias,      // [N]
                        const std::optional<at::Tensor>& residual,  // [T, N]; -> [T, N]
                        bool int8_activations);

at::Tensor quant_linear_silu_mul(const at::Tensor& x,                    // [T, K]
                                 const at::Tensor& qweight,              // [2I, row_bytes] uint8
                                 int64_t qtype, int64_t k,
                                 const std::optional<at::Tensor>& bias,  // [2I]; -> [T, I]
                                 bool int8_activations);

at::Tensor quant_rmsnorm_qkv(const at::Tensor& x,                    // [T, K]
                             const at::Tensor& norm_weight,          // [K]
                             const at::Tensor& qweight,              // [N, row_bytes] uint8
                             int64_t qtype, int64_t k,
                             const std::optional<at::Tensor>& bias,  // [N]
                             double eps, bool int8_activations);     // -> [T, N]

// Checks every id against [0, V) before reading (a ValueError names the bad id).
at::Tensor quant_embedding(const at::Tensor& qweight,    // [V, row_bytes] uint8
                           int64_t qtype, int64_t k,
                           const at::Tensor& token_ids,  // [T] int32 or int64
                           at::ScalarType dtype);        // float32 or bfloat16; -> [T, K]

// The instruction path of the quantized kernels: "avx2" or "avx512"; quant_paths(): those this CPU runs.
std::string quant_path();
void set_quant_path(const std::string& name);
std::vector<std::string> quant_paths();

// rmsnorm_qkv, linear and linear_silu_mul run our weight-streaming kernels (csrc/cpu/skinny_gemm.*,
// whose reduction order does not depend on T) for up to this many tokens, and ATen's GEMM
// (oneDNN) above it. Default: no crossover, every T on our kernels, so a token's outputs never
// depend on its batch. bench/skinny_crossover.py found ATen slower than our kernels at every T
// from 2 to 512 in both dtypes on the dev machine (AMD EPYC Zen 2, AVX2, no AVX512-BF16; 2026-11-30,
// bench/RESULTS.md). On a CPU where oneDNN has native bf16 (AVX512-BF16, AMX) re-run that script:
// set_stream_max_tokens("bfloat16", T) hands larger batches to ATen, at the price of invariance.
// Their batch_invariant argument keeps every T on our kernels whatever this crossover is.
int64_t stream_max_tokens(const std::string& dtype);
void set_stream_max_tokens(const std::string& dtype, int64_t max_tokens);
constexpr int64_t kStreamMaxTokensFloat = int64_t{1} << 30;
constexpr int64_t kStreamMaxTokensBf16 = int64_t{1} << 30;

// The instruction path of the bf16 kernels: "avx2", "avx512_bf16", or "avx512_bf16_emulated" (a
// scalar emulation of the latter, for tests on CPUs without it). bf16_paths(): those this CPU runs.
std::string bf16_path();
void set_bf16_path(const std::string& name);
std::vector<std::string> bf16_paths();
// The instruction path of the float32 kernels: "avx2" or "avx512". f32_paths(): those this CPU runs.
std::string f32_path();
void set_f32_path(const std::string& name);
std::vector<std::string> f32_paths();

// Reads every word of a contiguous CPU int64 tensor once with all threads (the streaming-read
// ceiling of the benchmarks) and returns their XOR.
uint64_t stream_read(const at::Tensor& words);

}  // namespace orca::cpu_ops
