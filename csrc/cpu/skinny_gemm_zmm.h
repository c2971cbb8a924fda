// The panel kernel of the 16-lane (zmm) paths, written once over a policy `Ops`:
//
//   using XT, WT;                     activation and weight element types
//   static constexpr int kStep;       k elements one dot() consumes (16 float32, 32 bf16 pairs)
//   X load_x(const XT*);  W load_w(const WT*);  W load_w_tail(const WT*, int rem);
//   __m512 dot(__m512 acc, X, W);
//
// An output's accumulator has 16 float32 lanes and consumes its k range in kStep steps from k = 0
// upwards (the K % kStep tail through a masked weight load against the activations' zero
// padding); the lanes are then summed as (l, l+8), (l, l+4), (l, l+2), (l, l+1) -- the hsum of
// skinny_gemm_blocks.h's 16-lane policies. The blocking never changes that sequence, so a token's
// outputs are the same whatever T is.
//
// Blocking: one panel is 8 weight rows. A block of MB tokens x R rows keeps MB x R accumulators, MB
// activation registers and one weight register in the 32 zmm registers, so each weight vector
// loaded feeds MB dot steps and each activation vector R (zmm_panel picks the shapes). The 8 accumulators of a
// token are reduced together by shuffles (reduce8): about one instruction per output, where a
// store and 15 scalar adds per output cost a third of the dot steps at K = 576 in float32 and more
// than all of them in bf16.
//
// Include this only after `#pragma GCC target(... avx512f ...)`, from a unit whose Ops live in an
// anonymous namespace (see skinny_gemm_blocks.h for why nothing here may leak to other units).
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "skinny_gemm_impl.h"

namespace orca {
namespace cpu {
namespace detail {
namespace {  // one copy per translation unit, compiled for that unit's instruction set

static_assert(kPanelRows == 8, "reduce8 sums 8 accumulators");

// The 8 sums of a[0..7] (each the 16-lane tree described above) into c[0..7].
inline void reduce8(const __m512* a, float* c) {
  // (l, l+8): 256-bit halves of two accumulators side by side -> [a.lo + a.hi | b.lo + b.hi]
  __m512 h[4];
  for (int i = 0; i < 4; ++i)
    h[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  // (l, l+4): 128-bit quarters [o0 | o1 | o2 | o3] and [o4 | o5 | o6 | o7] of 4 lanes each
  const __m512 q0 = _mm512_add_ps(_mm512_shuffle_f32x4(h[0], h[1], 0x88), _mm512_shuffle_f32x4(h[0], h[1], 0xDD));
  const __m512 q1 = _mm512_add_ps(_mm512_shuffle_f32x4(h[2], h[3], 0x88), _mm512_shuffle_f32x4(h[2], h[3], 0xDD));
  // (l, l+2): quarter j holds [t0, t1] of output j, then [t0, t1] of output j + 4
  const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(q0, q1, 0x44), _mm512_shuffle_ps(q0, q1, 0xEE));
  // (l, l+1): lane 4j is output j, lane 4j + 2 output j + 4
  const __m512 s = _mm512_add_ps(t, _mm512_permute_ps(t, 0xB1));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  _mm256_storeu_ps(c, _mm512_castps512_ps256(_mm512_permutexvar_ps(order, s)));
}

// c[m * 8 + j] = dot(x row m, w[j]) for m < MB, j < 8. x rows are 64-byte aligned and zero from K
// to the next multiple of kStep, so the tail step reads them unmasked.
template <class Ops, int MB, int R = kPanelRows>
inline void zmm_block(const typename Ops::XT* __restrict x, int64_t ldx, const typename Ops::WT* const* w, int64_t K,
                      float* __restrict c, int64_t ldc = kPanelRows) {
  __m512 acc[MB][R];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < R; ++j) acc[m][j] = _mm512_setzero_ps();
  const typename Ops::WT* wr[R];
#pragma GCC unroll 8
  for (int j = 0; j < R; ++j) wr[j] = w[j];
  const int64_t k_main = K - K % Ops::kStep;
  for (int64_t k = 0; k < k_main; k += Ops::kStep) {
    typename Ops::X xv[MB];
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) xv[m] = Ops::load_x(x + m * ldx + k);
#pragma GCC unroll 8
    for (int j = 0; j < R; ++j) {
      typename Ops::W wv = Ops::load_w(wr[j] + k);
      // One load per weight vector: GCC would otherwise fold it into each of the MB FMAs as a
      // memory operand, MB loads where one does (the loads, not the FMAs, then bound the loop).
      asm("" : "+v"(wv));
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) acc[m][j] = Ops::dot(acc[m][j], xv[m], wv);
    }
  }
  if (k_main < K) {
    const int rem = static_cast<int>(K - k_main);
    typename Ops::X xv[MB];
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) xv[m] = Ops::load_x(x + m * ldx + k_main);
#pragma GCC unroll 8
    for (int j = 0; j < R; ++j) {
      const typename Ops::W wv = Ops::load_w_tail(wr[j] + k_main, rem);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) acc[m][j] = Ops::dot(acc[m][j], xv[m], wv);
    }
  }
  if constexpr (R == 8) {
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) reduce8(acc[m], c + m * ldc);
  } else {
    static_assert(R == 4, "blocks cover 4 or 8 weight rows");
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m512 a8[8] = {acc[m][0], acc[m][1], acc[m][2], acc[m][3], acc[m][0], acc[m][1], acc[m][2], acc[m][3]};
      float s8[8];
      reduce8(a8, s8);
      for (int j = 0; j < 4; ++j) c[m * ldc + j] = s8[j];
    }
  }
}

// One panel (see PanelFn). While the panel's 8 weight rows fit L1 (32 KiB), or for a few tokens:
// blocks of 3 tokens x 8 rows (3 x 8 accumulators + 3 activations + 1 weight = 28 of 32 zmm),
// then a block of the 1 or 2 left. Longer rows: the panel in two halves of 4 rows, each run over
// blocks of 6 tokens (6 x 4 + 6 + 1 = 31 zmm), so the half's rows stay in L1 across all token
// blocks (one Zen 4 core, Llama-1B-sized float32 layer at T = 128: 58-61 -> 69-73 GFLOP/s).
// Every output still gets the same accumulator sequence and reduce8.
template <class Ops>
inline void zmm_panel(const typename Ops::XT* x, int64_t ldx, int64_t M, const typename Ops::WT* const* w, int64_t K,
                      float* c) {
  constexpr int R = kPanelRows;
  if (M < 6 || static_cast<int64_t>(sizeof(typename Ops::WT)) * K * R <= (int64_t{32} << 10)) {
    constexpr int kTokens = 3;
    int64_t m = 0;
    for (; m + kTokens <= M; m += kTokens) zmm_block<Ops, kTokens>(x + m * ldx, ldx, w, K, c + m * R);
    switch (M - m) {
      case 1: zmm_block<Ops, 1>(x + m * ldx, ldx, w, K, c + m * R); break;
      case 2: zmm_block<Ops, 2>(x + m * ldx, ldx, w, K, c + m * R); break;
      default: break;
    }
    return;
  }
  for (int h = 0; h < R; h += 4) {
    int64_t m = 0;
    for (; m + 6 <= M; m += 6) zmm_block<Ops, 6, 4>(x + m * ldx, ldx, w + h, K, c + m * R + h, R);
    for (; m + 3 <= M; m += 3) zmm_block<Ops, 3, 4>(x + m * ldx, ldx, w + h, K, c + m * R + h, R);
    switch (M - m) {
      case 1: zmm_block<Ops, 1, 4>(x + m * ldx, ldx, w + h, K, c + m * R + h, R); break;
      case 2: zmm_block<Ops, 2, 4>(x + m * ldx, ldx, w + h, K, c + m * R + h, R); break;
      default: break;
    }
  }
}

}  // namespace
}  // namespace detail
}  // namespace cpu
}  // namespace orca
