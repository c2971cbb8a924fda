// The quantized ops of quant_kernels.h: path selection, the activation rows, and the calls into
// the weight-streaming driver (skinny_gemm.cpp) with the panel kernel of the format and path.
#include <omp.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "quant_kernels.h"
#include "quant_panels.h"
#include "rms_norm_impl.h"
#include "skinny_gemm_impl.h"
#include "vec.h"

namespace orca {
namespace cpu {

const QuantFormat* quant_format(int type) {
  static constexpr QuantFormat kFormats[] = {
      {kQuantTypeQ4_0, "Q4_0", 32, 18},   {kQuantTypeQ4_1, "Q4_1", 32, 20},   {kQuantTypeQ5_0, "Q5_0", 32, 22},
      {kQuantTypeQ5_1, "Q5_1", 32, 24},   {kQuantTypeQ8_0, "Q8_0", 32, 34},   {kQuantTypeQ4_K, "Q4_K", 256, 144},
      {kQuantTypeQ5_K, "Q5_K", 256, 176}, {kQuantTypeQ6_K, "Q6_K", 256, 210},
  };
  for (const QuantFormat& f : kFormats)
    if (f.type == type) return &f;
  return nullptr;
}

// ---- path selection ---------------------------------------------------------------------------

namespace detail {
int q4k_decode_rows_ahead() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const int rows = [] {
    __builtin_cpu_init();
    unsigned eax, ebx, ecx, edx;
    // GCC 12 names AMD families only up to 0x19, so the family comes from cpuid leaf 1.
    if (!__builtin_cpu_is("amd") || __get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return 0;
    const unsigned base = (eax >> 8) & 0xfu, family = base == 0xfu ? base + ((eax >> 20) & 0xffu) : base;
    return family >= 0x1au ? 2 : 0;  // Zen 5 and later
  }();
  return rows;
#else
  return 0;
#endif
}
}  // namespace detail

const char* quant_path_name(QuantPath path) {
  switch (path) {
    case QuantPath::kAvx2: return "avx2";
    case QuantPath::kAvx512: return "avx512";
  }
  return "unknown";
}

bool quant_path_supported(QuantPath path) {
  static const bool avx512 = detail::cpu_has_avx512f();
  return path == QuantPath::kAvx2 || avx512;
}

namespace {

std::atomic<int> g_quant_path{-1};  // -1: not chosen yet

QuantPath initial_quant_path() {
  const QuantPath best = quant_path_supported(QuantPath::kAvx512) ? QuantPath::kAvx512 : QuantPath::kAvx2;
  const char* env = std::getenv("ORCA_CPU_QUANT_PATH");
  // Only a supported path can be chosen from the environment; anything else keeps the best one
  // (the torch glue reports the active path as _C.cpu_quant_path()).
  if (env != nullptr && std::strcmp(env, "avx2") == 0) return QuantPath::kAvx2;
  return best;
}

}  // namespace

QuantPath quant_path() {
  int p = g_quant_path.load(std::memory_order_relaxed);
  if (p < 0) {
    int expected = -1;
    g_quant_path.compare_exchange_strong(expected, static_cast<int>(initial_quant_path()));
    p = g_quant_path.load(std::memory_order_relaxed);
  }
  return static_cast<QuantPath>(p);
}

void set_quant_path(QuantPath path) {
  if (!quant_path_supported(path))
    throw std::invalid_argument(std::string("this CPU cannot run the quantized path ") + quant_path_name(path));
  g_quant_path.store(static_cast<int>(path), std::memory_order_relaxed);
}

// ---- ops ----------------------------------------------------------------------------------------

namespace {

detail::PanelFn<float, uint8_t> panel_for(int qtype) {
  const auto fn = quant_path() == QuantPath::kAvx512 ? detail::quant_panel_avx512(qtype)
                                                      : detail::quant_panel_avx2(qtype);
  if (fn == nullptr) throw std::invalid_argument("unsupported ggml type " + std::to_string(qtype));
  return fn;
}

int64_t row_bytes(int qtype, int64_t k) {
  const QuantFormat* f = quant_format(qtype);
  if (f == nullptr) throw std::invalid_argument("unsupported ggml type " + std::to_string(qtype));
  return k / f->block_elems * f->block_bytes;
}

// Float32 activation rows (the quantized panels always read float32): x widened exactly.
template <typename T>
detail::Activations float_activations(const T* x, int64_t n_tokens, int64_t k) {
  return detail::prepare_activations<float>(n_tokens, k,
                                            [=](int64_t t, float* dst) { detail::load_row(x + t * k, dst, k); });
}

// ---- int8 activations (quant_int8_act.h) ----

bool use_int8(int qtype, QuantActivations acts) {
  return acts == QuantActivations::kInt8 && quant_int8_supported(qtype);
}

// The elements per activation scale the int8 kernels of ggml type qtype read: the block of the
// 32-element formats, the super-block of the 256-element ones.
int64_t int8_act_block(int qtype) { return quant_format(qtype)->block_elems; }

// The int8 rows (detail::Int8Rows, for qtype's block) of the rows fill_row(t, float* dst) writes.
template <typename FillRow>
detail::Int8Rows int8_activations(int qtype, int64_t n_tokens, int64_t k, FillRow&& fill_row) {
  const int64_t block = int8_act_block(qtype);
  int8_t* q = detail::thread_scratch<int8_t>(4, static_cast<size_t>(n_tokens * k));
  detail::Int8Rows a{block, q, nullptr, nullptr, nullptr};
  float* d = nullptr;
  float* s = nullptr;
  int16_t* bsums = nullptr;
  if (block == 32) {  // d and s per 32-block
    d = detail::thread_scratch<float>(3, static_cast<size_t>(2 * n_tokens * (k / 32)));
    s = d + n_tokens * (k / 32);
    a.d = d, a.s = s;
  } else {  // d per 256-block, bsums per 16
    d = detail::thread_scratch<float>(3, static_cast<size_t>(n_tokens * (k / 256)));
    bsums = detail::thread_scratch<int16_t>(6, static_cast<size_t>(n_tokens * (k / 16)));
    a.d = d, a.bsums = bsums;
  }
  const bool parallel = n_tokens > 1 && n_tokens * k >= (int64_t{1} << 15);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t t = 0; t < n_tokens; ++t) {
    float* row = detail::thread_scratch<float>(5, static_cast<size_t>(k));
    fill_row(t, row);
    if (block == 32)
      detail::int8_quantize_row(row, k, q + t * k, d + t * (k / 32), s + t * (k / 32));
    else
      detail::int8_quantize_row_256(row, k, q + t * k, d + t * (k / 256), bsums + t * (k / 16));
  }
  return a;
}

// acc [T, n_rows] float32 = the int8 products of every weight row (the path's kernel).
float* int8_products(const detail::Int8Rows& a, const uint8_t* qweight, int qtype, int64_t n_tokens, int64_t k,
                     int64_t n_rows) {
  float* acc = detail::thread_scratch<float>(7, static_cast<size_t>(n_tokens * n_rows));
  const int64_t rb = row_bytes(qtype, k);
  if (quant_path() == QuantPath::kAvx512 && detail::cpu_has_avx512vnni())
    detail::int8_act_linear_avx512vnni(a, qweight, qtype, rb, n_tokens, k, n_rows, acc);
  else
    detail::int8_act_linear_avx2(a, qweight, qtype, rb, n_tokens, k, n_rows, acc);
  return acc;
}

// out = acc + bias (+ residual), one rounding to T.
template <typename T>
void bias_epilogue(const float* acc, const T* bias, const T* residual, T* out, int64_t n_tokens, int64_t n_out) {
  for (int64_t t = 0; t < n_tokens; ++t) {
    const float* a = acc + t * n_out;
    const T* r = residual != nullptr ? residual + t * n_out : nullptr;
    T* o = out + t * n_out;
    for (int64_t n = 0; n < n_out; ++n) {
      float v = a[n];
      if (bias != nullptr) v += to_float(bias[n]);
      if (r != nullptr) v += to_float(r[n]);
      o[n] = from_float<T>(v);
    }
  }
}

// out[t, i] = silu(acc[t, i] + bias[i]) * (acc[t, I + i] + bias[I + i]), rounded to T; silu as
// the float-activation kernels compute it (detail::silu). Without a bias each token's row is one
// vectorized pass (evaluated one output at a time, it was 7.5% of a Q5_K_M prompt's time on a
// Zen 4); the bias is added to acc in place first.
template <typename T>
void silu_mul_epilogue(float* acc, const T* bias, T* out, int64_t n_tokens, int64_t n_inter) {
  const bool parallel = n_tokens > 1 && n_tokens * n_inter >= (int64_t{1} << 16);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t t = 0; t < n_tokens; ++t) {
    float* __restrict g = acc + t * 2 * n_inter;
    float* __restrict u = g + n_inter;
    T* __restrict o = out + t * n_inter;
    if (bias != nullptr)
      for (int64_t i = 0; i < n_inter; ++i) g[i] += to_float(bias[i]), u[i] += to_float(bias[n_inter + i]);
#pragma omp simd
    for (int64_t i = 0; i < n_inter; ++i) o[i] = from_float<T>(detail::silu(g[i]) * u[i]);
  }
}

}  // namespace

bool quant_int8_supported(int qtype) {
#if defined(__AVX2__)
  return quant_format(qtype) != nullptr;  // every format has int8 kernels
#else
  (void)qtype;
  return false;
#endif
}

template <typename T>
void quant_linear(const T* x, const uint8_t* qweight, int qtype, const T* bias, const T* residual, T* out,
                  int64_t n_tokens, int64_t k, int64_t n_out, QuantActivations acts) {
  if (n_tokens <= 0 || n_out <= 0) return;
  if (use_int8(qtype, acts)) {
    const detail::Int8Rows a =
        int8_activations(qtype, n_tokens, k, [=](int64_t t, float* dst) { detail::load_row(x + t * k, dst, k); });
    bias_epilogue(int8_products(a, qweight, qtype, n_tokens, k, n_out), bias, residual, out, n_tokens, n_out);
    return;
  }
  const auto fn = panel_for(qtype);
  const detail::Activations a = float_activations(x, n_tokens, k);
  detail::stream_quant_weights<T>(a, qweight, row_bytes(qtype, k), fn, bias, residual, out, n_tokens, k, n_out,
                                  detail::Epilogue::kBias);
}

template <typename T>
void quant_linear_silu_mul(const T* x, const uint8_t* qweight, int qtype, const T* bias, T* out, int64_t n_tokens,
                           int64_t k, int64_t n_inter, QuantActivations acts) {
  if (n_tokens <= 0 || n_inter <= 0) return;
  if (use_int8(qtype, acts)) {
    const detail::Int8Rows a =
        int8_activations(qtype, n_tokens, k, [=](int64_t t, float* dst) { detail::load_row(x + t * k, dst, k); });
    silu_mul_epilogue(int8_products(a, qweight, qtype, n_tokens, k, 2 * n_inter), bias, out, n_tokens, n_inter);
    return;
  }
  const auto fn = panel_for(qtype);
  const detail::Activations a = float_activations(x, n_tokens, k);
  detail::stream_quant_weights<T>(a, qweight, row_bytes(qtype, k), fn, bias, nullptr, out, n_tokens, k, 2 * n_inter,
                                  detail::Epilogue::kSiluMul);
}

template <typename T>
void quant_rmsnorm_qkv(const T* x, const T* norm_weight, const uint8_t* qweight, int qtype, const T* bias, T* out,
                       int64_t n_tokens, int64_t k, int64_t n_out, float eps, QuantActivations acts) {
  if (n_tokens <= 0 || n_out <= 0) return;
  const auto normed_row = [=](int64_t t, float* dst) {
    detail::rms_normalize_row(x + t * k, norm_weight, dst, k, eps);
    if (std::is_same<T, bf16>::value)  // what the unfused rms_norm would have stored
      for (int64_t i = 0; i < k; ++i) dst[i] = to_float(from_float<bf16>(dst[i]));
  };
  if (use_int8(qtype, acts)) {
    const detail::Int8Rows a = int8_activations(qtype, n_tokens, k, normed_row);
    bias_epilogue<T>(int8_products(a, qweight, qtype, n_tokens, k, n_out), bias, nullptr, out, n_tokens, n_out);
    return;
  }
  const auto fn = panel_for(qtype);
  const detail::Activations a = detail::prepare_activations<float>(n_tokens, k, normed_row);
  detail::stream_quant_weights<T>(a, qweight, row_bytes(qtype, k), fn, bias, nullptr, out, n_tokens, k, n_out,
                                  detail::Epilogue::kBias);
}

template <typename T>
void quant_embedding(const uint8_t* qweight, int qtype, const int64_t* token_ids, T* out, int64_t n_tokens,
                     int64_t k) {
  const int64_t rb = row_bytes(qtype, k);
  const bool parallel = n_tokens > 1 && n_tokens * k >= (int64_t{1} << 16);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t t = 0; t < n_tokens; ++t) {
    float* row = detail::thread_scratch<float>(5, static_cast<size_t>(k));
    detail::dequant_row(qtype, qweight + token_ids[t] * rb, k, row);
    detail::store_row(row, out + t * k, k);
  }
}

template void quant_linear<float>(const float*, const uint8_t*, int, const float*, const float*, float*, int64_t,
                                  int64_t, int64_t, QuantActivations);
template void quant_linear<bf16>(const bf16*, const uint8_t*, int, const bf16*, const bf16*, bf16*, int64_t, int64_t,
                                 int64_t, QuantActivations);
template void quant_linear_silu_mul<float>(const float*, const uint8_t*, int, const float*, float*, int64_t, int64_t,
                                           int64_t, QuantActivations);
template void quant_linear_silu_mul<bf16>(const bf16*, const uint8_t*, int, const bf16*, bf16*, int64_t, int64_t,
                                          int64_t, QuantActivations);
template void quant_rmsnorm_qkv<float>(const float*, const float*, const uint8_t*, int, const float*, float*, int64_t,
                                       int64_t, int64_t, float, QuantActivations);
template void quant_rmsnorm_qkv<bf16>(const bf16*, const bf16*, const uint8_t*, int, const bf16*, bf16*, int64_t,
                                      int64_t, int64_t, float, QuantActivations);
template void quant_embedding<float>(const uint8_t*, int, const int64_t*, float*, int64_t, int64_t);
template void quant_embedding<bf16>(const uint8_t*, int, const int64_t*, bf16*, int64_t, int64_t);

}  // namespace cpu
}  // namespace orca
