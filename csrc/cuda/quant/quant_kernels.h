// Internal entry points of the quantized-weight kernels (csrc/cuda/quant/*.cu), called by the
// launchers in quant_launchers.cu after the arguments are checked. Host code, no torch.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/launchers.h"

namespace orca::kernels::quant {

// What follows the projection, per output: nothing (linear, with optional bias and residual) or
// silu(gate) * up, the gate row n and the up row I + n of a [2I, K] weight.
enum class Epilogue : int { kLinear = 0, kSiluMul = 1 };

struct LinearArgs {
  const void* x;         // [T, K]
  const uint8_t* w;      // [N_rows, K / QK * block_bytes] (N_rows = N, or 2I for kSiluMul)
  const void* bias;      // [N_rows] or nullptr
  const void* residual;  // [T, N] or nullptr (kLinear only)
  void* out;             // [T, N] (kLinear) or [T, I] (kSiluMul)
  int64_t n_tokens, k;
  int64_t n_out;         // N (kLinear) or I (kSiluMul): columns of `out`
  Epilogue epilogue;
};

// fp16 / bf16 activations: tensor cores (quant_linear_mma.cu). x must be 16-byte aligned.
cudaError_t linear_mma(DType dtype, int64_t qtype, const LinearArgs& a, cudaStream_t stream);
// float32 activations: CUDA cores, a warp per output (quant_linear_f32.cu).
cudaError_t linear_f32(int64_t qtype, const LinearArgs& a, cudaStream_t stream);

}  // namespace orca::kernels::quant
