// Microbenchmark of the CUDA fused rmsnorm_qkv kernel (decode-sized T; above
// kRmsnormQkvFusedMaxTokens the op runs rms_norm, benchmarked in bench_rms_norm.cu, and a cuBLAS
// GEMM timed from torch in bench/gpu_reference.py). Validates against the float64 reference
// (bench/common/reference.h) on random data first (exit 1 on mismatch), then prints the median
// time, achieved GB/s and the memory floor (bytes / measured copy ceiling). Target shape:
// H=1024 -> N=4096 at T=64: at most 2x the floor (bench/RESULTS.md). Timing: CUDA graph replays
// (bench_util.cuh), rotating over copies of the weight (8 MiB, which would otherwise stay in L2).
#include "bench_util.cuh"
#include "common/reference.h"
#include "cuda/launchers.h"

namespace {

using namespace bench;
namespace kern = orca::kernels;

constexpr float kEps = 1e-6f;

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
  // NaN everywhere: an output the kernel does not write fails the validation below.
  BENCH_CHECK(cudaMemset(dout.ptr, 0xff, dout.n * sizeof(T)));
  BENCH_CHECK(kern::rmsnorm_qkv_fused(dt, dx.ptr, dnw.ptr, dw.ptr, bias ? db.ptr : nullptr, dout.ptr, n_tokens, hidden,
                                      n_out, kEps, nullptr));
  BENCH_CHECK(cudaDeviceSynchronize());
  const std::vector<T> out = dout.download();
  const ref::QkvReference want =
      ref::rmsnorm_qkv(x.data(), nw.data(), w.data(), bias ? b.data() : nullptr, n_tokens, hidden, n_out, kEps,
                       ToDouble{});
  Checker chk{std::is_same<T, __half>::value ? 5e-3 : 3e-2, std::is_same<T, __half>::value ? 5e-3 : 2e-2};
  for (size_t i = 0; i < want.out.size(); ++i) chk.add(to_f(out[i]), want.out[i], "out", i);
  char label[160];
  std::snprintf(label, sizeof label, "rmsnorm_qkv_fused T=%d H=%d N=%d bias=%d (%s)", n_tokens, hidden, n_out,
                int(bias), type_name<T>());
  if (!chk.report(label)) return false;
  if (args.small) return true;
  const double bytes = (double(n_out) * hidden + double(n_tokens) * hidden + hidden + double(n_tokens) * n_out +
                        (bias ? n_out : 0)) * sizeof(T);
  const int copies = rotation_copies(double(n_out) * hidden * sizeof(T));
  std::vector<std::unique_ptr<DevBuf<T>>> ws;
  for (int c = 0; c < copies; ++c) ws.push_back(std::make_unique<DevBuf<T>>(w));
  const KernelTime kt = kernel_time(
      [&](cudaStream_t stream, int i) {
        return kern::rmsnorm_qkv_fused(dt, dx.ptr, dnw.ptr, ws[i % copies]->ptr, bias ? db.ptr : nullptr, dout.ptr,
                                       n_tokens, hidden, n_out, kEps, stream);
      },
      args);
  const double us = kt.us();
  const double floor_us = bytes / (copy_gbps * 1e9) * 1e6;
  const double gbps = bytes / (us * 1e-6) / 1e9;
  const double tflops = 2.0 * n_tokens * double(hidden) * n_out / (us * 1e-6) / 1e12;
  std::printf("rmsnorm_qkv_fused T=%-5d %8.2f us (%s; back-to-back %.2f us)  %7.1f GB/s  floor %.2f us -> %.2fx "
              "floor (target <= 2x)  %.1f TFLOP/s\n",
              n_tokens, us, kt.method(), kt.b2b_us, gbps, floor_us, us / floor_us, tflops);
  Result r;
  r.str("bench", "rmsnorm_qkv_fused").str("dtype", type_name<T>()).num("T", n_tokens).num("H", hidden).num("N", n_out);
  add_timing(r, kt);
  r.num("gbps", gbps).num("copy_gbps", copy_gbps).num("floor_us", floor_us).num("x_floor", us / floor_us)
      .num("tflops", tflops).num("rotated_copies", copies).print();
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
  if (!ok) return 1;
  if (args.small) return 0;

  const double copy = copy_ceiling_gbps();
  std::printf("copy ceiling (cudaMemcpy D2D, read+write): %.1f GB/s\n", copy);
  for (int t : {1, 16, 64}) ok &= run_fused<__nv_bfloat16>(t, 1024, 4096, false, args, copy, 100 + t);
  return ok ? 0 : 1;
}
