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
  bool small = false;    // tiny shapes, validation only (for compute-sanitizer)
  int reps = 20;         // timed graph replays (median)
  int calls = 20;        // kernel calls per graph
  int warmup = 3;
};

inline Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--small")) {
      a.small = true;
    } else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) {
      a.reps = std::max(1, std::atoi(argv[++i]));
    } else if (!std::strcmp(argv[i], "--calls") && i + 1 < argc) {
      a.calls = std::max(1, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: %s [--small] [--reps N] [--calls N]\n", argv[0]);
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
// Median milliseconds of `op()` over `reps` runs, each bracketed by events, after warm-up. Only
// for operations that run far longer than a launch takes on the host (the copy ceiling): for a
// kernel of a few microseconds the host's launch cost would sit between the events.
template <typename F>
double event_median_ms(F&& op, int warmup, int reps, cudaStream_t stream = nullptr) {
  for (int i = 0; i < warmup; ++i) op();
  BENCH_CHECK(cudaStreamSynchronize(stream));
  cudaEvent_t a, b;
  BENCH_CHECK(cudaEventCreate(&a));
  BENCH_CHECK(cudaEventCreate(&b));
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    BENCH_CHECK(cudaEventRecord(a, stream));
    op();
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

// Device time of one kernel call, in microseconds.
//   graph_us: `calls` calls captured in one CUDA graph; the median replay time (of `reps`) / calls.
//             Consecutive kernel nodes of a replay start without the host in between, as in the
//             engine's captured decode step: the figure to judge a kernel by.
//   b2b_us:   `calls` plain launches between two events, / calls (a cross-check; includes the
//             host's launch cost whenever the kernel is shorter than it).
// launch(stream, i) enqueues call i and returns its cudaError_t; a caller passes i to rotate over
// several input copies, so that call i + 1 does not find call i's data in L2. A launcher that
// cannot be captured is reported (capture_error) and timed back to back only.
struct KernelTime {
  double graph_us = NAN;
  double b2b_us = NAN;
  std::string capture_error;  // empty when the graph was captured
  double us() const { return std::isfinite(graph_us) ? graph_us : b2b_us; }
  const char* method() const { return std::isfinite(graph_us) ? "cuda_graph" : "back_to_back"; }
};

template <typename F>
KernelTime kernel_time(F&& launch, const Args& args) {
  cudaStream_t s;
  BENCH_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t a, b;
  BENCH_CHECK(cudaEventCreate(&a));
  BENCH_CHECK(cudaEventCreate(&b));
  const int n = args.calls;
  for (int i = 0; i < args.warmup; ++i) BENCH_CHECK(launch(s, i));  // one-time setup happens here
  BENCH_CHECK(cudaStreamSynchronize(s));
  auto replay_median_us = [&](auto&& one_replay) {
    std::vector<double> t;
    for (int r = 0; r < args.reps; ++r) {
      BENCH_CHECK(cudaEventRecord(a, s));
      one_replay();
      BENCH_CHECK(cudaEventRecord(b, s));
      BENCH_CHECK(cudaEventSynchronize(b));
      float ms = 0.f;
      BENCH_CHECK(cudaEventElapsedTime(&ms, a, b));
      t.push_back(ms * 1e3 / n);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  KernelTime kt;
  kt.b2b_us = replay_median_us([&] {
    for (int i = 0; i < n; ++i) BENCH_CHECK(launch(s, i));
  });

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cudaError_t err = cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
  for (int i = 0; i < n && err == cudaSuccess; ++i) err = launch(s, i);
  const cudaError_t end = cudaStreamEndCapture(s, &graph);  // always end an open capture
  if (err == cudaSuccess) err = end;
  if (err == cudaSuccess) err = cudaGraphInstantiate(&exec, graph, 0);
  if (err == cudaSuccess) {
    BENCH_CHECK(cudaGraphLaunch(exec, s));  // upload and warm up
    BENCH_CHECK(cudaStreamSynchronize(s));
    kt.graph_us = replay_median_us([&] { BENCH_CHECK(cudaGraphLaunch(exec, s)); });
  } else {
    kt.capture_error = cudaGetErrorName(err);
    (void)cudaGetLastError();  // clear the sticky-free capture error
    std::printf("WARNING graph capture failed (%s): timed back to back only\n", kt.capture_error.c_str());
  }
  if (exec) cudaGraphExecDestroy(exec);
  if (graph) cudaGraphDestroy(graph);
  BENCH_CHECK(cudaStreamSynchronize(s));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaStreamDestroy(s);
  return kt;
}

// How many copies of a call's working set (`bytes`) to rotate over so that consecutive timed calls
// read it from device memory, not from L2: enough to cover three times the L2, at most 16.
inline int rotation_copies(double bytes) {
  int dev = 0, l2 = 0;
  BENCH_CHECK(cudaGetDevice(&dev));
  BENCH_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
  const double copies = std::ceil(3.0 * l2 / std::max(bytes, 1.0));
  return static_cast<int>(std::min(16.0, std::max(1.0, copies)));
}

// Device copy ceiling in GB/s, counting bytes read + bytes written (cudaMemcpy D2D).
inline double copy_ceiling_gbps(size_t bytes = size_t(512) << 20, int reps = 20) {
  void *src = nullptr, *dst = nullptr;
  BENCH_CHECK(cudaMalloc(&src, bytes));
  BENCH_CHECK(cudaMalloc(&dst, bytes));
  BENCH_CHECK(cudaMemset(src, 1, bytes));
  const double ms = event_median_ms(
      [&] { BENCH_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, nullptr)); }, 3, reps);
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

// The timing fields every kernel RESULT line carries.
inline void add_timing(Result& r, const KernelTime& kt) {
  r.num("median_us", kt.us()).num("graph_us", kt.graph_us).num("b2b_us", kt.b2b_us).str("timing", kt.method());
  if (!kt.capture_error.empty()) r.str("capture_error", kt.capture_error);
}

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
