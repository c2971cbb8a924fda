// The token-interleaved copy of the int8 activations that the prefill tiles of Q4_K, Q5_K, Q6_K
// and Q8_0 (Q4_0 and Q5_0 through its tiles) read (quant_int8_act_k.h, quant_int8_act.h), and the vector ops those tiles share at two
// widths. Tokens come in groups of 8 (the last padded with zero rows); per group and 8-element
// chunk c, the 8 tokens' chunks lie side by side, so that one 64-byte load (or 32 for 4 of the
// tokens) meets one 8-byte broadcast of weights and yields two int32 lanes per token.
//
// Like quant_blocks.h, everything is local to the including unit (compiled for its target).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "quant_kernels.h"  // the ggml type ids
#include "quant_panels.h"   // Int8Rows

namespace orca {
namespace cpu {
namespace detail {
namespace {

constexpr int kGroupTokens = 8;

struct Int8Groups {
  int64_t n_groups;
  int64_t block;     // elements per activation scale: 256 (Q4_K, Q5_K, Q6_K) or 32 (Q8_0, Q4_0, Q5_0)
  int8_t* q;         // [n_groups, K / 8, 8, 8]; when biased, q + 128 (read as uint8)
  float* d;          // [n_groups, K / block, 16]: token s's scale in lanes 2s and 2s + 1
  int16_t* bsums;    // Q4_K: [n_groups, K / 256, 2, 4, 8], the sums of each 32 quants of tokens
                     // (0, 2, 4, 6) then (1, 3, 5, 7); else nullptr
  int16_t* bsums16;  // Q6_K: [n_groups, K / 256, 4, 8, 4]: for c8 = 0..3 and each token, the sums
                     // of the 16 quants 4 c8 .. 4 c8 + 3; else nullptr
  bool biased;       // Q8_0 (Q4_0, Q4_1, Q5_0, Q5_1) with vpdpbusd: q holds x + 128, the unsigned operand
  float* s = nullptr;  // Q4_1, Q5_1: [n_groups, K / 32, 16]: token s's d * sum(q) in lanes 2s and
                       // 2s + 1 (as d); else nullptr
};

// The 32-element formats with a minimum (w = d * code + m), whose tiles also read s.
template <int F>
constexpr bool kMinFormat = F == kQuantTypeQ4_1 || F == kQuantTypeQ5_1;
inline bool min_format(int type) { return type == kQuantTypeQ4_1 || type == kQuantTypeQ5_1; }
// The formats whose tiles read Q4_K's bsums (Q5_K is Q4_K with a fifth bit).
inline bool q4k_sums_format(int type) { return type == kQuantTypeQ4_K || type == kQuantTypeQ5_K; }

// Elements per activation scale of type's groups: its block (32, or a 256-element super-block).
inline int64_t int8_group_block(int type) { return quant_format(type)->block_elems; }

inline int64_t int8_groups_bytes(int64_t n_tokens, int64_t k, int type) {  // 64-byte aligned parts
  const int64_t g = (n_tokens + kGroupTokens - 1) / kGroupTokens, n_blocks = k / int8_group_block(type);
  const int64_t sums = q4k_sums_format(type)      ? g * n_blocks * 64 * 2
                       : type == kQuantTypeQ6_K    ? g * n_blocks * 128 * 2
                       : min_format(type)          ? g * n_blocks * 16 * 4
                                                   : 0;
  return g * kGroupTokens * k + g * n_blocks * 16 * 4 + sums + 3 * 64;
}

inline Int8Groups int8_groups_at(int8_t* base, int64_t n_tokens, int64_t k, int type, bool biased) {
  auto align = [](int8_t* p) {
    return reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
  };
  const int64_t block = int8_group_block(type);
  const int64_t g = (n_tokens + kGroupTokens - 1) / kGroupTokens, n_blocks = k / block;
  Int8Groups a;
  a.n_groups = g;
  a.block = block;
  a.q = align(base);
  a.d = reinterpret_cast<float*>(align(a.q + g * kGroupTokens * k));
  int16_t* sums = reinterpret_cast<int16_t*>(align(reinterpret_cast<int8_t*>(a.d + g * n_blocks * 16)));
  a.bsums = q4k_sums_format(type) ? sums : nullptr;
  a.bsums16 = type == kQuantTypeQ6_K ? sums : nullptr;
  a.s = min_format(type) ? reinterpret_cast<float*>(sums) : nullptr;
  a.biased = biased;
  return a;
}

// Where a tile's token slot starts in the grouped copy: the `tokens` tokens from token
// slot * tokens lie in group `group`, from its token `in` on (tiles of 4 tokens take half a group).
struct GroupSlot {
  int64_t group, in;
  GroupSlot(int64_t slot, int tokens) : group(slot * tokens / kGroupTokens), in(slot * tokens % kGroupTokens) {}
  const int8_t* q(const Int8Groups& a, int64_t k) const { return a.q + group * kGroupTokens * k + in * 8; }
  const float* d(const Int8Groups& a, int64_t n_blocks) const { return a.d + group * n_blocks * 16 + 2 * in; }
  const float* s(const Int8Groups& a, int64_t n_blocks) const { return a.s + group * n_blocks * 16 + 2 * in; }
  // Q4_K's bsums (per_group = K / 256 * 64) or Q6_K's bsums16 (K / 256 * 128)
  const int16_t* sums(const int16_t* base, int64_t per_group) const { return base + group * per_group + 4 * in; }
};

// f(out[t * n_out + n], lanes 2s and 2s + 1 of v) for each token t = slot * V::kTokens + s of a
// tile's slot below n_tokens: the lanes of v that hold token s.
template <class V, class Fn>
inline void each_slot_token(typename V::F v, int64_t slot, int64_t n_tokens, int64_t n_out, int64_t n, float* out,
                            Fn&& f) {
  alignas(64) float l[2 * V::kTokens];
  V::store_f(l, v);
  for (int s = 0; s < V::kTokens; ++s) {
    const int64_t t = slot * V::kTokens + s;
    if (t < n_tokens) f(out[t * n_out + n], l + 2 * s);
  }
}

// The end of a grouped tile: output row n0 + r of the V::kTokens tokens of slot slot0 + g sums
// its four accumulators acc[r][g][0..3] in hsum8_tree's order (lanes (l0 + l4) + (l2 + l6),
// (l1 + l5) + (l3 + l7), then their sum; token s holds lanes 2s and 2s + 1) and stores the tokens
// below n_tokens into out [n_tokens, n_out].
template <class V, int R, int G>
inline void store_group_tile(const typename V::F (&acc)[R][G][4], int64_t n_tokens, int64_t n_out, int64_t n0,
                             int64_t slot0, float* out) {
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g)
      each_slot_token<V>(V::add_f(V::add_f(acc[r][g][0], acc[r][g][2]), V::add_f(acc[r][g][1], acc[r][g][3])),
                         slot0 + g, n_tokens, n_out, n0 + r, out, [](float& o, const float* l) { o = l[0] + l[1]; });
}

// Group `grp` of dst from the int8 rows of src (src.block == dst.block; tokens past n_tokens
// are zero: their quants, scales and sums).
inline void fill_int8_group(const Int8Rows& src, int64_t n_tokens, int64_t k, int64_t grp, const Int8Groups& dst) {
  const int64_t n_blocks = k / dst.block;
  const uint64_t flip = dst.biased ? 0x8080808080808080ull : 0;  // q + 128 = q ^ 0x80 for |q| <= 127
  int8_t* q = dst.q + grp * kGroupTokens * k;
  float* d = dst.d + grp * n_blocks * 16;
  for (int s = 0; s < kGroupTokens; ++s) {
    const int64_t t = grp * kGroupTokens + s;
    const bool real = t < n_tokens;
    for (int64_t c = 0; c < k / 8; ++c) {
      uint64_t v = 0;
      if (real) std::memcpy(&v, src.q + t * k + 8 * c, 8);
      v ^= flip;
      std::memcpy(q + (c * kGroupTokens + s) * 8, &v, 8);
    }
    for (int64_t b = 0; b < n_blocks; ++b) {
      const float xd = real ? src.d[t * n_blocks + b] : 0.0f;
      d[b * 16 + 2 * s] = xd;
      d[b * 16 + 2 * s + 1] = xd;
    }
    if (dst.s != nullptr) {
      float* xs = dst.s + grp * n_blocks * 16;
      for (int64_t b = 0; b < n_blocks; ++b) xs[b * 16 + 2 * s] = xs[b * 16 + 2 * s + 1] = real ? src.s[t * n_blocks + b] : 0.0f;
    }
    const int16_t* sums16 = src.bsums + t * (k / 16);  // read only for real tokens
    if (dst.bsums != nullptr) {
      int16_t* bs = dst.bsums + grp * n_blocks * 64;
      for (int64_t b = 0; b < n_blocks; ++b) {
        int16_t* out = bs + b * 64 + (s & 1) * 32 + (s >> 1) * 8;
        for (int j = 0; j < 8; ++j)
          out[j] = real ? static_cast<int16_t>(sums16[16 * b + 2 * j] + sums16[16 * b + 2 * j + 1]) : int16_t{0};
      }
    }
    if (dst.bsums16 != nullptr) {
      int16_t* bs = dst.bsums16 + grp * n_blocks * 128;
      for (int64_t b = 0; b < n_blocks; ++b)
        for (int c8 = 0; c8 < 4; ++c8)
          for (int i = 0; i < 4; ++i) bs[b * 128 + c8 * 32 + s * 4 + i] = real ? sums16[16 * b + 4 * c8 + i] : int16_t{0};
    }
  }
}

// The vector ops of the group tiles at two widths: 4 tokens (ymm: half a group) and 8 (zmm).
// Lane l of either holds the same sums for the same token (token l / 2 of the tokens covered),
// so the two widths give the same bits.
// kDpbusd: vpdpbusd exists (Q8_0's tile then reads biased groups, Int8Groups::biased).
template <bool kVnni>
struct GroupOps256 {
  static constexpr int kTokens = 4;
#if defined(ORCA_QUANT_INT8_512)
  static constexpr bool kDpbusd = kVnni;
  static constexpr bool kPacked = kVnni;
  static __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
  static __m256i pack_halves(__m256i lo, __m256i hi) {  // int16 lanes: the low half of lo's dwords, then hi's high
    return _mm256_mask_blend_epi16(0xAAAA, lo, hi);
  }
  static __m256i slli12(__m256i a) { return _mm256_slli_epi32(a, 12); }
  static __m256i slli16(__m256i a) { return _mm256_slli_epi32(a, 16); }
  static __m256i slli5(__m256i a) { return _mm256_slli_epi32(a, 5); }
  static __m256i high4() { return _mm256_set1_epi8(static_cast<char>(0xf0)); }
#else
  static constexpr bool kDpbusd = false;
  static constexpr bool kPacked = false;
#endif
  using I = __m256i;
  using F = __m256;
  static I zero() { return _mm256_setzero_si256(); }
  static F zero_f() { return _mm256_setzero_ps(); }
  static I load(const void* p) { return _mm256_load_si256(static_cast<const __m256i*>(p)); }
  static F load_f(const float* p) { return _mm256_load_ps(p); }
  static I bcast64(const uint8_t* p) {
    int64_t v;
    std::memcpy(&v, p, 8);
    return _mm256_set1_epi64x(v);
  }
  static I bcast32(int32_t v) { return _mm256_set1_epi32(v); }
  static I bcast128(__m128i v) { return _mm256_broadcastsi128_si256(v); }
  static F bcast_f(float v) { return _mm256_set1_ps(v); }
  static I low4() { return _mm256_set1_epi8(0x0f); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I sub32(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I bcast8(int8_t v) { return _mm256_set1_epi8(v); }
  static I bcast16(int16_t v) { return _mm256_set1_epi16(v); }
  static I abs8(I a) { return _mm256_abs_epi8(a); }
  static I sign8(I a, I b) { return _mm256_sign_epi8(a, b); }
  static F add_f(F a, F b) { return _mm256_add_ps(a, b); }
  static I srli4(I a) { return _mm256_srli_epi16(a, 4); }
  static I maddubs(I u, I s) { return _mm256_maddubs_epi16(u, s); }
  static I add16(I a, I b) { return _mm256_add_epi16(a, b); }
  static I madd(I a, I b) { return _mm256_madd_epi16(a, b); }
  static I hadd32(I a, I b) { return _mm256_hadd_epi32(a, b); }
  static I madd_acc(I acc, I pairs, I scale16) {
    if constexpr (kVnni) {
      return _mm256_dpwssd_epi32(acc, pairs, scale16);
    } else {
      return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, scale16));
    }
  }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static void store_f(float* p, F v) { _mm256_store_ps(p, v); }
};

#if defined(ORCA_QUANT_INT8_512)
struct GroupOps512 {
  static constexpr int kTokens = 8;
  static constexpr bool kDpbusd = true;
  static constexpr bool kPacked = true;
  static __m512i dpbusd(__m512i acc, __m512i u, __m512i s) { return _mm512_dpbusd_epi32(acc, u, s); }
  static __m512i pack_halves(__m512i lo, __m512i hi) { return _mm512_mask_blend_epi16(0xAAAAAAAA, lo, hi); }
  static __m512i slli12(__m512i a) { return _mm512_slli_epi32(a, 12); }
  static __m512i slli16(__m512i a) { return _mm512_slli_epi32(a, 16); }
  static __m512i slli5(__m512i a) { return _mm512_slli_epi32(a, 5); }
  static __m512i high4() { return _mm512_set1_epi8(static_cast<char>(0xf0)); }
  using I = __m512i;
  using F = __m512;
  static I zero() { return _mm512_setzero_si512(); }
  static F zero_f() { return _mm512_setzero_ps(); }
  static I load(const void* p) { return _mm512_load_si512(p); }
  static F load_f(const float* p) { return _mm512_load_ps(p); }
  static I bcast64(const uint8_t* p) {
    int64_t v;
    std::memcpy(&v, p, 8);
    return _mm512_set1_epi64(v);
  }
  static I bcast32(int32_t v) { return _mm512_set1_epi32(v); }
  static I bcast128(__m128i v) { return _mm512_broadcast_i32x4(v); }
  static F bcast_f(float v) { return _mm512_set1_ps(v); }
  static I low4() { return _mm512_set1_epi8(0x0f); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I sub32(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I bcast8(int8_t v) { return _mm512_set1_epi8(v); }
  static F add_f(F a, F b) { return _mm512_add_ps(a, b); }
  static I srli4(I a) { return _mm512_srli_epi16(a, 4); }
  static I maddubs(I u, I s) { return _mm512_maddubs_epi16(u, s); }
  static I add16(I a, I b) { return _mm512_add_epi16(a, b); }
  static I madd(I a, I b) { return _mm512_madd_epi16(a, b); }
  static I hadd32(I a, I b) {  // [a0 + a1, a2 + a3, b0 + b1, b2 + b3] in each 128-bit lane, as vphaddd
    const I sa = _mm512_add_epi32(a, _mm512_shuffle_epi32(a, _MM_PERM_ENUM(0xb1)));  // [a0+a1, a0+a1, a2+a3, a2+a3]
    const I sb = _mm512_add_epi32(b, _mm512_shuffle_epi32(b, _MM_PERM_ENUM(0xb1)));
    return _mm512_castps_si512(_mm512_shuffle_ps(_mm512_castsi512_ps(sa), _mm512_castsi512_ps(sb), 0x88));
  }
  static I madd_acc(I acc, I pairs, I scale16) { return _mm512_dpwssd_epi32(acc, pairs, scale16); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static void store_f(float* p, F v) { _mm512_store_ps(p, v); }
};
#endif

}  // namespace
}  // namespace detail
}  // namespace cpu
}  // namespace orca
