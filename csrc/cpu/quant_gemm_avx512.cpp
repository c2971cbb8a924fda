// Quantized panel kernels for CPUs with AVX-512F: 16-lane float32 accumulators (lane l sums the
// k with k % 16 == l; hsum adds lanes (l, l+8), then the 8-lane tree of the other paths). This
// unit alone is compiled for AVX-512 (the pragma below) and is only called when
// cpu_has_avx512f() is true. See quant_blocks.h for the blocking.
#include <cstdint>

#include "quant_kernels.h"
#include "quant_panels.h"
#include "skinny_gemm_impl.h"  // before the pragma: its inline functions stay baseline code

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#if defined(__AVX2__)  // the 512-bit forms build on the AVX2 ones (a baseline below v3 keeps plain loops)
#define ORCA_QUANT_DEQUANT_512 1  // quant_formats.h: widen chunks 16 elements at a time
#define ORCA_QUANT_INT8_512 1     // quant_int8_act_k.h: 8-token prefill tiles in zmm registers
#endif
// GCC 12's own avx512fintrin.h trips -Wmaybe-uninitialized (its _mm512_undefined operands).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "quant_blocks.h"
#include "quant_int8_act.h"

namespace orca {
namespace cpu {
namespace detail {
namespace {

struct QuantAvx512Ops {
  using Acc = __m512;
  using X = __m512;
  using W = __m512;
  static constexpr int kStep = 16;
  static constexpr int kRows = 4;  // 4 x 4 accumulators + 4 activations + 1 weight of 32 zmm
  static Acc zero() { return _mm512_setzero_ps(); }
  static X load_x(const float* p) { return _mm512_load_ps(p); }  // 64-byte aligned rows, 32-element chunks
  static W load_w(const float* p) { return _mm512_load_ps(p); }
  static Acc dot(Acc acc, X x, W w) { return _mm512_fmadd_ps(x, w, acc); }
  // 4-bit chunks widen straight into registers through their 16 weights (quant_formats.h).
  template <int F>
  static constexpr bool kWidensInRegisters = kRegisterFormat<F>;
  template <int F>
  static void widen(const uint8_t* row, int64_t unit, int chunk, const ChunkScales& s, W* out) {  // out [2]
    widen_chunk<F>(row, unit, chunk, s, out[0], out[1]);
  }
  static void store_w(float* p, W w) { _mm512_store_ps(p, w); }
  static float hsum(Acc v) {
    alignas(64) float l[16];
    _mm512_store_ps(l, v);
    float h[8];
    for (int i = 0; i < 8; ++i) h[i] = l[i] + l[i + 8];
    return hsum8_tree(h);
  }
};

}  // namespace

PanelFn<float, uint8_t> quant_panel_avx512(int type) { return quant_panel_for<QuantAvx512Ops>(type); }

void int8_act_linear_avx512vnni(const Int8Rows& a, const uint8_t* w, int type, int64_t row_bytes, int64_t n_tokens,
                                int64_t k, int64_t n_out, float* out) {
  int8_act_linear<true>(a, w, type, row_bytes, n_tokens, k, n_out, out);
}

}  // namespace detail
}  // namespace cpu
}  // namespace orca
#pragma GCC diagnostic pop
#pragma GCC pop_options

namespace orca {
namespace cpu {
namespace detail {
bool cpu_has_avx512f() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
bool cpu_has_avx512vnni() {
  __builtin_cpu_init();
  return cpu_has_avx512f() && __builtin_cpu_supports("avx512vnni");
}
}  // namespace detail
}  // namespace cpu
}  // namespace orca

#else  // not x86-64: the path does not exist

#include <stdexcept>

namespace orca {
namespace cpu {
namespace detail {
PanelFn<float, uint8_t> quant_panel_avx512(int) { throw std::logic_error("the avx512 path exists only on x86-64"); }
void int8_act_linear_avx512vnni(const Int8Rows&, const uint8_t*, int, int64_t, int64_t, int64_t, int64_t, float*) {
  throw std::logic_error("the avx512 path exists only on x86-64");
}
bool cpu_has_avx512f() { return false; }
bool cpu_has_avx512vnni() { return false; }
}  // namespace detail
}  // namespace cpu
}  // namespace orca
#endif
