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

// int8 activations of T rows as the int8 kernels read them (quant_int8_act.h). The block is that
// of the weight format: 32 for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (int8_quantize_row), 256 for Q4_K, Q5_K and Q6_K
// (int8_quantize_row_256).
struct Int8Rows {
  int64_t block;         // elements per activation scale: 32 or 256
  const int8_t* q;       // [T, K]
  const float* d;        // [T, K / block] the scales
  const float* s;        // [T, K / 32] d * sum(q) of each 32-block (block 32; else nullptr)
  const int16_t* bsums;  // [T, K / 16] sum(q) of each 16 elements (block 256; else nullptr)
};

// The int8-activation products of n_out weight rows of ggml type `type` into out [T, n_out]
// (float32), for a's block (int8_act_block(type)). The avx512 form uses VNNI; both give the same
// results. They need AVX2 (they throw std::logic_error without it).
// int8_quantize_row: one row x [K] to q [K], d and s [K / 32]; int8_quantize_row_256: to q [K],
// d [K / 256] and bsums [K / 16] (one implementation each for both paths).
void int8_quantize_row(const float* x, int64_t k, int8_t* q, float* d, float* s);
void int8_quantize_row_256(const float* x, int64_t k, int8_t* q, float* d, int16_t* bsums);
void int8_act_linear_avx2(const Int8Rows& a, const uint8_t* w, int type, int64_t row_bytes, int64_t n_tokens,
                          int64_t k, int64_t n_out, float* out);
void int8_act_linear_avx512vnni(const Int8Rows& a, const uint8_t* w, int type, int64_t row_bytes, int64_t n_tokens,
                                int64_t k, int64_t n_out, float* out);
bool cpu_has_avx512vnni();

// Weight rows the one-token Q4_K int8 rows prefetch ahead of use in each of their 4 streams: 2 on
// AMD Zen 5 and later (family 0x1A), 0 elsewhere (baseline code, decided once per process).
int q4k_decode_rows_ahead();

// out[K] = row K of ggml type `type`, dequantized as every panel kernel sees it (baseline code).
void dequant_row(int type, const uint8_t* row, int64_t k, float* out);

}  // namespace detail
}  // namespace cpu
}  // namespace orca
