// Microbenchmark of the CPU rmsnorm_qkv kernel (the fused norm + QKV projection).
// 1. Validates against the scalar double-precision reference (bench/common/reference.h) on random
//    data of awkward sizes, float and bf16; exits 1 on any mismatch.
// 2. Times SmolLM2-135M shapes (H=576, N=(9+2*3)*64=960): a decode batch (T=32) and a prefill
//    (T=4*512), median of repeats, and prints GFLOP/s and GB/s next to the measured ceilings.
//    The decode case rotates over 30 copies of the weights (one per layer of the model, 66 MB
//    in float32) so W comes from memory as it does in a real forward pass, not from cache.
#include <cmath>
#include <cstdio>
#include <vector>

#include "bench_util.h"
#include "common/reference.h"
#include "cpu/cpu_kernels.h"

namespace {

using orca::bf16;

template <typename T>
constexpr double out_rtol() {  // rounding of the stored result
  return sizeof(T) == 2 ? 1.0 / 256.0 : 1e-6;
}

template <typename T>
bool check_qkv(int64_t Tn, int64_t H, int64_t N, bool with_bias, uint64_t seed) {
  bench::Rng rng(seed);
  bench::Vec<T> x(Tn * H), nw(H), w(N * H), b(N), out(Tn * N);
  bench::fill_random(x, rng, -2.0f, 2.0f);
  bench::fill_random(nw, rng, 0.5f, 1.5f);
  bench::fill_random(w, rng, -0.1f, 0.1f);
  bench::fill_random(b, rng, -0.5f, 0.5f);
  const float eps = 1e-5f;
  orca::cpu::rmsnorm_qkv<T>(x.data(), nw.data(), w.data(), with_bias ? b.data() : nullptr, out.data(), Tn, H, N, eps);
  // bf16 models: the kernel rounds the normalised row to bf16 before the product. It rounds a
  // float32 value that can sit on the other side of a rounding midpoint from the double one;
  // such an element is one bf16 ulp off, at most 2^-8 of its term (the tolerance allows two).
  const bool is_bf16 = sizeof(T) == 2;
  auto round_normed = [is_bf16](double v) {
    return is_bf16 ? static_cast<double>(orca::to_float(orca::from_float<bf16>(static_cast<float>(v)))) : v;
  };
  const bench::ref::QkvReference r = bench::ref::rmsnorm_qkv(x.data(), nw.data(), w.data(),
                                                             with_bias ? b.data() : nullptr, Tn, H, N, eps,
                                                             bench::ToDouble{}, round_normed);
  const std::vector<double>& ref = r.out;
  const std::vector<double>& mass = r.mass;
  const std::vector<double>& max_term = r.max_term;
  // Element-wise tolerance: output rounding + float32 accumulation (a few eps of the mass).
  const std::vector<double> got = bench::to_double(out);
  bool ok = true;
  size_t bad = 0;
  double worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double tol = out_rtol<T>() * std::fabs(ref[i]) + 1e-6 * mass[i] + 1e-7 +
                       (is_bf16 ? 2.0 * std::ldexp(max_term[i], -8) : 0.0);
    const double err = std::fabs(got[i] - ref[i]);
    if (!(err <= tol)) {
      if (bad < 5) std::printf("  index %zu got %.8g expected %.8g (tol %.3g)\n", i, got[i], ref[i], tol);
      ++bad;
      ok = false;
    }
    worst = std::max(worst, err);
  }
  char name[160];
  std::snprintf(name, sizeof name, "rmsnorm_qkv<%s> T=%lld H=%lld N=%lld bias=%d", sizeof(T) == 2 ? "bf16" : "f32",
                static_cast<long long>(Tn), static_cast<long long>(H), static_cast<long long>(N), with_bias ? 1 : 0);
  if (!ok)
    std::printf("FAIL %s: %zu of %zu out of tolerance\n", name, bad, ref.size());
  else
    std::printf("ok   %-68s max abs err %.2e\n", name, worst);
  return ok;
}

template <typename T>
bool validate_all() {
  bool ok = true;
  uint64_t seed = sizeof(T) == 2 ? 1000 : 2000;
  const int64_t tokens[] = {1, 2, 7, 83, 200};
  const int64_t hiddens[] = {111, 576};
  const int64_t outs[] = {1, 5, 67, 960};
  for (int64_t H : hiddens)
    for (int64_t N : outs)
      for (int64_t Tn : tokens) ok &= check_qkv<T>(Tn, H, N, (Tn + N) % 2 == 1, ++seed);
  ok &= check_qkv<T>(97, 64, 131, true, ++seed);  // > one token tile, odd everything
  return ok;
}

template <typename T>
void perf(const char* dtype, const bench::Ceilings& c) {
  const int64_t H = 576, N = (9 + 2 * 3) * 64, layers = 30;
  bench::Rng rng(42);
  bench::Vec<T> nw(H), b(N);
  bench::fill_random(nw, rng, 0.5f, 1.5f);
  bench::fill_random(b, rng, -0.5f, 0.5f);
  std::vector<bench::Vec<T>> w(layers, bench::Vec<T>(N * H));
  for (auto& wl : w) bench::fill_random(wl, rng, -0.1f, 0.1f);
  const size_t es = sizeof(T);
  for (int64_t Tn : {int64_t{32}, int64_t{4 * 512}}) {
    bench::Vec<T> x(Tn * H), out(Tn * N);
    bench::fill_random(x, rng, -2.0f, 2.0f);
    int64_t layer = 0;
    const bench::Timing t = bench::time_calls(
        [&] {
          orca::cpu::rmsnorm_qkv<T>(x.data(), nw.data(), w[layer].data(), nullptr, out.data(), Tn, H, N, 1e-5f);
          layer = (layer + 1) % layers;
        },
        Tn > 64 ? 11 : 61, layers);
    const double flops = 2.0 * Tn * N * H;
    const double bytes = static_cast<double>(es) * (N * H + Tn * H + Tn * N);
    char label[96];
    std::snprintf(label, sizeof label, "rmsnorm_qkv %s %s T=%lld", dtype, Tn == 32 ? "decode" : "prefill",
                  static_cast<long long>(Tn));
    bench::report(label, t, flops, bytes, c);
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool ok = validate_all<float>();
  ok &= validate_all<bf16>();
  return bench::finish_main(argc, argv, ok, [](const bench::Ceilings& c) {
    perf<float>("f32", c);
    perf<bf16>("bf16", c);
  });
}
