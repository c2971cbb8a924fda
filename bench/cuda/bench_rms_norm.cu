// Microbenchmark of the CUDA rms_norm kernel (the post-attention and final norms, and the first
// half of rmsnorm_qkv above kRmsnormQkvFusedMaxTokens). Validates against the float64 reference
// (bench/common/reference.h) on random data of awkward sizes first (exit 1 on mismatch), then
// prints the median time and GB/s (x read + out written + weight) next to the measured copy
// ceiling (read + write). Shapes: H=1024 at T=64 (decode) and T=8192 (prefill). Timing: CUDA
// graph replays (bench_util.cuh), rotating over copies of x and out so that every call reads and
// writes device memory rather than L2.
#include "bench_util.cuh"
#include "common/reference.h"
#include "cuda/launchers.h"

namespace {

using namespace bench;
namespace kern = orca::kernels;

constexpr float kEps = 1e-6f;

template <typename T>
bool run_norm(int n_tokens, int hidden, const Args& args, double copy_gbps, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const std::vector<T> x = random_vec<T>(size_t(n_tokens) * hidden, rng, 2.f);
  const std::vector<T> nw = random_vec<T>(hidden, rng, 0.2f, 1.f);
  DevBuf<T> dx(x), dnw(nw), dout(x.size());
  // NaN everywhere: an element the kernel does not write fails the validation below.
  BENCH_CHECK(cudaMemset(dout.ptr, 0xff, dout.n * sizeof(T)));
  const kern::DType dt = dtype_of<T>();
  BENCH_CHECK(kern::rms_norm(dt, dx.ptr, dnw.ptr, dout.ptr, n_tokens, hidden, kEps, nullptr));
  BENCH_CHECK(cudaDeviceSynchronize());
  const std::vector<T> out = dout.download();
  const std::vector<double> want = ref::rms_norm(x.data(), nw.data(), n_tokens, hidden, kEps, ToDouble{});
  const double tol = sizeof(T) == 4 ? 1e-5 : (std::is_same<T, __half>::value ? 2e-3 : 1.6e-2);
  Checker chk{tol, tol};
  for (size_t i = 0; i < want.size(); ++i) chk.add(to_f(out[i]), want[i], "out", i);
  char label[128];
  std::snprintf(label, sizeof label, "rms_norm T=%d H=%d (%s)", n_tokens, hidden, type_name<T>());
  if (!chk.report(label)) return false;
  if (args.small || copy_gbps != copy_gbps) return true;
  const double bytes = (2.0 * n_tokens * hidden + hidden) * sizeof(T);
  const int copies = rotation_copies(bytes);
  std::vector<std::unique_ptr<DevBuf<T>>> xs, outs;
  for (int c = 0; c < copies; ++c) {
    xs.push_back(std::make_unique<DevBuf<T>>(x));
    outs.push_back(std::make_unique<DevBuf<T>>(x.size()));
  }
  const KernelTime kt = kernel_time(
      [&](cudaStream_t stream, int i) {
        return kern::rms_norm(dt, xs[i % copies]->ptr, dnw.ptr, outs[i % copies]->ptr, n_tokens, hidden, kEps,
                              stream);
      },
      args);
  const double us = kt.us();
  const double gbps = bytes / (us * 1e-6) / 1e9;
  const double floor_us = bytes / (copy_gbps * 1e9) * 1e6;
  std::printf("rms_norm T=%-5d H=%d %8.2f us (%s; back-to-back %.2f us)  %7.1f GB/s = %5.1f%% of copy  "
              "floor %.2f us -> %.2fx\n",
              n_tokens, hidden, us, kt.method(), kt.b2b_us, gbps, 100.0 * gbps / copy_gbps, floor_us, us / floor_us);
  Result r;
  r.str("bench", "rms_norm").str("dtype", type_name<T>()).num("T", n_tokens).num("H", hidden);
  add_timing(r, kt);
  r.num("gbps", gbps).num("copy_gbps", copy_gbps).num("pct_of_copy", 100.0 * gbps / copy_gbps)
      .num("floor_us", floor_us).num("x_floor", us / floor_us).num("rotated_copies", copies).print();
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse_args(argc, argv);
  bool ok = true;
  // Validation: one row, odd hidden sizes (no 16-byte vectors), every dtype.
  ok &= run_norm<__nv_bfloat16>(5, 1000, args, NAN, 5);
  ok &= run_norm<float>(3, 77, args, NAN, 6);
  ok &= run_norm<__half>(9, 128, args, NAN, 7);
  ok &= run_norm<__nv_bfloat16>(1, 4096, args, NAN, 8);
  ok &= run_norm<float>(33, 1025, args, NAN, 9);
  if (!ok) return 1;
  if (args.small) return 0;

  const double copy = copy_ceiling_gbps();
  std::printf("copy ceiling (cudaMemcpy D2D, read+write): %.1f GB/s\n", copy);
  ok &= run_norm<__nv_bfloat16>(64, 1024, args, copy, 200);
  ok &= run_norm<__nv_bfloat16>(8192, 1024, args, copy, 201);
  return ok ? 0 : 1;
}
