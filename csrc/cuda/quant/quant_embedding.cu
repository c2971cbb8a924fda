// Embedding lookup in a quantized table: out[t] = deq(table[token_ids[t]]), dequantized in float32
// (bit for bit gguf.quants.dequantize) and rounded once to the output type. A block per token; a
// token id outside [0, V) gives a row of zeros (the ids are never read on the host).
#include "cuda/common.cuh"
#include "cuda/quant/quant_blocks.cuh"
#include "cuda/quant/quant_kernels.h"

namespace orca::kernels::quant {
namespace {

using namespace orca::kernels::detail;

constexpr int kThreads = 128;

template <typename T, typename Fmt>
__global__ void __launch_bounds__(kThreads)
    quant_embedding_kernel(const uint8_t* __restrict__ table,     // [V, row_bytes]
                           const int64_t* __restrict__ token_ids, // [T]
                           T* __restrict__ out,                   // [T, K]
                           int64_t n_rows, int64_t k_dim, int64_t row_bytes) {
  const int64_t t = blockIdx.x;
  const int64_t id = token_ids[t];
  const bool valid = id >= 0 && id < n_rows;
  const uint8_t* row = table + (valid ? id : 0) * row_bytes;
  T* dst = out + t * k_dim;
  for (int64_t k = int64_t(threadIdx.x) * 8; k < k_dim; k += kThreads * 8) {
    float v[8];
    if (valid) {
      Fmt::dequant(Fmt::load(row, k), v);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = 0.f;
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) dst[k + e] = from_float<T>(v[e]);
  }
}

template <typename T, typename Fmt>
cudaError_t launch(const uint8_t* table, const int64_t* token_ids, void* out, int64_t n_tokens, int64_t n_rows,
                   int64_t k, cudaStream_t stream) {
  const int64_t row_bytes = k / Fmt::kBlockElems * Fmt::kBlockBytes;
  quant_embedding_kernel<T, Fmt><<<static_cast<unsigned>(n_tokens), kThreads, 0, stream>>>(
      table, token_ids, static_cast<T*>(out), n_rows, k, row_bytes);
  return cudaGetLastError();
}

}  // namespace
}  // namespace orca::kernels::quant

namespace orca::kernels {

cudaError_t quant_embedding(DType dtype, int64_t qtype, const void* qweight, const int64_t* token_ids, void* out,
                            int64_t n_tokens, int64_t n_rows, int64_t k, cudaStream_t stream) {
  const int64_t qk = quant_block_elems(qtype);
  if (qk == 0 || k < 0 || k % qk != 0 || n_tokens < 0 || n_tokens > 0x7fffffff || n_rows < 0)
    return cudaErrorInvalidValue;
  if (n_tokens == 0 || k == 0) return cudaSuccess;
  const auto* table = static_cast<const uint8_t*>(qweight);
  cudaError_t err = cudaErrorInvalidValue;
  quant::visit_format(qtype, [&](auto fmt) {
    using Fmt = decltype(fmt);
    switch (dtype) {
      case DType::kFloat32: err = quant::launch<float, Fmt>(table, token_ids, out, n_tokens, n_rows, k, stream); break;
      case DType::kFloat16: err = quant::launch<__half, Fmt>(table, token_ids, out, n_tokens, n_rows, k, stream); break;
      case DType::kBFloat16:
        err = quant::launch<__nv_bfloat16, Fmt>(table, token_ids, out, n_tokens, n_rows, k, stream);
        break;
    }
  });
  return err;
}

}  // namespace orca::kernels
