// The int8-activation kernels: the 32-element formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) here, the
// 256-element ones (Q4_K, Q5_K, Q6_K) in quant_int8_act_k.h, on one driver (int8_act_linear) that splits the rows
// among threads and tiles rows and tokens.
//
// 32-element formats: each activation block
// of 32 is quantized to int8 (quantize_row_int8: scale amax / 127, round to nearest even), each
// weight block meets it in one integer dot product (AVX2: vpmaddubsw + vpmaddwd; AVX-512 VNNI:
// vpdpbusd, the same exact int32 sums), and the block's sum enters an 8-lane float32 accumulator
// scaled by d_w * d_x; Q4_1's (Q5_1's) minimum adds m * (d_x * sum(q_x)) to a scalar float32 sum
// (one fma per block). Q5_0 and Q5_1 are Q4_0 and Q4_1 with 5-bit codes (q5_codes). This is
// the dot product llama.cpp runs on these formats (activations as Q8_0 / Q8_1). Fewer
// instructions per weight than dequantizing to float32, at the price of rounding every activation
// to 8 bits.
//
// Reduction order: an output's block sums enter its accumulator in block order; the lanes are
// summed by hsum8_tree, then the minimum term is added. It depends only on K, never on T, the
// batch, the thread count or the path (both paths compute the same int32 block sums), so a row's
// outputs are bit-identical whatever else is in the batch. Q8_0's prefill reads the
// token-interleaved copy of the activations (quant_int8_groups.h) and keeps those lanes and
// sums (q8_0_int8_group_tile).
//
// Like quant_blocks.h, everything is local to the including unit (compiled for its target).
#pragma once
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "quant_formats.h"
#include "quant_int8_act_k.h"  // the 256-element formats
#include "quant_panels.h"      // Int8Rows
#include "skinny_gemm_blocks.h"  // hsum8_tree
#include "vec.h"                 // thread_scratch, take_units

namespace orca {
namespace cpu {
namespace detail {
namespace {

// One row of K (a multiple of 32) to int8 blocks: d = amax / 127, q = round_even(x * (1 / d))
// (q = 0 where amax = 0), s = d * sum(q). |q| <= 127, which the dot products below rely on.
inline void quantize_row_int8(const float* x, int64_t k, int8_t* q, float* d, float* s) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < k / 32; ++b) {
    const float* xb = x + 32 * b;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[i]));
    }
    float inv;
    const float scale = int8_scale(amax, &inv);
    const __m256 vinv = _mm256_set1_ps(inv);
    __m256i r[4];
    for (int i = 0; i < 4; ++i)
      r[i] = _mm256_cvtps_epi32(
          _mm256_round_ps(_mm256_mul_ps(v[i], vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    // int32 -> int16 -> int8 packs work within 128-bit lanes: restore element order after.
    const __m256i p16a = _mm256_packs_epi32(r[0], r[1]), p16b = _mm256_packs_epi32(r[2], r[3]);
    const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b),
                                                   _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * b), p8);
    const __m256i sum32 = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
    d[b] = scale;
    s[b] = scale * static_cast<float>(hsum_epi32(sum32));
  }
}

template <bool kVnni>
inline __m256i dot_u8_i8(__m256i u, __m256i s) {  // 8 int32 lanes, each the sum of 4 products u8 * i8
  if constexpr (kVnni) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
  } else {
    // exact: adjacent pairs |u * s| <= 2 * 128 * 127 (Q8_0's |w| <= 128, |x| <= 127) fit int16
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
  }
}

// The 32 nibbles of a 4-bit block as bytes (elements 0..15 the low nibbles, 16..31 the high).
inline __m256i nibbles32(const uint8_t* qs) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0f);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask));
}

template <int F>
constexpr int64_t int8_block_bytes() {
  return F == kQuantTypeQ8_0 ? 34 : F == kQuantTypeQ4_0 ? 18 : F == kQuantTypeQ4_1 ? 20 : F == kQuantTypeQ5_0 ? 22 : 24;
}

// The 32-element formats, whose prefill runs on Q8_0's grouped tiles (q8_0_row_blocks).
template <int F>
constexpr bool kQ8GroupedFormat = F == kQuantTypeQ8_0 || F == kQuantTypeQ4_0 || F == kQuantTypeQ5_0 || kMinFormat<F>;

// The 32 weights of a block of a 32-element format F as int8 codes in element order: Q8_0's
// quants, Q4_0's and Q5_0's codes less their offset (8, 16), Q4_1's and Q5_1's unsigned codes
// (their minimum is added apart). Q5's fifth bits are the 32-bit qh after the fp16 head.
template <int F>
inline __m256i block_codes32(const uint8_t* blk) {
  if constexpr (F == kQuantTypeQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  } else if constexpr (F == kQuantTypeQ4_0 || F == kQuantTypeQ4_1) {
    const __m256i nib = nibbles32(blk + (kMinFormat<F> ? 4 : 2));
    return kMinFormat<F> ? nib : _mm256_sub_epi8(nib, _mm256_set1_epi8(8));
  } else {
    constexpr int64_t kQh = kMinFormat<F> ? 4 : 2;
    uint32_t qh;
    std::memcpy(&qh, blk + kQh, sizeof qh);
    const __m256i codes = q5_codes(blk + kQh + 4, qh);
    return kMinFormat<F> ? codes : _mm256_sub_epi8(codes, _mm256_set1_epi8(16));
  }
}

// out[(t0 + m) * n_out + n0 + r * stride] for R weight rows (n0, n0 + stride, ...) and M tokens
// from t0: the rows share each activation block load and the tokens each unpacked weight block;
// the R * M accumulators are independent, so each output's sum is the same whatever the tile.
template <bool kVnni, int F, int R, int M>
inline void int8_act_tile_32(const Int8Rows& a, const uint8_t* w, int64_t row_bytes, int64_t k, int64_t n_out,
                             int64_t n0, int64_t stride, int64_t t0, float* out) {
  constexpr int64_t kBytes = int8_block_bytes<F>();
  const int64_t n_blocks = k / 32;
  __m256 acc[R][M];
  float acc_min[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps(), acc_min[r][m] = 0.0f;
  for (int64_t b = 0; b < n_blocks; ++b) {
    __m256i x[M];
    float xd[M];
    for (int m = 0; m < M; ++m) {
      x[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + (t0 + m) * k + 32 * b));
      xd[m] = a.d[(t0 + m) * n_blocks + b];
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = w + (n0 + r * stride) * row_bytes + b * kBytes;
      const float dw = half_to_float(blk);
      if constexpr (kMinFormat<F>) {
        // unsigned codes against signed x (pairs at most 2 * 31 * 127: no int16 saturation)
        const __m256i u = block_codes32<F>(blk);
        const float mw = half_to_float(blk + 2);
        for (int m = 0; m < M; ++m) {
          acc_min[r][m] = std::fma(mw, a.s[(t0 + m) * n_blocks + b], acc_min[r][m]);  // explicit: no contraction choice
          acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8_i8<kVnni>(u, x[m])), _mm256_set1_ps(dw * xd[m]),
                                      acc[r][m]);
        }
      } else {
        const __m256i wq = block_codes32<F>(blk);
        // signed x signed as unsigned x signed: |w| (as u8, so |-128| = 128) against x carrying w's sign
        const __m256i u = _mm256_sign_epi8(wq, wq);
        for (int m = 0; m < M; ++m)
          acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8_i8<kVnni>(u, _mm256_sign_epi8(x[m], wq))),
                                      _mm256_set1_ps(dw * xd[m]), acc[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      alignas(32) float l[8];
      _mm256_store_ps(l, acc[r][m]);
      out[(t0 + m) * n_out + n0 + r * stride] = hsum8_tree(l) + acc_min[r][m];
    }
}

#if defined(ORCA_QUANT_INT8_512)
// int8_act_tile_32 for Q4_0, Q4_1, Q5_0 and Q5_1 with AVX-512 VNNI: the 2P rows n0 + r * stride
// against the M tokens from t0, two rows per zmm register. Each 256-bit half holds one row's 8
// int32 lanes of the ymm tile (its codes, elements 0..15 then 16..31, against the block's
// activations: vpdpbusd; Q4_0's -8 (Q5_0's -16) as -8 (-16) * the sum of each lane's 4
// activations, from the same instruction against ones), then the same float updates per lane (the
// exact integers as float, times d_w * d_x, an fma in block order; Q4_1's and Q5_1's minimum in a
// chain of its own) and the same hsum8_tree: the same bits, with about half the instructions per
// weight (one unpack, product, conversion and fma for two rows; both rows' scales converted by one
// instruction). Q5's fifth bits come from the two rows' qh words as one 64-bit byte mask.
template <int F>
constexpr bool kZmmPairFormat =
    F == kQuantTypeQ4_0 || F == kQuantTypeQ4_1 || F == kQuantTypeQ5_0 || F == kQuantTypeQ5_1;

template <int F, int P, int M>
inline void q4_int8_tile_zmm(const Int8Rows& a, const uint8_t* w, int64_t row_bytes, int64_t k, int64_t n_out,
                             int64_t n0, int64_t stride, int64_t t0, float* out) {
  constexpr int64_t kBytes = int8_block_bytes<F>();
  constexpr bool kFive = F == kQuantTypeQ5_0 || F == kQuantTypeQ5_1;
  constexpr bool kMin = kMinFormat<F>;
  constexpr bool kOffset = !kMin;  // Q4_0, Q5_0: w = d * (code - 8 or 16)
  constexpr int64_t kHead = kMin ? 4 : 2;                   // fp16 d [, m]
  constexpr int64_t kQuants = kHead + (kFive ? 4 : 0);      // offset of a block's 16 quant bytes
  const int64_t n_blocks = k / 32;
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const __m512i high_halves = _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4);  // 128-bit lanes 1, 3: >> 4
  const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);  // d of each row
  const uint8_t* row[2 * P];
  for (int r = 0; r < 2 * P; ++r) row[r] = w + (n0 + r * stride) * row_bytes;
  __m512 acc[P][M];
  __m128 acc_min[P][M];  // lanes 1 and 3: the pair's rows
  for (int p = 0; p < P; ++p)
    for (int m = 0; m < M; ++m) acc[p][m] = _mm512_setzero_ps(), acc_min[p][m] = _mm_setzero_ps();
  for (int64_t b = 0; b < n_blocks; ++b) {
    // Each token's activations and scales, once for every pair; xsum8 (Q4_0, Q5_0): 8 (16) * (each
    // lane's 4 activations summed).
    __m512i x[M], xsum8[M];
    __m512 xd[M];
    __m128 xs[M];
    for (int m = 0; m < M; ++m) {
      const int64_t xb = (t0 + m) * n_blocks + b;
      x[m] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + (t0 + m) * k + 32 * b)));
      xd[m] = _mm512_set1_ps(a.d[xb]);
      if constexpr (kMin) xs[m] = _mm_set1_ps(a.s[xb]);
      if constexpr (kOffset)
        xsum8[m] = _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), x[m]),
                                     kFive ? 4 : 3);
    }
    for (int p = 0; p < P; ++p) {
      const uint8_t* ba = row[2 * p] + b * kBytes;
      const uint8_t* bb = row[2 * p + 1] + b * kBytes;
      // [d_a, m_a, d_b, m_b] (Q4_0, Q5_0: m is the bytes after d, never used)
      int32_t ha, hb;
      std::memcpy(&ha, ba, 4);
      std::memcpy(&hb, bb, 4);
      const __m128 heads = _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128(ha), hb, 1));
      const __m512 dw = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(heads));
      const __m512i qa = _mm512_castsi256_si512(
          _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ba + kQuants))));
      const __m512i qab = _mm512_inserti64x4(
          qa, _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bb + kQuants))), 1);
      __m512i nib = _mm512_and_si512(_mm512_srlv_epi64(qab, high_halves), low4);
      if constexpr (kFive) {  // byte i of the pair's codes (row a: 0..31, row b: 32..63) gains 16 where its bit is set
        uint32_t qa32, qb32;
        std::memcpy(&qa32, ba + kHead, 4);
        std::memcpy(&qb32, bb + kHead, 4);
        nib = _mm512_or_si512(nib, _mm512_maskz_mov_epi8(_cvtu64_mask64(qa32 | uint64_t{qb32} << 32),
                                                          _mm512_set1_epi8(16)));
      }
      for (int m = 0; m < M; ++m) {
        if constexpr (kMin) acc_min[p][m] = _mm_fmadd_ps(heads, xs[m], acc_min[p][m]);
        __m512i isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), nib, x[m]);
        if constexpr (kOffset) isum = _mm512_sub_epi32(isum, xsum8[m]);
        acc[p][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, xd[m]), acc[p][m]);
      }
    }
  }
  for (int p = 0; p < P; ++p)
    for (int m = 0; m < M; ++m) {
      alignas(64) float l[16];
      alignas(16) float mins[4];
      _mm512_store_ps(l, acc[p][m]);
      _mm_store_ps(mins, acc_min[p][m]);
      for (int h = 0; h < 2; ++h)  // Q4_0 and Q5_0 add a zero, as the ymm tile does
        out[(t0 + m) * n_out + n0 + (2 * p + h) * stride] = hsum8_tree(l + 8 * h) + (kMin ? mins[1 + 2 * h] : 0.0f);
    }
}
#endif

// A Q8_0 block as the prefill tiles read it, decoded once per row for every token slot: the
// quants, copied to an aligned place (the 34-byte blocks of the file would split some 8-byte
// loads across cache lines), d, and for the vpdpbusd tile (kCorrections: its x + 128 bias) the
// correction -128 * (the sum of w over elements 4l .. 4l + 3) of each int32 lane l. Without the
// corrections a block is one cache line instead of one and a half, so more of a panel's rows
// stay in L1 and L2 (1.0-1.06x at T = 512 on a Zen 3, where the rows of the next unit are
// prefetched into the same L2).
template <bool kCorrections>
struct Q8RowBlock {
  alignas(32) int8_t q[32];
  int32_t neg128_sums[8];
  float d, m;  // m: Q4_1's and Q5_1's minimum (0 for the others)
};

template <>
struct Q8RowBlock<false> {
  alignas(32) int8_t q[32];
  float d, m;
};

// The rows of a Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1 weight as Q8RowBlock: a Q4_0 (Q5_0) block's
// weights are d * (code - 8) (d * (code - 16)), so its int8 quants code - 8 (- 16) and its d make
// a Q8_0 block of the same numbers; Q4_1's and Q5_1's are their codes, d and m. Their prefill runs
// on Q8_0's grouped tiles (the int32 lanes and float sums of their own natural-order tiles: the
// same products of the same integers, and the same minimum terms).
template <int F, bool kCorrections>
inline void q8_0_row_blocks(const uint8_t* row, int64_t n_blocks, Q8RowBlock<kCorrections>* out) {  // out [n_blocks]
  static_assert(kQ8GroupedFormat<F>, "int8 codes times d (plus m)");
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < n_blocks; ++b) {
    const uint8_t* blk = row + b * int8_block_bytes<F>();
    const __m256i wq = block_codes32<F>(blk);
    _mm256_store_si256(reinterpret_cast<__m256i*>(out[b].q), wq);
    if constexpr (kCorrections) {
      const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, wq), ones16);  // exact: |pair| <= 256
      _mm256_store_si256(reinterpret_cast<__m256i*>(out[b].neg128_sums),
                         _mm256_mullo_epi32(sums, _mm256_set1_epi32(-128)));
    }
    out[b].d = half_to_float(blk);
    out[b].m = kMinFormat<F> ? half_to_float(blk + 2) : 0.0f;
  }
}

// out[t * n_out + n0 + r] for the R Q8_0 weight rows from n0 and G token slots of V::kTokens
// tokens from slot0 * V::kTokens (those below n_tokens), from the token-interleaved copy
// (Int8Groups, block 32), with the rows' quants, corrections and scales from blocks (Q8RowBlock).
// Each 8-byte piece of a weight block is broadcast once for the G slots. The int32 lanes are those of
// int8_act_tile_32, exactly: lanes 2s, 2s + 1 of chunk c are its lanes 2c, 2c + 1 of token s,
// and accumulator c their float sums, so the same fmas and the same hsum8_tree run on them.
// - With vpdpbusd (biased groups: x + 128 as uint8): vpdpbusd of x + 128 and w, started at
//   -128 * (the sum of w per lane, Q8RowBlock).
// - Without (AVX2): |w| (as uint8, so |-128| = 128) against x carrying w's sign, vpmaddubsw
//   (pairs |w x| <= 2 * 128 * 127 fit int16) then vpmaddwd by 1, as the one-token tile does.
// kMin (Q4_1, Q5_1): each output also sums m_w * s_x over its blocks in a chain of its own (one
// fma per block, in block order, lanes 2s and 2s + 1 of token s alike), added after the tree, as
// int8_act_tile_32 adds its scalar minimum sum.
template <class V, int R, int G, bool kMin = false>
inline void q8_0_int8_group_tile(const Int8Groups& a, int64_t k, int64_t n_tokens, int64_t n_out, int64_t n0,
                                 int64_t slot0, const Q8RowBlock<V::kDpbusd>* const* blocks, float* out) {  // blocks[r]: row n0 + r's [K / 32]
  using I = typename V::I;
  using F = typename V::F;
  const int64_t n_blocks = k / 32;
  const int8_t* xs[G];
  const float* ds[G];
  const float* ss[G];
  for (int g = 0; g < G; ++g) {
    const GroupSlot slot(slot0 + g, V::kTokens);
    xs[g] = slot.q(a, k);
    ds[g] = slot.d(a, n_blocks);
    ss[g] = kMin ? slot.s(a, n_blocks) : nullptr;
  }
  F acc[R][G][4];
  F mins[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) {
      mins[r][g] = V::zero_f();
      for (int c = 0; c < 4; ++c) acc[r][g][c] = V::zero_f();
    }
  for (int64_t b = 0; b < n_blocks; ++b) {
    for (int r = 0; r < R; ++r) {
      const Q8RowBlock<V::kDpbusd>& rb = blocks[r][b];
      if constexpr (kMin)
        for (int g = 0; g < G; ++g) mins[r][g] = V::fma(V::bcast_f(rb.m), V::load_f(ss[g] + 16 * b), mins[r][g]);
      const F dw = V::bcast_f(rb.d);
      F scale[G];
      for (int g = 0; g < G; ++g) scale[g] = V::mul(dw, V::load_f(ds[g] + 16 * b));
      for (int c = 0; c < 4; ++c) {
        const I wq = V::bcast64(reinterpret_cast<const uint8_t*>(rb.q + 8 * c));
        for (int g = 0; g < G; ++g) {
          const I x = V::load(xs[g] + (4 * b + c) * (kGroupTokens * 8));
          I sums;
          if constexpr (V::kDpbusd) {
            sums = V::dpbusd(V::bcast64(reinterpret_cast<const uint8_t*>(rb.neg128_sums + 2 * c)), x, wq);  // lanes 2c, 2c + 1
          } else {
            sums = V::madd(V::maddubs(V::abs8(wq), V::sign8(x, wq)), V::bcast16(1));
          }
          acc[r][g][c] = V::fma(V::cvt(sums), scale[g], acc[r][g][c]);
        }
      }
    }
  }
  store_group_tile<V, R, G>(acc, n_tokens, n_out, n0, slot0, out);
  if constexpr (kMin)
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g)
        each_slot_token<V>(mins[r][g], slot0 + g, n_tokens, n_out, n0 + r, out, [](float& o, const float* l) { o += l[0]; });
}

// The tile of format F in natural token order: the 32-element formats above, Q4_K, Q5_K and Q6_K
// in quant_int8_act_k.h.
template <bool kVnni, int F, int R, int M>
inline void int8_act_tile(const Int8Rows& a, const uint8_t* w, int64_t row_bytes, int64_t k, int64_t n_out,
                          int64_t n0, int64_t stride, int64_t t0, float* out) {
  if constexpr (kQ4Family<F>) {
    static_assert(R == 1, "Q4_K's and Q5_K's natural-order tile takes one row");
    q4k_int8_tokens<F, kVnni, M>(a, w, row_bytes, k, n_out, n0, t0, out);
  } else if constexpr (F == kQuantTypeQ6_K) {
    q6k_int8_tile<kVnni, R, M>(a, w, row_bytes, k, n_out, n0, stride, t0, out);
#if defined(ORCA_QUANT_INT8_512)
  } else if constexpr (kVnni && R % 2 == 0 && kZmmPairFormat<F>) {
    q4_int8_tile_zmm<F, R / 2, M>(a, w, row_bytes, k, n_out, n0, stride, t0, out);
#endif
  } else {
    int8_act_tile_32<kVnni, F, R, M>(a, w, row_bytes, k, n_out, n0, stride, t0, out);
  }
}

// Rows [n0, n0 + R) against tokens [t0, t1): tiles of MT tokens, then the remainder.
template <bool kVnni, int F, int R, int MT = 4>
inline void int8_act_rows_all_tokens(const Int8Rows& a, const uint8_t* w, int64_t row_bytes, int64_t t0,
                                     int64_t t1, int64_t k, int64_t n_out, int64_t n0, float* out) {
  int64_t t = t0;
  for (; t + MT <= t1; t += MT) int8_act_tile<kVnni, F, R, MT>(a, w, row_bytes, k, n_out, n0, 1, t, out);
  switch (t1 - t) {
    case 7: if constexpr (MT > 7) int8_act_tile<kVnni, F, R, 7>(a, w, row_bytes, k, n_out, n0, 1, t, out); break;
    case 6: if constexpr (MT > 6) int8_act_tile<kVnni, F, R, 6>(a, w, row_bytes, k, n_out, n0, 1, t, out); break;
    case 5: if constexpr (MT > 5) int8_act_tile<kVnni, F, R, 5>(a, w, row_bytes, k, n_out, n0, 1, t, out); break;
    case 4: if constexpr (MT > 4) int8_act_tile<kVnni, F, R, 4>(a, w, row_bytes, k, n_out, n0, 1, t, out); break;
    case 3: int8_act_tile<kVnni, F, R, 3>(a, w, row_bytes, k, n_out, n0, 1, t, out); break;
    case 2: int8_act_tile<kVnni, F, R, 2>(a, w, row_bytes, k, n_out, n0, 1, t, out); break;
    case 1: int8_act_tile<kVnni, F, R, 1>(a, w, row_bytes, k, n_out, n0, 1, t, out); break;
    default: break;
  }
}

// What a grouped format's prefill tiles read of each weight row besides its bytes, decoded
// once per row for all token slots: Q4_K's scales, Q5_K's scales and codes, Q6_K's q6 and
// scales, the 32-element formats' aligned int8 codes (and with vpdpbusd their corrections).
template <int F, bool kDpbusd>
using RowPrepOf = std::conditional_t<kQ4Family<F>, KRowPrep<F>,
                                     std::conditional_t<F == kQuantTypeQ6_K, Q6KRowBlock, Q8RowBlock<kDpbusd>>>;

// The prefill tile of a grouped format F (Q4_K, Q5_K, Q6_K and the 32-element formats) at width V.
template <int F, class V, int R, int G>
inline void group_tile(const Int8Groups& g, const uint8_t* w, int64_t row_bytes, int64_t k, int64_t n_tokens,
                       int64_t n_out, int64_t n, int64_t slot, const RowPrepOf<F, V::kDpbusd>* const* prep,
                       float* out) {
  if constexpr (kQ4Family<F>) {
    q4k_int8_group_tile<F, V, R, G>(g, w, row_bytes, k, n_tokens, n_out, n, slot, prep, out);
  } else if constexpr (kQ8GroupedFormat<F>) {
    q8_0_int8_group_tile<V, R, G, kMinFormat<F>>(g, k, n_tokens, n_out, n, slot, prep, out);
  } else {
#if defined(ORCA_QUANT_INT8_512)
    q6k_int8_group_tile<V, R, G>(g, k, n_tokens, n_out, n, slot, prep, out);
#endif
  }
}

// What a grouped format's tiles read of rows [n0, n1) besides their bytes, decoded once for
// every token slot into prep [(n1 - n0) * row_prep_blocks<F>(k)].
template <int F>
constexpr int64_t row_prep_blocks(int64_t k) {
  return k / (kQ8GroupedFormat<F> ? 32 : kSuperBlock);
}

template <int F, bool kQ8Corrections>
inline void prepare_rows(const uint8_t* w, int64_t row_bytes, int64_t k, int64_t n0, int64_t n1,
                         RowPrepOf<F, kQ8Corrections>* prep) {
  const int64_t n_blocks = row_prep_blocks<F>(k);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    RowPrepOf<F, kQ8Corrections>* out = prep + (n - n0) * n_blocks;
    if constexpr (kQ4Family<F>)
      q4k_row_scales<F>(row, n_blocks, out);
    else if constexpr (F == kQuantTypeQ6_K)
      q6k_row_blocks(row, n_blocks, out);
    else
      q8_0_row_blocks<F, kQ8Corrections>(row, n_blocks, out);
  }
}

// Token slots [s0, s1) of V::kTokens tokens (those below n_tokens) against rows [n0, n1), whose
// prep is prep: GT slots at a time, each slot tile against the rows RT at a time, so that the
// tile's activations stay in L1 while the rows come from L2 (the copy of the activations is
// streamed once per panel of rows, not once per tile of rows). Each tile also streams its share
// of the thread's next unit of rows into L2 (ahead).
template <int F, class V, int RT, int GT>
inline void slots_against_rows(const Int8Groups& g, const uint8_t* w, int64_t row_bytes, int64_t n_tokens, int64_t k,
                               int64_t n_out, int64_t n0, int64_t n1, int64_t s0, int64_t s1,
                               const RowPrepOf<F, V::kDpbusd>* prep, PrefetchAhead& ahead, float* out) {
  static_assert(RT == 1 || RT == 2, "tiles take 1 or 2 rows");
  const int64_t n_blocks = row_prep_blocks<F>(k);
  ahead.plan(((s1 - s0) / GT + (s1 - s0) % GT) * ((n1 - n0) / RT + (n1 - n0) % RT));
  auto rows = [&](auto slots, int64_t slot) {
    constexpr int G = decltype(slots)::value;
    int64_t n = n0;
    if constexpr (RT == 2) {
      for (; n + 2 <= n1; n += 2) {
        const RowPrepOf<F, V::kDpbusd>* pair[2] = {prep + (n - n0) * n_blocks, prep + (n + 1 - n0) * n_blocks};
        group_tile<F, V, 2, G>(g, w, row_bytes, k, n_tokens, n_out, n, slot, pair, out);
        ahead.step();
      }
    }
    for (; n < n1; ++n) {
      const RowPrepOf<F, V::kDpbusd>* one[1] = {prep + (n - n0) * n_blocks};
      group_tile<F, V, 1, G>(g, w, row_bytes, k, n_tokens, n_out, n, slot, one, out);
      ahead.step();
    }
  };
  int64_t slot = s0;
  for (; slot + GT <= s1; slot += GT) rows(std::integral_constant<int, GT>{}, slot);
  for (; slot < s1; ++slot) rows(std::integral_constant<int, 1>{}, slot);
}

// Rows [n0, n1) against every token: 8-token slots (zmm) on AVX-512, where the last group
// takes a 4-token slot (ymm) when it holds 4 tokens or fewer; 4-token slots on AVX2. Tiles of
// 2 rows share each activation load; Q4_K's take 2 slots with VNNI (its int32 sums need few
// registers), Q6_K's and Q8_0's one (4 accumulators per row and slot). Q8_0 without vpdpbusd
// takes 1 row x 2 slots, the whole group, so each 64-byte line of the copy is read whole by one
// tile (8-18% faster than 2 rows x 1 slot on a Zen 3).
template <bool kVnni, int F>
inline void grouped_prefill(const Int8Groups& g, const uint8_t* w, int64_t row_bytes, int64_t n_tokens, int64_t k,
                            int64_t n_out, int64_t n0, int64_t n1, PrefetchAhead& ahead, float* out) {
  constexpr int kSlots = kQ4Family<F> ? 2 : 1;
  using Prep = RowPrepOf<F, GroupOps256<kVnni>::kDpbusd>;
  Prep* prep = thread_scratch<Prep>(0, static_cast<size_t>((n1 - n0) * row_prep_blocks<F>(k)));
  prepare_rows<F, GroupOps256<kVnni>::kDpbusd>(w, row_bytes, k, n0, n1, prep);
#if defined(ORCA_QUANT_INT8_512)
  if constexpr (kVnni) {
    const int64_t tail = n_tokens % kGroupTokens;
    const int64_t wide = tail > 0 && tail <= 4 ? n_tokens - tail : n_tokens;  // tokens in 8-token slots
    if (wide > 0)
      slots_against_rows<F, GroupOps512, 2, kSlots>(g, w, row_bytes, wide, k, n_out, n0, n1, 0,
                                                    (wide + kGroupTokens - 1) / kGroupTokens, prep, ahead, out);
    if (wide < n_tokens)
      slots_against_rows<F, GroupOps256<true>, 2, 1>(g, w, row_bytes, n_tokens, k, n_out, n0, n1, wide / 4,
                                                     wide / 4 + 1, prep, ahead, out);
    return;
  }
#endif
  constexpr bool kQ8Sign = kQ8GroupedFormat<F> && !GroupOps256<kVnni>::kDpbusd;
  slots_against_rows<F, GroupOps256<kVnni>, kQ8Sign ? 1 : 2, kQ8Sign ? 2 : kVnni ? kSlots : 1>(
      g, w, row_bytes, n_tokens, k, n_out, n0, n1, 0, (n_tokens + 3) / 4, prep, ahead, out);
}

// Whether format F's prefill reads the token-interleaved copy (Int8Groups) on this path: Q4_K,
// Q5_K, Q8_0 and the 32-element formats always; Q6_K with VNNI (its tile packs sums of 4 products in int16 halves for
// vpdpbusd). On AVX2 Q6_K keeps the natural-order tiles, whose int32 lanes and float sums are
// the same.
template <bool kVnni, int F>
constexpr bool grouped_prefill_of() {
#if defined(ORCA_QUANT_INT8_512)
  if (kVnni && F == kQuantTypeQ6_K) return true;
#endif
  return kQ4Family<F> || kQ8GroupedFormat<F>;
}

// Rows per panel of a prefill: about 64 KiB of weights, which stay in L2 while every token tile
// passes over them; an even number, for the 2-row tiles.
inline int64_t int8_panel_rows(int64_t row_bytes) {
  return std::max<int64_t>(2, ((int64_t{64} << 10) / row_bytes) & ~int64_t{1});
}

// out[t, n] for n in [n0, n1) and every token. A single token takes 4 rows at a time (4 FMA
// chains), one from each quarter of the range, so that the weights are read as 4 long forward
// streams (the hardware prefetchers follow those better than one; skinny_gemm.cpp measured the
// same for the float kernels). More tokens take panels of rows small enough to stay in L2 while
// every token tile passes over them (each weight byte read from memory once): from 8 tokens the
// grouped formats take tiles of the interleaved copy, each against every row of the panel
// (grouped_prefill), otherwise 2 rows x 4 tokens for the 32-element formats and 1 row x 8 tokens
// for Q4_K and Q6_K.
template <bool kVnni, int F>
inline void int8_act_rows(const Int8Rows& a, const Int8Groups& groups, const uint8_t* w, int64_t row_bytes,
                          int64_t n_tokens, int64_t k, int64_t n_out, int64_t n0, int64_t n1, PrefetchAhead& ahead,
                          float* out) {
  if (n_tokens == 1) {
#if defined(ORCA_QUANT_INT8_512)
    constexpr bool kZmmRows = kVnni;  // the one-token K-quant rows in zmm registers (same integers)
#else
    constexpr bool kZmmRows = false;
#endif
    const int64_t quarter = (n1 - n0) / 4;
    // On Zen 5, Q4_K's rows are prefetched two rows ahead of use in each of the 4 streams: its
    // one-token product waited on its weight loads with the hardware prefetchers alone, and the
    // Llama-1B-shaped Q4_K_M file decoded 28-29 -> 38-42 tok/s on 2 cores (bench/peer_cpu.py);
    // the same hint for every format cut the Q8_0 stream to 0.65-0.75x and Q4_K_M's Q6_K rows
    // too, so only Q4_K takes it. On a Zen 4, whose 512-bit integer ops take two passes, the
    // prefetch instructions themselves cost more than they hide: the same file's forward ran
    // 1.28x faster without them (21.6 against 27.6 ms, forwards alternated in one process), and
    // prefetching into L2 only was in between (24.4-24.9 ms). q4k_decode_rows_ahead() chooses.
    const int64_t rows_ahead = F == kQuantTypeQ4_K ? q4k_decode_rows_ahead() : 0;
    for (int64_t j = 0; j < quarter; ++j) {
      if (rows_ahead > 0 && j + rows_ahead < quarter)
        for (int r = 0; r < 4; ++r) {
          const char* row = reinterpret_cast<const char*>(w + (n0 + j + rows_ahead + r * quarter) * row_bytes);
          for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(row + off, 0, 3);
        }
      if constexpr (kQ4Family<F>)
        q4k_int8_rows<F, kVnni, 4, kZmmRows>(a, w, row_bytes, k, n0 + j, quarter, out);
#if defined(ORCA_QUANT_INT8_512)
      else if constexpr (F == kQuantTypeQ6_K && kVnni)
        q6k_int8_rows_zmm<4>(a, w, row_bytes, k, n0 + j, quarter, out);
#endif
      else
        int8_act_tile<kVnni, F, 4, 1>(a, w, row_bytes, k, n_out, n0 + j, quarter, 0, out);
    }
    for (int64_t n = n0 + 4 * quarter; n < n1; ++n) {
      if constexpr (kQ4Family<F>)
        q4k_int8_rows<F, kVnni, 1, kZmmRows>(a, w, row_bytes, k, n, 1, out);
#if defined(ORCA_QUANT_INT8_512)
      else if constexpr (F == kQuantTypeQ6_K && kVnni)
        q6k_int8_rows_zmm<1>(a, w, row_bytes, k, n, 1, out);
#endif
      else
        int8_act_tile<kVnni, F, 1, 1>(a, w, row_bytes, k, n_out, n, 1, 0, out);
    }
    return;
  }
  const int64_t panel = int8_panel_rows(row_bytes);
  for (int64_t p0 = n0; p0 < n1; p0 += panel) {
    const int64_t p1 = std::min(n1, p0 + panel);
    if (groups.n_groups > 0) {
      if constexpr (grouped_prefill_of<kVnni, F>())
        grouped_prefill<kVnni, F>(groups, w, row_bytes, n_tokens, k, n_out, p0, p1, ahead, out);
    } else {
      // Token tiles of ~128 KiB of int8 rows, each against every row of the panel: at 512
      // tokens the rows are 1 MiB at K = 2048, more than this L2, and were streamed once per
      // weight row (Q6_K on AVX2 fell from 130-144 GFLOP/s at T = 64 to 103-121 at T = 512).
      const int64_t tile = std::max<int64_t>(8, ((int64_t{128} << 10) / (k + k / 8)) & ~int64_t{7});
      constexpr bool kOneRow = F == kQuantTypeQ6_K || kQ4Family<F>;
      ahead.plan((n_tokens + tile - 1) / tile * (kOneRow ? p1 - p0 : (p1 - p0) / 2 + (p1 - p0) % 2));
      for (int64_t t0 = 0; t0 < n_tokens; t0 += tile) {
        const int64_t t1 = std::min(n_tokens, t0 + tile);
        int64_t n = p0;
        if constexpr (kOneRow) {
          for (; n < p1; ++n) {
            int8_act_rows_all_tokens<kVnni, F, 1, 8>(a, w, row_bytes, t0, t1, k, n_out, n, out);
            ahead.step();
          }
        } else {
#if defined(ORCA_QUANT_INT8_512)
          // Q4_0, Q4_1, Q5_0 and Q5_1 hold two rows per zmm register (q4_int8_tile_zmm): a tile
          // of two such pairs loads each token's activations and scales once for both.
          if constexpr (kVnni && kZmmPairFormat<F>)
            for (; n + 4 <= p1; n += 4) {
              int8_act_rows_all_tokens<kVnni, F, 4>(a, w, row_bytes, t0, t1, k, n_out, n, out);
              ahead.step();
              ahead.step();
            }
#endif
          for (; n + 2 <= p1; n += 2) {
            int8_act_rows_all_tokens<kVnni, F, 2>(a, w, row_bytes, t0, t1, k, n_out, n, out);
            ahead.step();
          }
          for (; n < p1; ++n) {
            int8_act_rows_all_tokens<kVnni, F, 1>(a, w, row_bytes, t0, t1, k, n_out, n, out);
            ahead.step();
          }
        }
      }
    }
  }
}

// Batches below this many tokens keep the natural-order tiles: with fewer than a group of
// tokens, building and reading the interleaved copy costs more than it saves (measured on Zen 4:
// 1.3-1.8x slower at T = 2..4, faster from T = 8).
constexpr int64_t kGroupedMinTokens = kGroupTokens;

// The fewest rows one token's claim takes (WorkClaims, in int8_act_linear): never so few that the
// claim's 4 quarter streams (int8_act_rows) get shorter than ~64 KiB each, the length the
// prefetchers need.
inline int64_t int8_decode_min_rows(int64_t row_bytes) {
  return 4 * std::max<int64_t>(1, (int64_t{64} << 10) / row_bytes);
}

// Rows per unit of a prefill: a panel (int8_panel_rows), shrunk to give every thread at least 8.
inline int64_t int8_prefill_unit_rows(int64_t row_bytes, int64_t n_out, int64_t threads) {
  return std::min(int8_panel_rows(row_bytes), std::max<int64_t>(2, (n_out / (8 * threads)) & ~int64_t{1}));
}

// int8_act_rows for the ggml type `type`, chosen at run time.
template <bool kVnni>
inline void int8_rows_of_type(int type, const Int8Rows& a, const Int8Groups& groups, const uint8_t* w,
                              int64_t row_bytes, int64_t n_tokens, int64_t k, int64_t n_out, int64_t n0, int64_t n1,
                              PrefetchAhead& ahead, float* out) {
  dispatch_quant_format(type, [&](auto f) {
    int8_act_rows<kVnni, decltype(f)::value>(a, groups, w, row_bytes, n_tokens, k, n_out, n0, n1, ahead, out);
  });
}

// out[T, N] (float32) = the int8-activation products of every weight row, each weight byte read
// from memory once, by one thread. One token: each thread claims half of what is left of its own
// share of the rows at a time, then takes what is left of the others' from their far ends
// (WorkClaims): against units of an eighth of a share from a shared counter, the Llama-3.2-1B-shaped
// Q4_K_M forward ran 1.016-1.025x faster (Zen 4, one process alternating the two every 15
// forwards, 11-12 of 12 rounds). More tokens take units of rows from a shared counter: with a
// static split, the faster core of a 2-core Zen 3 whose second core ran slower waited at the
// barrier. In paired A/B runs there (Llama-3.2-1B's blocks): prefill 1.07x (Q8_0 gate_up,
// T = 512), 1.22x (Q4_K) and 1.16x (Q6_K down, T = 8 and 128); one token within the host's
// noise in the kernel (0.92-1.14x) and 1.00-1.08x end to end. With more than one token each
// thread claims its next unit before computing the current one and streams the next unit's rows
// into L2 while it computes (take_units_ahead, PrefetchAhead): otherwise each panel's rows came
// from memory in one serial burst when the panel started, with nothing to overlap it (a quarter
// of a 16-token Q8_0 gate_up call on a Zen 3). Paired A/B there, Llama-3.2-1B's blocks: Q4_K
// gate_up 1.45-1.50x at T = 8-16, 1.19x at 32, 1.10x at 128; Q8_0 gate_up 1.39-1.53x at
// T = 2-4, 1.06-1.10x at T = 8-32; Q6_K down 1.07-1.16x at T = 2-32; T = 512 level (0.97-1.04x). Which thread computes a
// row never changes its bits. Formats with a grouped prefill first build the token-interleaved
// copy of a (its groups split among the threads).
template <bool kVnni>
inline void int8_act_linear(const Int8Rows& a, const uint8_t* w, int type, int64_t row_bytes,
                            int64_t n_tokens, int64_t k, int64_t n_out, float* out) {
  Int8Groups groups{0, a.block, nullptr, nullptr, nullptr, nullptr, false};
  bool grouped = false, q8_tiles = false;  // q8_tiles: Q8_0's grouped tiles (the 32-element formats)
  dispatch_quant_format(type, [&](auto f) {
    grouped = grouped_prefill_of<kVnni, decltype(f)::value>();
    q8_tiles = kQ8GroupedFormat<decltype(f)::value>;
  });
  if (grouped && n_tokens >= kGroupedMinTokens)
    groups = int8_groups_at(thread_scratch<int8_t>(5, static_cast<size_t>(int8_groups_bytes(n_tokens, k, type))),
                            n_tokens, k, type, q8_tiles && GroupOps256<kVnni>::kDpbusd);
  const int64_t threads = omp_get_max_threads();
  if (n_tokens == 1) {  // a share of the rows per thread, the ends taken over by whoever is done first
    const int64_t min_rows = int8_decode_min_rows(row_bytes);
    const int64_t ranges = std::max<int64_t>(1, std::min(threads, n_out));
    std::vector<WorkClaims> claims = even_share_claims(n_out, ranges, 1);
#pragma omp parallel if (ranges > 1)
    take_shares(claims.data(), ranges, min_rows, omp_get_thread_num(), [&](int64_t r, int64_t i0, int64_t i1) {
      PrefetchAhead none;  // one token streams its rows: nothing is claimed ahead to prefetch
      const int64_t base = n_out * r / ranges;
      int8_rows_of_type<kVnni>(type, a, groups, w, row_bytes, n_tokens, k, n_out, base + i0, base + i1, none, out);
    });
    return;
  }
  const int64_t unit = int8_prefill_unit_rows(row_bytes, n_out, threads);
  const int64_t n_units = (n_out + unit - 1) / unit;
  std::atomic<int64_t> next{0};
#pragma omp parallel
  {
    if (groups.n_groups > 0) {
#pragma omp for schedule(static)
      for (int64_t g = 0; g < groups.n_groups; ++g) fill_int8_group(a, n_tokens, k, g, groups);
    }
    auto rows = [&](int64_t n0, int64_t n1, PrefetchAhead& ahead) {
      int8_rows_of_type<kVnni>(type, a, groups, w, row_bytes, n_tokens, k, n_out, n0, n1, ahead, out);
    };
    take_units_ahead(next, n_units, 2 * threads, [&](int64_t u, int64_t u_next) {
      PrefetchAhead ahead;
      if (u_next >= 0) {
        const int64_t r0 = u_next * unit, r1 = std::min(n_out, r0 + unit);
        ahead = PrefetchAhead(w + r0 * row_bytes, (r1 - r0) * row_bytes);
      }
      rows(u * unit, std::min(n_out, (u + 1) * unit), ahead);
    });
  }
}

}  // namespace
}  // namespace detail
}  // namespace cpu
}  // namespace orca
