// Panel kernels for the baseline instruction set (x86-64-v3: AVX2 + FMA) and the scalar
// emulation of the vdpbf16ps path. See skinny_gemm_blocks.h for the blocking.
//
// The avx2 order: an output's accumulator has 8 float32 lanes; lane l sums x[k] * w[k] over
// k = l, l + 8, l + 16, ... with one FMA each, and hsum adds lanes (l, l+4), then (0+2, 1+3), then
// the two halves. bf16 weights are widened to float32 in registers (exact), so float32 and bf16
// models share this order. On other architectures the same order runs as scalar std::fma (an FMA
// rounds once, like vfmadd), so results match the x86 build bit for bit.
#include <cmath>
#include <cstdint>

#include "cpu_kernels.h"
#include "skinny_gemm_impl.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ORCA_SKINNY_AVX2 1
#endif

#include "skinny_gemm_blocks.h"
#include "vec.h"  // thread_scratch, load_row

namespace orca {
namespace cpu {
namespace detail {
namespace {

#ifdef ORCA_SKINNY_AVX2
struct Avx2Ops {
  using XT = float;
  using Acc = __m256;
  using X = __m256;
  using W = __m256;
  static constexpr int kStep = 8;
  static constexpr int kRows = 3;  // 3 x 4 accumulators + 3 activations + 1 weight = 16 ymm
  static Acc zero() { return _mm256_setzero_ps(); }
  static X load_x(const float* p) { return _mm256_load_ps(p); }
  static W load_w(const float* p) {
    __m256 w = _mm256_loadu_ps(p);
    // One load per weight vector: GCC would otherwise fold it into each of the kRows FMAs that
    // use it as a memory operand, kRows loads where one does.
    asm("" : "+x"(w));
    return w;
  }
  static W load_w(const bf16* p) {  // bf16 -> float32: zero-extend to 32 bits, shift into the top half
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  template <typename WT>
  static W load_w_tail(const WT* p, int rem) {
    alignas(32) float t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int i = 0; i < rem; ++i) t[i] = to_float(p[i]);
    return _mm256_load_ps(t);
  }
  static Acc dot(Acc acc, X x, W w) { return _mm256_fmadd_ps(x, w, acc); }
  static float hsum(Acc v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // l + l+4
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                        // 0+2, 1+3
    s = _mm_add_ss(s, _mm_movehdup_ps(s));                                         // + lane 1
    return _mm_cvtss_f32(s);  // the same sums as hsum8_tree
  }
};
using BaselineOps = Avx2Ops;
#else
// The same arithmetic, one lane at a time.
struct ScalarLanesOps {
  using XT = float;
  struct Acc { float l[8]; };
  using X = Acc;
  using W = Acc;
  static constexpr int kStep = 8;
  static constexpr int kRows = 3;
  static Acc zero() { return Acc{{0, 0, 0, 0, 0, 0, 0, 0}}; }
  static X load_x(const float* p) {
    X v;
    for (int i = 0; i < 8; ++i) v.l[i] = p[i];
    return v;
  }
  template <typename WT>
  static W load_w(const WT* p) {
    W v;
    for (int i = 0; i < 8; ++i) v.l[i] = to_float(p[i]);
    return v;
  }
  template <typename WT>
  static W load_w_tail(const WT* p, int rem) {
    W v = zero();
    for (int i = 0; i < rem; ++i) v.l[i] = to_float(p[i]);
    return v;
  }
  static Acc dot(Acc acc, const X& x, const W& w) {
    for (int i = 0; i < 8; ++i) acc.l[i] = std::fma(x.l[i], w.l[i], acc.l[i]);
    return acc;
  }
  static float hsum(const Acc& v) { return hsum8_tree(v.l); }
};
using BaselineOps = ScalarLanesOps;
#endif

// vdpbf16ps in scalar code: 16 float32 lanes; per 32-element step, lane i adds the products of
// elements 2i+1 and then 2i, each add rounded to nearest even (the product of two bf16 values is
// exact in float32, so an FMA is that add). hsum adds lanes (i, i+8), then the 8-lane tree.
// Denormal inputs and results are not flushed to zero as the instruction does.
struct EmulatedDpOps {
  using XT = bf16;
  struct Acc { float l[16]; };
  struct X { float e[32]; };
  using W = X;
  static constexpr int kStep = 32;
  static constexpr int kRows = 4;
  static Acc zero() {
    Acc a;
    for (float& v : a.l) v = 0.0f;
    return a;
  }
  static X load_x(const bf16* p) {
    X v;
    for (int i = 0; i < 32; ++i) v.e[i] = to_float(p[i]);
    return v;
  }
  static W load_w(const bf16* p) { return load_x(p); }
  static W load_w_tail(const bf16* p, int rem) {
    W v;
    for (int i = 0; i < 32; ++i) v.e[i] = i < rem ? to_float(p[i]) : 0.0f;
    return v;
  }
  static Acc dot(Acc acc, const X& x, const W& w) {
    for (int i = 0; i < 16; ++i) {
      acc.l[i] = std::fma(x.e[2 * i + 1], w.e[2 * i + 1], acc.l[i]);
      acc.l[i] = std::fma(x.e[2 * i], w.e[2 * i], acc.l[i]);
    }
    return acc;
  }
  static float hsum(const Acc& v) {
    float l[8];
    for (int i = 0; i < 8; ++i) l[i] = v.l[i] + v.l[i + 8];
    return hsum8_tree(l);
  }
};

}  // namespace

void panel_avx2(const float* x, int64_t ldx, int64_t M, const float* const* w, int64_t K, float* c) {
  panel<BaselineOps, float>(x, ldx, M, w, K, c);
}

// From 12 tokens on, when the widened panel fits L1 with room for the activations (rows of up to
// 768 elements), a panel's bf16 weight rows are widened to float32 once, into a buffer of the
// calling thread, and the float32 panel runs on them: each weight vector then costs one widening
// instead of one per block of 3 tokens (24 per 72-token tile), a shuffle-port op beside every 3
// FMAs. Paired A/B on a 2-core Zen 3 at T = 128: SmolLM2-135M's gate_up 1.19x, qkv 1.10x (K =
// 576); its down projection (K = 1536, 48 KiB widened) 0.97x and Llama-3.2-1B's 0.78-0.95x,
// whose float rows come from L2 at twice the bytes. Widening is exact: the bits are the same.
constexpr int64_t kWidenPanelFromTokens = 12;
constexpr int64_t kWidenPanelMaxBytes = 24 << 10;

void panel_avx2(const float* x, int64_t ldx, int64_t M, const bf16* const* w, int64_t K, float* c) {
  if (M < kWidenPanelFromTokens || kPanelRows * K * static_cast<int64_t>(sizeof(float)) > kWidenPanelMaxBytes) {
    panel<BaselineOps, bf16>(x, ldx, M, w, K, c);
    return;
  }
  float* wide = thread_scratch<float>(1, static_cast<size_t>(kPanelRows * K));  // [kPanelRows, K]
  const float* rows[kPanelRows];
  for (int j = 0; j < kPanelRows; ++j) {
    // A partial panel repeats its last live row: widen each distinct row once.
    if (j > 0 && w[j] == w[j - 1]) {
      rows[j] = rows[j - 1];
      continue;
    }
    load_row(w[j], wide + j * K, K);
    rows[j] = wide + j * K;
  }
  panel<BaselineOps, float>(x, ldx, M, rows, K, c);
}

void panel_avx512bf16_emulated(const bf16* x, int64_t ldx, int64_t M, const bf16* const* w, int64_t K, float* c) {
  panel<EmulatedDpOps, bf16>(x, ldx, M, w, K, c);
}

}  // namespace detail
}  // namespace cpu
}  // namespace orca
