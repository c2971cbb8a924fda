// Microbenchmark of the CPU row_argmax kernel (the greedy token of each row of logits).
// 1. Validates against the scalar reference (bench/common/reference.h) on random rows of awkward
//    widths with planted ties, NaNs, infinities and all -inf rows; exits 1 on any mismatch.
// 2. Times the vocabulary of SmolLM2-135M (V = 49152) for one row and for a batch of 32, with the
//    logits in cache (as right after the lm_head wrote them) and in memory (rotating copies), and
//    prints GB/s next to the streaming-read ceiling.
#include <cmath>
#include <cstdio>
#include <limits>
#include <vector>

#include "bench_util.h"
#include "common/reference.h"
#include "cpu/cpu_kernels.h"

namespace {

bool check_case(int64_t n_rows, int64_t n_cols, uint64_t seed) {
  bench::Rng rng(seed);
  bench::Vec<float> x(static_cast<size_t>(n_rows * n_cols));
  bench::fill_random(x, rng, -8.0f, 8.0f);
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < n_rows; ++r) {
    float* row = x.data() + r * n_cols;
    const int64_t a = static_cast<int64_t>(rng.next() % static_cast<uint64_t>(n_cols));
    const int64_t b = static_cast<int64_t>(rng.next() % static_cast<uint64_t>(n_cols));
    switch (r % 5) {
      case 1: row[a] = row[b] = 100.0f; break;                 // a tie: the first column counts
      case 2: row[a] = std::nanf(""); row[b] = inf; break;     // NaN outranks +inf
      case 3: for (int64_t c = 0; c < n_cols; ++c) row[c] = -inf; break;
      case 4: row[a] = inf; break;
      default: break;
    }
  }
  std::vector<int64_t> index(static_cast<size_t>(n_rows));
  std::vector<float> value(static_cast<size_t>(n_rows));
  orca::cpu::row_argmax(x.data(), n_rows, n_cols, index.data(), value.data());
  const std::vector<int64_t> ref = bench::ref::row_argmax(x.data(), n_rows, n_cols);
  size_t bad = 0;
  for (int64_t r = 0; r < n_rows; ++r) {
    const float want = x[static_cast<size_t>(r * n_cols + ref[static_cast<size_t>(r)])];
    const float got = value[static_cast<size_t>(r)];
    const bool same_value = std::isnan(want) ? std::isnan(got) : got == want;
    bad += index[static_cast<size_t>(r)] != ref[static_cast<size_t>(r)] || !same_value;
  }
  char name[96];
  std::snprintf(name, sizeof name, "row_argmax R=%lld V=%lld", static_cast<long long>(n_rows),
                static_cast<long long>(n_cols));
  if (bad) {
    std::printf("FAIL %s: %zu of %lld rows differ from the reference\n", name, bad, static_cast<long long>(n_rows));
    return false;
  }
  std::printf("ok   %s\n", name);
  return true;
}

bool validate_all() {
  bool ok = true;
  uint64_t seed = 5000;
  for (int64_t n_rows : {int64_t{1}, int64_t{5}, int64_t{33}})
    for (int64_t n_cols : {int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{49157}}) ok &= check_case(n_rows, n_cols, ++seed);
  return ok;
}

void perf(const bench::Ceilings& c) {
  const int64_t vocab = 49152;
  bench::Rng rng(13);
  for (int64_t n_rows : {int64_t{1}, int64_t{32}}) {
    const size_t elems = static_cast<size_t>(n_rows * vocab);
    for (bool cached : {true, false}) {
      // In memory: enough copies that a row was evicted by the others (96 MiB).
      const int copies = cached ? 1 : static_cast<int>((size_t{96} << 20) / (elems * sizeof(float)) + 1);
      std::vector<bench::Vec<float>> x(static_cast<size_t>(copies), bench::Vec<float>(elems));
      for (auto& xc : x) bench::fill_random(xc, rng, -8.0f, 8.0f);
      std::vector<int64_t> index(static_cast<size_t>(n_rows));
      std::vector<float> value(static_cast<size_t>(n_rows));
      int copy = 0;
      const bench::Timing t = bench::time_calls(
          [&] {
            orca::cpu::row_argmax(x[static_cast<size_t>(copy)].data(), n_rows, vocab, index.data(), value.data());
            copy = (copy + 1) % copies;
          },
          201, copies);
      char label[96];
      std::snprintf(label, sizeof label, "row_argmax R=%lld V=%lld (%s)", static_cast<long long>(n_rows),
                    static_cast<long long>(vocab), cached ? "cache" : "memory");
      bench::report(label, t, 0.0, static_cast<double>(elems * sizeof(float)), c);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  return bench::finish_main(argc, argv, validate_all(), [](const bench::Ceilings& c) { perf(c); });
}
