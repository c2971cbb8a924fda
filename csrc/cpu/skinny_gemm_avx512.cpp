// Panel kernel for float32 models on CPUs with AVX-512F (the `avx512` float32 path). The build
// targets x86-64-v3, so this unit alone is compiled for AVX-512 (the pragma below) and is only
// called when cpu_has_avx512_f32() is true.
//
// Order: an output's accumulator has 16 float32 lanes; lane l sums x[k] * w[k] over k = l, l + 16,
// l + 32, ... with one FMA each (the K % 16 tail through a masked weight load against the
// activations' zero padding), then the lanes are summed as (l, l+8), (l, l+4), (l, l+2), (l, l+1)
// -- the 8-lane tree of the avx2 path after one more level. The blocking below never changes that
// sequence, so a token's outputs are the same whatever T is.
//
// Blocking: one panel is 8 weight rows. A block of MB tokens keeps MB x 8 accumulators, MB
// activation registers and one weight register in the 32 zmm registers (MB = 3: 28), so each
// weight vector loaded feeds MB FMAs and each activation vector 8. The 8 accumulators of a token
// are reduced together by shuffles (reduce8), so the horizontal sums cost about one instruction
// per output instead of a dozen: at K = 576 a scalar reduction per output was a third of the
// FMA count.
#include <cstdint>

#include "cpu_kernels.h"
#include "skinny_gemm_impl.h"  // before the pragma: its inline functions stay baseline code

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq")
// GCC 12's own avx512fintrin.h trips -W(maybe-)uninitialized (its _mm512_undefined operands).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace orca {
namespace cpu {
namespace detail {
namespace {

constexpr int kRows = kPanelRows;  // 8 weight rows per panel
static_assert(kRows == 8, "reduce8 sums 8 accumulators");

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
// to the next multiple of 32, so the tail step reads them unmasked.
template <int MB>
inline void panel_block(const float* __restrict x, int64_t ldx, const float* const* w, int64_t K,
                        float* __restrict c) {
  __m512 acc[MB][kRows];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < kRows; ++j) acc[m][j] = _mm512_setzero_ps();
  const float* wr[kRows];
#pragma GCC unroll 8
  for (int j = 0; j < kRows; ++j) wr[j] = w[j];
  const int64_t k_main = K & ~int64_t{15};
  for (int64_t k = 0; k < k_main; k += 16) {
    __m512 xv[MB];
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) xv[m] = _mm512_load_ps(x + m * ldx + k);
#pragma GCC unroll 8
    for (int j = 0; j < kRows; ++j) {
      __m512 wv = _mm512_loadu_ps(wr[j] + k);
      // One load per weight vector: GCC would otherwise fold it into each of the MB FMAs as a
      // memory operand, MB loads where one does (the loads, not the FMAs, then bound the loop).
      asm("" : "+v"(wv));
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) acc[m][j] = _mm512_fmadd_ps(xv[m], wv, acc[m][j]);
    }
  }
  if (k_main < K) {
    const __mmask16 keep = static_cast<__mmask16>((1u << (K - k_main)) - 1u);  // masked-off lanes are not read
    __m512 xv[MB];
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) xv[m] = _mm512_load_ps(x + m * ldx + k_main);
#pragma GCC unroll 8
    for (int j = 0; j < kRows; ++j) {
      const __m512 wv = _mm512_maskz_loadu_ps(keep, wr[j] + k_main);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) acc[m][j] = _mm512_fmadd_ps(xv[m], wv, acc[m][j]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) reduce8(acc[m], c + m * kRows);
}

}  // namespace

void panel_avx512(const float* x, int64_t ldx, int64_t M, const float* const* w, int64_t K, float* c) {
  constexpr int kTokens = 3;  // 3 x 8 accumulators + 3 activations + 1 weight = 28 of 32 zmm
  int64_t m = 0;
  for (; m + kTokens <= M; m += kTokens) panel_block<kTokens>(x + m * ldx, ldx, w, K, c + m * kRows);
  switch (M - m) {
    case 1: panel_block<1>(x + m * ldx, ldx, w, K, c + m * kRows); break;
    case 2: panel_block<2>(x + m * ldx, ldx, w, K, c + m * kRows); break;
    default: break;
  }
}

}  // namespace detail
}  // namespace cpu
}  // namespace orca
#pragma GCC diagnostic pop
#pragma GCC pop_options

namespace orca {
namespace cpu {
namespace detail {
bool cpu_has_avx512_f32() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
}  // namespace detail
}  // namespace cpu
}  // namespace orca

#else  // not x86-64: the path does not exist

#include <stdexcept>

namespace orca {
namespace cpu {
namespace detail {
void panel_avx512(const float*, int64_t, int64_t, const float* const*, int64_t, float*) {
  throw std::logic_error("the avx512 float32 path exists only on x86-64");
}
bool cpu_has_avx512_f32() { return false; }
}  // namespace detail
}  // namespace cpu
}  // namespace orca
#endif
