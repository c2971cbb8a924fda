// Tensor-level entry points of the three kernels (+ rms_norm). Each one checks ranks, shapes,
// dtypes, devices and (on CPU) index values, then dispatches on the device: CPU tensors to the
// raw-pointer kernels in csrc/cpu, CUDA tensors to csrc/cuda (built only when torch has CUDA).
// Bad input raises c10::ValueError (Python ValueError) with a message naming the argument.
#pragma once
#include <ATen/core/Tensor.h>
#include <optional>

namespace orca {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

at::Tensor rmsnorm_qkv(const at::Tensor& x, const at::Tensor& norm_weight, const at::Tensor& qkv_weight,
                       const std::optional<at::Tensor>& qkv_bias, double eps);

void slab_write(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
                const at::Tensor& slots);

at::Tensor ragged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& q_start, const at::Tensor& q_len, const at::Tensor& kv_start,
                            const at::Tensor& kv_len, double scale);

// Up to this many tokens the CPU rmsnorm_qkv runs our fused kernel, which streams the weight once;
// above it we normalise with our kernel and hand the GEMM to ATen. Measured with 2 threads on the
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

}  // namespace orca
