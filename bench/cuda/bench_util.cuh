// Shared helpers of the CUDA microbenchmarks (cudart only, no torch): error checks, random data,
// host-side fp16/bf16 conversions, event timing (median), the device copy ceiling, and the
// machine-readable `RESULT {json}` lines that bench/device_check.sh collects. The scalar
// references the benchmarks validate against are shared with bench/cpu: bench/common/reference.h.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cuda/launchers.h"

#define BENCH_CHECK(expr)                                                                             \
  do {                                                                                                \
    const cudaError_t err_ = (expr);                                                                  \
    if (err_ != cudaSuccess) {                                                                        \
      std::fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(err_)); \
      std::exit(2);                                                                                   \
    }                                                                                                 \
  } while (0)

namespace bench {

// ---- arguments ----------------------------------------------------------------------------------
struct Args {
  bool small = false;  // tiny shapes, validation only (for compute-sanitizer)
  int reps = 50;
  int warmup = 5;
};

inline Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--small")) {
      a.small = true;
    } else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) {
      a.reps = std::max(1, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: %s [--small] [--reps N]\n", argv[0]);
      std::exit(2);
    }
  }
  if (a.small) a.reps = std::min(a.reps, 3), a.warmup = 1;
  return a;
}

// ---- host element types ---------------------------------------------------------------------------
template <typename T> inline float to_f(T x);
template <> inline float to_f<float>(float x) { return x; }
template <> inline float to_f<__half>(__half x) { return __half2float(x); }
template <> inline float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> inline T from_f(float x);
template <> inline float from_f<float>(float x) { return x; }
template <> inline __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> inline __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Element -> double, the conversion the shared references (bench/common/reference.h) read with.
struct ToDouble {
  template <typename T>
  double operator()(T x) const {
    return static_cast<double>(to_f(x));
  }
};

template <typename T> inline orca::kernels::DType dtype_of();
template <> inline orca::kernels::DType dtype_of<float>() { return orca::kernels::DType::kFloat32; }
template <> inline orca::kernels::DType dtype_of<__half>() { return orca::kernels::DType::kFloat16; }
template <> inline orca::kernels::DType dtype_of<__nv_bfloat16>() { return orca::kernels::DType::kBFloat16; }

template <typename I> inline orca::kernels::IndexType index_type_of();
template <> inline orca::kernels::IndexType index_type_of<int32_t>() { return orca::kernels::IndexType::kInt32; }
template <> inline orca::kernels::IndexType index_type_of<int64_t>() { return orca::kernels::IndexType::kInt64; }

template <typename T> inline const char* type_name();
template <> inline const char* type_name<float>() { return "float32"; }
template <> inline const char* type_name<__half>() { return "float16"; }
template <> inline const char* type_name<__nv_bfloat16>() { return "bfloat16"; }

// Random normal values (never all zeros), already rounded to T.
template <typename T>
std::vector<T> random_vec(size_t n, std::mt19937_64& rng, float stddev = 1.f, float mean = 0.f) {
  std::normal_distribution<float> dist(mean, stddev);
  std::vector<T> v(n);
  for (auto& x : v) x = from_f<T>(dist(rng));
  return v;
}

// ---- device buffers -------------------------------------------------------------------------------
template <typename T>
struct DevBuf {
  T* ptr = nullptr;
  size_t n = 0;
  explicit DevBuf(size_t count) : n(count) { BENCH_CHECK(cudaMalloc(&ptr, std::max<size_t>(count, 1) * sizeof(T))); }
  DevBuf(const std::vector<T>& host) : DevBuf(host.size()) { upload(host); }
  ~DevBuf() { cudaFree(ptr); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  void upload(const std::vector<T>& host) {
    BENCH_CHECK(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> h(n);
    BENCH_CHECK(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

// ---- timing ---------------------------------------------------------------------------------------
// Median milliseconds of `launch()` over `reps` runs (each bracketed by events), after warm-up.
template <typename F>
double median_ms(F&& launch, int warmup, int reps, cudaStream_t stream = nullptr) {
  for (int i = 0; i < warmup; ++i) launch();
  BENCH_CHECK(cudaStreamSynchronize(stream));
  cudaEvent_t a, b;
  BENCH_CHECK(cudaEventCreate(&a));
  BENCH_CHECK(cudaEventCreate(&b));
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    BENCH_CHECK(cudaEventRecord(a, stream));
    launch();
    BENCH_CHECK(cudaEventRecord(b, stream));
    BENCH_CHECK(cudaEventSynchronize(b));
    float ms = 0.f;
    BENCH_CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  BENCH_CHECK(cudaGetLastError());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Device copy ceiling in GB/s, counting bytes read + bytes written (cudaMemcpy D2D).
inline double copy_ceiling_gbps(size_t bytes = size_t(512) << 20, int reps = 20) {
  void *src = nullptr, *dst = nullptr;
  BENCH_CHECK(cudaMalloc(&src, bytes));
  BENCH_CHECK(cudaMalloc(&dst, bytes));
  BENCH_CHECK(cudaMemset(src, 1, bytes));
  const double ms =
      median_ms([&] { BENCH_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, nullptr)); }, 3, reps);
  cudaFree(src);
  cudaFree(dst);
  return 2.0 * static_cast<double>(bytes) / (ms * 1e-3) / 1e9;
}

// ---- output ---------------------------------------------------------------------------------------
// One `RESULT {...}` line: keys with numeric or string values (strings are quoted here).
struct Result {
  std::vector<std::pair<std::string, std::string>> kv;
  Result& str(const std::string& k, const std::string& v) {
    kv.emplace_back(k, "\"" + v + "\"");
    return *this;
  }
  Result& num(const std::string& k, double v) {
    char buf[64];
    if (std::isfinite(v)) std::snprintf(buf, sizeof buf, "%.6g", v);
    else std::snprintf(buf, sizeof buf, "null");
    kv.emplace_back(k, buf);
    return *this;
  }
  void print() const {
    std::string s = "RESULT {";
    for (size_t i = 0; i < kv.size(); ++i) s += (i ? ", \"" : "\"") + kv[i].first + "\": " + kv[i].second;
    s += "}";
    std::printf("%s\n", s.c_str());
    std::fflush(stdout);
  }
};

// Elementwise check |a - b| <= atol + rtol * |b|; prints the worst offender.
struct Checker {
  double atol, rtol;
  double max_err = 0.0;
  size_t n = 0, bad = 0;
  std::string first_bad;
  void add(double got, double want, const char* what, size_t index) {
    ++n;
    const double err = std::fabs(got - want);
    if (!(err <= atol + rtol * std::fabs(want))) {  // NaN fails too
      if (bad++ == 0) {
        char buf[256];
        std::snprintf(buf, sizeof buf, "%s[%zu]: got %.6g want %.6g", what, index, got, want);
        first_bad = buf;
      }
    }
    if (err > max_err || std::isnan(err)) max_err = std::isnan(err) ? INFINITY : err;
  }
  bool report(const char* name) const {
    if (bad) {
      std::printf("VALIDATION FAILED %s: %zu of %zu values out of tolerance (max abs err %.4g); first: %s\n", name,
                  bad, n, max_err, first_bad.c_str());
      return false;
    }
    std::printf("validated %s: %zu values, max abs err %.4g\n", name, n, max_err);
    return true;
  }
};

}  // namespace bench
