// The quantized ops of quant_kernels.h: path selection, the activation rows, and the calls into
// the weight-streaming driver (skinny_gemm.cpp) with the panel kernel of the format and path.
#include <omp.h>

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
      {kQuantTypeQ4_0, "Q4_0", 32, 18}, {kQuantTypeQ4_1, "Q4_1", 32, 20}, {kQuantTypeQ8_0, "Q8_0", 32, 34},
      {kQuantTypeQ4_K, "Q4_K", 256, 144}, {kQuantTypeQ6_K, "Q6_K", 256, 210},
  };
  for (const QuantFormat& f : kFormats)
    if (f.type == type) return &f;
  return nullptr;
}

// ---- path selection ---------------------------------------------------------------------------

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

}  // namespace

template <typename T>
void quant_linear(const T* x, const uint8_t* qweight, int qtype, const T* bias, const T* residual, T* out,
                  int64_t n_tokens, int64_t k, int64_t n_out) {
  if (n_tokens <= 0 || n_out <= 0) return;
  const auto fn = panel_for(qtype);
  const detail::Activations a = float_activations(x, n_tokens, k);
  detail::stream_quant_weights<T>(a, qweight, row_bytes(qtype, k), fn, bias, residual, out, n_tokens, k, n_out,
                                  detail::Epilogue::kBias);
}

template <typename T>
void quant_linear_silu_mul(const T* x, const uint8_t* qweight, int qtype, const T* bias, T* out, int64_t n_tokens,
                           int64_t k, int64_t n_inter) {
  if (n_tokens <= 0 || n_inter <= 0) return;
  const auto fn = panel_for(qtype);
  const detail::Activations a = float_activations(x, n_tokens, k);
  detail::stream_quant_weights<T>(a, qweight, row_bytes(qtype, k), fn, bias, nullptr, out, n_tokens, k, 2 * n_inter,
                                  detail::Epilogue::kSiluMul);
}

template <typename T>
void quant_rmsnorm_qkv(const T* x, const T* norm_weight, const uint8_t* qweight, int qtype, const T* bias, T* out,
                       int64_t n_tokens, int64_t k, int64_t n_out, float eps) {
  if (n_tokens <= 0 || n_out <= 0) return;
  const auto fn = panel_for(qtype);
  const detail::Activations a = detail::prepare_activations<float>(n_tokens, k, [=](int64_t t, float* dst) {
    detail::rms_normalize_row(x + t * k, norm_weight, dst, k, eps);
    if (std::is_same<T, bf16>::value)  // what the unfused rms_norm would have stored
      for (int64_t i = 0; i < k; ++i) dst[i] = to_float(from_float<bf16>(dst[i]));
  });
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

bool quant_linear_int8_activations(const float* x, const uint8_t* qweight, int qtype, float* out, int64_t n_tokens,
                                   int64_t k, int64_t n_out) {
#if defined(__AVX2__)
  if (qtype != kQuantTypeQ8_0 && qtype != kQuantTypeQ4_0 && qtype != kQuantTypeQ4_1) return false;
  const int64_t n_blocks = k / 32;
  int8_t* q = detail::thread_scratch<int8_t>(4, static_cast<size_t>(n_tokens * k));
  float* d = detail::thread_scratch<float>(3, static_cast<size_t>(2 * n_tokens * n_blocks));
  float* s = d + n_tokens * n_blocks;
  for (int64_t t = 0; t < n_tokens; ++t)
    for (int64_t b = 0; b < n_blocks; ++b) {  // as llama.cpp's quantize_row_q8_0: scale amax / 127
      const float* xb = x + t * k + 32 * b;
      float amax = 0.0f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float scale = amax / 127.0f, inv = scale != 0.0f ? 1.0f / scale : 0.0f;
      int sum = 0;
      for (int i = 0; i < 32; ++i) {
        const int v = static_cast<int>(std::nearbyint(xb[i] * inv));
        q[t * k + 32 * b + i] = static_cast<int8_t>(v);
        sum += v;
      }
      d[t * n_blocks + b] = scale;
      s[t * n_blocks + b] = scale * static_cast<float>(sum);
    }
  const int64_t rb = row_bytes(qtype, k);
  if (quant_path() == QuantPath::kAvx512 && detail::cpu_has_avx512vnni())
    detail::int8_act_linear_avx512vnni(q, d, s, qweight, qtype, rb, n_tokens, k, n_out, out);
  else
    detail::int8_act_linear_avx2(q, d, s, qweight, qtype, rb, n_tokens, k, n_out, out);
  return true;
#else
  (void)x, (void)qweight, (void)qtype, (void)out, (void)n_tokens, (void)k, (void)n_out;
  return false;
#endif
}

template void quant_linear<float>(const float*, const uint8_t*, int, const float*, const float*, float*, int64_t,
                                  int64_t, int64_t);
template void quant_linear<bf16>(const bf16*, const uint8_t*, int, const bf16*, const bf16*, bf16*, int64_t, int64_t,
                                 int64_t);
template void quant_linear_silu_mul<float>(const float*, const uint8_t*, int, const float*, float*, int64_t, int64_t,
                                           int64_t);
template void quant_linear_silu_mul<bf16>(const bf16*, const uint8_t*, int, const bf16*, bf16*, int64_t, int64_t,
                                          int64_t);
template void quant_rmsnorm_qkv<float>(const float*, const float*, const uint8_t*, int, const float*, float*, int64_t,
                                       int64_t, int64_t, float);
template void quant_rmsnorm_qkv<bf16>(const bf16*, const bf16*, const uint8_t*, int, const bf16*, bf16*, int64_t,
                                      int64_t, int64_t, float);
template void quant_embedding<float>(const uint8_t*, int, const int64_t*, float*, int64_t, int64_t);
template void quant_embedding<bf16>(const uint8_t*, int, const int64_t*, bf16*, int64_t, int64_t);

}  // namespace cpu
}  // namespace orca
