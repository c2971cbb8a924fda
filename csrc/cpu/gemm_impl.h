// Register-blocked float32 matrix-product building blocks used by ragged_attention (Q * K^T,
// then P * V); the projections have their own kernels (skinny_gemm_blocks.h). Plain loops that auto-vectorize; why they look the
// way they do:
//  * "NT" products C = A * B^T have both operands contiguous along the reduction axis. Each
//    micro-kernel keeps a 3x4 block of named scalar accumulators and vectorizes the k loop with
//    `omp simd reduction`: every accumulator becomes one vector register and the horizontal
//    sums happen once at the end. (Array accumulators or lane arrays make GCC 12 spill them to
//    the stack, which measured 2-3x slower.) 3x4 = 12 accumulators + 3 A + 1 B registers fits
//    the 16 ymm registers of x86-64-v3; per k-vector it does 7 loads for 12 FMAs.
//    The horizontal sums GCC emits for `omp simd` reductions are slow (~25 instructions per
//    accumulator), so NT suits long reductions far better than short ones (D = 64 in
//    attention, where it is only used for decodes).
//  * "NN" accumulation O += P * V keeps a 3 x 32 block of O in registers (12 vectors) while
//    walking the rows of V, broadcasting one P element per row of O: 4 loads + 3 broadcasts
//    per 12 FMAs, no horizontal sums at all. Every element is an explicit FMA chain over the
//    rows of V in order (vec.h: fmadd), whichever block shape computes it: the two attention
//    paths rely on that to round identically in the batch-invariant mode.
// Callers keep float32 operands in 64-byte-aligned rows where they can (vec.h: padded_ld,
// thread_scratch): loads that straddle cache lines made these kernels ~1.6x slower.
//
// Everything here has internal linkage (an anonymous namespace): a unit compiled for AVX-512
// (attention_tile_avx512.cpp) includes this header too, and its copies must never replace the
// baseline ones at link time.
#pragma once
#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "vec.h"

namespace orca {
namespace cpu {
namespace detail {
namespace {  // one copy per translation unit, compiled for that unit's instruction set

// ---- C[m][n] = sum_k A[m][k] * B[n][k] -------------------------------------------------

inline void nt_3x4(const float* __restrict A, int64_t lda, const float* __restrict B, int64_t ldb,
                   int64_t K, float* __restrict C, int64_t ldc) {
  const float* a0 = A;
  const float* a1 = A + lda;
  const float* a2 = A + 2 * lda;
  const float* b0 = B;
  const float* b1 = B + ldb;
  const float* b2 = B + 2 * ldb;
  const float* b3 = B + 3 * ldb;
  float c00 = 0, c01 = 0, c02 = 0, c03 = 0;
  float c10 = 0, c11 = 0, c12 = 0, c13 = 0;
  float c20 = 0, c21 = 0, c22 = 0, c23 = 0;
#pragma omp simd reduction(+ : c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23)
  for (int64_t k = 0; k < K; ++k) {
    const float x0 = a0[k], x1 = a1[k], x2 = a2[k];
    const float w0 = b0[k], w1 = b1[k], w2 = b2[k], w3 = b3[k];
    c00 += x0 * w0; c01 += x0 * w1; c02 += x0 * w2; c03 += x0 * w3;
    c10 += x1 * w0; c11 += x1 * w1; c12 += x1 * w2; c13 += x1 * w3;
    c20 += x2 * w0; c21 += x2 * w1; c22 += x2 * w2; c23 += x2 * w3;
  }
  C[0] = c00; C[1] = c01; C[2] = c02; C[3] = c03;
  C += ldc;
  C[0] = c10; C[1] = c11; C[2] = c12; C[3] = c13;
  C += ldc;
  C[0] = c20; C[1] = c21; C[2] = c22; C[3] = c23;
}

inline void nt_2x4(const float* __restrict A, int64_t lda, const float* __restrict B, int64_t ldb,
                   int64_t K, float* __restrict C, int64_t ldc) {
  const float* a0 = A;
  const float* a1 = A + lda;
  const float* b0 = B;
  const float* b1 = B + ldb;
  const float* b2 = B + 2 * ldb;
  const float* b3 = B + 3 * ldb;
  float c00 = 0, c01 = 0, c02 = 0, c03 = 0;
  float c10 = 0, c11 = 0, c12 = 0, c13 = 0;
#pragma omp simd reduction(+ : c00, c01, c02, c03, c10, c11, c12, c13)
  for (int64_t k = 0; k < K; ++k) {
    const float x0 = a0[k], x1 = a1[k];
    const float w0 = b0[k], w1 = b1[k], w2 = b2[k], w3 = b3[k];
    c00 += x0 * w0; c01 += x0 * w1; c02 += x0 * w2; c03 += x0 * w3;
    c10 += x1 * w0; c11 += x1 * w1; c12 += x1 * w2; c13 += x1 * w3;
  }
  C[0] = c00; C[1] = c01; C[2] = c02; C[3] = c03;
  C += ldc;
  C[0] = c10; C[1] = c11; C[2] = c12; C[3] = c13;
}

inline void nt_1x4(const float* __restrict A, const float* __restrict B, int64_t ldb, int64_t K,
                   float* __restrict C) {
  const float* b0 = B;
  const float* b1 = B + ldb;
  const float* b2 = B + 2 * ldb;
  const float* b3 = B + 3 * ldb;
  float c0 = 0, c1 = 0, c2 = 0, c3 = 0;
#pragma omp simd reduction(+ : c0, c1, c2, c3)
  for (int64_t k = 0; k < K; ++k) {
    const float x = A[k];
    c0 += x * b0[k]; c1 += x * b1[k]; c2 += x * b2[k]; c3 += x * b3[k];
  }
  C[0] = c0; C[1] = c1; C[2] = c2; C[3] = c3;
}

inline void nt_3x1(const float* __restrict A, int64_t lda, const float* __restrict B, int64_t K,
                   float* __restrict C, int64_t ldc) {
  const float* a0 = A;
  const float* a1 = A + lda;
  const float* a2 = A + 2 * lda;
  float c0 = 0, c1 = 0, c2 = 0;
#pragma omp simd reduction(+ : c0, c1, c2)
  for (int64_t k = 0; k < K; ++k) {
    const float w = B[k];
    c0 += a0[k] * w; c1 += a1[k] * w; c2 += a2[k] * w;
  }
  C[0] = c0; C[ldc] = c1; C[2 * ldc] = c2;
}

inline float nt_1x1(const float* __restrict A, const float* __restrict B, int64_t K) {
  float c = 0;
#pragma omp simd reduction(+ : c)
  for (int64_t k = 0; k < K; ++k) c += A[k] * B[k];
  return c;
}

#if defined(__AVX2__)
// R rows x 4 columns of C for K a multiple of 8, in ymm registers. The 4 accumulators of a row
// are reduced together: three hadds and one add give its 4 sums, where `omp simd` reduces each
// accumulator on its own. With D = 64 those reductions were most of a decode's score products.
template <int R>
inline void nt_rx4_ymm(const float* __restrict A, int64_t lda, const float* __restrict B, int64_t ldb, int64_t K,
                       float* __restrict C, int64_t ldc) {
  __m256 acc[R][4];
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 b0 = _mm256_loadu_ps(B + k), b1 = _mm256_loadu_ps(B + ldb + k);
    const __m256 b2 = _mm256_loadu_ps(B + 2 * ldb + k), b3 = _mm256_loadu_ps(B + 3 * ldb + k);
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
      const __m256 a = _mm256_loadu_ps(A + i * lda + k);
      acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);
      acc[i][2] = _mm256_fmadd_ps(a, b2, acc[i][2]);
      acc[i][3] = _mm256_fmadd_ps(a, b3, acc[i][3]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i) {
    // hadd(x, y) = [x0+x1, x2+x3, y0+y1, y2+y3 | x4+x5, x6+x7, y4+y5, y6+y7], so after two levels
    // lane j of each 128-bit half holds half of column j's sum.
    const __m256 h01 = _mm256_hadd_ps(acc[i][0], acc[i][1]);
    const __m256 h23 = _mm256_hadd_ps(acc[i][2], acc[i][3]);
    const __m256 h = _mm256_hadd_ps(h01, h23);
    _mm_storeu_ps(C + i * ldc, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
}
#endif

// C[M, N] (leading dim ldc) = A[M, K] (lda) * B[N, K]^T (ldb). Columns of C are walked in
// groups of 4 in the outer loop so the 4 rows of B stay in L1 while all rows of A pass by.
inline void gemm_nt(const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                    int64_t ldc, int64_t M, int64_t N, int64_t K) {
  int64_t n = 0;
#if defined(__AVX2__)
  if (K % 8 == 0) {
    for (; n + 4 <= N; n += 4) {
      int64_t m = 0;
      for (; m + 3 <= M; m += 3) nt_rx4_ymm<3>(A + m * lda, lda, B + n * ldb, ldb, K, C + m * ldc + n, ldc);
      if (M - m == 2) {
        nt_rx4_ymm<2>(A + m * lda, lda, B + n * ldb, ldb, K, C + m * ldc + n, ldc);
      } else if (M - m == 1) {
        nt_rx4_ymm<1>(A + m * lda, lda, B + n * ldb, ldb, K, C + m * ldc + n, ldc);
      }
    }
  }
#endif
  for (; n + 4 <= N; n += 4) {
    int64_t m = 0;
    for (; m + 3 <= M; m += 3) nt_3x4(A + m * lda, lda, B + n * ldb, ldb, K, C + m * ldc + n, ldc);
    if (M - m == 2) {
      nt_2x4(A + m * lda, lda, B + n * ldb, ldb, K, C + m * ldc + n, ldc);
    } else if (M - m == 1) {
      nt_1x4(A + m * lda, B + n * ldb, ldb, K, C + m * ldc + n);
    }
  }
  for (; n < N; ++n) {
    int64_t m = 0;
    for (; m + 3 <= M; m += 3) nt_3x1(A + m * lda, lda, B + n * ldb, K, C + m * ldc + n, ldc);
    for (; m < M; ++m) C[m * ldc + n] = nt_1x1(A + m * lda, B + n * ldb, K);
  }
}

// ---- O[i][n] += sum_j P(i, j) * V[j][n] ---------------------------------------------------
// P is addressed with two strides, P(i, j) = P[i * p_rs + j * p_cs], so the same kernel serves
// P row-major (probabilities x V), P = K rows (K * Q^T) and P = V^T (V^T * P^T).

// Register blocks of gemm_nn_acc: kRows rows x kCols columns of O in accumulators. The shape
// never changes a result (every element is its own FMA chain over j), only how many chains are
// in flight: 12 fill 16 ymm registers with room for the V row and the broadcast; with 32 zmm
// registers, 16 accumulators of 16 lanes (4 rows x 64 columns) keep both FMA pipes busy where
// 3 x 32 (6 zmm chains) waited on the FMA latency.
struct NnYmm {
  static constexpr int kRows = 3, kCols = 32;
};
struct NnZmm {
  static constexpr int kRows = 4, kCols = 64;
};

// MR rows of O, NC consecutive columns starting at O (and V), all J rows of V. kAccumulate:
// O += P V, else O = P V (the chains start at zero without reading O).
template <int MR, int NC, bool kAccumulate>
inline void nn_block(const float* __restrict P, int64_t p_rs, int64_t p_cs, const float* __restrict V,
                     int64_t ldv, int64_t J, float* __restrict O, int64_t ldo) {
  float acc[MR][NC];
  for (int i = 0; i < MR; ++i)
    for (int l = 0; l < NC; ++l) acc[i][l] = kAccumulate ? O[i * ldo + l] : 0.0f;
  for (int64_t j = 0; j < J; ++j) {
    const float* v = V + j * ldv;
    // Without the unroll pragmas GCC keeps acc[MR][16] on the stack (a load, an FMA and a store
    // per vector and row) while it holds acc[MR][32] in registers: 16-lane attention tiles ran
    // several times slower per key than 32-lane ones. The FMA order per element is unchanged.
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const float p = P[i * p_rs + j * p_cs];
#pragma GCC unroll 64
      for (int l = 0; l < NC; ++l) acc[i][l] = fmadd(p, v[l], acc[i][l]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int l = 0; l < NC; ++l) O[i * ldo + l] = acc[i][l];
}

// Columns [n0, N) of MR rows that are not a multiple of 16 wide: a plain row update.
template <int MR, bool kAccumulate>
inline void nn_tail(const float* __restrict P, int64_t p_rs, int64_t p_cs, const float* __restrict V,
                    int64_t ldv, int64_t J, float* __restrict O, int64_t ldo, int64_t n0, int64_t N) {
  for (int i = 0; i < MR; ++i) {
    float* o = O + i * ldo;
    if (!kAccumulate)
      for (int64_t n = n0; n < N; ++n) o[n] = 0.0f;
    for (int64_t j = 0; j < J; ++j) {
      const float p = P[i * p_rs + j * p_cs];
      const float* v = V + j * ldv;
      for (int64_t n = n0; n < N; ++n) o[n] = fmadd(p, v[n], o[n]);
    }
  }
}

template <class Shape, int MR, bool kAccumulate>
inline void nn_rows(const float* P, int64_t p_rs, int64_t p_cs, const float* V, int64_t ldv, int64_t J,
                    float* O, int64_t ldo, int64_t N) {
  int64_t n = 0;
  for (; n + Shape::kCols <= N; n += Shape::kCols)
    nn_block<MR, Shape::kCols, kAccumulate>(P, p_rs, p_cs, V + n, ldv, J, O + n, ldo);
  if constexpr (Shape::kCols > 32)
    for (; n + 32 <= N; n += 32) nn_block<MR, 32, kAccumulate>(P, p_rs, p_cs, V + n, ldv, J, O + n, ldo);
  for (; n + 16 <= N; n += 16) nn_block<MR, 16, kAccumulate>(P, p_rs, p_cs, V + n, ldv, J, O + n, ldo);
  if (n < N) nn_tail<MR, kAccumulate>(P, p_rs, p_cs, V, ldv, J, O, ldo, n, N);
}

template <class Shape, bool kAccumulate>
inline void gemm_nn_impl(const float* P, int64_t p_rs, int64_t p_cs, const float* V, int64_t ldv, float* O,
                         int64_t ldo, int64_t M, int64_t J, int64_t N) {
  static_assert(Shape::kRows <= 4, "the rows left over below a full block are 3 at most");
  int64_t m = 0;
  for (; m + Shape::kRows <= M; m += Shape::kRows)
    nn_rows<Shape, Shape::kRows, kAccumulate>(P + m * p_rs, p_rs, p_cs, V, ldv, J, O + m * ldo, ldo, N);
  // The rows left over run as one shorter block, not one at a time: a decode's 3 query heads
  // per KV head (GQA 3) under the 4-row zmm block would otherwise be three single chains.
  P += m * p_rs;
  O += m * ldo;
  switch (M - m) {
    case 3: nn_rows<Shape, 3, kAccumulate>(P, p_rs, p_cs, V, ldv, J, O, ldo, N); break;
    case 2: nn_rows<Shape, 2, kAccumulate>(P, p_rs, p_cs, V, ldv, J, O, ldo, N); break;
    case 1: nn_rows<Shape, 1, kAccumulate>(P, p_rs, p_cs, V, ldv, J, O, ldo, N); break;
    default: break;
  }
}

// O[M, N] (ldo) += P(M, J) * V[J, N] (ldv), P(i, j) = P[i * p_rs + j * p_cs].
// Shape::kRows rows x Shape::kCols columns of O stay in vector registers while the J rows of V
// stream by.
template <class Shape = NnYmm>
inline void gemm_nn_acc(const float* P, int64_t p_rs, int64_t p_cs, const float* V, int64_t ldv, float* O,
                        int64_t ldo, int64_t M, int64_t J, int64_t N) {
  gemm_nn_impl<Shape, true>(P, p_rs, p_cs, V, ldv, O, ldo, M, J, N);
}

// O = P V: gemm_nn_acc's chains started at zero, the same bits as zeroing O first.
template <class Shape = NnYmm>
inline void gemm_nn(const float* P, int64_t p_rs, int64_t p_cs, const float* V, int64_t ldv, float* O, int64_t ldo,
                    int64_t M, int64_t J, int64_t N) {
  gemm_nn_impl<Shape, false>(P, p_rs, p_cs, V, ldv, O, ldo, M, J, N);
}

}  // namespace
}  // namespace detail
}  // namespace cpu
}  // namespace orca
