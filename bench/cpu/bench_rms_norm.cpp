// Microbenchmark of the CPU rms_norm kernel (the post-attention and final norms, and the first
// half of rmsnorm_qkv's prefill path).
// 1. Validates against the scalar double-precision reference (bench/common/reference.h) on random
//    data of awkward sizes (one row, odd hidden sizes, rows above and below the threading
//    threshold, values spanning several orders of magnitude), float and bf16; exits 1 on any
//    mismatch.
// 2. Times SmolLM2-135M shapes (H=576): a decode batch (T=32, rows hot in cache, as they are right
//    after the layer that wrote them) and a prefill (T=4*512, rotating over enough copies of x and
//    out that every call reads and writes memory). GB/s counts x read + out written + weight, next
//    to the measured memcpy ceiling (also read + write).
#include <cstdio>
#include <vector>

#include "bench_util.h"
#include "common/reference.h"
#include "cpu/cpu_kernels.h"

namespace {

using orca::bf16;

template <typename T>
bool check_case(int64_t n_tokens, int64_t hidden, float magnitude, float eps, uint64_t seed) {
  bench::Rng rng(seed);
  bench::Vec<T> x(n_tokens * hidden), w(hidden), out(n_tokens * hidden);
  bench::fill_random(x, rng, -magnitude, magnitude);
  bench::fill_random(w, rng, 0.5f, 1.5f);
  orca::cpu::rms_norm<T>(x.data(), w.data(), out.data(), n_tokens, hidden, eps);
  const std::vector<double> ref = bench::ref::rms_norm(x.data(), w.data(), n_tokens, hidden, eps, bench::ToDouble{});
  char name[160];
  std::snprintf(name, sizeof name, "rms_norm<%s> T=%lld H=%lld |x|<%g eps=%g", sizeof(T) == 2 ? "bf16" : "f32",
                static_cast<long long>(n_tokens), static_cast<long long>(hidden), magnitude, eps);
  // One rounding of the stored result (bf16: 2^-8 relative) plus float32 accumulation error.
  const double rtol = sizeof(T) == 2 ? 1.0 / 256.0 + 1e-6 : 2e-6;
  return bench::check_close(name, bench::to_double(out), ref, 1e-6, rtol);
}

template <typename T>
bool validate_all() {
  bool ok = true;
  uint64_t seed = sizeof(T) == 2 ? 3000 : 4000;
  for (int64_t n_tokens : {int64_t{1}, int64_t{7}, int64_t{83}, int64_t{200}})
    for (int64_t hidden : {int64_t{1}, int64_t{111}, int64_t{576}, int64_t{1000}})
      ok &= check_case<T>(n_tokens, hidden, 3.0f, 1e-6f, ++seed);
  ok &= check_case<T>(64, 2048, 300.0f, 1e-5f, ++seed);   // large activations
  ok &= check_case<T>(5, 333, 1e-3f, 1e-6f, ++seed);      // tiny ones: eps matters
  ok &= check_case<T>(3, 4096, 1.0f, 1e-2f, ++seed);      // a large eps
  return ok;
}

template <typename T>
void perf(const char* dtype, const bench::Ceilings& c) {
  const int64_t hidden = 576;
  bench::Rng rng(11);
  bench::Vec<T> w(hidden);
  bench::fill_random(w, rng, 0.5f, 1.5f);
  const size_t es = sizeof(T);
  for (int64_t n_tokens : {int64_t{32}, int64_t{4 * 512}}) {
    const size_t elems = static_cast<size_t>(n_tokens * hidden);
    const bool decode = n_tokens <= 64;
    // Prefill: enough copies that x and out of one call were evicted by the others (96 MiB).
    const int copies = decode ? 1 : static_cast<int>((size_t{96} << 20) / (2 * elems * es) + 1);
    std::vector<bench::Vec<T>> x(static_cast<size_t>(copies), bench::Vec<T>(elems)), out = x;
    for (auto& xc : x) bench::fill_random(xc, rng, -2.0f, 2.0f);
    int copy = 0;
    const bench::Timing t = bench::time_calls(
        [&] {
          orca::cpu::rms_norm<T>(x[static_cast<size_t>(copy)].data(), w.data(), out[static_cast<size_t>(copy)].data(),
                                 n_tokens, hidden, 1e-5f);
          copy = (copy + 1) % copies;
        },
        decode ? 201 : 41, copies);
    const double bytes = static_cast<double>(es) * (2.0 * static_cast<double>(elems) + hidden);
    char label[96];
    std::snprintf(label, sizeof label, "rms_norm %s %s T=%lld H=%lld", dtype,
                  decode ? "decode (cache)" : "prefill (memory)", static_cast<long long>(n_tokens),
                  static_cast<long long>(hidden));
    bench::report(label, t, 0.0, bytes, c);
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
