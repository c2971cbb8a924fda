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

// Above this many tokens the CPU rmsnorm_qkv normalises with our kernel and hands the GEMM to
// ATen (oneDNN/MKL), which is faster than a hand-rolled GEMM at prefill sizes; at decode sizes
// our fused kernel streams the weight once and wins. Chosen by bench/cpu/bench_rmsnorm_qkv.
constexpr int64_t kCpuFusedMaxTokens = 16;

}  // namespace orca
