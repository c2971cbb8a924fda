// Weight-only quantized projection for float32 activations, on CUDA cores (the float32 path exists
// for parity tests against the float64 references; serving uses fp16 / bf16 and tensor cores):
//
//   a warp per output (its weight row, or its gate and up rows), a tile of up to 8 tokens per warp.
//   Lane l dequantizes the 8-element groups l, l + 32, l + 64, ... of the row in registers and
//   applies each dequantized weight to all the tile's tokens; the lanes' sums are added by a fixed
//   butterfly. Every token has its own accumulator and the order of its additions depends on K
//   alone, so a token's result is the same at any T and in any batch (batch-invariant).
#include "cuda/common.cuh"
#include "cuda/quant/quant_blocks.cuh"
#include "cuda/quant/quant_kernels.h"

namespace orca::kernels::quant {
namespace {

using namespace orca::kernels::detail;

constexpr int kWarps = 4;   // outputs per block
constexpr int kTile = 8;    // tokens per warp

template <typename Fmt, Epilogue E>
__global__ void __launch_bounds__(kWarps * 32)
    quant_linear_f32_kernel(const float* __restrict__ x,         // [T, K]
                            const uint8_t* __restrict__ w,       // [N_rows, row_bytes]
                            const float* __restrict__ bias,      // [N_rows] or nullptr
                            const float* __restrict__ residual,  // [T, N] or nullptr
                            float* __restrict__ out,             // [T, n_out]
                            int64_t n_tokens, int64_t k_dim, int64_t n_out, int64_t row_bytes) {
  constexpr int kRows = E == Epilogue::kSiluMul ? 2 : 1;
  const int lane = threadIdx.x & 31;
  const int64_t o = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  const int64_t t0 = int64_t(blockIdx.y) * kTile;
  if (o >= n_out) return;
  const int n_tile = static_cast<int>(n_tokens - t0 < kTile ? n_tokens - t0 : kTile);
  const uint8_t* rows[kRows];
  rows[0] = w + o * row_bytes;
  if (kRows == 2) rows[kRows - 1] = w + (n_out + o) * row_bytes;

  float acc[kRows][kTile];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int t = 0; t < kTile; ++t) acc[r][t] = 0.f;

  for (int64_t k = int64_t(lane) * 8; k < k_dim; k += 32 * 8) {
    float wv[kRows][8];
#pragma unroll
    for (int r = 0; r < kRows; ++r) Fmt::dequant(Fmt::load(rows[r], k), wv[r]);
#pragma unroll
    for (int t = 0; t < kTile; ++t) {
      if (t >= n_tile) break;
      const float* xr = x + (t0 + t) * k_dim + k;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float xv = xr[e];
#pragma unroll
        for (int r = 0; r < kRows; ++r) acc[r][t] = fmaf(wv[r][e], xv, acc[r][t]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int t = 0; t < kTile; ++t) acc[r][t] = warp_sum(acc[r][t]);

  // Lane t writes token t of the tile (every lane holds every sum after the butterfly).
#pragma unroll
  for (int t = 0; t < kTile; ++t) {
    if (lane != t || t >= n_tile) continue;
    float v;
    if (E == Epilogue::kSiluMul) {
      float gate = acc[0][t], up = acc[kRows - 1][t];
      if (bias != nullptr) {
        gate += bias[o];
        up += bias[n_out + o];
      }
      v = gate / (1.f + __expf(-gate)) * up;
    } else {
      v = acc[0][t];
      if (bias != nullptr) v += bias[o];
      if (residual != nullptr) v += residual[(t0 + t) * n_out + o];
    }
    out[(t0 + t) * n_out + o] = v;
  }
}

template <typename Fmt, Epilogue E>
cudaError_t launch(const LinearArgs& a, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div(a.n_out, kWarps)), static_cast<unsigned>(ceil_div(a.n_tokens, kTile)));
  const int64_t row_bytes = a.k / Fmt::kBlockElems * Fmt::kBlockBytes;
  quant_linear_f32_kernel<Fmt, E><<<grid, kWarps * 32, 0, stream>>>(
      static_cast<const float*>(a.x), a.w, static_cast<const float*>(a.bias), static_cast<const float*>(a.residual),
      static_cast<float*>(a.out), a.n_tokens, a.k, a.n_out, row_bytes);
  return cudaGetLastError();
}

}  // namespace

cudaError_t linear_f32(int64_t qtype, const LinearArgs& a, cudaStream_t stream) {
  if (a.k % 8 != 0 || ceil_div(a.n_tokens, kTile) > 65535 || ceil_div(a.n_out, kWarps) > 0x7fffffff)
    return cudaErrorInvalidValue;
  cudaError_t err = cudaErrorInvalidValue;
  const bool known = visit_format(qtype, [&](auto fmt) {
    using Fmt = decltype(fmt);
    err = a.epilogue == Epilogue::kSiluMul ? launch<Fmt, Epilogue::kSiluMul>(a, stream)
                                           : launch<Fmt, Epilogue::kLinear>(a, stream);
  });
  return known ? err : cudaErrorInvalidValue;
}

}  // namespace orca::kernels::quant
