// Torch-facing CPU glue: index-value checks -> dtype dispatch (float32, bfloat16) -> raw-pointer
// kernels in csrc/cpu. ops.cpp has already checked ranks, shapes, dtypes and devices, made every
// input contiguous and given the index tensors one type (int32 or int64).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace orca::cpu_ops {

at::Tensor rms_norm(const at::Tensor& x,       // [T, H]
                    const at::Tensor& weight,  // [H]
                    double eps);               // -> [T, H]

at::Tensor rmsnorm_qkv(const at::Tensor& x,                        // [T, H]
                       const at::Tensor& norm_weight,              // [H]
                       const at::Tensor& qkv_weight,               // [N, H]
                       const std::optional<at::Tensor>& qkv_bias,  // [N]
                       double eps, bool batch_invariant);          // -> [T, N]

// The fused kernel's product without the norm, for every T (batch-invariant, see ops.h).
at::Tensor linear(const at::Tensor& x,                    // [T, K]
                  const at::Tensor& weight,               // [N, K]
                  const std::optional<at::Tensor>& bias);  // [N] -> [T, N]

// Checks every slot against [0, S) before writing (a ValueError names the bad slot).
void slab_write(at::Tensor& k_cache,       // [S, Hkv, D]
                at::Tensor& v_cache,       // [S, Hkv, D]
                const at::Tensor& k,       // [T, Hkv, D]
                const at::Tensor& v,       // [T, Hkv, D]
                const at::Tensor& slots);  // [T] int32 or int64

// Checks every request's rows and slots against q and the cache before computing.
at::Tensor silu_mul(const at::Tensor& gate_up);  // [T, 2I] -> [T, I]

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

// Up to this many tokens the CPU rmsnorm_qkv runs our fused kernel, which streams the weight once;
// above it we normalise with our kernel and hand the GEMM to ATen (except with batch_invariant,
// which keeps every T on the fused kernel: ATen's blocking, and so its reduction order, changes
// with T). Measured with 2 threads on the
// dev machine (AMD EPYC, AVX-512, 2026-11-29; SmolLM2 shapes H=576 -> 960): in float32 the fused
// kernel is 1.3-3.4x faster than norm + ATen linear for T <= 16 and about even at T = 32; in
// bfloat16 ATen's oneDNN path uses the CPU's native bf16 dot products and wins from T = 4 on.
// A very wide float32 projection (the lm_head, N = 49152) is the exception: ATen manages only
// 40-65 GFLOP/s on that tall-skinny shape at T = 16-32, so the fused kernel keeps it up to one
// token tile (96 rows), where it streams the weight exactly once.
constexpr int64_t kCpuFusedMaxTokensFloat = 16;
constexpr int64_t kCpuFusedMaxTokensBf16 = 2;
constexpr int64_t kCpuWideOutputs = 16384;
constexpr int64_t kCpuFusedMaxTokensWide = 96;

}  // namespace orca::cpu_ops
