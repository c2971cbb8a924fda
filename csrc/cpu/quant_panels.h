// The quantized panel kernels of each instruction path (quant_gemm_avx2.cpp,
// quant_gemm_avx512.cpp), reached through plain function pointers so that AVX-512 code only ever
// runs on CPUs that report it. Each returns the PanelFn of ggml type `type` (nullptr if unsupported).
#pragma once
#include <cstdint>

#include "skinny_gemm_impl.h"

namespace orca {
namespace cpu {
namespace detail {

PanelFn<float, uint8_t> quant_panel_avx2(int type);
PanelFn<float, uint8_t> quant_panel_avx512(int type);  // call only when cpu_has_avx512f()
bool cpu_has_avx512f();

// int8 activations of T rows (quant_int8_act.h: Int8Activations): q [T, K], d and s [T, K / 32].
struct Int8Rows {
  const int8_t* q;
  const float* d;
  const float* s;
};

// The int8-activation kernels (quant_int8_act.h) over n_out rows: q [T, K] int8 activations, d and
// s [T, K / 32] their block scales and scale * sum; Q8_0, Q4_0, Q4_1 only. The avx512 form uses
// VNNI; both give the same results. They need AVX2 (they throw std::logic_error without it).
// int8_quantize_row: one row x [K] to q [K], d and s [K / 32] (one implementation for both paths).
void int8_quantize_row(const float* x, int64_t k, int8_t* q, float* d, float* s);
void int8_act_linear_avx2(const int8_t* q, const float* d, const float* s, const uint8_t* w, int type,
                          int64_t row_bytes, int64_t n_tokens, int64_t k, int64_t n_out, float* out);
void int8_act_linear_avx512vnni(const int8_t* q, const float* d, const float* s, const uint8_t* w, int type,
                                int64_t row_bytes, int64_t n_tokens, int64_t k, int64_t n_out, float* out);
bool cpu_has_avx512vnni();

// out[K] = row K of ggml type `type`, dequantized as every panel kernel sees it (baseline code).
void dequant_row(int type, const uint8_t* row, int64_t k, float* out);

}  // namespace detail
}  // namespace cpu
}  // namespace orca
