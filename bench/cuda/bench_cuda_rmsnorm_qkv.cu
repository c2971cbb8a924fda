// Microbenchmark of the fused rmsnorm_qkv kernel (decode-sized T) and of rms_norm (the first
// half of the large-T path; its GEMM half is cuBLAS and is timed from torch in
// bench/gpu_reference.py). Validates against a float64 CPU reference on random data first (exit 1
// on mismatch), then prints the median time, achieved GB/s and the memory floor
// (bytes / measured copy ceiling). Issue shapes: H=1024 -> N=4096 at T=64 (and T=8192 for rms_norm).
#include "bench_util.cuh"
#include "kernels/launchers.h"

namespace {

using namespace bench;
namespace kern = orca::kernels;

template <typename T> kern::DType dtype_of();
template <> kern::DType dtype_of<__half>() { return kern::DType::kFloat16; }
template <> kern::DType dtype_of<__nv_bfloat16>() { return kern::DType::kBFloat16; }
template <> kern::DType dtype_of<float>() { return kern::DType::kFloat32; }

constexpr float kEps = 1e-6f;

// out[t] = rms_norm(x[t]) * nw, in double.
template <typename T>
std::vector<double> ref_norm(const std::vector<T>& x, const std::vector<T>& nw, int n_tokens, int hidden) {
  std::vector<double> y(size_t(n_tokens) * hidden);
  for (int t = 0; t < n_tokens; ++t) {
    double ss = 0;
    for (int k = 0; k < hidden; ++k) ss += double(to_f(x[size_t(t) * hidden + k])) * to_f(x[size_t(t) * hidden + k]);
    const double inv = 1.0 / std::sqrt(ss / hidden + kEps);
    for (int k = 0; k < hidden; ++k) y[size_t(t) * hidden + k] = to_f(x[size_t(t) * hidden + k]) * inv * to_f(nw[k]);
  }
  return y;
}

template <typename T>
bool run_fused(int n_tokens, int hidden, int n_out, bool bias, const Args& args, double copy_gbps, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const std::vector<T> x = random_vec<T>(size_t(n_tokens) * hidden, rng, 2.f);
  const std::vector<T> nw = random_vec<T>(hidden, rng, 0.2f, 1.f);
  const std::vector<T> w = random_vec<T>(size_t(n_out) * hidden, rng, 1.f / std::sqrt(float(hidden)));
  const std::vector<T> b = random_vec<T>(n_out, rng);
  DevBuf<T> dx(x), dnw(nw), dw(w), db(b), dout(size_t(n_tokens) * n_out);
  const kern::DType dt = dtype_of<T>();
  if (!kern::rmsnorm_qkv_fused_supported(dt, n_tokens, hidden, dx.ptr, dnw.ptr, dw.ptr)) {
    std::printf("fused kernel does not support T=%d H=%d\n", n_tokens, hidden);
    return false;
  }
  auto launch = [&] {
    BENCH_CHECK(kern::rmsnorm_qkv_fused(dt, dx.ptr, dnw.ptr, dw.ptr, bias ? db.ptr : nullptr, dout.ptr, n_tokens,
                                        hidden, n_out, kEps, nullptr));
  };
  launch();
  BENCH_CHECK(cudaDeviceSynchronize());
  const std::vector<T> out = dout.download();
  const std::vector<double> y = ref_norm(x, nw, n_tokens, hidden);
  Checker chk{std::is_same<T, __half>::value ? 5e-3 : 3e-2, std::is_same<T, __half>::value ? 5e-3 : 2e-2};
  for (int t = 0; t < n_tokens; ++t)
    for (int n = 0; n < n_out; ++n) {
      double acc = bias ? to_f(b[n]) : 0.0;
      const T* wr = &w[size_t(n) * hidden];
      const double* yr = &y[size_t(t) * hidden];
      for (int k = 0; k < hidden; ++k) acc += yr[k] * to_f(wr[k]);
      chk.add(to_f(out[size_t(t) * n_out + n]), acc, "out", size_t(t) * n_out + n);
    }
  char label[160];
  std::snprintf(label, sizeof label, "rmsnorm_qkv_fused T=%d H=%d N=%d bias=%d (%s)", n_tokens, hidden, n_out,
                int(bias), type_name<T>());
  if (!chk.report(label)) return false;
  if (args.small) return true;
  const double ms = median_ms(launch, args.warmup, args.reps);
  const double bytes = (double(n_out) * hidden + double(n_tokens) * hidden + hidden + double(n_tokens) * n_out +
                        (bias ? n_out : 0)) * sizeof(T);
  const double floor_us = bytes / (copy_gbps * 1e9) * 1e6;
  const double gbps = bytes / (ms * 1e-3) / 1e9;
  const double tflops = 2.0 * n_tokens * double(hidden) * n_out / (ms * 1e-3) / 1e12;
  std::printf("rmsnorm_qkv_fused T=%-5d median %8.2f us  %7.1f GB/s  floor %.2f us -> %.2fx floor  %.1f TFLOP/s\n",
              n_tokens, ms * 1e3, gbps, floor_us, ms * 1e3 / floor_us, tflops);
  Result()
      .str("bench", "rmsnorm_qkv_fused")
      .str("dtype", type_name<T>())
      .num("T", n_tokens)
      .num("H", hidden)
      .num("N", n_out)
      .num("median_us", ms * 1e3)
      .num("gbps", gbps)
      .num("copy_gbps", copy_gbps)
      .num("floor_us", floor_us)
      .num("x_floor", ms * 1e3 / floor_us)
      .num("tflops", tflops)
      .print();
  return true;
}

template <typename T>
bool run_norm(int n_tokens, int hidden, const Args& args, double copy_gbps, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const std::vector<T> x = random_vec<T>(size_t(n_tokens) * hidden, rng, 2.f);
  const std::vector<T> nw = random_vec<T>(hidden, rng, 0.2f, 1.f);
  DevBuf<T> dx(x), dnw(nw), dout(x.size());
  const kern::DType dt = dtype_of<T>();
  auto launch = [&] {
    BENCH_CHECK(kern::rms_norm(dt, dx.ptr, dnw.ptr, dout.ptr, n_tokens, hidden, kEps, nullptr));
  };
  launch();
  BENCH_CHECK(cudaDeviceSynchronize());
  const std::vector<T> out = dout.download();
  const std::vector<double> y = ref_norm(x, nw, n_tokens, hidden);
  const double tol = sizeof(T) == 4 ? 1e-5 : (std::is_same<T, __half>::value ? 2e-3 : 1.6e-2);
  Checker chk{tol, tol};
  for (size_t i = 0; i < y.size(); ++i) chk.add(to_f(out[i]), y[i], "out", i);
  char label[128];
  std::snprintf(label, sizeof label, "rms_norm T=%d H=%d (%s)", n_tokens, hidden, type_name<T>());
  if (!chk.report(label)) return false;
  if (args.small || copy_gbps != copy_gbps) return true;
  const double ms = median_ms(launch, args.warmup, args.reps);
  const double bytes = (2.0 * n_tokens * hidden + hidden) * sizeof(T);
  const double gbps = bytes / (ms * 1e-3) / 1e9;
  std::printf("rms_norm T=%-5d H=%d median %8.2f us  %7.1f GB/s (%5.1f%% of copy)\n", n_tokens, hidden, ms * 1e3,
              gbps, 100.0 * gbps / copy_gbps);
  Result()
      .str("bench", "rms_norm")
      .str("dtype", type_name<T>())
      .num("T", n_tokens)
      .num("H", hidden)
      .num("median_us", ms * 1e3)
      .num("gbps", gbps)
      .num("copy_gbps", copy_gbps)
      .num("pct_of_copy", 100.0 * gbps / copy_gbps)
      .print();
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse_args(argc, argv);
  bool ok = true;
  // Validation on awkward shapes: partial row tiles, N not a multiple of 32, H not a multiple of 128.
  ok &= run_fused<__nv_bfloat16>(1, 1024, 4096, false, args, NAN, 1);
  ok &= run_fused<__nv_bfloat16>(7, 200, 100, true, args, NAN, 2);
  ok &= run_fused<__half>(23, 584, 328, true, args, NAN, 3);
  ok &= run_fused<__nv_bfloat16>(45, 96, 33, false, args, NAN, 4);
  ok &= run_norm<__nv_bfloat16>(5, 1000, args, NAN, 5);
  ok &= run_norm<float>(3, 77, args, NAN, 6);
  ok &= run_norm<__half>(9, 128, args, NAN, 7);
  if (!ok) return 1;
  if (args.small) return 0;

  const double copy = copy_ceiling_gbps();
  std::printf("copy ceiling (cudaMemcpy D2D, read+write): %.1f GB/s\n", copy);
  for (int t : {1, 16, 64}) ok &= run_fused<__nv_bfloat16>(t, 1024, 4096, false, args, copy, 100 + t);
  ok &= run_norm<__nv_bfloat16>(64, 1024, args, copy, 200);
  ok &= run_norm<__nv_bfloat16>(8192, 1024, args, copy, 201);
  return ok ? 0 : 1;
}
