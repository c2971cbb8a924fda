// Panel kernel for float32 models on CPUs with AVX-512F (the `avx512` float32 path). The build
// targets x86-64-v3, so this unit alone is compiled for AVX-512 (the pragma below) and is only
// called when cpu_has_avx512_f32() is true.
//
// Order: an output's accumulator has 16 float32 lanes; lane l sums x[k] * w[k] over k = l, l + 16,
// l + 32, ... with one FMA each, then the lanes are summed as (l, l+8), (l, l+4), (l, l+2),
// (l, l+1) -- the 8-lane tree of the avx2 path after one more level. Blocking and reduction:
// skinny_gemm_zmm.h.
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

#include "skinny_gemm_zmm.h"

namespace orca {
namespace cpu {
namespace detail {
namespace {

struct Avx512F32Ops {
  using XT = float;
  using WT = float;
  using X = __m512;
  using W = __m512;
  static constexpr int kStep = 16;
  static X load_x(const float* p) { return _mm512_load_ps(p); }  // 64-byte aligned rows
  static W load_w(const float* p) { return _mm512_loadu_ps(p); }
  static W load_w_tail(const float* p, int rem) {  // 0 < rem < 16; masked-off elements are not read
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << rem) - 1u), p);
  }
  static __m512 dot(__m512 acc, X x, W w) { return _mm512_fmadd_ps(x, w, acc); }
};

}  // namespace

void panel_avx512(const float* x, int64_t ldx, int64_t M, const float* const* w, int64_t K, float* c) {
  zmm_panel<Avx512F32Ops>(x, ldx, M, w, K, c);
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
