// Shared helpers of the CPU microbenchmarks (header-only, no torch): a timer, seeded random
// fills, median-of-repeats timing, tolerance checks against double references, and the
// machine's measured ceilings (streaming-read and memcpy bandwidth, FMA throughput) so that each
// kernel's number is printed next to what the same process can reach.
#pragma once
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "cpu/cpu_kernels.h"

namespace bench {

// 64-byte-aligned allocator: torch's CPU allocator aligns tensors to 64 bytes, so the
// benchmarks' buffers do too (misaligned rows would measure a slower case than production).
// Buffers of 2 MiB or more start on a 2 MiB boundary and are advised to use transparent huge
// pages, as the engine's CPU weights are (orca_ext/models/huge_pages.py).
template <typename T>
struct AlignedAlloc {
  using value_type = T;
  AlignedAlloc() = default;
  template <typename U>
  AlignedAlloc(const AlignedAlloc<U>&) {}
  T* allocate(size_t n) {
    constexpr size_t kHugePage = size_t{2} << 20;
    const size_t bytes = n * sizeof(T);
    const size_t align = bytes >= kHugePage ? kHugePage : 64;
    const size_t rounded = (bytes + align - 1) & ~(align - 1);  // aligned_alloc wants a multiple
    void* p = std::aligned_alloc(align, rounded);
    if (p == nullptr) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
    if (align == kHugePage) madvise(p, rounded, MADV_HUGEPAGE);
#endif
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { std::free(p); }
  template <typename U>
  bool operator==(const AlignedAlloc<U>&) const { return true; }
  template <typename U>
  bool operator!=(const AlignedAlloc<U>&) const { return false; }
};
template <typename T>
using Vec = std::vector<T, AlignedAlloc<T>>;

inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// splitmix64: tiny, seedable, identical on every platform (std::uniform_real_distribution is not).
struct Rng {
  uint64_t state;
  explicit Rng(uint64_t seed) : state(seed) {}
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }  // [0,1)
  float uniform(float lo, float hi) { return lo + static_cast<float>(uniform()) * (hi - lo); }
  int64_t randint(int64_t lo, int64_t hi) {  // inclusive
    return lo + static_cast<int64_t>(next() % static_cast<uint64_t>(hi - lo + 1));
  }
};

// Uniform in [lo, hi), never exactly zero (a zero-filled benchmark can hide work or bugs).
template <typename V>
void fill_random(V& v, Rng& rng, float lo = -1.0f, float hi = 1.0f) {
  for (auto& e : v) {
    float x = 0.0f;
    while (x == 0.0f) x = rng.uniform(lo, hi);
    e = orca::from_float<typename V::value_type>(x);
  }
}

// Element -> double, the conversion the shared references (bench/common/reference.h) read with.
struct ToDouble {
  template <typename T>
  double operator()(T x) const {
    return static_cast<double>(orca::to_float(x));
  }
};

template <typename V>
std::vector<double> to_double(const V& v) {
  std::vector<double> d(v.size());
  for (size_t i = 0; i < v.size(); ++i) d[i] = static_cast<double>(orca::to_float(v[i]));
  return d;
}

// Wall time of `reps` calls of f() after `warmup` untimed calls: the median (the number to
// quote) and the best (robust to other processes stealing the CPU on a shared machine).
struct Timing {
  double median;
  double best;
};

template <typename F>
Timing time_calls(F&& f, int reps = 21, int warmup = 3) {
  for (int i = 0; i < warmup; ++i) f();
  std::vector<double> t(static_cast<size_t>(reps));
  for (int i = 0; i < reps; ++i) {
    const double t0 = now_s();
    f();
    t[static_cast<size_t>(i)] = now_s() - t0;
  }
  std::sort(t.begin(), t.end());
  return {t[t.size() / 2], t.front()};
}

// |got - ref| <= atol + rtol * |ref| element-wise; prints the first few mismatches.
inline bool check_close(const char* what, const std::vector<double>& got, const std::vector<double>& ref,
                        double atol, double rtol) {
  if (got.size() != ref.size()) {
    std::printf("FAIL %s: size %zu vs reference %zu\n", what, got.size(), ref.size());
    return false;
  }
  size_t bad = 0;
  double worst = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(got[i] - ref[i]);
    const double tol = atol + rtol * std::fabs(ref[i]);
    if (!(err <= tol)) {  // also catches NaN
      if (bad < 5) std::printf("  %s: index %zu got %.8g expected %.8g (tol %.3g)\n", what, i, got[i], ref[i], tol);
      ++bad;
    }
    worst = std::max(worst, err);
  }
  if (bad) {
    std::printf("FAIL %s: %zu of %zu elements out of tolerance\n", what, bad, got.size());
    return false;
  }
  std::printf("ok   %-68s max abs err %.2e\n", what, worst);
  return true;
}

// `--validate-only` as the first argument: run the built-in checks and skip the timings (for
// CTest, sanitizer builds and slow machines).
inline bool validate_only(int argc, char** argv) {
  return argc > 1 && std::strcmp(argv[1], "--validate-only") == 0;
}

// ---- measured ceilings ---------------------------------------------------------------

struct Ceilings {
  double read_gbs;    // streaming read of a large buffer with all threads (the bound of a GEMV)
  double copy_gbs;    // memcpy of a large buffer with all threads, read + write bytes per second
  double fma_gflops;  // independent FMA chains on all threads
  int threads;
};

// Each thread copies its own contiguous chunk, like the kernels' row-parallel loops.
inline double measure_copy_gbs() {
  const size_t bytes = size_t{256} << 20;  // well beyond the last-level cache
  Vec<char> src(bytes), dst(bytes);
  Rng rng(7);
  for (size_t i = 0; i < bytes; i += 4096) src[i] = static_cast<char>(rng.next() | 1u);
  auto copy = [&] {
#pragma omp parallel
    {
      const size_t nt = static_cast<size_t>(omp_get_num_threads());
      const size_t id = static_cast<size_t>(omp_get_thread_num());
      const size_t chunk = (bytes / nt) & ~size_t{63};
      const size_t beg = id * chunk;
      const size_t len = id + 1 == nt ? bytes - beg : chunk;
      std::memcpy(dst.data() + beg, src.data() + beg, len);
    }
  };
  const double t = time_calls(copy, 5, 1).best;  // a ceiling: the best run
  return 2.0 * static_cast<double>(bytes) / t * 1e-9;
}

// The streaming-read ceiling: csrc/cpu/read_probe.cpp over 512 MiB, best of 7.
inline double measure_read_gbs() {
  const size_t bytes = size_t{512} << 20;  // far beyond the last-level cache
  Vec<uint64_t> src(bytes / sizeof(uint64_t));
#pragma omp parallel for schedule(static)  // first touch by the thread that will read the page
  for (size_t i = 0; i < src.size(); ++i) src[i] = i * 0x9e3779b97f4a7c15ull;
  volatile uint64_t sink = 0;
  auto read = [&] { sink = orca::cpu::stream_read(src.data(), static_cast<int64_t>(src.size())); };
  const double t = time_calls(read, 7, 1).best;  // a ceiling: the best run
  return static_cast<double>(bytes) / t * 1e-9;
}

// 12 independent FMA chains of kLanes floats per thread: enough to cover the FMA latency on
// current x86 cores. The loop auto-vectorizes to the caller's widest registers (inlined into
// fma_chains, ymm at -march=x86-64-v3, or into fma_chains_zmm, zmm).
template <int kLanes>
__attribute__((always_inline)) inline float fma_chains_of(int64_t iters, float seed) {
  constexpr int kChains = 12;
  float acc[kChains][kLanes];
  for (int c = 0; c < kChains; ++c)
    for (int l = 0; l < kLanes; ++l) acc[c][l] = seed * static_cast<float>(c + l + 1);
  const float a = 0.999999f, b = 1e-7f;
  for (int64_t it = 0; it < iters; ++it)
    for (int c = 0; c < kChains; ++c)
      for (int l = 0; l < kLanes; ++l) acc[c][l] = acc[c][l] * a + b;
  float s = 0.0f;
  for (int c = 0; c < kChains; ++c)
    for (int l = 0; l < kLanes; ++l) s += acc[c][l];
  return s;
}

__attribute__((noinline)) inline float fma_chains(int64_t iters, float seed) { return fma_chains_of<8>(iters, seed); }

// GFLOP/s of `chains(iters, seed)`, which performs `flops` floating-point operations per call,
// run on every OpenMP thread at once (the best of 5 runs).
inline double measure_gflops(float (*chains)(int64_t, float), int64_t iters, double flops) {
  volatile float sink = 0.0f;  // keeps the chains' results alive
  int threads = 1;
  auto run = [&] {
    float total = 0.0f;
#pragma omp parallel reduction(+ : total)
    {
#pragma omp single
      threads = omp_get_num_threads();
      total += chains(iters, 1e-3f * static_cast<float>(omp_get_thread_num() + 1));
    }
    sink = total;
  };
  const double t = time_calls(run, 5, 1).best;
  return flops * threads / t * 1e-9;
}

// GFLOP/s of `chains` (12 chains of `lanes` floats per call) on every OpenMP thread at once.
inline double measure_chains_gflops(float (*chains)(int64_t, float), int lanes, int64_t iters) {
  return measure_gflops(chains, iters, 2.0 * 12 * lanes * static_cast<double>(iters));
}

inline double measure_fma_gflops() { return measure_chains_gflops(fma_chains, 8, 20000000); }

// The zmm form of fma_chains: 12 independent 16-lane chains (0 where the CPU has no AVX-512F).
// On CPUs that split 512-bit FMAs into two halves (Zen 4) it equals the ymm peak; on those with
// full-width units (Zen 5, Intel server cores) it is up to twice that.
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx512f"), noinline)) inline float fma_chains_zmm(int64_t iters, float seed) {
  return fma_chains_of<16>(iters, seed);
}

inline double measure_fma_gflops_zmm() {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f")) return 0.0;
  return measure_chains_gflops(fma_chains_zmm, 16, 10000000);
}
#else
inline double measure_fma_gflops_zmm() { return 0.0; }
#endif

// One result line: median and best time, then throughput at the median next to the ceilings.
// flops == 0 leaves out the GFLOP/s column (pure data movement).
inline void report(const char* label, const Timing& t, double flops, double bytes, const Ceilings& c) {
  std::printf("%-44s median %9.1f us (best %9.1f)", label, t.median * 1e6, t.best * 1e6);
  if (flops > 0)
    std::printf("  %6.1f GFLOP/s = %3.0f%% of FMA %.0f", flops / t.median * 1e-9,
                100.0 * flops / t.median * 1e-9 / c.fma_gflops, c.fma_gflops);
  const double gbs = bytes / t.median * 1e-9;
  std::printf("  %6.1f GB/s = %3.0f%% of read %.1f, %3.0f%% of memcpy %.1f\n", gbs, 100.0 * gbs / c.read_gbs,
              c.read_gbs, 100.0 * gbs / c.copy_gbs, c.copy_gbs);
}

inline Ceilings measure_ceilings() {
  Ceilings c;
  c.threads = omp_get_max_threads();
  c.read_gbs = measure_read_gbs();
  c.copy_gbs = measure_copy_gbs();
  c.fma_gflops = measure_fma_gflops();
  std::printf("ceilings (%d threads): streaming read %.1f GB/s, memcpy %.1f GB/s (read+write), FMA %.1f GFLOP/s\n",
              c.threads, c.read_gbs, c.copy_gbs, c.fma_gflops);
  return c;
}

// The shared tail of every main(): report validation (exit 1 on a mismatch), then run the timings
// with the measured ceilings unless --validate-only was given.
template <typename Perf>
int finish_main(int argc, char** argv, bool validation_ok, Perf&& perf) {
  if (!validation_ok) {
    std::printf("VALIDATION FAILED\n");
    return 1;
  }
  std::printf("validation passed\n\n");
  if (validate_only(argc, argv)) return 0;
  perf(measure_ceilings());
  return 0;
}

}  // namespace bench
