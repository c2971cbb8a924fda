// Panel kernel for bf16 models on CPUs with AVX512-BF16: vdpbf16ps multiplies 32 bf16 pairs and
// accumulates them into 16 float32 lanes in one instruction, reading bf16 weights directly (half
// the bytes of float32, no conversion). The build targets x86-64-v3, so this unit alone is
// compiled for AVX-512 (the pragma below) and is only called when cpu_has_avx512bf16() is true.
// Blocking and lane sums: skinny_gemm_zmm.h. Its arithmetic is mirrored by EmulatedDpOps in
// skinny_gemm_avx2.cpp, which the tests run on CPUs without the instructions.
#include <cstdint>

#include "cpu_kernels.h"
#include "skinny_gemm_impl.h"  // before the pragma: its inline functions stay baseline code

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16")
// GCC 12's own avx512fintrin.h trips -W(maybe-)uninitialized (its _mm512_undefined operands).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include "skinny_gemm_zmm.h"

namespace orca {
namespace cpu {
namespace detail {
namespace {

struct Avx512Bf16Ops {
  using XT = bf16;
  using WT = bf16;
  using X = __m512bh;
  using W = __m512bh;
  static constexpr int kStep = 32;
  static X load_x(const bf16* p) { return (__m512bh)_mm512_load_si512(p); }  // 64-byte aligned rows
  static W load_w(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static W load_w_tail(const bf16* p, int rem) {  // 0 < rem < 32; masked-off elements are not read
    const __mmask32 keep = static_cast<__mmask32>((uint32_t{1} << rem) - 1u);
    return (__m512bh)_mm512_maskz_loadu_epi16(keep, p);
  }
  static __m512 dot(__m512 acc, X x, W w) { return _mm512_dpbf16_ps(acc, x, w); }
};

}  // namespace

void panel_avx512bf16(const bf16* x, int64_t ldx, int64_t M, const bf16* const* w, int64_t K, float* c) {
  zmm_panel<Avx512Bf16Ops>(x, ldx, M, w, K, c);
}

}  // namespace detail
}  // namespace cpu
}  // namespace orca
#pragma GCC diagnostic pop
#pragma GCC pop_options

namespace orca {
namespace cpu {
namespace detail {
bool cpu_has_avx512bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16");
}
}  // namespace detail
}  // namespace cpu
}  // namespace orca

#else  // not x86-64: the path does not exist

#include <stdexcept>

namespace orca {
namespace cpu {
namespace detail {
void panel_avx512bf16(const bf16*, int64_t, int64_t, const bf16* const*, int64_t, float*) {
  throw std::logic_error("the avx512_bf16 path exists only on x86-64");
}
bool cpu_has_avx512bf16() { return false; }
}  // namespace detail
}  // namespace cpu
}  // namespace orca
#endif
