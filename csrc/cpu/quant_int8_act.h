// The int8-activation design of the 32-element formats (Q8_0, Q4_0, Q4_1), kept for comparison
// in bench_quant_gemm: each activation block of 32 is quantized to int8 (scale amax / 127, round
// to nearest), each weight block meets it in one integer dot product (AVX2: vpmaddubsw +
// vpmaddwd; AVX-512 VNNI: vpdpbusd), and the block's sum enters a float32 accumulator scaled by
// d_w * d_x. Fewer instructions per weight than dequantizing to float32, at the price of
// rounding every activation to 8 bits; the ops (quant_kernels.h) keep float32 activations.
// Q8_0 weights must lie in [-127, 127], as ggml's quantizer writes them: the sign trick below
// (|x| against w with x's sign) cannot negate -128.
//
// Like quant_blocks.h, everything is local to the including unit (compiled for its target).
#pragma once
#include <immintrin.h>
#include <omp.h>

#include <cstdint>

#include "quant_formats.h"
#include "skinny_gemm_blocks.h"  // hsum8_tree

namespace orca {
namespace cpu {
namespace detail {
namespace {

// Activations as the int8 kernels read them: q [T, K] int8, and per 32-block d (the scale) and
// s = d * sum(q) (for Q4_1's minimum), [T, K / 32] each.
struct Int8Activations {
  const int8_t* q;
  const float* d;
  const float* s;
};

template <bool kVnni>
inline __m256i dot_u8_i8(__m256i u, __m256i s) {  // 8 int32 lanes, each the sum of 4 products u8 * i8
  if constexpr (kVnni) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
  } else {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));  // |u*s| pairs <= 2*255*127
  }
}

// The 32 nibbles of a 4-bit block as bytes (elements 0..15 the low nibbles, 16..31 the high).
inline __m256i nibbles32(const uint8_t* qs) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0f);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask));
}

// out[t, n] = sum over blocks of d_w * d_x * (integer dot) (+ m * s for Q4_1), n in [n0, n1).
template <bool kVnni, int F>
inline void int8_act_rows(const Int8Activations& a, const uint8_t* w, int64_t row_bytes, int64_t n_tokens,
                          int64_t k, int64_t n_out, int64_t n0, int64_t n1, float* out) {
  constexpr int64_t kBytes = F == kQuantTypeQ8_0 ? 34 : F == kQuantTypeQ4_0 ? 18 : 20;
  const int64_t n_blocks = k / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    for (int64_t t = 0; t < n_tokens; ++t) {
      const int8_t* xq = a.q + t * k;
      const float* xd = a.d + t * n_blocks;
      __m256 acc = _mm256_setzero_ps();
      float acc_min = 0.0f;
      for (int64_t b = 0; b < n_blocks; ++b) {
        const uint8_t* blk = row + b * kBytes;
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * b));
        __m256i isum;
        if constexpr (F == kQuantTypeQ4_1) {
          isum = dot_u8_i8<kVnni>(nibbles32(blk + 4), x);
          acc_min += half_to_float(blk + 2) * a.s[t * n_blocks + b];
        } else {
          const __m256i wq = F == kQuantTypeQ8_0
                                 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2))
                                 : _mm256_sub_epi8(nibbles32(blk + 2), _mm256_set1_epi8(8));
          // signed x signed as unsigned x signed: |x| against w carrying x's sign
          isum = dot_u8_i8<kVnni>(_mm256_sign_epi8(x, x), _mm256_sign_epi8(wq, x));
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(half_to_float(blk) * xd[b]), acc);
      }
      alignas(32) float l[8];
      _mm256_store_ps(l, acc);
      out[t * n_out + n] = hsum8_tree(l) + acc_min;
    }
  }
}

template <bool kVnni>
inline void int8_act_linear(const Int8Activations& a, const uint8_t* w, int type, int64_t row_bytes,
                            int64_t n_tokens, int64_t k, int64_t n_out, float* out) {
#pragma omp parallel
  {
    const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t n0 = n_out * tid / nth, n1 = n_out * (tid + 1) / nth;
    switch (type) {
      case kQuantTypeQ8_0: int8_act_rows<kVnni, kQuantTypeQ8_0>(a, w, row_bytes, n_tokens, k, n_out, n0, n1, out); break;
      case kQuantTypeQ4_0: int8_act_rows<kVnni, kQuantTypeQ4_0>(a, w, row_bytes, n_tokens, k, n_out, n0, n1, out); break;
      case kQuantTypeQ4_1: int8_act_rows<kVnni, kQuantTypeQ4_1>(a, w, row_bytes, n_tokens, k, n_out, n0, n1, out); break;
      default: break;
    }
  }
}

}  // namespace
}  // namespace detail
}  // namespace cpu
}  // namespace orca
