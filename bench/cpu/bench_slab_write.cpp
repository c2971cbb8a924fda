// Microbenchmark of the CPU slab_write kernel (scatter K/V rows into the slot pools).
// 1. Validates on random data against the shared reference (bench/common/reference.h): every
//    target slot holds exactly its token's row afterwards and every other slot is untouched,
//    bit for bit; float and bf16, int32 and int64 slots, odd row sizes.
//    Exits 1 on any mismatch.
// 2. Times SmolLM2-135M shapes (Hkv=3, D=64): a decode batch (32 tokens, one per slab,
//    scattered over the pool) and a prefill (4 x 512 tokens into 4 slabs). GB/s counts the
//    bytes read plus written, to compare with the memcpy ceiling (read + write). Several pool
//    copies (one per layer) are rotated so the destination is not warm in cache.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <vector>

#include "bench_util.h"
#include "common/reference.h"
#include "cpu/cpu_kernels.h"

namespace {

using orca::bf16;

template <typename T>
bool same_bits(const T* a, const T* b, int64_t n) {
  return std::memcmp(a, b, static_cast<size_t>(n) * sizeof(T)) == 0;
}

template <typename T, typename I>
bool check_case(int64_t n_tokens, int64_t row, int64_t n_slots, uint64_t seed) {
  bench::Rng rng(seed);
  bench::Vec<T> kc(n_slots * row), vc(n_slots * row), k(n_tokens * row), v(n_tokens * row);
  bench::fill_random(kc, rng);
  bench::fill_random(vc, rng);
  bench::fill_random(k, rng);
  bench::fill_random(v, rng);
  bench::Vec<T> want_k = kc, want_v = vc;
  // Distinct slots in random order (a partial Fisher-Yates shuffle of 0..n_slots-1).
  std::vector<int64_t> perm(static_cast<size_t>(n_slots));
  std::iota(perm.begin(), perm.end(), int64_t{0});
  for (int64_t i = 0; i < n_tokens; ++i)
    std::swap(perm[static_cast<size_t>(i)], perm[static_cast<size_t>(rng.randint(i, n_slots - 1))]);
  std::vector<I> slots(perm.begin(), perm.begin() + n_tokens);
  orca::cpu::slab_write<T, I>(kc.data(), vc.data(), k.data(), v.data(), slots.data(), n_tokens, row);
  bench::ref::slab_write(want_k.data(), want_v.data(), k.data(), v.data(), slots.data(), n_tokens, n_slots, row);

  size_t bad = 0;
  for (int64_t s = 0; s < n_slots; ++s) {
    if (!same_bits(&kc[s * row], &want_k[s * row], row) || !same_bits(&vc[s * row], &want_v[s * row], row)) {
      if (bad < 5) std::printf("  slot %lld differs\n", static_cast<long long>(s));
      ++bad;
    }
  }
  char name[160];
  std::snprintf(name, sizeof name, "slab_write<%s,%s> T=%lld row=%lld S=%lld", sizeof(T) == 2 ? "bf16" : "f32",
                sizeof(I) == 4 ? "i32" : "i64", static_cast<long long>(n_tokens), static_cast<long long>(row),
                static_cast<long long>(n_slots));
  if (bad) {
    std::printf("FAIL %s: %zu slots wrong\n", name, bad);
    return false;
  }
  std::printf("ok   %s\n", name);
  return true;
}

template <typename T, typename I>
bool validate_all() {
  bool ok = true;
  uint64_t seed = 10 * sizeof(T) + sizeof(I);
  const int64_t tokens[] = {1, 7, 83, 1000};
  const int64_t rows[] = {13, 64, 3 * 64, 2 * 80, 7 * 128};
  for (int64_t t : tokens)
    for (int64_t r : rows) ok &= check_case<T, I>(t, r, t + 1 + t / 2, ++seed);
  return ok;
}

template <typename T>
void perf(const char* dtype, const bench::Ceilings& c) {
  const int64_t row = 3 * 64, n_slots = 16384;
  bench::Rng rng(9);
  const size_t pool = static_cast<size_t>(n_slots * row);
  const int layers = 8;
  std::vector<bench::Vec<T>> kc(layers, bench::Vec<T>(pool)), vc = kc;
  for (int l = 0; l < layers; ++l) {
    bench::fill_random(kc[static_cast<size_t>(l)], rng);
    bench::fill_random(vc[static_cast<size_t>(l)], rng);
  }
  struct Case {
    const char* name;
    std::vector<int32_t> slots;
  };
  std::vector<Case> cases(2);
  cases[0].name = "decode";  // the next position of 32 requests with slabs of 512 slots
  for (int i = 0; i < 32; ++i) cases[0].slots.push_back(static_cast<int32_t>(i * 512 + rng.randint(16, 500)));
  cases[1].name = "prefill";  // 4 prompts of 512 tokens, each at the start of its slab
  for (int i = 0; i < 4; ++i)
    for (int p = 0; p < 512; ++p) cases[1].slots.push_back(static_cast<int32_t>(i * 1024 + p));
  for (const Case& cs : cases) {
    const int64_t n = static_cast<int64_t>(cs.slots.size());
    bench::Vec<T> k(n * row), v(n * row);
    bench::fill_random(k, rng);
    bench::fill_random(v, rng);
    int layer = 0;
    const bench::Timing t = bench::time_calls(
        [&] {
          orca::cpu::slab_write<T, int32_t>(kc[static_cast<size_t>(layer)].data(), vc[static_cast<size_t>(layer)].data(),
                                            k.data(), v.data(), cs.slots.data(), n, row);
          layer = (layer + 1) % layers;
        },
        n > 64 ? 101 : 1001, layers);
    const double bytes = 2.0 * 2.0 * static_cast<double>(n * row) * sizeof(T);  // K and V, read + write
    char label[96];
    std::snprintf(label, sizeof label, "slab_write %s %s T=%lld", dtype, cs.name, static_cast<long long>(n));
    bench::report(label, t, 0.0, bytes, c);
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool ok = validate_all<float, int32_t>();
  ok &= validate_all<float, int64_t>();
  ok &= validate_all<bf16, int32_t>();
  ok &= validate_all<bf16, int64_t>();
  return bench::finish_main(argc, argv, ok, [](const bench::Ceilings& c) {
    perf<float>("f32", c);
    perf<bf16>("bf16", c);
  });
}
