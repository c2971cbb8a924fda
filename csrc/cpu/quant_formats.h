// The ggml block formats of quantized weights, exactly as a GGUF file stores them, and their
// dequantization, one 32-element chunk at a time (every format's blocks split into 32-element
// chunks: Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 blocks are one chunk, Q4_K/Q5_K/Q6_K blocks eight).
//
// A weight row of K elements is K / block_elems consecutive blocks (row_bytes = K / block_elems *
// block_bytes). Dequantization repeats the float32 arithmetic of gguf.quants.dequantize operation
// for operation (fp16 scales widened exactly, then the same products and sums, each rounded on
// its own): the files that include this header are compiled with -ffp-contract=off, so no product
// is fused into an FMA (widen_chunk's one FMA fuses an exact product, which changes no bit).
// Every path therefore sees the same float32 weights, bit for bit.
//
// Everything here sits in an anonymous namespace: each translation unit (one per instruction set)
// compiles its own copy for its own target, and none leaks into another through the linker.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "quant_kernels.h"

namespace orca {
namespace cpu {
namespace detail {
namespace {

constexpr int kChunk = 32;  // elements per dequantization chunk

// IEEE half -> float, exact for every value (subnormals, infinities, NaN).
inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
#if defined(__F16C__)
  return _cvtsh_ss(h);  // vcvtph2ps: exact
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do {
      man <<= 1;
      ++e;
    } while ((man & 0x400u) == 0);
    bits = sign | ((112u - static_cast<uint32_t>(e)) << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// Chunks are dequantized with explicit AVX2 code where the unit is compiled for it, with a plain
// loop beside it for other targets: GCC vectorizes those loops only partly (the nibble halves and
// per-chunk shifts defeat it). Both forms compute the same values: integers widened exactly, then
// the same float32 operations in the same order.
#if defined(__AVX2__)
inline __m256 widen_u8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); }  // low 8
inline __m256 widen_i8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)); }  // low 8

// lo = low nibbles of qs[0..16) (elements 0..15), hi = high nibbles (elements 16..31).
inline void load_nibbles(const uint8_t* qs, __m128i& lo, __m128i& hi) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0f);
  lo = _mm_and_si128(q, mask);
  hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
}

// The 5-bit codes of a Q5_0/Q5_1 block as 32 bytes in element order: element i's low 4 bits are
// the nibbles of qs (as load_nibbles), its bit 4 is bit i of the 32-bit qh.
inline __m256i q5_codes(const uint8_t* qs, uint32_t qh) {
  __m128i lo, hi;
  load_nibbles(qs, lo, hi);
  // byte i of the vector <- byte i / 8 of qh, then tested against bit i % 8
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(qh)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ull));
  const __m256i high = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
  return _mm256_or_si256(_mm256_set_m128i(hi, lo), high);
}

// Bytes 8p .. 8p + 7 of v (elements 8p .. 8p + 7 of a chunk's codes) in the low 8 bytes, as
// widen_u8 / widen_i8 read them.
inline __m128i part8(__m256i v, int p) {
  const __m128i half = p < 2 ? _mm256_castsi256_si128(v) : _mm256_extracti128_si256(v, 1);
  return (p & 1) ? _mm_srli_si128(half, 8) : half;
}
#endif

// The AVX-512 unit (quant_gemm_avx512.cpp, compiled for it by a target pragma, which defines no
// feature macros) sets ORCA_QUANT_DEQUANT_512: its chunks are widened 16 elements at a time.
#if defined(ORCA_QUANT_DEQUANT_512)
inline __m512 widen16_u8(__m128i bytes) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)); }
inline __m512 widen16_i8(__m128i bytes) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)); }
#endif

// Q8_0 block (34 bytes): fp16 d, int8 q[32]; w = q * d.
inline void dequant_q8_0(const uint8_t* __restrict blk, float* __restrict out) {  // out [32]
  const float d = half_to_float(blk);
#if defined(ORCA_QUANT_DEQUANT_512)
  for (int i = 0; i < 32; i += 16) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 + i));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(widen16_i8(q), _mm512_set1_ps(d)));
  }
#elif defined(__AVX2__)
  const __m256 dv = _mm256_set1_ps(d);
  for (int i = 0; i < 32; i += 8) {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + i));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(widen_i8(q), dv));
  }
#else
  const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
  for (int i = 0; i < 32; ++i) out[i] = static_cast<float>(q[i]) * d;
#endif
}

// Q4_0 block (18 bytes): fp16 d, qs[16]; element i < 16 is the low nibble of qs[i], element
// 16 + i its high nibble; w = d * (nib - 8).
inline void dequant_q4_0(const uint8_t* __restrict blk, float* __restrict out) {  // out [32]
  const float d = half_to_float(blk);
  const uint8_t* qs = blk + 2;
#if defined(ORCA_QUANT_DEQUANT_512)
  __m128i lo, hi;
  load_nibbles(qs, lo, hi);
  const __m512 dv = _mm512_set1_ps(d), eight = _mm512_set1_ps(8.0f);
  _mm512_storeu_ps(out, _mm512_mul_ps(dv, _mm512_sub_ps(widen16_u8(lo), eight)));
  _mm512_storeu_ps(out + 16, _mm512_mul_ps(dv, _mm512_sub_ps(widen16_u8(hi), eight)));
#elif defined(__AVX2__)
  __m128i lo, hi;
  load_nibbles(qs, lo, hi);
  const __m256 dv = _mm256_set1_ps(d), eight = _mm256_set1_ps(8.0f);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int p = 0; p < 4; ++p)  // nib - 8 is exact in float32
    _mm256_storeu_ps(out + 8 * p, _mm256_mul_ps(dv, _mm256_sub_ps(widen_u8(parts[p]), eight)));
#else
  for (int i = 0; i < 16; ++i) out[i] = d * static_cast<float>((qs[i] & 0x0f) - 8);
  for (int i = 0; i < 16; ++i) out[i + 16] = d * static_cast<float>((qs[i] >> 4) - 8);
#endif
}

// Q4_1 block (20 bytes): fp16 d, fp16 m, qs[16] (nibbles as Q4_0); w = d * nib + m.
inline void dequant_q4_1(const uint8_t* __restrict blk, float* __restrict out) {  // out [32]
  const float d = half_to_float(blk), m = half_to_float(blk + 2);
  const uint8_t* qs = blk + 4;
#if defined(ORCA_QUANT_DEQUANT_512)
  __m128i lo, hi;
  load_nibbles(qs, lo, hi);
  const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_mul_ps(dv, widen16_u8(lo)), mv));
  _mm512_storeu_ps(out + 16, _mm512_add_ps(_mm512_mul_ps(dv, widen16_u8(hi)), mv));
#elif defined(__AVX2__)
  __m128i lo, hi;
  load_nibbles(qs, lo, hi);
  const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int p = 0; p < 4; ++p)  // a product, then a sum: two roundings, no FMA
    _mm256_storeu_ps(out + 8 * p, _mm256_add_ps(_mm256_mul_ps(dv, widen_u8(parts[p])), mv));
#else
  for (int i = 0; i < 16; ++i) out[i] = d * static_cast<float>(qs[i] & 0x0f) + m;
  for (int i = 0; i < 16; ++i) out[i + 16] = d * static_cast<float>(qs[i] >> 4) + m;
#endif
}

// Q5_0 block (22 bytes): fp16 d, uint32 qh, qs[16]; element i's code is the nibble of Q4_0's
// layout with bit i of qh as bit 4; w = d * (code - 16).
inline void dequant_q5_0(const uint8_t* __restrict blk, float* __restrict out) {  // out [32]
  const float d = half_to_float(blk);
  uint32_t qh;
  std::memcpy(&qh, blk + 2, sizeof qh);
  const uint8_t* qs = blk + 6;
#if defined(__AVX2__)
  const __m256i q = _mm256_sub_epi8(q5_codes(qs, qh), _mm256_set1_epi8(16));  // code - 16, exact
  const __m256 dv = _mm256_set1_ps(d);
  for (int p = 0; p < 4; ++p) _mm256_storeu_ps(out + 8 * p, _mm256_mul_ps(dv, widen_i8(part8(q, p))));
#else
  for (int i = 0; i < 16; ++i) {  // the codes as int: code - 16 is negative below 16
    out[i] = d * static_cast<float>(static_cast<int>((qs[i] & 0x0fu) | (((qh >> i) & 1u) << 4)) - 16);
    out[i + 16] = d * static_cast<float>(static_cast<int>((qs[i] >> 4) | (((qh >> (i + 16)) & 1u) << 4)) - 16);
  }
#endif
}

// Q5_1 block (24 bytes): fp16 d, fp16 m, uint32 qh, qs[16] (codes as Q5_0); w = d * code + m.
inline void dequant_q5_1(const uint8_t* __restrict blk, float* __restrict out) {  // out [32]
  const float d = half_to_float(blk), m = half_to_float(blk + 2);
  uint32_t qh;
  std::memcpy(&qh, blk + 4, sizeof qh);
  const uint8_t* qs = blk + 8;
#if defined(__AVX2__)
  const __m256i q = q5_codes(qs, qh);
  const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
  for (int p = 0; p < 4; ++p)  // a product, then a sum: two roundings, no FMA
    _mm256_storeu_ps(out + 8 * p, _mm256_add_ps(_mm256_mul_ps(dv, widen_u8(part8(q, p))), mv));
#else
  for (int i = 0; i < 16; ++i) {
    out[i] = d * static_cast<float>((qs[i] & 0x0f) | (((qh >> i) & 1u) << 4)) + m;
    out[i + 16] = d * static_cast<float>((qs[i] >> 4) | (((qh >> (i + 16)) & 1u) << 4)) + m;
  }
#endif
}

// Q4_K block (144 bytes): fp16 d, fp16 dmin, scales[12], qs[128]. Sub-block s < 8 (elements
// 32s .. 32s+31) has a 6-bit scale sc and min mn packed in scales[] (ggml's get_scale_min_k4) and
// reads the low (s even) or high (s odd) nibbles of qs[32 * (s / 2) ..]; w = (d*sc) * nib - dmin*mn.
inline void q4_k_scale_min(const uint8_t* __restrict s, int sub, int& sc, int& mn) {
  if (sub < 4) {
    sc = s[sub] & 63;
    mn = s[sub + 4] & 63;
  } else {
    sc = (s[sub + 4] & 0x0f) | ((s[sub - 4] >> 6) << 4);
    mn = (s[sub + 4] >> 4) | ((s[sub] >> 6) << 4);
  }
}

#if defined(__AVX2__)
// Q4_K's 12 packed bytes -> sc (bytes 0..7) and mn (bytes 8..15), 6 bits each (ggml's
// get_scale_min_k4, four sub-blocks per 32-bit word), for two super-blocks at once, one per
// 128-bit lane: a one-token row decodes 4 rows' scales per super-block, and in scalar code that
// was about a third of its instructions. Reads 16 bytes from each `packed` (inside the block).
inline void q4k_scales_mins2(const uint8_t* packed0, const uint8_t* packed1, __m128i* out0, __m128i* out1) {
  const __m256i v = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(packed0))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed1)), 1);
  // per lane, from the dwords u0 u1 u2: lo = (sc_lo, mins_lo) = the low 6 bits of u0, u1;
  // hi = (sc_hi, mins_hi) = the low (high) nibbles of u2 under the top 2 bits of u0 (u1)
  const __m256i lo = _mm256_and_si256(v, _mm256_set1_epi32(0x3f3f3f3f));
  const __m256i u2 = _mm256_srlv_epi32(_mm256_shuffle_epi32(v, 0xaa), _mm256_setr_epi32(0, 4, 0, 0, 0, 4, 0, 0));
  const __m256i top2 = _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(v, 6), _mm256_set1_epi32(0x03030303)), 4);
  const __m256i hi = _mm256_or_si256(_mm256_and_si256(u2, _mm256_set1_epi32(0x0f0f0f0f)), top2);
  const __m256i scmn = _mm256_unpacklo_epi32(lo, hi);  // per lane: sc_lo, sc_hi, mins_lo, mins_hi
  *out0 = _mm256_castsi256_si128(scmn);
  *out1 = _mm256_extracti128_si256(scmn, 1);
}

// The same for one super-block.
inline __m128i q4k_scales_mins(const uint8_t* packed) {
  __m128i scmn, unused;
  q4k_scales_mins2(packed, packed, &scmn, &unused);
  return scmn;
}
#endif

// Sub-block `sub` of a Q4_K or Q5_K block (F), its scale and min already decoded and widened:
// dl = d * sc, ml = dmin * mn. Q5_K (176 bytes) is Q4_K's d, dmin and scales[12], then qh[32],
// then Q4_K's qs[128]: element l's code is Q4_K's nibble with bit `sub` of qh[l] as bit 4.
template <int F>
inline void dequant_k_sub(const uint8_t* __restrict blk, float dl, float ml, int sub,
                          float* __restrict out) {  // out [32]
  constexpr bool kFive = F == kQuantTypeQ5_K;
  const uint8_t* qh = blk + 16;
  const uint8_t* qs = blk + (kFive ? 48 : 16) + 32 * (sub / 2);
  const int shift = (sub & 1) * 4;
#if defined(__AVX2__)
  const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
  __m256i code = _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(0x0f));
  if constexpr (kFive) {
    // bit `sub` of each qh byte to bit 0 (16-bit shifts by at most 7 keep each byte's bit in
    // place), then to bit 4
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
    const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(sub)), _mm256_set1_epi8(1));
    code = _mm256_or_si256(code, _mm256_slli_epi16(bit, 4));
  }
  // 256-bit on the avx512 path too: the 512-bit form measured 1.35x slower at T = 1
  // (bench_quant_gemm, one thread, 576x576 and 2048x2048).
  const __m256 dv = _mm256_set1_ps(dl), mv = _mm256_set1_ps(ml);
  for (int p = 0; p < 4; ++p)  // a product, then a difference: two roundings, no FMA
    _mm256_storeu_ps(out + 8 * p, _mm256_sub_ps(_mm256_mul_ps(dv, widen_u8(part8(code, p))), mv));
#else
  for (int i = 0; i < 32; ++i) {
    const int code = ((qs[i] >> shift) & 0x0f) | (kFive ? ((qh[i] >> sub) & 1) << 4 : 0);
    out[i] = dl * static_cast<float>(code) - ml;
  }
#endif
}

// Every sub-block's a = d * sc and b = dmin * mn of a Q4_K block (gguf's products: sc and mn
// widened exactly, each product rounded once).
inline void q4_k_sub_scales(const uint8_t* __restrict blk, float* __restrict a, float* __restrict b) {  // a, b [8]
  const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
#if defined(__AVX2__)
  // 8 lanes at a time: per sub-block the scalar form is an extract, a conversion and a product
  // for each of a and b, which was about half of a one-token row's instructions.
  const __m128i sc_mn = q4k_scales_mins(blk + 4);
  _mm256_storeu_ps(a, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc_mn))));
  _mm256_storeu_ps(b, _mm256_mul_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sc_mn, 8)))));
#else
  for (int sub = 0; sub < 8; ++sub) {
    int sc, mn;
    q4_k_scale_min(blk + 4, sub, sc, mn);
    a[sub] = d * static_cast<float>(sc), b[sub] = dmin * static_cast<float>(mn);
  }
#endif
}

// A whole Q4_K or Q5_K block: d, dmin and the packed scales (at the same offsets in both)
// decoded once for the 8 sub-blocks.
template <int F>
inline void dequant_k_block(const uint8_t* __restrict blk, float* __restrict out) {  // out [256]
  float a[8], b[8];
  q4_k_sub_scales(blk, a, b);
  for (int sub = 0; sub < 8; ++sub) dequant_k_sub<F>(blk, a[sub], b[sub], sub, out + 32 * sub);
}

// ---- 4-bit chunks widened straight into registers (the AVX-512 panels) ----
// The panels for one token spend most of their instructions widening weights, not multiplying.
// A 32-element chunk of Q4_0, Q4_1 or Q4_K holds 4-bit codes whose 16 possible weights share one
// pair of scales (a, b): those 16 weights are computed once, and vpermps picks every element's
// weight by its code. It reads only the low 4 bits of an index lane, so high nibbles take one
// shift and no mask. The 16 weights are the dequant_* ones bit for bit: a * code is exact in
// float32 (a is an fp16 scale, or one times a 6-bit integer: at most 17 significant bits; the
// code has 4), so the product above does not round and the one FMA a * code + b rounds where
// its sum does.
// (Q8_0 widened the same way without the buffer measured level with the buffered form, so it
// keeps that.)
template <int F>
constexpr bool kRegisterFormat = F == kQuantTypeQ4_0 || F == kQuantTypeQ4_1 || F == kQuantTypeQ4_K;

// Q4_K's (d * sc, dmin * mn) of each sub-block of one super-block, decoded once for its 8 chunks.
// The 32-element formats read their scales from the block as each chunk widens.
struct ChunkScales {
  float a[8], b[8];
};

template <int F>
inline void chunk_scales(const uint8_t* __restrict row, int64_t unit, ChunkScales& s) {
  static_assert(kRegisterFormat<F>, "a 4-bit format");
  if constexpr (F == kQuantTypeQ4_K) {
    q4_k_sub_scales(row + unit * 144, s.a, s.b);
  } else {
    (void)row, (void)unit, (void)s;
  }
}

#if defined(ORCA_QUANT_DEQUANT_512)
// Chunk c of unit `unit` (Q4_K: scales s from chunk_scales): elements 0..15 into lo, 16..31 into hi.
template <int F>
inline void widen_chunk(const uint8_t* __restrict row, int64_t unit, int c, const ChunkScales& s, __m512& lo,
                        __m512& hi) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 table;
  __m512i lo_codes, hi_codes;
  if constexpr (F == kQuantTypeQ4_K) {  // 32 bytes, the low (c even) or high nibble of each
    table = _mm512_fmsub_ps(_mm512_set1_ps(s.a[c]), iota, _mm512_set1_ps(s.b[c]));
    const uint8_t* qs = row + unit * 144 + 16 + 32 * (c / 2);
    lo_codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    hi_codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16)));
    if (c & 1) lo_codes = _mm512_srli_epi32(lo_codes, 4), hi_codes = _mm512_srli_epi32(hi_codes, 4);
  } else {  // 16 bytes: elements 0..15 in the low nibbles, 16..31 in the high ones
    const uint8_t* qs;
    if constexpr (F == kQuantTypeQ4_0) {
      uint16_t d;
      std::memcpy(&d, row + unit * 18, sizeof d);
      const __m512 dv = _mm512_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(d)));  // exact
      table = _mm512_mul_ps(dv, _mm512_sub_ps(iota, _mm512_set1_ps(8.0f)));
      qs = row + unit * 18 + 2;
    } else {  // d and m, adjacent fp16, widened together
      int32_t dm;
      std::memcpy(&dm, row + unit * 20, sizeof dm);
      const __m512 both = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(dm)));  // [d, m, 0, 0]
      table = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_setzero_si512(), both), iota,
                              _mm512_permutexvar_ps(_mm512_set1_epi32(1), both));
      qs = row + unit * 20 + 4;
    }
    lo_codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    hi_codes = _mm512_srli_epi32(lo_codes, 4);
  }
  lo = _mm512_permutexvar_ps(lo_codes, table);
  hi = _mm512_permutexvar_ps(hi_codes, table);
}
#endif

// Q6_K block (210 bytes): ql[128], qh[64], int8 scales[16], fp16 d. Chunk c < 8 (elements
// 32c .. 32c+31) lies in half h = c / 4, quarter r = c % 4: element i takes the low (r < 2) or high
// nibble of ql[64h + 32(r % 2) + i] and bits 2r, 2r+1 of qh[32h + i] as bits 4, 5; q = that - 32;
// w = (d * scales[8h + 2r + i / 16]) * q.
inline void dequant_q6_k_chunk(const uint8_t* __restrict blk, float d, int chunk,
                               float* __restrict out) {  // out [32]; d: the block's, widened
  const int h = chunk / 4, r = chunk % 4;
  const uint8_t* ql = blk + 64 * h + 32 * (r % 2);
  const uint8_t* qh = blk + 128 + 32 * h;
  const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192) + 8 * h + 2 * r;
  const float d0 = d * static_cast<float>(sc[0]), d1 = d * static_cast<float>(sc[1]);
  const int lshift = (r / 2) * 4, hshift = 2 * r;
#if defined(__AVX2__)
  const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
  const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
  const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(l, _mm_cvtsi32_si128(lshift)), _mm256_set1_epi8(0x0f));
  const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(hshift)), _mm256_set1_epi8(3));
  const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
#if defined(ORCA_QUANT_DEQUANT_512)
  _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_set1_ps(d0), widen16_i8(_mm256_castsi256_si128(q))));
  _mm512_storeu_ps(out + 16, _mm512_mul_ps(_mm512_set1_ps(d1), widen16_i8(_mm256_extracti128_si256(q, 1))));
#else
  for (int p = 0; p < 4; ++p)  // elements 8p .. 8p+7; the first 16 take d0, the rest d1
    _mm256_storeu_ps(out + 8 * p, _mm256_mul_ps(_mm256_set1_ps(p < 2 ? d0 : d1), widen_i8(part8(q, p))));
#endif
#else
  for (int i = 0; i < 32; ++i) {
    const int q = (((ql[i] >> lshift) & 0x0f) | (((qh[i] >> hshift) & 3) << 4)) - 32;
    out[i] = (i < 16 ? d0 : d1) * static_cast<float>(q);
  }
#endif
}

inline void dequant_q6_k(const uint8_t* __restrict blk, int chunk, float* __restrict out) {  // out [32]
  dequant_q6_k_chunk(blk, half_to_float(blk + 208), chunk, out);
}

// Chunk `chunk` (elements 32*chunk .. 32*chunk+31) of a row in format F (Q4_K and Q5_K go by
// whole super-blocks: dequant_k_block).
template <int F>
inline void dequant_chunk(const uint8_t* __restrict row, int64_t chunk, float* __restrict out) {  // out [32]
  constexpr int kQ4_0 = kQuantTypeQ4_0, kQ4_1 = kQuantTypeQ4_1, kQ8_0 = kQuantTypeQ8_0, kQ6_K = kQuantTypeQ6_K;
  if constexpr (F == kQ8_0) {
    dequant_q8_0(row + chunk * 34, out);
  } else if constexpr (F == kQ4_0) {
    dequant_q4_0(row + chunk * 18, out);
  } else if constexpr (F == kQ4_1) {
    dequant_q4_1(row + chunk * 20, out);
  } else if constexpr (F == kQuantTypeQ5_0) {
    dequant_q5_0(row + chunk * 22, out);
  } else if constexpr (F == kQuantTypeQ5_1) {
    dequant_q5_1(row + chunk * 24, out);
  } else {
    static_assert(F == kQ6_K, "unknown format");
    dequant_q6_k(row + (chunk / 8) * 210, static_cast<int>(chunk % 8), out);
  }
}

// Elements a panel kernel dequantizes at a time in format F: 32, or a whole Q4_K (Q5_K)
// super-block, so that its d, dmin and packed scales are decoded once (measured 1.3-1.5x faster
// at T = 16 on a Zen 4; for Q6_K, whose chunks only share d, the 256-float buffer measured slower).
template <int F>
constexpr int kDequantUnit = F == kQuantTypeQ4_K || F == kQuantTypeQ5_K ? 256 : 32;

// Unit `u` (elements kDequantUnit<F> * u ..) of a row in format F.
template <int F>
inline void dequant_unit(const uint8_t* __restrict row, int64_t u, float* __restrict out) {  // out [kDequantUnit<F>]
  if constexpr (F == kQuantTypeQ4_K) {
    dequant_k_block<F>(row + u * 144, out);
  } else if constexpr (F == kQuantTypeQ5_K) {
    dequant_k_block<F>(row + u * 176, out);
  } else {
    dequant_chunk<F>(row, u, out);
  }
}

// Calls f(std::integral_constant<int, F>{}) for the runtime type id (one of kQuantFormats).
template <typename Fn>
inline void dispatch_quant_format(int type, Fn&& f) {
  switch (type) {
    case kQuantTypeQ8_0: f(std::integral_constant<int, kQuantTypeQ8_0>{}); break;
    case kQuantTypeQ4_0: f(std::integral_constant<int, kQuantTypeQ4_0>{}); break;
    case kQuantTypeQ4_1: f(std::integral_constant<int, kQuantTypeQ4_1>{}); break;
    case kQuantTypeQ5_0: f(std::integral_constant<int, kQuantTypeQ5_0>{}); break;
    case kQuantTypeQ5_1: f(std::integral_constant<int, kQuantTypeQ5_1>{}); break;
    case kQuantTypeQ4_K: f(std::integral_constant<int, kQuantTypeQ4_K>{}); break;
    case kQuantTypeQ5_K: f(std::integral_constant<int, kQuantTypeQ5_K>{}); break;
    case kQuantTypeQ6_K: f(std::integral_constant<int, kQuantTypeQ6_K>{}); break;
    default: break;
  }
}

}  // namespace
}  // namespace detail
}  // namespace cpu
}  // namespace orca
