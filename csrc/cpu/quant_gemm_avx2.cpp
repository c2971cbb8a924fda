// Quantized panel kernels for the baseline instruction set (x86-64-v3: AVX2 + FMA): 8-lane
// float32 accumulators, the lane order of the float32 `linear` (skinny_gemm_avx2.cpp). Elsewhere
// the same order runs as scalar std::fma. See quant_blocks.h for the blocking.
#include <cmath>
#include <cstdint>
#include <stdexcept>

#include "quant_kernels.h"
#include "quant_panels.h"
#include "skinny_gemm_impl.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ORCA_QUANT_AVX2 1
#endif

#include "quant_blocks.h"
#ifdef ORCA_QUANT_AVX2
#include "quant_int8_act.h"
#endif

namespace orca {
namespace cpu {
namespace detail {
namespace {

#ifdef ORCA_QUANT_AVX2
struct QuantAvx2Ops {
  using Acc = __m256;
  using X = __m256;
  using W = __m256;
  static constexpr int kStep = 8;
  static constexpr int kRows = 3;  // 3 x 4 accumulators + 3 activations + 1 weight = 16 ymm
  static Acc zero() { return _mm256_setzero_ps(); }
  static X load_x(const float* p) { return _mm256_load_ps(p); }  // 64-byte aligned rows, 32-element chunks
  static W load_w(const float* p) { return _mm256_load_ps(p); }
  static Acc dot(Acc acc, X x, W w) { return _mm256_fmadd_ps(x, w, acc); }
  template <int F>
  static constexpr bool kWidensInRegisters = false;  // every format widens through a buffer
  static float hsum(Acc v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // l + l+4
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                        // 0+2, 1+3
    s = _mm_add_ss(s, _mm_movehdup_ps(s));                                         // + lane 1
    return _mm_cvtss_f32(s);  // the same sums as hsum8_tree
  }
};
using QuantBaselineOps = QuantAvx2Ops;
#else
struct QuantScalarLanesOps {
  struct Acc { float l[8]; };
  using X = Acc;
  using W = Acc;
  static constexpr int kStep = 8;
  static constexpr int kRows = 3;
  static Acc zero() { return Acc{{0, 0, 0, 0, 0, 0, 0, 0}}; }
  static X load_x(const float* p) {
    X v;
    for (int i = 0; i < 8; ++i) v.l[i] = p[i];
    return v;
  }
  static W load_w(const float* p) { return load_x(p); }
  static Acc dot(Acc acc, const X& x, const W& w) {
    for (int i = 0; i < 8; ++i) acc.l[i] = std::fma(x.l[i], w.l[i], acc.l[i]);
    return acc;
  }
  static float hsum(const Acc& v) { return hsum8_tree(v.l); }
  template <int F>
  static constexpr bool kWidensInRegisters = false;
};
using QuantBaselineOps = QuantScalarLanesOps;
#endif

}  // namespace

PanelFn<float, uint8_t> quant_panel_avx2(int type) { return quant_panel_for<QuantBaselineOps>(type); }

void int8_act_linear_avx2(const Int8Rows& a, const uint8_t* w, int type, int64_t row_bytes, int64_t n_tokens,
                          int64_t k, int64_t n_out, float* out) {
#ifdef ORCA_QUANT_AVX2
  int8_act_linear<false>(a, w, type, row_bytes, n_tokens, k, n_out, out);
#else
  (void)a, (void)w, (void)type, (void)row_bytes, (void)n_tokens, (void)k, (void)n_out, (void)out;
  throw std::logic_error("the int8-activation kernels need AVX2");
#endif
}

void int8_quantize_row(const float* x, int64_t k, int8_t* q, float* d, float* s) {
#ifdef ORCA_QUANT_AVX2
  quantize_row_int8(x, k, q, d, s);
#else
  (void)x, (void)k, (void)q, (void)d, (void)s;
  throw std::logic_error("the int8-activation kernels need AVX2");
#endif
}

void int8_quantize_row_256(const float* x, int64_t k, int8_t* q, float* d, int16_t* bsums) {
#ifdef ORCA_QUANT_AVX2
  quantize_row_int8_256(x, k, q, d, bsums);
#else
  (void)x, (void)k, (void)q, (void)d, (void)bsums;
  throw std::logic_error("the int8-activation kernels need AVX2");
#endif
}

void dequant_row(int type, const uint8_t* row, int64_t k, float* out) {
  dispatch_quant_format(type, [&](auto f) {
    constexpr int F = decltype(f)::value;
    for (int64_t u = 0; u < k / kDequantUnit<F>; ++u) dequant_unit<F>(row, u, out + u * kDequantUnit<F>);
  });
}

}  // namespace detail
}  // namespace cpu
}  // namespace orca
