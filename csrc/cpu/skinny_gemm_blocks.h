// The register-blocked dot-product kernels behind skinny_gemm_impl.h's panel functions, written
// once over an instruction-set policy `Ops`:
//
//   using XT, Acc, X, W;               activation element type; accumulator, activation and weight
//                                      registers
//   static constexpr int kStep;        k elements one dot() consumes
//   static constexpr int kRows;        activation rows per block when there are many tokens
//   Acc zero();  X load_x(const XT*);  W load_w(const WT*);  W load_w_tail(const WT*, int rem);
//   Acc dot(Acc, X, W);  float hsum(Acc);
//
// Every output element gets one accumulator that consumes its k range in kStep steps from k = 0
// upwards, then one hsum. That sequence is the same whether the block holds 1, 2, 3 or 4
// activation rows and 4 or 8 weight rows, so the blocking (chosen from T) never changes a result.
//
// This header holds templates that depend on `Ops` and one function in an anonymous namespace,
// and each translation unit defines its Ops in an anonymous namespace: everything instantiated
// from here is local to that unit and compiled with its instruction set (the AVX-512 unit includes this after `#pragma GCC target`).
// Nothing compiled for AVX-512 can leak into code that runs on other CPUs through the linker.
#pragma once
#include <cstdint>

#include "skinny_gemm_impl.h"

namespace orca {
namespace cpu {
namespace detail {
namespace {  // one copy per translation unit, compiled for that unit's instruction set

// The final lane sums of every path: (l + l+4) for l < 4, then (0 + 2, 1 + 3), then 0 + 1.
inline float hsum8_tree(const float* l) {
  const float s0 = l[0] + l[4], s1 = l[1] + l[5], s2 = l[2] + l[6], s3 = l[3] + l[7];
  const float t0 = s0 + s2, t1 = s1 + s3;
  return t0 + t1;
}

}  // namespace

// c[m * ldc + j] = dot(x row m, w[j]) for m < MB, j < NB. The tail (K % kStep) reads activations
// from their zero padding and weights through load_w_tail, which never reads past row end.
template <class Ops, int MB, int NB, typename WT>
inline void dot_block(const typename Ops::XT* __restrict x, int64_t ldx, const WT* const* w, int64_t K,
                      float* __restrict c, int64_t ldc) {
  typename Ops::Acc acc[MB][NB];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) acc[m][j] = Ops::zero();
  const int64_t k_main = K - K % Ops::kStep;
  for (int64_t k = 0; k < k_main; k += Ops::kStep) {
    typename Ops::X xv[MB];
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) xv[m] = Ops::load_x(x + m * ldx + k);
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
      const typename Ops::W wv = Ops::load_w(w[j] + k);
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
    for (int j = 0; j < NB; ++j) {
      const typename Ops::W wv = Ops::load_w_tail(w[j] + k_main, rem);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) acc[m][j] = Ops::dot(acc[m][j], xv[m], wv);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) c[m * ldc + j] = Ops::hsum(acc[m][j]);
}

// One panel (see PanelFn). A single token streams all 8 weight rows at once (8 independent
// accumulators hide the FMA latency while the loads wait on memory); more tokens take the rows 4
// at a time so that kRows activation registers, 4 x kRows accumulators and one weight register
// fit the register file, with each weight vector loaded once per kRows tokens.
template <class Ops, typename WT>
inline void panel(const typename Ops::XT* x, int64_t ldx, int64_t M, const WT* const* w, int64_t K, float* c) {
  constexpr int R = kPanelRows;
  static_assert(R == 8, "the blocks below cover 8 weight rows");
  if (M == 1) {
    dot_block<Ops, 1, 8, WT>(x, ldx, w, K, c, R);
    return;
  }
  for (int h = 0; h < R; h += 4) {
    int64_t m = 0;
    for (; m + Ops::kRows <= M; m += Ops::kRows)
      dot_block<Ops, Ops::kRows, 4, WT>(x + m * ldx, ldx, w + h, K, c + m * R + h, R);
    switch (M - m) {
      case 1: dot_block<Ops, 1, 4, WT>(x + m * ldx, ldx, w + h, K, c + m * R + h, R); break;
      case 2: dot_block<Ops, 2, 4, WT>(x + m * ldx, ldx, w + h, K, c + m * R + h, R); break;
      case 3: dot_block<Ops, 3, 4, WT>(x + m * ldx, ldx, w + h, K, c + m * R + h, R); break;
      default: break;
    }
  }
}

}  // namespace detail
}  // namespace cpu
}  // namespace orca
