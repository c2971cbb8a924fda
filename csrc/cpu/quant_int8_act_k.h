// The int8-activation kernels of the 256-element formats (Q4_K, Q5_K, Q6_K), as llama.cpp computes them
// against Q8_K activations: each activation row is quantized per 256-element super-block to int8
// (quantize_row_int8_256: one scale d = amax / 127, round to nearest even, and the exact sum of
// every 16 quants), and each weight super-block meets it in integer arithmetic only:
//
//   Q4_K:  sum_j sc_j * dot(nib_j, x_j)                     (8 sub-blocks of 32, 6-bit sc and mn)
//          - and separately sum_j mn_j * (bsum_2j + bsum_2j+1), the dmin term
//   Q5_K:  Q4_K's sums with 5-bit codes (the nibble and one bit of qh) in place of the nibbles:
//          the same kernels, which read the codes through k_codes / the row prep
//   Q6_K:  sum_j sc_j * dot(q6_j, x_j) - 32 * sum_j sc_j * bsum_j   (16 sub-blocks of 16, q6 in 0..63)
//
// Q6_K's sub-block dot products are vpmaddubsw (u8 weights x s8 activations, pairs summed to
// int16 without saturation: 2 * 63 * 127 < 2^15) followed by a multiply-add of the int16 pairs
// with the sub-block scale into int32 lanes (AVX2: vpmaddwd + vpaddd; AVX-512 VNNI: vpdpwssd, the
// same exact sums). Per super-block the 8 int32 lanes are converted to float32 and enter an
// 8-lane float32 accumulator with one FMA by d_w * d_x; after the last super-block hsum8_tree adds
// the lanes. Q4_K keeps two int32 lanes per output and super-block and two float32 accumulators
// (its reduction is spelled out above q4k_int8_group_tile). The prefill of Q4_K (and of Q6_K with
// VNNI) reads the token-interleaved copy of the activations (quant_int8_groups.h), 8 tokens per
// instruction, and forms the same lanes.
// Either order depends only on K, never on T, the batch, the thread count or the path (every
// path forms the same integers), so a row's outputs are bit-identical whatever else is in the
// batch.
//
// Like quant_blocks.h, everything is local to the including unit (compiled for its target).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "quant_formats.h"
#include "quant_int8_groups.h"  // Int8Groups, GroupOps256, GroupOps512
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

// Q4_K and Q5_K share their kernels below: a Q5_K super-block is Q4_K's d, dmin and 12 bytes of
// scales, then qh[32] (bit 4 of every code), then Q4_K's 128 bytes of nibbles. Every integer
// bound below holds for 5-bit codes too (noted where it is closest).
template <int F>
constexpr bool kQ4Family = F == kQuantTypeQ4_K || F == kQuantTypeQ5_K;
template <int F>
constexpr int64_t kKBlockBytes = F == kQuantTypeQ5_K ? 176 : 144;
template <int F>
constexpr int64_t kKQuantsAt = F == kQuantTypeQ5_K ? 48 : 16;  // the nibbles' offset in a block

// The codes of sub-blocks 2p (lo) and 2p + 1 (hi) of a Q4_K or Q5_K super-block blk: 32 bytes
// each, element l in byte l.
template <int F>
inline void k_codes(const uint8_t* blk, int p, __m256i& lo, __m256i& hi) {
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kKQuantsAt<F> + 32 * p));
  lo = _mm256_and_si256(qv, low4), hi = _mm256_and_si256(_mm256_srli_epi16(qv, 4), low4);
  if constexpr (F == kQuantTypeQ5_K) {
    // bits 2p and 2p + 1 of each qh byte to bit 4 (16-bit shifts by at most 7, then a byte mask,
    // keep each byte's own bits)
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
    const __m256i bit4 = _mm256_set1_epi8(16);
    const __m128i to_lo = _mm_cvtsi32_si128(2 * p), to_hi = _mm_cvtsi32_si128(2 * p + 1);
    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(qh, to_lo), 4), bit4));
    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(qh, to_hi), 4), bit4));
  }
}

// Q4_K's reduction. Per output (weight row, token) and super-block, three exact integers:
//   A = sum_j sc_j * sum(nib * x over the positions i of sub-block j with i % 8 < 4)
//   B = the same over the positions with i % 8 >= 4
//   (M_lo, M_hi) = sum_j mn_j * (the sum of sub-block j's 32 quants x), j < 4 and j >= 4
// and two float32 accumulators, each updated once per super-block in super-block order:
//   acc_A = fnmadd(float(M_lo), dmin * xd, fma(float(A), d * xd, acc_A))
//   acc_B = fnmadd(float(M_hi), dmin * xd, fma(float(B), d * xd, acc_B))
// and the output acc_A + acc_B. |A|, |B|, |M| < 2^24, so each float(.) is exact. Two kernels form
// these same integers and floats: q4k_int8_rows (one token, rows in natural order) and
// q4k_int8_group_tile (a row against token groups, Int8Groups), so a token's bits never depend
// on T, its group or its batch-mates.

// A Q4_K super-block's scales as the prefill tiles read them, decoded once per row for every
// token slot.
struct Q4KScales {
  alignas(16) int32_t sc_pairs[8];  // sc_j in both int16 halves of dword j
  int32_t sc_packed[4];             // sc_2p in the low int16 half of dword p, sc_2p+1 in the high
  int16_t mn16[8];                  // mn_j in int16 lane j
  float d, dmin;
};

// A Q5_K super-block as the prefill tiles read it: Q4_K's scales and the 256 codes of its 8
// sub-blocks (32 bytes each, in order), unpacked once per row for every token slot.
struct Q5KRowBlock : Q4KScales {
  alignas(32) uint8_t codes[256];
};

template <int F>
using KRowPrep = std::conditional_t<F == kQuantTypeQ5_K, Q5KRowBlock, Q4KScales>;

template <int F>
inline void q4k_row_scales(const uint8_t* row, int64_t n_super, KRowPrep<F>* out) {  // out [n_super]
  for (int64_t b = 0; b < n_super; ++b) {
    const uint8_t* blk = row + b * kKBlockBytes<F>;
    if constexpr (F == kQuantTypeQ5_K)
      for (int p = 0; p < 4; ++p) {
        __m256i lo, hi;
        k_codes<F>(blk, p, lo, hi);
        _mm256_store_si256(reinterpret_cast<__m256i*>(out[b].codes + 64 * p), lo);
        _mm256_store_si256(reinterpret_cast<__m256i*>(out[b].codes + 64 * p + 32), hi);
      }
    const __m128i scmn = q4k_scales_mins(blk + 4);
    const __m128i sc = _mm_cvtepu8_epi16(scmn);
    _mm_store_si128(reinterpret_cast<__m128i*>(out[b].sc_pairs), _mm_unpacklo_epi16(sc, sc));
    _mm_store_si128(reinterpret_cast<__m128i*>(out[b].sc_pairs + 4), _mm_unpackhi_epi16(sc, sc));
    _mm_store_si128(reinterpret_cast<__m128i*>(out[b].sc_packed), sc);
    _mm_store_si128(reinterpret_cast<__m128i*>(out[b].mn16), _mm_cvtepu8_epi16(_mm_srli_si128(scmn, 8)));
    out[b].d = half_to_float(blk);
    out[b].dmin = half_to_float(blk + 2);
  }
}

// out[t * n_out + n0 + r] for the R weight rows from n0 and G token slots of V::kTokens tokens
// from token slot0 * V::kTokens (those below n_tokens), Q4_K or Q5_K. Per sub-block, each slot's 4
// activation vectors (8 elements of each of its tokens) are loaded once for the R rows, and each
// row's 8-byte pieces of quants are broadcast once for the G slots. Without VNNI the 4 vpmaddubsw
// of a sub-block are summed in int16 (at most 8 * 15 * 127; Q5_K's 8 * 31 * 127 = 31496 fits too)
// before its scale multiplies them into the int32 lanes (A, B) of each token; with it, Q4_K's
// vpdpbusd forms each sub-block's int32 sums and a pair of sub-blocks shares one vpdpwssd
// (pair_packed). Q5_K takes the vpmaddubsw form on every path (its sub-block sums, up to
// 16 * 31 * 127, do not fit the int16 halves pair_packed packs them into) and reads its codes
// unpacked from the row prep.
template <int KF, class V, int R, int G>
inline void q4k_int8_group_tile(const Int8Groups& a, const uint8_t* w, int64_t row_bytes, int64_t k, int64_t n_tokens,
                                int64_t n_out, int64_t n0, int64_t slot0, const KRowPrep<KF>* const* scales,
                                float* out) {  // scales[r]: row n0 + r's [K / 256]
  using I = typename V::I;
  using F = typename V::F;
  const int64_t n_super = k / kSuperBlock;
  const int8_t* xs[G];    // the slots' chunk 0
  const float* ds[G];     // their scales of super-block 0
  const int16_t* bss[G];  // their 32-sums of super-block 0
  for (int g = 0; g < G; ++g) {
    const GroupSlot slot(slot0 + g, V::kTokens);
    xs[g] = slot.q(a, k);
    ds[g] = slot.d(a, n_super);
    bss[g] = slot.sums(a.bsums, n_super * 64);
  }
  F acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = V::zero_f();
  const I low4 = V::low4();
  for (int64_t b = 0; b < n_super; ++b) {
    const uint8_t* blk[R];
    const KRowPrep<KF>* sb[R];
    for (int r = 0; r < R; ++r) {
      blk[r] = w + (n0 + r) * row_bytes + b * kKBlockBytes<KF>;
      sb[r] = scales[r] + b;
    }
    I isum[R][G];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) isum[r][g] = V::zero();
    // Sub-block j = 2p + h: the low (h = 0) or high nibbles of qs[32p ..].
    auto load_x = [&](int j, I (&x)[G][4]) {
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < 4; ++c) x[g][c] = V::load(xs[g] + (32 * b + 4 * j + c) * (kGroupTokens * 8));
    };
    // vpmaddubsw: the 4 products of a sub-block summed in int16, then its scale (vpmaddwd).
    auto sub_block = [&](int p, auto high) {
      const int j = 2 * p + (high ? 1 : 0);
      I x[G][4];
      load_x(j, x);
      for (int r = 0; r < R; ++r) {
        I wq[4];
        for (int c = 0; c < 4; ++c) {
          if constexpr (KF == kQuantTypeQ5_K) {
            wq[c] = V::bcast64(sb[r]->codes + 32 * j + 8 * c);
          } else {
            const I v = V::bcast64(blk[r] + 16 + 32 * p + 8 * c);
            if constexpr (decltype(high)::value)
              wq[c] = V::and_(V::srli4(v), low4);
            else
              wq[c] = V::and_(v, low4);
          }
        }
        const I sc = V::bcast32(sb[r]->sc_pairs[j]);
        for (int g = 0; g < G; ++g) {
          const I s01 = V::add16(V::maddubs(wq[0], x[g][0]), V::maddubs(wq[1], x[g][1]));
          const I s23 = V::add16(V::maddubs(wq[2], x[g][2]), V::maddubs(wq[3], x[g][3]));
          isum[r][g] = V::madd_acc(isum[r][g], V::add16(s01, s23), sc);
        }
      }
    };
    // vpdpbusd (VNNI): each sub-block's int32 sums (|D| <= 16 * 15 * 127 < 2^15) straight from
    // the bytes; the pair's two are packed into the int16 halves of each dword (the high
    // nibbles are read unshifted, 16 * D, and shifted by 12) and meet (sc_2p, sc_2p+1) in one
    // vpdpwssd.
    auto pair_packed = [&](int p) {
      if constexpr (V::kPacked) {
        I d_even[R][G];
        I x[G][4];
        load_x(2 * p, x);
        for (int r = 0; r < R; ++r) {
          I wq[4];
          for (int c = 0; c < 4; ++c) wq[c] = V::and_(V::bcast64(blk[r] + 16 + 32 * p + 8 * c), low4);
          for (int g = 0; g < G; ++g) {
            I acc_e = V::dpbusd(V::zero(), wq[0], x[g][0]);
            for (int c = 1; c < 4; ++c) acc_e = V::dpbusd(acc_e, wq[c], x[g][c]);
            d_even[r][g] = acc_e;
          }
        }
        load_x(2 * p + 1, x);
        const I high4 = V::high4();
        for (int r = 0; r < R; ++r) {
          I wq[4];
          for (int c = 0; c < 4; ++c) wq[c] = V::and_(V::bcast64(blk[r] + 16 + 32 * p + 8 * c), high4);
          const I sc = V::bcast32(sb[r]->sc_packed[p]);
          for (int g = 0; g < G; ++g) {
            I acc_o = V::dpbusd(V::zero(), wq[0], x[g][0]);  // 16 * D_odd
            for (int c = 1; c < 4; ++c) acc_o = V::dpbusd(acc_o, wq[c], x[g][c]);
            isum[r][g] = V::madd_acc(isum[r][g], V::pack_halves(d_even[r][g], V::slli12(acc_o)), sc);
          }
        }
      }
    };
    for (int p = 0; p < 4; ++p) {
      if constexpr (V::kPacked && KF == kQuantTypeQ4_K) {
        pair_packed(p);
      } else {
        sub_block(p, std::false_type{});
        sub_block(p, std::true_type{});
      }
    }
    for (int r = 0; r < R; ++r) {
      const F d = V::bcast_f(sb[r]->d), dmin = V::bcast_f(sb[r]->dmin);
      const I mn = V::bcast128(_mm_load_si128(reinterpret_cast<const __m128i*>(sb[r]->mn16)));
      for (int g = 0; g < G; ++g) {
        const F xd = V::load_f(ds[g] + 16 * b);
        // the 32-sums of tokens (0, 2, ..) and (1, 3, ..) of the slot: lanes (M_lo, M_hi) of each token
        const int16_t* bs = bss[g] + 64 * b;
        const I m = V::hadd32(V::madd(mn, V::load(bs)), V::madd(mn, V::load(bs + 32)));
        acc[r][g] = V::fma(V::cvt(isum[r][g]), V::mul(d, xd), acc[r][g]);
        acc[r][g] = V::fnma(V::cvt(m), V::mul(dmin, xd), acc[r][g]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g)
      each_slot_token<V>(acc[r][g], slot0 + g, n_tokens, n_out, n0 + r, out, [](float& o, const float* l) { o = l[0] + l[1]; });
}

// The Q4_K lanes of 4 outputs folded together: isum[i] (8 int32 lanes, positions 4l .. 4l + 3)
// to [A_0, B_0, A_1, B_1 | A_2, B_2, A_3, B_3], msum[i] (lane j: sub-block j's min term) to
// [M_lo_0, M_hi_0, ... | ...].
inline void q4k_fold4(const __m256i (&isum)[4], const __m256i (&msum)[4], __m256i* ab, __m256i* m) {
  auto fold2 = [](__m256i v0, __m256i v1) {  // [v0 (0+2, 1+3), v1 (0+2, 1+3) | v0 (4+6, 5+7), v1 (4+6, 5+7)]
    return _mm256_add_epi32(_mm256_unpacklo_epi64(v0, v1), _mm256_unpackhi_epi64(v0, v1));
  };
  const __m256i s01 = fold2(isum[0], isum[1]), s23 = fold2(isum[2], isum[3]);
  *ab = _mm256_add_epi32(_mm256_permute2x128_si256(s01, s23, 0x20), _mm256_permute2x128_si256(s01, s23, 0x31));
  const __m256i mm = _mm256_hadd_epi32(_mm256_hadd_epi32(msum[0], msum[1]), _mm256_hadd_epi32(msum[2], msum[3]));
  *m = _mm256_permutevar8x32_epi32(mm, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// The same for 2 outputs, in lanes 0 .. 3.
inline void q4k_fold2(__m256i isum0, __m256i isum1, __m256i msum0, __m256i msum1, __m128i* ab, __m128i* m) {
  const __m256i f = _mm256_add_epi32(_mm256_unpacklo_epi64(isum0, isum1), _mm256_unpackhi_epi64(isum0, isum1));
  *ab = _mm_add_epi32(_mm256_castsi256_si128(f), _mm256_extracti128_si256(f, 1));
  const __m256i h = _mm256_hadd_epi32(msum0, msum1);  // [0: 01, 23; 1: 01, 23 | 0: 45, 67; 1: 45, 67]
  const __m128i h2 = _mm_hadd_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));  // lo0 lo1 hi0 hi1
  *m = _mm_shuffle_epi32(h2, 0xd8);
}

// The same for one output, in lanes 0, 1.
inline void q4k_fold1(__m256i isum, __m256i msum, __m256i* ab, __m256i* m) {
  const __m128i i4 = _mm_add_epi32(_mm256_castsi256_si128(isum), _mm256_extracti128_si256(isum, 1));
  *ab = _mm256_castsi128_si256(_mm_add_epi32(i4, _mm_shuffle_epi32(i4, 0x4e)));
  const __m128i m4 = _mm_hadd_epi32(_mm256_castsi256_si128(msum), _mm256_extracti128_si256(msum, 1));
  *m = _mm256_castsi128_si256(_mm_hadd_epi32(m4, m4));
}

// out[n0 + r * stride] for R weight rows (n0, n0 + stride, ...) and the single token of a, Q4_K,
// rows in natural order: the int32 lanes of each sub-block product hold positions 4l .. 4l + 3,
// folded to (A, B) = (even lanes, odd lanes) per super-block. R = 4 folds the 4 rows together
// into one vector [A_0, B_0, A_1, B_1 | A_2, B_2, A_3, B_3] (R = 1: one row in lanes 0, 1).
// One row's super-block of Q4_K quants qs (128 bytes) against its 256 activations x: 8 int32
// lanes, lane l = sum_j sc_j * (the products at positions 4l .. 4l + 3 of sub-block j), with the
// int16 scales sc_j in lanes j (and j + 8) of sc16. Two chains (even and odd sub-blocks), added
// exactly.
template <int KF, bool kVnni>
inline __m256i q4k_isum(const uint8_t* blk, const int8_t* x, __m256i sc16) {
  __m256i chain[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int p = 0; p < 4; ++p) {
    __m256i lo, hi;
    k_codes<KF>(blk, p, lo, hi);
    chain[0] = dot_scaled<kVnni>(chain[0], lo, x + 64 * p, _mm256_shuffle_epi8(sc16, load_control(kBroadcast16[2 * p])));
    chain[1] = dot_scaled<kVnni>(chain[1], hi, x + 64 * p + 32,
                                 _mm256_shuffle_epi8(sc16, load_control(kBroadcast16[2 * p + 1])));
  }
  return _mm256_add_epi32(chain[0], chain[1]);
}

#if defined(ORCA_QUANT_INT8_512)
// vpshufb controls over a vector whose four 128-bit lanes each hold the 8 int16 scales: entry q
// takes scale j into every int16 lane of the low 256 bits and scale j + 2 into the high 256 bits,
// j = 0, 1, 4, 5: the sub-blocks whose quants one zmm load and nibble of q4k_isum_zmm holds.
alignas(64) constexpr int8_t kQ4SplitScales[4][64] = {
#define ORCA_S(j) 2 * (j), 2 * (j) + 1
#define ORCA_Q(j) ORCA_S(j), ORCA_S(j), ORCA_S(j), ORCA_S(j), ORCA_S(j), ORCA_S(j), ORCA_S(j), ORCA_S(j)
#define ORCA_P(j) {ORCA_Q(j), ORCA_Q(j), ORCA_Q((j) + 2), ORCA_Q((j) + 2)}
    ORCA_P(0), ORCA_P(1), ORCA_P(4), ORCA_P(5),
#undef ORCA_P
#undef ORCA_Q
#undef ORCA_S
};

// A super-block's 256 int8 activations as q4k_isum_zmm pairs them with the quants: vector q holds
// the 32 activations of sub-block j in its low 256 bits and those of sub-block j + 2 in its high
// 256 bits, j = 0, 1, 4, 5. Built once per super-block for every row that reads it.
inline void q4k_split_activations(const int8_t* x, __m512i (&xv)[4]) {
  for (int h = 0; h < 2; ++h)
    for (int nib = 0; nib < 2; ++nib) {
      const int8_t* lo = x + 128 * h + 32 * nib;
      xv[2 * h + nib] = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + 64)), 1);
    }
}

// q4k_isum in zmm registers with VNNI. One zmm load holds 64 bytes of quants, whose low nibbles
// are sub-blocks j and j + 2 and whose high nibbles j + 1 and j + 3 (j = 0 for the first half of
// qs, 4 for the second), against the activations in the same order (q4k_split_activations): each
// pair of sub-blocks takes one vpmaddubsw and one vpdpwssd, with no lane shuffles of the quants.
// The upper 8 int32 lanes are added to the lower 8 at the end: the same integers as q4k_isum.
// Q5_K: bit 4 of the codes of sub-blocks j and j + 2 comes from bits j and j + 2 of qh (broadcast
// to both 256-bit halves, each shifted by its own count).
template <int KF>
inline __m256i q4k_isum_zmm(const uint8_t* blk, const __m512i (&xv)[4], __m256i sc16) {
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const __m512i sc = _mm512_broadcast_i32x4(_mm256_castsi256_si128(sc16));
  __m512i qh2 = _mm512_setzero_si512();
  if constexpr (KF == kQuantTypeQ5_K)
    qh2 = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)));
  __m512i chain[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
  for (int h = 0; h < 2; ++h) {
    const __m512i qv = _mm512_loadu_si512(blk + kKQuantsAt<KF> + 64 * h);
    __m512i nib[2] = {_mm512_and_si512(qv, low4), _mm512_and_si512(_mm512_srli_epi16(qv, 4), low4)};
    if constexpr (KF == kQuantTypeQ5_K)
      for (int n = 0; n < 2; ++n) {
        const int j = 4 * h + n;  // the sub-block of the low half; the high half holds j + 2
        const __m512i counts = _mm512_inserti64x4(_mm512_set1_epi16(static_cast<short>(j)),
                                                  _mm256_set1_epi16(static_cast<short>(j + 2)), 1);
        const __m512i bit = _mm512_and_si512(_mm512_slli_epi16(_mm512_srlv_epi16(qh2, counts), 4), _mm512_set1_epi8(16));
        nib[n] = _mm512_or_si512(nib[n], bit);
      }
    for (int n = 0; n < 2; ++n) {
      const int q = 2 * h + n;
      const __m512i s = _mm512_shuffle_epi8(sc, _mm512_load_si512(kQ4SplitScales[q]));
      chain[n] = _mm512_dpwssd_epi32(chain[n], _mm512_maddubs_epi16(nib[n], xv[q]), s);
    }
  }
  const __m512i z = _mm512_add_epi32(chain[0], chain[1]);
  return _mm256_add_epi32(_mm512_castsi512_si256(z), _mm512_extracti64x4_epi64(z, 1));
}
#endif

// kZmm: the integer sums by q4k_isum_zmm (AVX-512 VNNI units only); the same integers either way.
template <int KF, bool kVnni, int R, bool kZmm = false>
inline void q4k_int8_rows(const Int8Rows& a, const uint8_t* w, int64_t row_bytes, int64_t k, int64_t n0,
                          int64_t stride, float* out) {
  static_assert(R == 1 || R == 4, "one row or four");
  const int64_t n_super = k / kSuperBlock;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < n_super; ++b) {
    const __m256 xd = _mm256_set1_ps(a.d[b]);
    const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bsums + 16 * b));
    const int8_t* x = a.q + b * kSuperBlock;
#if defined(ORCA_QUANT_INT8_512)
    __m512i xv[4];
    if constexpr (kZmm) q4k_split_activations(x, xv);
#endif
    __m256i isum[R], msum[R];
    int32_t scales[R];  // the fp16 d and dmin of each row's super-block
    const uint8_t* blk[R];  // each row's super-block b
    for (int r = 0; r < R; ++r) blk[r] = w + (n0 + r * stride) * row_bytes + b * kKBlockBytes<KF>;
    __m128i scmns[R];
    if constexpr (R == 4) {
      q4k_scales_mins2(blk[0] + 4, blk[1] + 4, &scmns[0], &scmns[1]);
      q4k_scales_mins2(blk[2] + 4, blk[3] + 4, &scmns[2], &scmns[3]);
    } else {
      scmns[0] = q4k_scales_mins(blk[0] + 4);
    }
    for (int r = 0; r < R; ++r) {
      std::memcpy(&scales[r], blk[r], 4);
      const __m128i scmn = scmns[r];
      const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(scmn));
      const __m256i mn_pairs = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(scmn, scmn));  // lanes 2j, 2j+1: mn_j
#if defined(ORCA_QUANT_INT8_512)
      if constexpr (kZmm)
        isum[r] = q4k_isum_zmm<KF>(blk[r], xv, sc16);
      else
#endif
        isum[r] = q4k_isum<KF, kVnni>(blk[r], x, sc16);
      msum[r] = _mm256_madd_epi16(mn_pairs, bs);  // lane j: mn_j * (bsum_2j + bsum_2j+1)
    }
    __m256i ab, m;  // lanes 2r, 2r + 1: (A, B) and (M_lo, M_hi) of row r
    __m256 dd;      // lanes 2r, 2r + 1: d, dmin of row r
    if constexpr (R == 4) {
      q4k_fold4(isum, msum, &ab, &m);
      dd = _mm256_cvtph_ps(_mm_setr_epi32(scales[0], scales[1], scales[2], scales[3]));
    } else {
      q4k_fold1(isum[0], msum[0], &ab, &m);
      dd = _mm256_cvtph_ps(_mm_cvtsi32_si128(scales[0]));
    }
    const __m256 d = _mm256_mul_ps(_mm256_permute_ps(dd, 0xa0), xd), dmin = _mm256_mul_ps(_mm256_permute_ps(dd, 0xf5), xd);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ab), d, acc);
    acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(m), dmin, acc);
  }
  alignas(32) float l[8];
  _mm256_store_ps(l, acc);
  for (int r = 0; r < R; ++r) out[n0 + r * stride] = l[2 * r] + l[2 * r + 1];
}

// out[(t0 + m) * n_out + n] for weight row n and the M tokens from t0 of a, Q4_K, in natural
// token order (small batches, where a token-interleaved copy costs more than it saves): the
// row's super-block is unpacked once for the M tokens, their lanes fold to (A, B) 4 (or 2)
// tokens at a time, and each token's float sums run exactly as in q4k_int8_rows.
template <int KF, bool kVnni, int M>
inline void q4k_int8_tokens(const Int8Rows& a, const uint8_t* w, int64_t row_bytes, int64_t k, int64_t n_out,
                            int64_t n, int64_t t0, float* out) {
  constexpr int kQuads = M / 4, kPair = (M % 4) / 2, kRest = M % 2;
  const int64_t n_super = k / kSuperBlock;
  __m256 acc4[kQuads > 0 ? kQuads : 1];  // lanes 2i, 2i + 1: token 4q + i
  __m128 acc2 = _mm_setzero_ps();        // lanes 0 .. 3: tokens 4 kQuads, 4 kQuads + 1
  __m256 acc1[kRest > 0 ? kRest : 1];    // lanes 0, 1: token 4 kQuads + 2 kPair
  for (auto& v : acc4) v = _mm256_setzero_ps();
  for (auto& v : acc1) v = _mm256_setzero_ps();
  for (int64_t b = 0; b < n_super; ++b) {
    const uint8_t* blk = w + n * row_bytes + b * kKBlockBytes<KF>;
    const __m128i scmn = q4k_scales_mins(blk + 4);
    const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(scmn));
    const __m256i mn_pairs = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(scmn, scmn));  // lanes 2j, 2j+1: mn_j
    __m256i isum[kChains<M>][M];
    for (int c = 0; c < kChains<M>; ++c)
      for (int m = 0; m < M; ++m) isum[c][m] = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      __m256i lo, hi;
      k_codes<KF>(blk, p, lo, hi);
      const __m256i s0 = _mm256_shuffle_epi8(sc16, load_control(kBroadcast16[2 * p]));
      const __m256i s1 = _mm256_shuffle_epi8(sc16, load_control(kBroadcast16[2 * p + 1]));
      for (int m = 0; m < M; ++m) {
        const int8_t* x = a.q + (t0 + m) * k + b * kSuperBlock + 64 * p;
        isum[0][m] = dot_scaled<kVnni>(isum[0][m], lo, x, s0);
        isum[kChains<M> - 1][m] = dot_scaled<kVnni>(isum[kChains<M> - 1][m], hi, x + 32, s1);
      }
    }
    const __m256 d = _mm256_set1_ps(half_to_float(blk)), dmin = _mm256_set1_ps(half_to_float(blk + 2));
    float xd[M];
    __m256i msum[M];
    for (int m = 0; m < M; ++m) {
      const int64_t xb = (t0 + m) * n_super + b;
      xd[m] = a.d[xb];
      msum[m] = _mm256_madd_epi16(mn_pairs, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bsums + 16 * xb)));
    }
    for (int q = 0; q < kQuads; ++q) {
      const __m256i is[4] = {chain_sum<M>(isum, 4 * q), chain_sum<M>(isum, 4 * q + 1), chain_sum<M>(isum, 4 * q + 2),
                             chain_sum<M>(isum, 4 * q + 3)};
      const __m256i ms[4] = {msum[4 * q], msum[4 * q + 1], msum[4 * q + 2], msum[4 * q + 3]};
      __m256i ab, m;
      q4k_fold4(is, ms, &ab, &m);
      const __m256 x = _mm256_setr_ps(xd[4 * q], xd[4 * q], xd[4 * q + 1], xd[4 * q + 1], xd[4 * q + 2], xd[4 * q + 2],
                                      xd[4 * q + 3], xd[4 * q + 3]);
      acc4[q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ab), _mm256_mul_ps(d, x), acc4[q]);
      acc4[q] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(m), _mm256_mul_ps(dmin, x), acc4[q]);
    }
    if constexpr (kPair > 0) {
      const int m0 = 4 * kQuads;
      __m128i ab, m;
      q4k_fold2(chain_sum<M>(isum, m0), chain_sum<M>(isum, m0 + 1), msum[m0], msum[m0 + 1], &ab, &m);
      const __m128 x = _mm_setr_ps(xd[m0], xd[m0], xd[m0 + 1], xd[m0 + 1]);
      acc2 = _mm_fmadd_ps(_mm_cvtepi32_ps(ab), _mm_mul_ps(_mm256_castps256_ps128(d), x), acc2);
      acc2 = _mm_fnmadd_ps(_mm_cvtepi32_ps(m), _mm_mul_ps(_mm256_castps256_ps128(dmin), x), acc2);
    }
    for (int i = 0; i < kRest; ++i) {
      const int mi = 4 * kQuads + 2 * kPair + i;
      __m256i ab, m;
      q4k_fold1(chain_sum<M>(isum, mi), msum[mi], &ab, &m);
      const __m256 x = _mm256_set1_ps(xd[mi]);
      acc1[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ab), _mm256_mul_ps(d, x), acc1[i]);
      acc1[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(m), _mm256_mul_ps(dmin, x), acc1[i]);
    }
  }
  alignas(32) float l[8];
  for (int q = 0; q < kQuads; ++q) {
    _mm256_store_ps(l, acc4[q]);
    for (int i = 0; i < 4; ++i) out[(t0 + 4 * q + i) * n_out + n] = l[2 * i] + l[2 * i + 1];
  }
  if constexpr (kPair > 0) {
    _mm_store_ps(l, acc2);
    for (int i = 0; i < 2; ++i) out[(t0 + 4 * kQuads + i) * n_out + n] = l[2 * i] + l[2 * i + 1];
  }
  for (int i = 0; i < kRest; ++i) {
    _mm256_store_ps(l, acc1[i]);
    out[(t0 + 4 * kQuads + 2 * kPair + i) * n_out + n] = l[0] + l[1];
  }
}

// A Q6_K super-block as the prefill tiles read it, decoded once per row for every token slot.
struct Q6KRowBlock {
  alignas(32) uint8_t q6[256];  // in element order, 0..63
  int16_t sc16[16];             // the 16 sub-block scales
  int32_t sc_pairs[8];          // (h, cp, e): sc of sub-block 8h + 4cp + e, then of 8h + 4cp + 2 + e
  float d;
};

inline void q6k_row_blocks(const uint8_t* row, int64_t n_super, Q6KRowBlock* out) {  // out [n_super]
  const __m256i low4 = _mm256_set1_epi8(0x0f), bits45 = _mm256_set1_epi8(0x30);
  for (int64_t b = 0; b < n_super; ++b) {
    const uint8_t* blk = row + b * 210;
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = blk + 64 * h;
      const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
      const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
      __m256i* dst = reinterpret_cast<__m256i*>(out[b].q6 + 128 * h);
      _mm256_store_si256(dst, _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), bits45)));
      _mm256_store_si256(dst + 1, _mm256_or_si256(_mm256_and_si256(ql1, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), bits45)));
      _mm256_store_si256(dst + 2, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4), _mm256_and_si256(qh, bits45)));
      _mm256_store_si256(dst + 3, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                                                  _mm256_and_si256(_mm256_srli_epi16(qh, 2), bits45)));
    }
    const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
    std::memcpy(out[b].sc16, &sc, 32);
    for (int h = 0; h < 2; ++h)
      for (int cp = 0; cp < 2; ++cp)
        for (int e = 0; e < 2; ++e) {
          const int sub = 8 * h + 4 * cp + e;
          out[b].sc_pairs[4 * h + 2 * cp + e] = static_cast<int32_t>(
              static_cast<uint16_t>(out[b].sc16[sub]) | (static_cast<uint32_t>(static_cast<uint16_t>(out[b].sc16[sub + 2])) << 16));
        }
    out[b].d = half_to_float(blk + 208);
  }
}

#if defined(ORCA_QUANT_INT8_512)
// out[t * n_out + n0 + r] for the R Q6_K weight rows from n0 and G token slots of V::kTokens
// tokens from slot0 * V::kTokens (those below n_tokens), from the token-interleaved copy. Each
// 32-element chunk of a row's q6 (built once per super-block into a stack buffer) is read as 4
// broadcast 8-byte pieces c8; piece c8 of token s gives the int32 lanes 2c8, 2c8 + 1 of
// q6k_int8_tile (lanes 2s, 2s + 1 of accumulator c8). The pieces c8 of chunks 2cp and 2cp + 1
// (|sum| <= 4 * 63 * 127 < 2^15 each) are packed into the int16 halves of each dword and meet
// their two sub-block scales in one vpdpwssd. The same integers, the same fmas per super-block
// and the same hsum8_tree as q6k_int8_tile, so the same bits.
template <class V, int R, int G>
inline void q6k_int8_group_tile(const Int8Groups& a, int64_t k, int64_t n_tokens, int64_t n_out, int64_t n0,
                                int64_t slot0, const Q6KRowBlock* const* rows, float* out) {  // rows[r]: row n0 + r's [K / 256]
  using I = typename V::I;
  using F = typename V::F;
  const int64_t n_super = k / kSuperBlock;
  const int8_t* xs[G];
  const float* ds[G];
  const int16_t* bss[G];
  for (int g = 0; g < G; ++g) {
    const GroupSlot slot(slot0 + g, V::kTokens);
    xs[g] = slot.q(a, k);
    ds[g] = slot.d(a, n_super);
    bss[g] = slot.sums(a.bsums16, n_super * 128);
  }
  F acc[R][G][4];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < 4; ++c) acc[r][g][c] = V::zero_f();
  for (int64_t b = 0; b < n_super; ++b) {
    const Q6KRowBlock* rb[R];
    for (int r = 0; r < R; ++r) rb[r] = rows[r] + b;
    I isum[R][G][4];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g)
        for (int c8 = 0; c8 < 4; ++c8) {  // -32 * (sc_2l bsum_2l + sc_2l+1 bsum_2l+1), l = 2 c8 + (0, 1)
          const I bs = V::load(bss[g] + b * 128 + c8 * 32);
          const I m = V::madd(V::bcast64(reinterpret_cast<const uint8_t*>(rb[r]->sc16 + 4 * c8)), bs);
          isum[r][g][c8] = V::sub32(V::zero(), V::slli5(m));
        }
    for (int h = 0; h < 2; ++h)
      for (int cp = 0; cp < 2; ++cp)
        for (int c8 = 0; c8 < 4; ++c8) {
          const int64_t ca = 32 * b + 16 * h + 4 * (2 * cp) + c8, cb = ca + 4;  // 8-element chunks of the two pieces
          I xa[G], xb[G];
          for (int g = 0; g < G; ++g) {
            xa[g] = V::load(xs[g] + ca * (kGroupTokens * 8));
            xb[g] = V::load(xs[g] + cb * (kGroupTokens * 8));
          }
          for (int r = 0; r < R; ++r) {
            const uint8_t* piece = rb[r]->q6 + 128 * h + 32 * (2 * cp) + 8 * c8;
            const I wa = V::bcast64(piece), wb = V::bcast64(piece + 32);
            const I sc = V::bcast32(rb[r]->sc_pairs[4 * h + 2 * cp + (c8 >= 2 ? 1 : 0)]);
            for (int g = 0; g < G; ++g) {
              const I da = V::dpbusd(V::zero(), wa, xa[g]), db = V::dpbusd(V::zero(), wb, xb[g]);
              isum[r][g][c8] = V::madd_acc(isum[r][g][c8], V::pack_halves(da, V::slli16(db)), sc);
            }
          }
        }
    for (int r = 0; r < R; ++r) {
      const F d = V::bcast_f(rb[r]->d);
      for (int g = 0; g < G; ++g) {
        const F scale = V::mul(d, V::load_f(ds[g] + 16 * b));
        for (int c8 = 0; c8 < 4; ++c8) acc[r][g][c8] = V::fma(V::cvt(isum[r][g][c8]), scale, acc[r][g][c8]);
      }
    }
  }
  store_group_tile<V, R, G>(acc, n_tokens, n_out, n0, slot0, out);
}
#endif

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

#if defined(ORCA_QUANT_INT8_512)
// Quarter q of the int16 scale vector of chunk pair p (chunks 2p, 2p + 1) of half h holds the
// scale of sub-block 8h + 4p + q (vpermw indices into the super-block's 16 int16 scales).
alignas(64) constexpr int16_t kQ6PairScales[4][32] = {
#define ORCA_Q(s) s, s, s, s, s, s, s, s
#define ORCA_HP(base) {ORCA_Q(base), ORCA_Q(base + 1), ORCA_Q(base + 2), ORCA_Q(base + 3)}
    ORCA_HP(0), ORCA_HP(4), ORCA_HP(8), ORCA_HP(12),
#undef ORCA_HP
#undef ORCA_Q
};

// q6k_int8_tile for one token (R rows, M = 1) in zmm registers, with VNNI. The activations of a
// half's chunks (0, 1) and (2, 3) are 64 contiguous bytes each, so one vpmaddubsw and one
// vpdpwssd cover a pair of chunks, its q6 built with per-lane shifts (qh << 4 | << 2 for the
// first pair, >> 0 | >> 2 for the second). When the super-block ends the pair's upper 8 int32
// lanes are added to its lower 8: the very integers of q6k_int8_tile's 8 lanes (integer sums are
// exact in any order), then the same float update and lane sum, so the same bits.
template <int R>
inline void q6k_int8_rows_zmm(const Int8Rows& a, const uint8_t* w, int64_t row_bytes, int64_t k, int64_t n0,
                              int64_t stride, float* out) {
  const int64_t n_super = k / kSuperBlock;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0f), bits45 = _mm512_set1_epi8(0x30);
  const __m512i shl01 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
  const __m512i shr23 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
  for (int64_t b = 0; b < n_super; ++b) {
    const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bsums + 16 * b));
    const int8_t* x = a.q + b * kSuperBlock;
    const float xd = a.d[b];
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = w + (n0 + r * stride) * row_bytes + b * 210;
      const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
      const __m512i sc16z = _mm512_castsi256_si512(sc16);
      // -32 * sum_j sc_j * bsum_j, as q6k_int8_tile starts its lanes
      const __m256i bias = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5));
      __m512i chain[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
      for (int h = 0; h < 2; ++h) {
        const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h)));
        const __m512i q01 = _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_and_si512(_mm512_sllv_epi16(qh, shl01), bits45));
        const __m512i q23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                            _mm512_and_si512(_mm512_srlv_epi16(qh, shr23), bits45));
        const __m512i s01 = _mm512_permutexvar_epi16(_mm512_load_si512(kQ6PairScales[2 * h]), sc16z);
        const __m512i s23 = _mm512_permutexvar_epi16(_mm512_load_si512(kQ6PairScales[2 * h + 1]), sc16z);
        const __m512i x01 = _mm512_loadu_si512(x + 128 * h), x23 = _mm512_loadu_si512(x + 128 * h + 64);
        chain[0] = _mm512_dpwssd_epi32(chain[0], _mm512_maddubs_epi16(q01, x01), s01);
        chain[1] = _mm512_dpwssd_epi32(chain[1], _mm512_maddubs_epi16(q23, x23), s23);
      }
      const __m512i z = _mm512_add_epi32(chain[0], chain[1]);
      const __m256i isum = _mm256_add_epi32(
          bias, _mm256_add_epi32(_mm512_castsi512_si256(z), _mm512_extracti64x4_epi64(z, 1)));
      const float d = half_to_float(blk + 208);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d * xd), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float l[8];
    _mm256_store_ps(l, acc[r]);
    out[n0 + r * stride] = hsum8_tree(l);
  }
}
#endif

}  // namespace
}  // namespace detail
}  // namespace cpu
}  // namespace orca
