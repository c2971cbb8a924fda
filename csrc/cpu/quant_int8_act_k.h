// The int8-activation kernels of the 256-element formats (Q4_K, Q6_K), as llama.cpp computes them
// against Q8_K activations: each activation row is quantized per 256-element super-block to int8
// (quantize_row_int8_256: one scale d = amax / 127, round to nearest even, and the exact sum of
// every 16 quants), and each weight super-block meets it in integer arithmetic only:
//
//   Q4_K:  sum_j sc_j * dot(nib_j, x_j)                     (8 sub-blocks of 32, 6-bit sc and mn)
//          - and separately sum_j mn_j * (bsum_2j + bsum_2j+1), the dmin term
//   Q6_K:  sum_j sc_j * dot(q6_j, x_j) - 32 * sum_j sc_j * bsum_j   (16 sub-blocks of 16, q6 in 0..63)
//
// The sub-block dot products are vpmaddubsw (u8 weights x s8 activations, pairs summed to int16
// without saturation: 2 * 63 * 127 < 2^15) followed by a multiply-add of the int16 pairs with the
// sub-block scale into int32 lanes (AVX2: vpmaddwd + vpaddd; AVX-512 VNNI: vpdpwssd, the same
// exact sums). Per super-block the 8 int32 lanes are converted to float32 and enter an 8-lane
// float32 accumulator with one FMA by d_w * d_x (Q4_K: a second one subtracts the dmin term,
// dmin_w * d_x times its 8 int32 lanes); after the last super-block hsum8_tree adds the lanes.
// That order depends only on K, never on T, the batch, the thread count or the path (both paths
// form the same integers), so a row's outputs are bit-identical whatever else is in the batch.
//
// Like quant_blocks.h, everything is local to the including unit (compiled for its target).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "quant_formats.h"
#include "quant_panels.h"  // Int8Rows
#include "skinny_gemm_blocks.h"  // hsum8_tree

namespace orca {
namespace cpu {
namespace detail {
namespace {

constexpr int64_t kSuperBlock = 256;

inline int hsum_epi32(__m256i v) {
  alignas(32) int32_t l[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(l), v);
  int s = 0;
  for (int i = 0; i < 8; ++i) s += l[i];
  return s;
}

// The int8 scale of a block from the lane-wise maxima of |x| over it: d = max / 127, and *inv =
// 1 / d (0 for an all-zero block, whose quants are then all 0).
inline float int8_scale(__m256 amax, float* inv) {
  alignas(32) float l[8];
  _mm256_store_ps(l, amax);
  float m = l[0];
  for (int i = 1; i < 8; ++i) m = m > l[i] ? m : l[i];
  const float scale = m / 127.0f;
  *inv = scale != 0.0f ? 1.0f / scale : 0.0f;
  return scale;
}

// One row of K (a multiple of 256) to int8 super-blocks: d = amax / 127 over the 256 elements,
// q = round_even(x * (1 / d)) (q = 0 where amax = 0), bsums[i] = the sum of q over elements
// 16i .. 16i+15. |q| <= 127, which the dot products below rely on.
inline void quantize_row_int8_256(const float* x, int64_t k, int8_t* q, float* d, int16_t* bsums) {  // q [K], d [K/256], bsums [K/16]
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < k / kSuperBlock; ++b) {
    const float* xb = x + kSuperBlock * b;
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 32; ++i) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, _mm256_loadu_ps(xb + 8 * i)));
    float inv;
    const float scale = int8_scale(amax, &inv);
    const __m256 vinv = _mm256_set1_ps(inv);
    for (int g = 0; g < 8; ++g) {  // 32 elements at a time
      const float* xg = xb + 32 * g;
      __m256i r[4];
      for (int i = 0; i < 4; ++i)
        r[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xg + 8 * i), vinv),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      // int32 -> int16 -> int8 packs work within 128-bit lanes: restore element order after.
      const __m256i p16a = _mm256_packs_epi32(r[0], r[1]), p16b = _mm256_packs_epi32(r[2], r[3]);
      const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b),
                                                     _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + kSuperBlock * b + 32 * g), p8);
      int16_t* bs = bsums + 16 * b + 2 * g;
      bs[0] = static_cast<int16_t>(hsum_epi32(_mm256_add_epi32(r[0], r[1])));
      bs[1] = static_cast<int16_t>(hsum_epi32(_mm256_add_epi32(r[2], r[3])));
    }
    d[b] = scale;
  }
}

// acc + (the int16 pairs of u * s) * scale16: int32 lane l gains scale * (the 4 products of
// elements 4l .. 4l+3), exactly.
template <bool kVnni>
inline __m256i dot_scaled(__m256i acc, __m256i u, const int8_t* s, __m256i scale16) {
  const __m256i p = _mm256_maddubs_epi16(u, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
  if constexpr (kVnni) {
    return _mm256_dpwssd_epi32(acc, p, scale16);
  } else {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, scale16));
  }
}

// Integer dependency chains per token and super-block: fewer than 4 tokens leave too few
// independent vpdpwssd chains to hide its latency, so their sub-blocks alternate between two
// chains, added (exactly) at the end.
template <int M>
constexpr int kChains = M < 4 ? 2 : 1;

template <int M>
inline __m256i chain_sum(const __m256i (&isum)[kChains<M>][M], int m) {
  if constexpr (kChains<M> == 2) {
    return _mm256_add_epi32(isum[0][m], isum[1][m]);
  } else {
    return isum[0][m];
  }
}

// Byte-shuffle controls that broadcast int16 lane j of a 128-bit half to all 8 lanes.
alignas(32) constexpr int8_t kBroadcast16[8][32] = {
#define ORCA_B16(j) {2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, \
                     2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, \
                     2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, \
                     2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1}
    ORCA_B16(0), ORCA_B16(1), ORCA_B16(2), ORCA_B16(3), ORCA_B16(4), ORCA_B16(5), ORCA_B16(6), ORCA_B16(7),
#undef ORCA_B16
};
// Controls for Q6_K chunk r (32 elements, two 16-element sub-blocks 2r, 2r+1 of a half): the low
// 128-bit lane broadcasts int16 lane 2r, the high one lane 2r + 1.
alignas(32) constexpr int8_t kPairBroadcast16[4][32] = {
#define ORCA_P16(r) {4 * r, 4 * r + 1, 4 * r, 4 * r + 1, 4 * r, 4 * r + 1, 4 * r, 4 * r + 1, \
                     4 * r, 4 * r + 1, 4 * r, 4 * r + 1, 4 * r, 4 * r + 1, 4 * r, 4 * r + 1, \
                     4 * r + 2, 4 * r + 3, 4 * r + 2, 4 * r + 3, 4 * r + 2, 4 * r + 3, 4 * r + 2, 4 * r + 3, \
                     4 * r + 2, 4 * r + 3, 4 * r + 2, 4 * r + 3, 4 * r + 2, 4 * r + 3, 4 * r + 2, 4 * r + 3}
    ORCA_P16(0), ORCA_P16(1), ORCA_P16(2), ORCA_P16(3),
#undef ORCA_P16
};

inline __m256i load_control(const int8_t* c) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(c)); }

// Q4_K's 12 packed bytes -> sc (bytes 0..7) and mn (bytes 8..15), 6 bits each (ggml's
// get_scale_min_k4, four sub-blocks per 32-bit word).
inline __m128i q4k_scales_mins(const uint8_t* packed) {
  uint32_t u[4];
  std::memcpy(u, packed, 12);
  constexpr uint32_t kLow6 = 0x3f3f3f3f, kLow4 = 0x0f0f0f0f, kLow2 = 0x03030303;
  const uint32_t mins_hi = ((u[2] >> 4) & kLow4) | (((u[1] >> 6) & kLow2) << 4);
  const uint32_t mins_lo = u[1] & kLow6;
  const uint32_t sc_hi = (u[2] & kLow4) | (((u[0] >> 6) & kLow2) << 4);
  const uint32_t sc_lo = u[0] & kLow6;
  return _mm_set_epi32(static_cast<int>(mins_hi), static_cast<int>(mins_lo), static_cast<int>(sc_hi),
                       static_cast<int>(sc_lo));
}

// out[(t0 + m) * n_out + n0 + r * stride] for R weight rows (n0, n0 + stride, ...) and M tokens
// from t0, Q4_K: each row's super-block is unpacked once for the M tokens; the R * M float
// accumulators are independent, so each output's sum is the same whatever the tile.
template <bool kVnni, int R, int M>
inline void q4k_int8_tile(const Int8Rows& a, const uint8_t* w, int64_t row_bytes, int64_t k, int64_t n_out,
                          int64_t n0, int64_t stride, int64_t t0, float* out) {
  const int64_t n_super = k / kSuperBlock;
  __m256 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  for (int64_t b = 0; b < n_super; ++b) {
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = w + (n0 + r * stride) * row_bytes + b * 144;
      const __m128i scmn = q4k_scales_mins(blk + 4);
      const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(scmn));  // sc_j in int16 lane j, both halves
      const __m256i mn_pairs = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(scmn, scmn));  // lanes 2j, 2j+1: mn_j
      __m256i isum[kChains<M>][M];
      for (int c = 0; c < kChains<M>; ++c)
        for (int m = 0; m < M; ++m) isum[c][m] = _mm256_setzero_si256();
      const uint8_t* qs = blk + 16;
      for (int p = 0; p < 4; ++p) {  // sub-blocks 2p (low nibbles) and 2p + 1 (high) share qs[32p ..]
        const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * p));
        const __m256i lo = _mm256_and_si256(qv, low4), hi = _mm256_and_si256(_mm256_srli_epi16(qv, 4), low4);
        const __m256i s0 = _mm256_shuffle_epi8(sc16, load_control(kBroadcast16[2 * p]));
        const __m256i s1 = _mm256_shuffle_epi8(sc16, load_control(kBroadcast16[2 * p + 1]));
        for (int m = 0; m < M; ++m) {
          const int8_t* x = a.q + (t0 + m) * k + b * kSuperBlock + 64 * p;
          isum[0][m] = dot_scaled<kVnni>(isum[0][m], lo, x, s0);
          isum[kChains<M> - 1][m] = dot_scaled<kVnni>(isum[kChains<M> - 1][m], hi, x + 32, s1);
        }
      }
      const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
      for (int m = 0; m < M; ++m) {
        const int64_t xb = (t0 + m) * n_super + b;
        const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bsums + 16 * xb));
        const __m256i msum = _mm256_madd_epi16(mn_pairs, bs);  // lane j: mn_j * (bsum_2j + bsum_2j+1)
        const float xd = a.d[xb];
        const __m256i isum_m = chain_sum<M>(isum, m);
        acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum_m), _mm256_set1_ps(d * xd), acc[r][m]);
        acc[r][m] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(dmin * xd), acc[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      alignas(32) float l[8];
      _mm256_store_ps(l, acc[r][m]);
      out[(t0 + m) * n_out + n0 + r * stride] = hsum8_tree(l);
    }
}

// The same for Q6_K. A half h of the super-block (elements 128h ..) is 4 chunks r of 32: chunk r
// takes the low (r < 2) or high nibbles of ql[64h + 32(r % 2) ..] and bits 2r, 2r+1 of qh[32h ..]
// as bits 4, 5, and covers the 16-element sub-blocks 8h + 2r and 8h + 2r + 1.
template <bool kVnni, int R, int M>
inline void q6k_int8_tile(const Int8Rows& a, const uint8_t* w, int64_t row_bytes, int64_t k, int64_t n_out,
                          int64_t n0, int64_t stride, int64_t t0, float* out) {
  const int64_t n_super = k / kSuperBlock;
  __m256 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0f), bits45 = _mm256_set1_epi8(0x30);
  for (int64_t b = 0; b < n_super; ++b) {
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = w + (n0 + r * stride) * row_bytes + b * 210;
      const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
      const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);  // sc_j in int16 lane j
      __m256i isum[kChains<M>][M];
      for (int m = 0; m < M; ++m) {  // -32 * sum_j sc_j * bsum_j: q6 - 32 without a signed weight
        const __m256i bs =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bsums + 16 * ((t0 + m) * n_super + b)));
        isum[0][m] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5));
        if constexpr (kChains<M> == 2) isum[1][m] = _mm256_setzero_si256();
      }
      for (int h = 0; h < 2; ++h) {
        const uint8_t* ql = blk + 64 * h;
        const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
        const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
        const __m256i q6[4] = {
            _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), bits45)),
            _mm256_or_si256(_mm256_and_si256(ql1, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), bits45)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4), _mm256_and_si256(qh, bits45)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                            _mm256_and_si256(_mm256_srli_epi16(qh, 2), bits45)),
        };
        // int16 scales of this half in both 128-bit lanes
        const __m256i sch = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(h == 0 ? sc8 : _mm_srli_si128(sc8, 8)));
        for (int c = 0; c < 4; ++c) {
          const __m256i s = _mm256_shuffle_epi8(sch, load_control(kPairBroadcast16[c]));
          for (int m = 0; m < M; ++m)
            isum[c % kChains<M>][m] = dot_scaled<kVnni>(isum[c % kChains<M>][m], q6[c],
                                                        a.q + (t0 + m) * k + b * kSuperBlock + 128 * h + 32 * c, s);
        }
      }
      const float d = half_to_float(blk + 208);
      for (int m = 0; m < M; ++m) {
        const float xd = a.d[(t0 + m) * n_super + b];
        const __m256i isum_m = chain_sum<M>(isum, m);
        acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum_m), _mm256_set1_ps(d * xd), acc[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      alignas(32) float l[8];
      _mm256_store_ps(l, acc[r][m]);
      out[(t0 + m) * n_out + n0 + r * stride] = hsum8_tree(l);
    }
}

}  // namespace
}  // namespace detail
}  // namespace cpu
}  // namespace orca
