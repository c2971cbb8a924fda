// The quantized-weight launchers of launchers.h: argument checks, then the float32 (CUDA-core) or
// fp16/bf16 (tensor-core) kernel. Calls with more tokens than one grid can hold run as several
// launches over consecutive token ranges, which changes nothing for any token (the kernels are
// batch-invariant).
#include "cuda/common.cuh"
#include "cuda/quant/quant_blocks.cuh"
#include "cuda/quant/quant_kernels.h"

namespace orca::kernels {
namespace {

// Tokens per launch: a multiple of both kernels' token tiles (8 and 64) whose tile count fits grid.y.
constexpr int64_t kMaxTokensPerLaunch = int64_t{64} * 8190;

size_t elem_bytes(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

cudaError_t run(DType dtype, int64_t qtype, quant::LinearArgs a, cudaStream_t stream) {
  const int64_t qk = quant_block_elems(qtype);
  if (qk == 0 || a.k < 0 || a.k % qk != 0 || a.n_tokens < 0 || a.n_out < 0) return cudaErrorInvalidValue;
  if (a.n_tokens == 0 || a.n_out == 0) return cudaSuccess;
  if (a.k == 0) return cudaErrorInvalidValue;  // the glue answers an empty reduction itself
  const int64_t total = a.n_tokens;
  const size_t es = elem_bytes(dtype);
  for (int64_t t0 = 0; t0 < total; t0 += kMaxTokensPerLaunch) {
    quant::LinearArgs part = a;
    part.n_tokens = total - t0 < kMaxTokensPerLaunch ? total - t0 : kMaxTokensPerLaunch;
    part.x = static_cast<const char*>(a.x) + t0 * a.k * es;
    part.out = static_cast<char*>(a.out) + t0 * a.n_out * es;
    if (a.residual != nullptr) part.residual = static_cast<const char*>(a.residual) + t0 * a.n_out * es;
    const cudaError_t err =
        dtype == DType::kFloat32 ? quant::linear_f32(qtype, part, stream) : quant::linear_mma(dtype, qtype, part, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace

int64_t quant_block_elems(int64_t qtype) {
  int64_t n = 0;
  quant::visit_format(qtype, [&](auto fmt) { n = decltype(fmt)::kBlockElems; });
  return n;
}

int64_t quant_block_bytes(int64_t qtype) {
  int64_t n = 0;
  quant::visit_format(qtype, [&](auto fmt) { n = decltype(fmt)::kBlockBytes; });
  return n;
}

bool quant_linear_supported(DType dtype, const void* x) {
  return dtype == DType::kFloat32 || detail::aligned16(x);
}

cudaError_t quant_linear(DType dtype, int64_t qtype, const void* x, const void* qweight, const void* bias,
                         const void* residual, void* out, int64_t n_tokens, int64_t k, int64_t n_out,
                         cudaStream_t stream) {
  if (!quant_linear_supported(dtype, x)) return cudaErrorInvalidValue;
  return run(dtype, qtype,
             {x, static_cast<const uint8_t*>(qweight), bias, residual, out, n_tokens, k, n_out,
              quant::Epilogue::kLinear},
             stream);
}

cudaError_t quant_linear_silu_mul(DType dtype, int64_t qtype, const void* x, const void* qweight, const void* bias,
                                  void* out, int64_t n_tokens, int64_t k, int64_t n_inter, cudaStream_t stream) {
  if (!quant_linear_supported(dtype, x)) return cudaErrorInvalidValue;
  return run(dtype, qtype,
             {x, static_cast<const uint8_t*>(qweight), bias, nullptr, out, n_tokens, k, n_inter,
              quant::Epilogue::kSiluMul},
             stream);
}

}  // namespace orca::kernels
