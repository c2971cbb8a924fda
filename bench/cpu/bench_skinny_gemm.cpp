// Microbenchmark of the weight-streaming linear layers (linear, linear_silu_mul; rmsnorm_qkv shares
// their driver).
// 1. Validates against the scalar double-precision reference (bench/common/reference.h) on random
//    data of awkward sizes (K and N not multiples of any vector width, T across the block
//    shapes), float32 on every float32 path this CPU can run (avx2, avx512), and bf16 on every bf16
//    path (avx2, the scalar emulation of avx512_bf16, and the native avx512_bf16 and amx_bf16 where
//    present). Also checks bit-for-bit batch invariance: each token's outputs
//    from a 13-token call equal those of the token alone, with 1 thread and with all threads.
//    Exits 1 on any mismatch.
// 2. Times SmolLM2-135M-Instruct (H = 576, I = 1536, 30 layers, tied 49152-row lm_head): every
//    linear layer of one decode step (T = 1) over all 30 layers' weights, which is what a forward
//    reads from memory, and prints GB/s next to the streaming-read ceiling measured here. Then
//    each projection alone at T = 1, and gate_up over a range of T (GFLOP/s next to the FMA
//    ceiling), rotating over 30 weight copies so that weights come from memory, not cache.
// 3. Prefill: every projection of one layer at T = 1, 8, 32, 128, 512 for SmolLM2-135M and for a
//    Llama-3.2-1B-like layer (H = 2048, I = 8192, 32 x 64 query and 8 x 64 kv heads), on each
//    float32 and bf16 path, in GFLOP/s against the FMA peak (bf16: against the path's own
//    multiply-add probe, vdpbf16ps chains or AMX tile products). The peak is the larger of the ymm and (where
//    the CPU has AVX-512F) zmm FMA-chain probes: cores that split 512-bit FMAs into two halves
//    (Zen 4) have the same peak for both, cores with two 512-bit FMA units twice the ymm one.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "bench_util.h"
#include "common/reference.h"
#include "cpu/cpu_kernels.h"
#include "cpu/vec.h"

namespace {

using orca::bf16;
using orca::cpu::Bf16Path;
using orca::cpu::F32Path;

// A rigorous bound on float32 accumulation error: each lane adds at most K/8 products (one
// rounding each), then 3 tree adds, then bias and residual. amx_bf16 runs each sum as one chain
// through K in tile steps whose internal rounding is unspecified: one ulp per product there.
template <typename T>
double accumulation_rtol(int64_t K) {
  if (sizeof(T) == 2 && orca::cpu::bf16_path() == Bf16Path::kAmxBf16)
    return static_cast<double>(2 * K + 6) * std::ldexp(1.0, -24);
  return static_cast<double>(K / 8 + 6) * std::ldexp(1.0, -24);
}

template <typename T>
constexpr double out_rtol() {  // rounding of the stored result: half an ulp
  return sizeof(T) == 2 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -24);
}

template <typename T>
const char* dtype_name() {
  return sizeof(T) == 2 ? "bf16" : "f32";
}

template <typename T>
const char* path_label() {
  return sizeof(T) == 2 ? orca::cpu::bf16_path_name(orca::cpu::bf16_path())
                        : orca::cpu::f32_path_name(orca::cpu::f32_path());
}

bool report_case(const char* name, size_t bad, size_t n, double worst) {
  if (bad) {
    std::printf("FAIL %s: %zu of %zu out of tolerance\n", name, bad, n);
    return false;
  }
  std::printf("ok   %-72s max abs err %.2e\n", name, worst);
  return true;
}

template <typename T>
bool check_linear(int64_t Tn, int64_t K, int64_t N, bool with_bias, bool with_residual, uint64_t seed) {
  bench::Rng rng(seed);
  bench::Vec<T> x(Tn * K), w(N * K), b(N), r(Tn * N), out(Tn * N);
  bench::fill_random(x, rng, -2.0f, 2.0f);
  bench::fill_random(w, rng, -0.2f, 0.2f);
  bench::fill_random(b, rng, -0.5f, 0.5f);
  bench::fill_random(r, rng, -1.0f, 1.0f);
  const T* bias = with_bias ? b.data() : nullptr;
  const T* residual = with_residual ? r.data() : nullptr;
  orca::cpu::linear<T>(x.data(), w.data(), bias, residual, out.data(), Tn, K, N);
  const bench::ref::LinearReference lr =
      bench::ref::linear(x.data(), w.data(), bias, residual, Tn, K, N, bench::ToDouble{});
  const std::vector<double>& ref = lr.out;
  const std::vector<double>& mass = lr.mass;
  const std::vector<double> got = bench::to_double(out);
  size_t bad = 0;
  double worst = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double tol = out_rtol<T>() * std::fabs(ref[i]) + accumulation_rtol<T>(K) * mass[i] + 1e-30;
    const double err = std::fabs(got[i] - ref[i]);
    if (!(err <= tol)) {
      if (bad < 5) std::printf("  index %zu got %.8g expected %.8g (tol %.3g)\n", i, got[i], ref[i], tol);
      ++bad;
    }
    worst = std::max(worst, err);
  }
  char name[160];
  std::snprintf(name, sizeof name, "linear<%s,%s> T=%lld K=%lld N=%lld bias=%d residual=%d", dtype_name<T>(),
                path_label<T>(), static_cast<long long>(Tn),
                static_cast<long long>(K), static_cast<long long>(N), with_bias, with_residual);
  return report_case(name, bad, ref.size(), worst);
}

template <typename T>
bool check_silu_mul(int64_t Tn, int64_t K, int64_t I, bool with_bias, uint64_t seed) {
  bench::Rng rng(seed);
  bench::Vec<T> x(Tn * K), w(2 * I * K), b(2 * I), out(Tn * I);
  bench::fill_random(x, rng, -2.0f, 2.0f);
  bench::fill_random(w, rng, -0.3f, 0.3f);
  bench::fill_random(b, rng, -0.5f, 0.5f);
  const T* bias = with_bias ? b.data() : nullptr;
  orca::cpu::linear_silu_mul<T>(x.data(), w.data(), bias, out.data(), Tn, K, I);
  // gate and up are the two halves of one linear over the stacked [2I, K] weight.
  const bench::ref::LinearReference lr =
      bench::ref::linear(x.data(), w.data(), bias, static_cast<const T*>(nullptr), Tn, K, 2 * I, bench::ToDouble{});
  const std::vector<double>& gu = lr.out;
  const std::vector<double>& mass = lr.mass;
  const std::vector<double> got = bench::to_double(out);
  size_t bad = 0;
  double worst = 0.0;
  for (int64_t t = 0; t < Tn; ++t)
    for (int64_t n = 0; n < I; ++n) {
      const size_t gi = static_cast<size_t>(t * 2 * I + n), ui = gi + static_cast<size_t>(I);
      const double g = gu[gi], u = gu[ui];
      const double sig = 1.0 / (1.0 + std::exp(-g));
      const double ref = g * sig * u;
      // Errors dg, du of the float32 gate and up propagate through d(silu)/dg <= 1.1; silu and the
      // product add a few float32 roundings; then the output is rounded.
      const double dg = accumulation_rtol<T>(K) * mass[gi], du = accumulation_rtol<T>(K) * mass[ui];
      const double tol = out_rtol<T>() * std::fabs(ref) + 1.1 * std::fabs(u) * dg + std::fabs(g * sig) * du +
                         1e-6 * std::fabs(ref) + 1e-30;
      const double err = std::fabs(got[static_cast<size_t>(t * I + n)] - ref);
      if (!(err <= tol)) {
        if (bad < 5) std::printf("  t %lld n %lld got %.8g expected %.8g (tol %.3g)\n", static_cast<long long>(t),
                                 static_cast<long long>(n), got[static_cast<size_t>(t * I + n)], ref, tol);
        ++bad;
      }
      worst = std::max(worst, err);
    }
  char name[160];
  std::snprintf(name, sizeof name, "linear_silu_mul<%s,%s> T=%lld K=%lld I=%lld bias=%d", dtype_name<T>(),
                path_label<T>(), static_cast<long long>(Tn),
                static_cast<long long>(K), static_cast<long long>(I), with_bias);
  return report_case(name, bad, static_cast<size_t>(Tn * I), worst);
}

// Each token's outputs from one 13-token call equal, bit for bit, those of the token alone and of
// the token inside a 5-token call, with 1 thread and with all threads.
template <typename T>
bool check_batch_invariance(int64_t K, int64_t N, uint64_t seed) {
  const int64_t Tn = 13;
  bench::Rng rng(seed);
  bench::Vec<T> x(Tn * K), w(N * K), b(N), nw(K), big(Tn * N), one(N), five(5 * N), gu(2 * N * K), act_big(Tn * N),
      act_one(N), qkv_big(Tn * N), qkv_one(N);
  bench::fill_random(x, rng, -2.0f, 2.0f);
  bench::fill_random(w, rng, -0.2f, 0.2f);
  bench::fill_random(b, rng, -0.5f, 0.5f);
  bench::fill_random(nw, rng, 0.5f, 1.5f);
  bench::fill_random(gu, rng, -0.3f, 0.3f);
  orca::cpu::linear<T>(x.data(), w.data(), b.data(), nullptr, big.data(), Tn, K, N);
  orca::cpu::linear_silu_mul<T>(x.data(), gu.data(), nullptr, act_big.data(), Tn, K, N);
  orca::cpu::rmsnorm_qkv<T>(x.data(), nw.data(), w.data(), b.data(), qkv_big.data(), Tn, K, N, 1e-5f);
  bool ok = true;
  const int max_threads = omp_get_max_threads();
  for (int threads : {1, max_threads}) {
    omp_set_num_threads(threads);
    for (int64_t t = 0; t < Tn; ++t) {
      const T* xt = x.data() + t * K;
      orca::cpu::linear<T>(xt, w.data(), b.data(), nullptr, one.data(), 1, K, N);
      orca::cpu::linear_silu_mul<T>(xt, gu.data(), nullptr, act_one.data(), 1, K, N);
      orca::cpu::rmsnorm_qkv<T>(xt, nw.data(), w.data(), b.data(), qkv_one.data(), 1, K, N, 1e-5f);
      const size_t bytes = static_cast<size_t>(N) * sizeof(T);
      ok &= std::memcmp(one.data(), big.data() + t * N, bytes) == 0;
      ok &= std::memcmp(act_one.data(), act_big.data() + t * N, bytes) == 0;
      ok &= std::memcmp(qkv_one.data(), qkv_big.data() + t * N, bytes) == 0;
      if (t + 5 <= Tn) {
        orca::cpu::linear<T>(xt, w.data(), b.data(), nullptr, five.data(), 5, K, N);
        ok &= std::memcmp(five.data(), big.data() + t * N, 5 * bytes) == 0;
      }
    }
  }
  omp_set_num_threads(max_threads);
  char name[160];
  std::snprintf(name, sizeof name, "batch invariance <%s,%s> K=%lld N=%lld (linear, silu_mul, rmsnorm_qkv)",
                dtype_name<T>(), path_label<T>(), static_cast<long long>(K),
                static_cast<long long>(N));
  return report_case(name, ok ? 0 : 1, 1, 0.0);
}

// Few-token calls split the outputs into one range per thread, and a thread done with its own
// takes the rest of another's from its end. With more threads than ranges (N of a few panels),
// the extra threads do nothing but take from the ends, from the start: every output must still
// come out once, with the bits of a one-thread call.
template <typename T>
bool check_helpers(int64_t Tn, int64_t K, int64_t N, uint64_t seed) {
  bench::Rng rng(seed);
  bench::Vec<T> x(Tn * K), w(N * K), gu(2 * N * K), alone(Tn * N), act_alone(Tn * N), out(Tn * N), act(Tn * N);
  bench::fill_random(x, rng, -2.0f, 2.0f);
  bench::fill_random(w, rng, -0.2f, 0.2f);
  bench::fill_random(gu, rng, -0.3f, 0.3f);
  const int max_threads = omp_get_max_threads();
  omp_set_num_threads(1);
  orca::cpu::linear<T>(x.data(), w.data(), nullptr, nullptr, alone.data(), Tn, K, N);
  orca::cpu::linear_silu_mul<T>(x.data(), gu.data(), nullptr, act_alone.data(), Tn, K, N);
  size_t bad = 0;
  const size_t bytes = static_cast<size_t>(Tn * N) * sizeof(T);
  for (int threads : {3, 5, 8}) {
    omp_set_num_threads(threads);
    for (int rep = 0; rep < 20; ++rep) {
      std::memset(out.data(), 0, bytes);
      std::memset(act.data(), 0, bytes);
      orca::cpu::linear<T>(x.data(), w.data(), nullptr, nullptr, out.data(), Tn, K, N);
      orca::cpu::linear_silu_mul<T>(x.data(), gu.data(), nullptr, act.data(), Tn, K, N);
      bad += std::memcmp(out.data(), alone.data(), bytes) != 0;
      bad += std::memcmp(act.data(), act_alone.data(), bytes) != 0;
    }
  }
  omp_set_num_threads(max_threads);
  char name[160];
  std::snprintf(name, sizeof name, "helper threads <%s,%s> T=%lld K=%lld N=%lld (3, 5, 8 threads = 1 thread)",
                dtype_name<T>(), path_label<T>(), static_cast<long long>(Tn), static_cast<long long>(K),
                static_cast<long long>(N));
  return report_case(name, bad, 2 * 3 * 20, 0.0);
}

// WorkClaims under contention: owners take from the front and helpers from the back of the same
// shares at once, and every position is taken exactly once.
bool check_work_claims() {
  size_t bad = 0, cases = 0;
  const int max_threads = omp_get_max_threads();
  omp_set_num_threads(4);
  for (int64_t n : {int64_t{1}, int64_t{2}, int64_t{7}, int64_t{64}, int64_t{1000}, int64_t{100003}})
    for (int64_t min_take : {int64_t{1}, int64_t{3}, int64_t{50}})
      for (int shares : {1, 2, 3}) {
        std::vector<orca::cpu::detail::WorkClaims> claims(static_cast<size_t>(shares));
        for (auto& c : claims) c.reset(n);
        std::vector<std::atomic<int>> taken(static_cast<size_t>(shares * n));
        for (auto& t : taken) t.store(0);
#pragma omp parallel
        {
          const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
          int64_t i0 = 0, i1 = 0;
          auto mark = [&](int share) {
            for (int64_t i = i0; i < i1; ++i) taken[static_cast<size_t>(share * n + i)].fetch_add(1);
          };
          if (tid < shares)
            while (claims[static_cast<size_t>(tid)].take(min_take, true, &i0, &i1)) mark(tid);
          for (int k = 1; k <= nth + shares; ++k) {
            const int share = (tid + k) % shares;
            while (claims[static_cast<size_t>(share)].take(min_take, false, &i0, &i1)) mark(share);
          }
        }
        for (const auto& t : taken) bad += t.load() != 1;
        cases += static_cast<size_t>(shares * n);
      }
  omp_set_num_threads(max_threads);
  return report_case("WorkClaims: owners from the front, helpers from the back, 4 threads", bad, cases, 0.0);
}

template <typename T>
bool validate_all(uint64_t seed) {
  bool ok = true;
  const int64_t tokens[] = {1, 2, 3, 5, 13, 97};
  const int64_t ks[] = {1, 7, 33, 96, 581};  // 96: AMX tiles (K a multiple of 32)
  const int64_t ns[] = {1, 9, 67, 260};
  for (int64_t K : ks)
    for (int64_t N : ns)
      for (int64_t Tn : tokens) {
        ++seed;
        ok &= check_linear<T>(Tn, K, N, seed % 2 == 0, seed % 3 == 0, seed);
      }
  for (int64_t Tn : {int64_t{1}, int64_t{4}, int64_t{29}})
    for (int64_t I : {int64_t{1}, int64_t{5}, int64_t{131}}) {
      ++seed;
      ok &= check_silu_mul<T>(Tn, 263, I, seed % 2 == 0, seed);
    }
  ok &= check_linear<T>(300, 97, 11, true, true, ++seed);  // more token tiles than panels: tiles split
  ok &= check_silu_mul<T>(37, 96, 131, true, ++seed);
  ok &= check_batch_invariance<T>(581, 67, ++seed);
  ok &= check_batch_invariance<T>(64, 260, ++seed);
  ok &= check_helpers<T>(1, 8200, 9, ++seed);   // 2 panels (1 for gate_up): ranges < threads
  ok &= check_helpers<T>(3, 2900, 37, ++seed);  // 5 panels, 3 tokens
  return ok;
}

std::vector<F32Path> runnable_f32_paths() {
  std::vector<F32Path> paths;
  for (F32Path p : {F32Path::kAvx2, F32Path::kAvx512})
    if (orca::cpu::f32_path_supported(p)) paths.push_back(p);
  return paths;
}

std::vector<Bf16Path> runnable_bf16_paths() {
  std::vector<Bf16Path> paths;
  for (Bf16Path p : {Bf16Path::kAvx2, Bf16Path::kAvx512Bf16Emulated, Bf16Path::kAvx512Bf16, Bf16Path::kAmxBf16})
    if (orca::cpu::bf16_path_supported(p)) paths.push_back(p);
  return paths;
}

// ---- timings ------------------------------------------------------------------------------------

struct Shape {
  int64_t hidden = 576, inter = 1536, qkv = (9 + 2 * 3) * 64, vocab = 49152, layers = 30;
};

template <typename T>
struct LayerWeights {
  bench::Vec<T> norm, qkv, o, gate_up, down;
};

template <typename T>
struct Model {
  Shape s;
  std::vector<LayerWeights<T>> layers;
  bench::Vec<T> final_norm, lm_head;

  explicit Model(bench::Rng& rng) {
    layers.resize(static_cast<size_t>(s.layers));
    for (auto& l : layers) {
      l.norm.resize(s.hidden);
      l.qkv.resize(s.qkv * s.hidden);
      l.o.resize(s.hidden * s.hidden);
      l.gate_up.resize(2 * s.inter * s.hidden);
      l.down.resize(s.hidden * s.inter);
      for (auto* v : {&l.norm, &l.qkv, &l.o, &l.gate_up, &l.down}) bench::fill_random(*v, rng, -0.05f, 0.05f);
    }
    final_norm.resize(s.hidden);
    lm_head.resize(s.vocab * s.hidden);
    bench::fill_random(final_norm, rng, 0.5f, 1.5f);
    bench::fill_random(lm_head, rng, -0.05f, 0.05f);
  }

  double weight_bytes() const {
    const double per_layer = static_cast<double>(s.qkv * s.hidden + s.hidden * s.hidden + 2 * s.inter * s.hidden +
                                                 s.hidden * s.inter);
    return sizeof(T) * (per_layer * static_cast<double>(s.layers) + static_cast<double>(s.vocab * s.hidden));
  }
};

// Every linear layer of one forward over Tn tokens (attention and the small norms left out: they
// read no weights). x and scratch buffers are [Tn, *].
template <typename T>
void model_step(const Model<T>& m, int64_t Tn, bench::Vec<T>& x, bench::Vec<T>& qkv, bench::Vec<T>& act,
                bench::Vec<T>& logits) {
  const Shape& s = m.s;
  for (const auto& l : m.layers) {
    orca::cpu::rmsnorm_qkv<T>(x.data(), l.norm.data(), l.qkv.data(), nullptr, qkv.data(), Tn, s.hidden, s.qkv, 1e-5f);
    // o_proj reads the first H columns of qkv as its [Tn, H] input (the attention output's shape).
    orca::cpu::linear<T>(qkv.data(), l.o.data(), nullptr, x.data(), x.data(), Tn, s.hidden, s.hidden);
    orca::cpu::linear_silu_mul<T>(x.data(), l.gate_up.data(), nullptr, act.data(), Tn, s.hidden, s.inter);
    orca::cpu::linear<T>(act.data(), l.down.data(), nullptr, x.data(), x.data(), Tn, s.inter, s.hidden);
  }
  orca::cpu::rmsnorm_qkv<T>(x.data(), m.final_norm.data(), m.lm_head.data(), nullptr, logits.data(), Tn, s.hidden,
                            s.vocab, 1e-5f);
}

template <typename T>
void perf(const char* label, const Model<T>& m, const bench::Ceilings& c) {
  const Shape& s = m.s;
  bench::Rng rng(99);
  for (int64_t Tn : {int64_t{1}, int64_t{4}, int64_t{16}}) {
    bench::Vec<T> x(Tn * s.hidden), qkv(Tn * s.qkv), act(Tn * s.inter), logits(Tn * s.vocab);
    bench::fill_random(x, rng, -1.0f, 1.0f);
    const bench::Vec<T> x0 = x;
    const bench::Timing t = bench::time_calls(
        [&] {
          x = x0;  // keep the values bounded across repeats
          model_step(m, Tn, x, qkv, act, logits);
        },
        Tn == 1 ? 15 : 7, 2);
    char name[96];
    std::snprintf(name, sizeof name, "all linear layers %s T=%lld (%.0f MB)", label, static_cast<long long>(Tn),
                  m.weight_bytes() * 1e-6);
    const double flops = 2.0 * static_cast<double>(Tn) * m.weight_bytes() / sizeof(T);
    bench::report(name, t, flops, m.weight_bytes(), c);
    if (Tn == 1)
      std::printf("    -> bound %.1f tok/s at the read ceiling; this step alone %.1f tok/s\n",
                  c.read_gbs * 1e9 / m.weight_bytes(), 1.0 / t.median);
  }
  // Each projection alone at T = 1, rotating over the 30 layers' copies.
  struct Proj {
    const char* name;
    int64_t rows, k;
    int kind;  // 0 rmsnorm_qkv, 1 linear (+residual), 2 silu_mul
  };
  const Proj projs[] = {{"qkv (norm fused) 576->960", s.qkv, s.hidden, 0},
                        {"o_proj + residual 576->576", s.hidden, s.hidden, 1},
                        {"gate_up + silu*mul 576->2x1536", 2 * s.inter, s.hidden, 2},
                        {"down + residual 1536->576", s.hidden, s.inter, 1}};
  for (const Proj& p : projs)
    for (int64_t Tn : {int64_t{1}, int64_t{8}, int64_t{32}, int64_t{128}}) {
      if (p.kind != 2 && Tn != 1) continue;  // the T sweep is for the largest projection only
      bench::Vec<T> x(Tn * p.k), out(Tn * p.rows), res(Tn * p.rows);
      bench::fill_random(x, rng, -1.0f, 1.0f);
      bench::fill_random(res, rng, -1.0f, 1.0f);
      size_t layer = 0;
      const bench::Timing t = bench::time_calls(
          [&] {
            const auto& l = m.layers[layer];
            layer = (layer + 1) % m.layers.size();
            if (p.kind == 0)
              orca::cpu::rmsnorm_qkv<T>(x.data(), l.norm.data(), l.qkv.data(), nullptr, out.data(), Tn, p.k, p.rows,
                                        1e-5f);
            else if (p.kind == 1)
              orca::cpu::linear<T>(x.data(), p.k == s.hidden ? l.o.data() : l.down.data(), nullptr, res.data(),
                                   out.data(), Tn, p.k, p.rows);
            else
              orca::cpu::linear_silu_mul<T>(x.data(), l.gate_up.data(), nullptr, out.data(), Tn, p.k, p.rows / 2);
          },
          Tn >= 32 ? 15 : 61, 30);
      char name[96];
      std::snprintf(name, sizeof name, "%s %s T=%lld", p.name, label, static_cast<long long>(Tn));
      const double bytes = sizeof(T) * static_cast<double>(p.rows * p.k + Tn * (p.k + p.rows));
      bench::report(name, t, 2.0 * Tn * p.rows * p.k, bytes, c);
    }
}

// ---- prefill sweep ----------------------------------------------------------------------------


struct LayerShape {
  const char* name;
  int64_t hidden, qkv, inter;
};

// The bf16 multiply-add peak of the vdpbf16ps path (12 independent chains, 32 products each) or
// of the AMX path (4 independent accumulator tiles, 16 x 16 x 32 products each), GFLOP/s on every
// thread at once; 0 where this CPU has no such path.
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16,amx-tile,amx-bf16")
__attribute__((noinline)) float dpbf16_chains(int64_t iters, float seed) {
  __m512 acc[12];
  for (auto& a : acc) a = _mm512_set1_ps(seed);
  const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), w = (__m512bh)_mm512_set1_epi16(0x2f80);  // 1, 2^-32
  for (int64_t i = 0; i < iters; ++i)
    for (auto& a : acc) a = _mm512_dpbf16_ps(a, x, w);
  float s = 0.0f;
  for (auto& a : acc) s += _mm512_reduce_add_ps(a);
  return s;
}

__attribute__((noinline)) float amx_chains(int64_t iters, float) {
  // A constant in memory: GCC's _tile_loadconfig declares an 8-byte read, so a stack copy's other
  // bytes could be dropped.
  struct alignas(64) Config {
    uint8_t palette, start, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  };
  static constexpr Config cfg = {1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};
  alignas(64) static const bf16 zeros[16 * 32] = {};
  alignas(64) float out[16 * 16];
  _tile_loadconfig(&cfg);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, zeros, 64);
  _tile_loadd(5, zeros, 64);
  _tile_loadd(6, zeros, 64);
  _tile_loadd(7, zeros, 64);
  for (int64_t i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(3, out, 64);
  _tile_release();
  return out[0];
}
#pragma GCC pop_options

double bf16_peak_gflops(Bf16Path path) {
  constexpr int64_t kAmxIters = 1000000;
  if (path == Bf16Path::kAmxBf16)  // 4 tile products of 16 x 16 x 32 multiply-adds per iteration
    return bench::measure_gflops(amx_chains, kAmxIters, 2.0 * 4 * 16 * 16 * 32 * kAmxIters);
  if (path == Bf16Path::kAvx512Bf16)  // 12 chains of 32 products (16 lanes x a pair) per iteration
    return bench::measure_chains_gflops(dpbf16_chains, 32, 10000000);
  return 0.0;
}
#else
double bf16_peak_gflops(Bf16Path) { return 0.0; }
#endif

// One layer's projections (qkv with its norm, o + residual, gate_up + SiLU, down + residual) over
// T tokens, on each instruction path of T's kernels; each call's FLOPs against the path's peak
// (float32: the FMA peak; bf16: the path's own multiply-add probe above) and the weight bytes
// against the read ceiling.
template <typename T>
void prefill_sweep(const LayerShape& s, const bench::Ceilings& c, const std::vector<double>& bf16_peaks) {
  bench::Rng rng(7);
  bench::Vec<T> norm(s.hidden), qkv_w(s.qkv * s.hidden), o_w(s.hidden * s.hidden), gu_w(2 * s.inter * s.hidden),
      down_w(s.hidden * s.inter);
  for (auto* v : {&norm, &qkv_w, &o_w, &gu_w, &down_w}) bench::fill_random(*v, rng, -0.05f, 0.05f);
  const double weight_elems = static_cast<double>(s.qkv * s.hidden + s.hidden * s.hidden + 2 * s.inter * s.hidden +
                                                  s.hidden * s.inter);
  std::vector<int> paths;
  if constexpr (sizeof(T) == 4) {
    for (F32Path p : runnable_f32_paths()) paths.push_back(static_cast<int>(p));
  } else {
    for (Bf16Path p : runnable_bf16_paths())
      if (p != Bf16Path::kAvx512Bf16Emulated) paths.push_back(static_cast<int>(p));  // a test aid: too slow
  }
  for (int64_t Tn : {int64_t{1}, int64_t{8}, int64_t{32}, int64_t{128}, int64_t{512}}) {
    bench::Vec<T> x(Tn * s.hidden), qkv(Tn * s.qkv), act(Tn * s.inter), res(Tn * s.hidden), out(Tn * s.hidden);
    bench::fill_random(x, rng, -1.0f, 1.0f);
    bench::fill_random(act, rng, -1.0f, 1.0f);
    bench::fill_random(res, rng, -1.0f, 1.0f);
    for (int path : paths) {
      bench::Ceilings pc = c;
      if constexpr (sizeof(T) == 4) {
        orca::cpu::set_f32_path(static_cast<F32Path>(path));
      } else {
        orca::cpu::set_bf16_path(static_cast<Bf16Path>(path));
        const double peak = bf16_peaks[static_cast<size_t>(path)];
        if (peak > 0.0) pc.fma_gflops = peak;
      }
      const bench::Timing t = bench::time_calls(
          [&] {
            orca::cpu::rmsnorm_qkv<T>(x.data(), norm.data(), qkv_w.data(), nullptr, qkv.data(), Tn, s.hidden, s.qkv,
                                      1e-5f);
            orca::cpu::linear<T>(x.data(), o_w.data(), nullptr, res.data(), out.data(), Tn, s.hidden, s.hidden);
            orca::cpu::linear_silu_mul<T>(x.data(), gu_w.data(), nullptr, act.data(), Tn, s.hidden, s.inter);
            orca::cpu::linear<T>(act.data(), down_w.data(), nullptr, res.data(), out.data(), Tn, s.inter, s.hidden);
          },
          Tn >= 128 ? 7 : 21, 3);
      char name[96];
      std::snprintf(name, sizeof name, "layer %s %s/%s T=%lld", s.name, dtype_name<T>(), path_label<T>(),
                    static_cast<long long>(Tn));
      bench::report(name, t, 2.0 * static_cast<double>(Tn) * weight_elems, sizeof(T) * weight_elems, pc);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool ok = true;
  for (F32Path path : runnable_f32_paths()) {
    orca::cpu::set_f32_path(path);
    ok &= validate_all<float>(1000 + 50 * static_cast<uint64_t>(path));
  }
  ok &= check_linear<float>(513, 581, 67, true, true, 7);  // prompt-sized T: token blocks and remainders
  ok &= check_work_claims();
  for (Bf16Path path : runnable_bf16_paths()) {
    orca::cpu::set_bf16_path(path);
    ok &= validate_all<bf16>(2000 + 100 * static_cast<uint64_t>(path));
  }
  return bench::finish_main(argc, argv, ok, [](const bench::Ceilings& measured) {
    bench::Ceilings c = measured;
    const double zmm = bench::measure_fma_gflops_zmm();
    if (zmm > 0.0) std::printf("zmm FMA %.1f GFLOP/s; the peak below is the larger of ymm and zmm\n", zmm);
    c.fma_gflops = std::max(c.fma_gflops, zmm);
    bench::Rng rng(42);
    {
      const Model<float> m(rng);
      for (F32Path path : runnable_f32_paths()) {
        orca::cpu::set_f32_path(path);
        char label[48];
        std::snprintf(label, sizeof label, "f32/%s", orca::cpu::f32_path_name(path));
        perf<float>(label, m, c);
      }
    }
    std::vector<double> bf16_peaks(8, 0.0);  // by Bf16Path; the best of three probes
    for (Bf16Path path : runnable_bf16_paths()) {
      double& peak = bf16_peaks[static_cast<size_t>(path)];
      for (int i = 0; i < 3; ++i) peak = std::max(peak, bf16_peak_gflops(path));
      if (peak > 0.0) std::printf("bf16 multiply-add peak of %s: %.0f GFLOP/s\n", orca::cpu::bf16_path_name(path), peak);
    }
    for (const LayerShape& shape : {LayerShape{"SmolLM2-135M 576/960/1536", 576, 960, 1536},
                                    LayerShape{"Llama-3.2-1B-like 2048/3072/8192", 2048, 3072, 8192}}) {
      prefill_sweep<float>(shape, c, bf16_peaks);
      prefill_sweep<bf16>(shape, c, bf16_peaks);
    }
    const Model<bf16> m(rng);
    for (Bf16Path path : runnable_bf16_paths()) {
      if (path == Bf16Path::kAvx512Bf16Emulated) continue;  // a test aid, far too slow to time
      orca::cpu::set_bf16_path(path);
      char label[48];
      std::snprintf(label, sizeof label, "bf16/%s", orca::cpu::bf16_path_name(path));
      perf<bf16>(label, m, c);
    }
  });
}
