// CUDA glue of the quantized-weight ops (declared in cuda_ops.h): device guard -> current stream ->
// the launchers of csrc/cuda/quant (launchers.h). ops.cpp has checked the arguments; the checks
// here protect the launchers' own assumptions.
#include <ATen/ops/empty.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include "cuda/launchers.h"
#include "cuda_ops.h"

namespace orca::cuda_ops {
namespace {

namespace kern = orca::kernels;

kern::DType activation_dtype(at::ScalarType st, const char* name) {
  switch (st) {
    case at::kFloat: return kern::DType::kFloat32;
    case at::kHalf: return kern::DType::kFloat16;
    case at::kBFloat16: return kern::DType::kBFloat16;
    default: break;
  }
  TORCH_CHECK_VALUE(false, name, " has dtype ", st, "; the CUDA quantized kernels support float32, float16 and bfloat16");
  return kern::DType::kFloat32;  // unreachable
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "orca_ext ", op, ": CUDA launch failed: ", cudaGetErrorName(err), " (",
              cudaGetErrorString(err), ")");
}

void check_format(int64_t qtype, int64_t k, const at::Tensor& qweight, const char* op) {
  const int64_t qk = kern::quant_block_elems(qtype);
  TORCH_CHECK_VALUE(qk > 0, op, ": qtype ", qtype, " has no CUDA kernel");
  TORCH_CHECK_VALUE(k >= 0 && k % qk == 0 && qweight.size(1) == k / qk * kern::quant_block_bytes(qtype), op,
                    ": k=", k, " does not match qweight's ", qweight.size(1), " bytes per row");
  TORCH_CHECK_VALUE(qweight.is_cuda() && qweight.scalar_type() == at::kByte && qweight.is_contiguous(), op,
                    ": qweight must be a contiguous uint8 CUDA tensor");
}

// The tensor-core kernels read x with 16-byte copies; a view starting elsewhere gets a fresh copy.
at::Tensor aligned_activations(const at::Tensor& x) {
  return kern::quant_linear_supported(activation_dtype(x.scalar_type(), "x"), x.data_ptr()) ? x : x.clone();
}

const void* ptr_or_null(const std::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr() : nullptr; }

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

}  // namespace

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, int64_t qtype, int64_t k,
                        const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual) {
  check_format(qtype, k, qweight, "quant_linear");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n_tokens = x.size(0), n_out = qweight.size(0);
  if (k == 0) {  // an empty reduction: bias + residual, or zeros
    at::Tensor out = at::zeros({n_tokens, n_out}, x.options());
    if (bias.has_value()) out.add_(*bias);
    if (residual.has_value()) out.add_(*residual);
    return out;
  }
  at::Tensor out = at::empty({n_tokens, n_out}, x.options());
  if (n_tokens == 0 || n_out == 0) return out;
  const at::Tensor xa = aligned_activations(x);
  check_launch(kern::quant_linear(activation_dtype(x.scalar_type(), "x"), qtype, xa.data_ptr(), qweight.data_ptr(),
                                  ptr_or_null(bias), ptr_or_null(residual), out.data_ptr(), n_tokens, k, n_out,
                                  current_stream()),
               "quant_linear");
  return out;
}

at::Tensor quant_linear_silu_mul(const at::Tensor& x, const at::Tensor& qweight, int64_t qtype, int64_t k,
                                 const std::optional<at::Tensor>& bias) {
  check_format(qtype, k, qweight, "quant_linear_silu_mul");
  TORCH_CHECK_VALUE(qweight.size(0) % 2 == 0, "quant_linear_silu_mul: qweight must have an even number of rows, got ",
                    qweight.size(0));
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n_tokens = x.size(0), n_inter = qweight.size(0) / 2;
  if (k == 0) {  // gate and up are their biases (or zeros)
    if (!bias.has_value()) return at::zeros({n_tokens, n_inter}, x.options());
    const at::Tensor b = bias->to(at::kFloat);
    const at::Tensor row = at::silu(b.narrow(0, 0, n_inter)).mul(b.narrow(0, n_inter, n_inter));
    return row.to(x.scalar_type()).expand({n_tokens, n_inter}).contiguous();
  }
  at::Tensor out = at::empty({n_tokens, n_inter}, x.options());
  if (n_tokens == 0 || n_inter == 0) return out;
  const at::Tensor xa = aligned_activations(x);
  check_launch(kern::quant_linear_silu_mul(activation_dtype(x.scalar_type(), "x"), qtype, xa.data_ptr(),
                                           qweight.data_ptr(), ptr_or_null(bias), out.data_ptr(), n_tokens, k, n_inter,
                                           current_stream()),
               "quant_linear_silu_mul");
  return out;
}

at::Tensor quant_embedding(const at::Tensor& qweight, int64_t qtype, int64_t k, const at::Tensor& token_ids,
                           at::ScalarType dtype) {
  check_format(qtype, k, qweight, "quant_embedding");
  TORCH_CHECK_VALUE(token_ids.scalar_type() == at::kLong && token_ids.is_contiguous() && token_ids.is_cuda(),
                    "quant_embedding: token_ids must be a contiguous int64 CUDA tensor");
  const c10::cuda::CUDAGuard guard(qweight.device());
  const int64_t n_tokens = token_ids.size(0);
  at::Tensor out = at::empty({n_tokens, k}, qweight.options().dtype(dtype));
  if (n_tokens == 0 || k == 0) return out;
  check_launch(kern::quant_embedding(activation_dtype(dtype, "dtype"), qtype, qweight.data_ptr(),
                                     token_ids.data_ptr<int64_t>(), out.data_ptr(), n_tokens, qweight.size(0), k,
                                     current_stream()),
               "quant_embedding");
  return out;
}

}  // namespace orca::cuda_ops
