// Internals of the weight-streaming linear layers (cpu_kernels.h: linear, linear_silu_mul,
// rmsnorm_qkv). Two steps:
//  1. prepare_activations: the T activation rows, in the element type the chosen instruction path
//     reads (float32, or bf16 for vdpbf16ps), in 64-byte-aligned rows zero-padded past K. A fused
//     producer (the RMS norm of rmsnorm_qkv) writes its rows straight into this buffer.
//  2. stream_weights: each thread owns a contiguous range of outputs, cut into kPanelRows streams
//     (a thread done with its own range early takes the rest of another's from its end); panel i
//     holds the weight rows of output i of every stream (skinny_gemm.cpp says why). Per
//     token tile, a panel kernel runs all tile rows against the panel's rows (full K each), then
//     the epilogue (bias, residual or SiLU * up, rounding) writes the panel's outputs.
// The panel kernels live in one translation unit per instruction set (skinny_gemm_avx2.cpp,
// skinny_gemm_avx512.cpp, skinny_gemm_avx512bf16.cpp) and are reached through plain function pointers, so AVX-512 code
// is only ever executed on CPUs that report it.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_kernels.h"
#include "vec.h"

namespace orca {
namespace cpu {
namespace detail {

// Weight rows per panel. A panel is 8 outputs of a plain projection, or 4 gate rows + the
// matching 4 up rows of a SwiGLU gate_up projection.
constexpr int kPanelRows = 8;

// c[m * kPanelRows + j] = dot(x[m, 0:K], w[j][0:K]) for m < M, j < kPanelRows. x rows are ldx
// elements apart, 64-byte aligned and zero from K up to the next multiple of the path's k step.
template <typename XT, typename WT>
using PanelFn = void (*)(const XT* x, int64_t ldx, int64_t M, const WT* const* w, int64_t K, float* c);

void panel_avx2(const float* x, int64_t ldx, int64_t M, const float* const* w, int64_t K, float* c);
void panel_avx2(const float* x, int64_t ldx, int64_t M, const bf16* const* w, int64_t K, float* c);
void panel_avx512bf16(const bf16* x, int64_t ldx, int64_t M, const bf16* const* w, int64_t K, float* c);
void panel_avx512bf16_emulated(const bf16* x, int64_t ldx, int64_t M, const bf16* const* w, int64_t K, float* c);
bool cpu_has_avx512bf16();
void panel_avx512(const float* x, int64_t ldx, int64_t M, const float* const* w, int64_t K, float* c);
bool cpu_has_avx512_f32();  // AVX-512 F, BW, VL, DQ: what panel_avx512 is compiled for
bool cpu_has_amx_bf16();    // AMX-TILE, AMX-BF16 and AVX-512 F, and the OS grants the tile state

// Activation rows as the panel kernels read them.
struct Activations {
  const void* rows;  // [T, ld] float, or bf16 when bf16_rows
  int64_t ld;        // elements; a multiple of 32 (64 bytes of bf16, 128 of float)
  bool bf16_rows;
};

// Rows whose elements cover the widest k step (32 bf16 for vdpbf16ps) and 64-byte alignment.
inline int64_t activation_ld(int64_t k) { return (k + 31) & ~int64_t{31}; }

// fill_row(t, dst) writes the K float32 values of activation row t into dst. For bf16 models
// they are rounded to bf16 (as the unfused op's output would be). The buffer belongs to the
// calling thread and stays valid until its next call.
template <typename T, typename FillRow>
Activations prepare_activations(int64_t n_tokens, int64_t k, FillRow&& fill_row) {
  constexpr bool kIsBf16 = std::is_same<T, bf16>::value;
  const bool bf16_rows = kIsBf16 && bf16_path() != Bf16Path::kAvx2;
  const int64_t ld = activation_ld(k);
  const size_t elems = static_cast<size_t>(n_tokens * ld);
  void* rows = bf16_rows ? static_cast<void*>(thread_scratch<bf16>(6, elems))
                         : static_cast<void*>(thread_scratch<float>(6, elems));
  const bool parallel = n_tokens > 1 && n_tokens * k >= (int64_t{1} << 15);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t t = 0; t < n_tokens; ++t) {
    if (bf16_rows) {
      float* tmp = thread_scratch<float>(5, static_cast<size_t>(k));
      fill_row(t, tmp);
      bf16* dst = static_cast<bf16*>(rows) + t * ld;
      store_row(tmp, dst, k);
      std::fill(dst + k, dst + ld, bf16{0});
    } else {
      float* dst = static_cast<float*>(rows) + t * ld;
      fill_row(t, dst);
      if (kIsBf16)
        for (int64_t i = 0; i < k; ++i) dst[i] = to_float(from_float<bf16>(dst[i]));
      std::fill(dst + k, dst + ld, 0.0f);
    }
  }
  return Activations{rows, ld, bf16_rows};
}

enum class Epilogue {
  kBias,      // out = acc + bias (+ residual)
  kSiluMul,   // out = silu(acc_gate + bias_gate) * (acc_up + bias_up)
};

// silu(g) = g * sigmoid(g), with e^-|g| from the vectorizable exp2 of vec.h (relative error ~1e-7).
inline float silu(float g) {
  const float e = exp2_nonpos(-std::fabs(g) * 1.4426950408889634f);
  const float s = (g >= 0.0f ? 1.0f : e) / (1.0f + e);  // one division: the loop vectorizes
  return g * s;
}

// out = epilogue(A * W^T). W has n_rows rows of K; kSiluMul reads rows [0, n_rows/2) as gates and
// [n_rows/2, n_rows) as ups and writes n_rows/2 outputs per token. residual (kBias only) may alias out.
template <typename T>
void stream_weights(const Activations& a, const T* w, const T* bias, const T* residual, T* out,
                    int64_t n_tokens, int64_t k, int64_t n_rows, Epilogue epilogue);

// stream_weights on AMX tiles (skinny_gemm_amx.cpp), for bf16 rows (a.bf16_rows) and shapes where
// amx_fits: K a multiple of 32 and at least 16 outputs (per half for kSiluMul). Whether a matrix
// fits depends on its shape alone, so one matrix takes one path at every T.
bool amx_fits(int64_t k, int64_t n_rows, bool gate_up);
void stream_weights_amx(const Activations& a, const bf16* w, const bf16* bias, const bf16* residual, bf16* out,
                        int64_t n_tokens, int64_t k, int64_t n_rows, Epilogue epilogue);

// stream_weights over weight rows in a ggml block format (quant_kernels.h): row r starts at
// w + r * row_bytes, panel_fn dequantizes while it multiplies, and a holds float32 rows.
template <typename T>
void stream_quant_weights(const Activations& a, const uint8_t* w, int64_t row_bytes,
                          PanelFn<float, uint8_t> panel_fn, const T* bias, const T* residual, T* out,
                          int64_t n_tokens, int64_t k, int64_t n_rows, Epilogue epilogue);

}  // namespace detail
}  // namespace cpu
}  // namespace orca
