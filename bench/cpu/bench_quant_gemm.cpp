// Microbenchmark of the quantized weight-streaming projections (csrc/cpu/quant_kernels.h).
// 1. Validates quant_linear, quant_linear_silu_mul and quant_rmsnorm_qkv against double-precision
//    references on the dequantized rows (quant_embedding, whose reading of every format
//    tests/test_quant_kernels.py checks bit for bit against the gguf package), for every format,
//    every quantized path this CPU runs, awkward T and N, float32 and bf16 activations; and
//    bit-for-bit batch invariance (each token of a 13-token call equals the token alone). Exits 1
//    on any mismatch.
// 2. Times quant_linear over float32 activations for every format on a SmolLM2-135M-shaped layer
//    (576x576, 1536x576 up, 576x1536 down, 49152x576 lm_head) and a Llama-3.2-1B-shaped one
//    (2048x2048, 8192x2048, 2048x8192) at T = 1, 4, 16, 64, 512, rotating over enough weight
//    copies (>= 96 MiB) that weights come from memory, and prints GB/s of weight bytes read next
//    to the streaming-read ceiling (arguments at main() narrow the T and the layers).
// 3. Side by side, the int8-activation design (quant_kernels.h: quant_linear with QuantActivations::kInt8) for
//    every format that has it (activations per 32-block for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, per
//    256-block for Q4_K, Q5_K, Q6_K): validated against a bound on its activation rounding, timed
//    as "-int8act".
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "bench_util.h"
#include "cpu/quant_kernels.h"

namespace {

using orca::bf16;
using orca::cpu::QuantFormat;
using orca::cpu::QuantPath;

// Random valid blocks: random quant bytes, then every fp16 scale set to a finite positive value
// in [2^-12, 2^-7) (every bit pattern of the quants is valid).
bench::Vec<uint8_t> random_qweight(const QuantFormat& f, int64_t rows, int64_t k, bench::Rng& rng) {
  const int64_t blocks = rows * (k / f.block_elems);
  bench::Vec<uint8_t> w(static_cast<size_t>(blocks * f.block_bytes));
  for (size_t i = 0; i + 8 <= w.size(); i += 8) {
    const uint64_t r = rng.next();
    std::memcpy(&w[i], &r, 8);
  }
  for (size_t i = w.size() & ~size_t{7}; i < w.size(); ++i) w[i] = static_cast<uint8_t>(rng.next());
  auto scale = [&](uint8_t* p) {
    const uint16_t h = static_cast<uint16_t>(((3 + rng.next() % 5) << 10) | (rng.next() & 0x3ff));
    std::memcpy(p, &h, 2);
  };
  for (int64_t b = 0; b < blocks; ++b) {
    uint8_t* blk = w.data() + b * f.block_bytes;
    switch (f.type) {
      case orca::cpu::kQuantTypeQ6_K: scale(blk + 208); break;
      case orca::cpu::kQuantTypeQ4_1:
      case orca::cpu::kQuantTypeQ5_1:
      case orca::cpu::kQuantTypeQ4_K:
      case orca::cpu::kQuantTypeQ5_K: scale(blk); scale(blk + 2); break;
      case orca::cpu::kQuantTypeQ8_0:  // q in [-127, 127], as ggml's quantizer writes (the int8 design's sign
        scale(blk);                    // trick cannot negate -128)
        for (int i = 2; i < 34; ++i) blk[i] = blk[i] == 0x80 ? 0x81 : blk[i];
        break;
      default: scale(blk); break;
    }
  }
  return w;
}

std::vector<double> dequantized(const QuantFormat& f, const bench::Vec<uint8_t>& w, int64_t rows, int64_t k) {
  std::vector<int64_t> ids(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) ids[static_cast<size_t>(r)] = r;
  bench::Vec<float> out(static_cast<size_t>(rows * k));
  orca::cpu::quant_embedding<float>(w.data(), f.type, ids.data(), out.data(), rows, k);
  return std::vector<double>(out.begin(), out.end());
}

// A rigorous bound on float32 accumulation: each lane adds at most K/8 products, then at most 4
// tree adds, then bias and residual; plus half an ulp of the stored output.
template <typename T>
double tolerance(double ref, double mass, int64_t K) {
  const double out_rtol = sizeof(T) == 2 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -24);
  return out_rtol * std::fabs(ref) + static_cast<double>(K / 8 + 7) * std::ldexp(1.0, -24) * mass + 1e-30;
}

template <typename T>
bool check_case(const QuantFormat& f, int64_t Tn, int64_t K, int64_t N, uint64_t seed) {
  bench::Rng rng(seed);
  const bench::Vec<uint8_t> w = random_qweight(f, N, K, rng);
  const std::vector<double> wd = dequantized(f, w, N, K);
  bench::Vec<T> x(Tn * K), b(N), r(Tn * N), out(Tn * N), act(Tn * (N / 2)), nw(K), qkv(Tn * N);
  bench::fill_random(x, rng, -2.0f, 2.0f);
  bench::fill_random(b, rng, -0.5f, 0.5f);
  bench::fill_random(r, rng, -1.0f, 1.0f);
  bench::fill_random(nw, rng, 0.5f, 1.5f);
  orca::cpu::quant_linear<T>(x.data(), w.data(), f.type, b.data(), r.data(), out.data(), Tn, K, N);
  orca::cpu::quant_linear_silu_mul<T>(x.data(), w.data(), f.type, nullptr, act.data(), Tn, K, N / 2);
  orca::cpu::quant_rmsnorm_qkv<T>(x.data(), nw.data(), w.data(), f.type, nullptr, qkv.data(), Tn, K, N, 1e-5f);
  size_t bad = 0;
  double worst = 0.0;
  auto expect = [&](double got, double ref, double tol) {
    const double err = std::fabs(got - ref);
    if (!(err <= tol)) ++bad;
    worst = std::max(worst, err);
  };
  for (int64_t t = 0; t < Tn; ++t) {
    // The normalised row in float64 from the same inputs (bf16: rounded as the kernel rounds a
    // float32 norm; the slack below covers a one-ulp disagreement in two elements).
    double ss = 0.0;
    for (int64_t i = 0; i < K; ++i) ss += std::pow(orca::to_float(x[t * K + i]), 2);
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(K) + 1e-5);
    for (int64_t n = 0; n < N; ++n) {
      double dot = 0.0, mass = 0.0, ndot = 0.0, nmass = 0.0;
      for (int64_t i = 0; i < K; ++i) {
        const double xv = orca::to_float(x[t * K + i]), wv = wd[static_cast<size_t>(n * K + i)];
        double nv = xv * inv * orca::to_float(nw[i]);
        if (sizeof(T) == 2) nv = orca::to_float(orca::from_float<bf16>(static_cast<float>(nv)));
        dot += xv * wv;
        mass += std::fabs(xv * wv);
        ndot += nv * wv;
        nmass += std::fabs(nv * wv);
      }
      const double bias = orca::to_float(b[n]), res = orca::to_float(r[t * N + n]);
      const double ref = dot + bias + res;
      expect(orca::to_float(out[t * N + n]), ref,
             tolerance<T>(ref, mass + std::fabs(bias) + std::fabs(res), K));
      const double slack = sizeof(T) == 2 ? 2 * std::ldexp(1.0, -8) * nmass : 1e-6 * nmass;
      expect(orca::to_float(qkv[t * N + n]), ndot, tolerance<T>(ndot, nmass, K) + slack);
    }
    for (int64_t n = 0; n < N / 2; ++n) {  // silu(gate) * up over rows n and N/2 + n
      double g = 0.0, u = 0.0, gm = 0.0, um = 0.0;
      for (int64_t i = 0; i < K; ++i) {
        const double xv = orca::to_float(x[t * K + i]);
        g += xv * wd[static_cast<size_t>(n * K + i)];
        u += xv * wd[static_cast<size_t>((N / 2 + n) * K + i)];
        gm += std::fabs(xv * wd[static_cast<size_t>(n * K + i)]);
        um += std::fabs(xv * wd[static_cast<size_t>((N / 2 + n) * K + i)]);
      }
      const double sg = g / (1.0 + std::exp(-g)), ref = sg * u, acc = (K / 8 + 7) * std::ldexp(1.0, -24);
      const double tol = tolerance<T>(ref, 0.0, K) + 1.1 * std::fabs(u) * acc * gm + std::fabs(sg) * acc * um +
                         1e-6 * std::fabs(ref);
      expect(orca::to_float(act[t * (N / 2) + n]), ref, tol);
    }
  }
  // Batch invariance: each token alone equals its row of the Tn-token call, bit for bit.
  bench::Vec<T> one(N), r0(N, orca::from_float<T>(0.0f)), big(Tn * N), zeros(Tn * N, orca::from_float<T>(0.0f));
  orca::cpu::quant_linear<T>(x.data(), w.data(), f.type, b.data(), zeros.data(), big.data(), Tn, K, N);
  bool invariant = true;
  for (int64_t t = 0; t < Tn; ++t) {
    orca::cpu::quant_linear<T>(x.data() + t * K, w.data(), f.type, b.data(), r0.data(), one.data(), 1, K, N);
    invariant &= std::memcmp(one.data(), big.data() + t * N, N * sizeof(T)) == 0;
  }
  char name[160];
  std::snprintf(name, sizeof name, "%s<%s,%s> T=%lld K=%lld N=%lld (linear, silu_mul, rmsnorm; invariance)", f.name,
                sizeof(T) == 2 ? "bf16" : "f32", orca::cpu::quant_path_name(orca::cpu::quant_path()),
                static_cast<long long>(Tn), static_cast<long long>(K), static_cast<long long>(N));
  if (bad || !invariant) {
    std::printf("FAIL %s: %zu out of tolerance%s\n", name, bad, invariant ? "" : ", batch invariance broken");
    return false;
  }
  std::printf("ok   %-84s max abs err %.2e\n", name, worst);
  return true;
}

void int8_linear(const float* x, const uint8_t* w, int type, float* out, int64_t Tn, int64_t K, int64_t N) {
  orca::cpu::quant_linear<float>(x, w, type, nullptr, nullptr, out, Tn, K, N, orca::cpu::QuantActivations::kInt8);
}

// The int8-activation design: each activation moves by at most half its block's step
// (amax / 127 / 2) when rounded to int8, so |error| <= sum over blocks of amax_b / 254 * sum |w| in
// the block, plus float32 accumulation. The block is the format's: 32 or 256 elements.
bool check_int8_activations(const QuantFormat& f, int64_t Tn, int64_t K, int64_t N, uint64_t seed) {
  bench::Rng rng(seed);
  const bench::Vec<uint8_t> w = random_qweight(f, N, K, rng);
  const std::vector<double> wd = dequantized(f, w, N, K);
  bench::Vec<float> x(Tn * K), out(Tn * N);
  bench::fill_random(x, rng, -2.0f, 2.0f);
  if (!orca::cpu::quant_int8_supported(f.type)) return true;
  int8_linear(x.data(), w.data(), f.type, out.data(), Tn, K, N);
  size_t bad = 0;
  double worst = 0.0;
  for (int64_t t = 0; t < Tn; ++t)
    for (int64_t n = 0; n < N; ++n) {
      double ref = 0.0, mass = 0.0, bound = 0.0;
      const int64_t blk = f.block_elems;
      for (int64_t b = 0; b < K / blk; ++b) {
        double amax = 0.0, wabs = 0.0;
        for (int64_t i = blk * b; i < blk * b + blk; ++i) {
          const double xv = x[t * K + i], wv = wd[static_cast<size_t>(n * K + i)];
          ref += xv * wv;
          mass += std::fabs(xv * wv);
          amax = std::max(amax, std::fabs(xv));
          wabs += std::fabs(wv);
        }
        bound += amax / 254.0 * wabs * (1 + 1e-6);
      }
      const double err = std::fabs(out[t * N + n] - ref);
      if (!(err <= bound + 1e-5 * (mass + bound))) ++bad;
      worst = std::max(worst, err);
    }
  char name[160];
  std::snprintf(name, sizeof name, "%s int8 activations <%s> T=%lld K=%lld N=%lld", f.name,
                orca::cpu::quant_path_name(orca::cpu::quant_path()), static_cast<long long>(Tn),
                static_cast<long long>(K), static_cast<long long>(N));
  if (bad) {
    std::printf("FAIL %s: %zu out of bound\n", name, bad);
    return false;
  }
  std::printf("ok   %-84s max abs err %.2e\n", name, worst);
  return true;
}

// One token's rows are split into a share per thread, and a thread done with its own share takes
// what is left of the others' from their far ends. With 3, 5 and 8 threads on 2 cores the threads
// finish at different times and take from each other's shares: every output must still have the
// bits of a one-thread call, with float32 and (where the format has them) int8 activations.
bool check_thread_counts(const QuantFormat& f, int64_t K, int64_t N, uint64_t seed) {
  bench::Rng rng(seed);
  const bench::Vec<uint8_t> w = random_qweight(f, N, K, rng);
  bench::Vec<float> x(K), alone(N), out(N);
  bench::fill_random(x, rng, -2.0f, 2.0f);
  const int max_threads = omp_get_max_threads();
  size_t bad = 0, runs = 0;
  for (auto act : {orca::cpu::QuantActivations::kFloat32, orca::cpu::QuantActivations::kInt8}) {
    if (act == orca::cpu::QuantActivations::kInt8 && !orca::cpu::quant_int8_supported(f.type)) continue;
    omp_set_num_threads(1);
    orca::cpu::quant_linear<float>(x.data(), w.data(), f.type, nullptr, nullptr, alone.data(), 1, K, N, act);
    for (int threads : {3, 5, 8}) {
      omp_set_num_threads(threads);
      for (int rep = 0; rep < 10; ++rep, ++runs) {
        std::memset(out.data(), 0, static_cast<size_t>(N) * sizeof(float));
        orca::cpu::quant_linear<float>(x.data(), w.data(), f.type, nullptr, nullptr, out.data(), 1, K, N, act);
        bad += std::memcmp(out.data(), alone.data(), static_cast<size_t>(N) * sizeof(float)) != 0;
      }
    }
  }
  omp_set_num_threads(max_threads);
  char name[160];
  std::snprintf(name, sizeof name, "%s one token on 3, 5, 8 threads = 1 thread <%s> K=%lld N=%lld", f.name,
                orca::cpu::quant_path_name(orca::cpu::quant_path()), static_cast<long long>(K),
                static_cast<long long>(N));
  if (bad) {
    std::printf("FAIL %s: %zu of %zu runs differ\n", name, bad, runs);
    return false;
  }
  std::printf("ok   %-84s max abs err %.2e\n", name, 0.0);
  return true;
}

std::vector<QuantPath> runnable_paths() {
  std::vector<QuantPath> paths;
  for (QuantPath p : {QuantPath::kAvx2, QuantPath::kAvx512})
    if (orca::cpu::quant_path_supported(p)) paths.push_back(p);
  return paths;
}

bool validate_all() {
  bool ok = true;
  uint64_t seed = 1;
  for (QuantPath p : runnable_paths()) {
    orca::cpu::set_quant_path(p);
    for (int type : orca::cpu::kQuantTypes) {
      const QuantFormat& f = *orca::cpu::quant_format(type);
      const int64_t K = f.block_elems == 32 ? 32 * 9 : 256 * 3;
      for (int64_t Tn : {int64_t{1}, int64_t{5}, int64_t{13}}) {
        ok &= check_case<float>(f, Tn, K, 38, ++seed);
        ok &= check_case<bf16>(f, Tn, K, 38, ++seed);
        ok &= check_int8_activations(f, Tn, K, 38, ++seed);
      }
      ok &= check_thread_counts(f, K, 38, ++seed);
      ok &= check_thread_counts(f, K, 3000, ++seed);  // shares longer than a claim: claims split them
    }
  }
  return ok;
}

// ---- timings ------------------------------------------------------------------------------------

struct Layer {
  const char* name;
  int64_t n, k;  // weight [n, k]
};

// Which cases perf() times: T values, layers whose name contains `layers`, formats whose name is
// in the comma-separated `formats`, paths whose name is in `paths` (nullptr: every one), and
// whether to skip the float32-activation timings.
struct PerfFilter {
  std::vector<int64_t> tokens = {1, 4, 16, 64, 512};
  const char* layers = nullptr;
  const char* formats = nullptr;
  const char* paths = nullptr;
  bool int8_only = false;
};

// Whether `name` is one of the comma-separated names in `list` (any name when list is nullptr).
bool listed(const char* list, const char* name) {
  if (list == nullptr) return true;
  const size_t n = std::strlen(name);
  for (const char* p = list; *p != '\0';) {
    const char* end = std::strchr(p, ',');
    const size_t len = end ? static_cast<size_t>(end - p) : std::strlen(p);
    if (len == n && std::strncmp(p, name, n) == 0) return true;
    p = end ? end + 1 : p + len;
  }
  return false;
}

void perf(const bench::Ceilings& c, const PerfFilter& filter) {
  const Layer layers[] = {
      {"smollm2 qkv/o 576x576", 576, 576},       {"smollm2 up 1536x576", 1536, 576},
      {"smollm2 down 576x1536", 576, 1536},      {"smollm2 lm_head 49152x576", 49152, 576},
      {"llama1b o 2048x2048", 2048, 2048},       {"llama1b up 8192x2048", 8192, 2048},
      {"llama1b down 2048x8192", 2048, 8192},
  };
  bench::Rng rng(42);
  for (QuantPath p : runnable_paths()) {
    if (!listed(filter.paths, orca::cpu::quant_path_name(p))) continue;
    orca::cpu::set_quant_path(p);
    for (int type : orca::cpu::kQuantTypes) {
      const QuantFormat& f = *orca::cpu::quant_format(type);
      if (!listed(filter.formats, f.name) || (filter.int8_only && !orca::cpu::quant_int8_supported(f.type))) continue;
      for (const Layer& l : layers) {
        if (filter.layers != nullptr && std::strstr(l.name, filter.layers) == nullptr) continue;
        const int64_t row_bytes = l.k / f.block_elems * f.block_bytes;
        const double w_bytes = static_cast<double>(l.n * row_bytes);
        const int64_t copies = std::max<int64_t>(1, static_cast<int64_t>(std::ceil((96.0 * (1 << 20)) / w_bytes)));
        std::vector<bench::Vec<uint8_t>> ws;
        for (int64_t i = 0; i < copies; ++i) ws.push_back(random_qweight(f, l.n, l.k, rng));
        for (int64_t Tn : filter.tokens) {
          bench::Vec<float> x(Tn * l.k), out(Tn * l.n);
          bench::fill_random(x, rng, -1.0f, 1.0f);
          size_t at = 0;
          const double flops = 2.0 * static_cast<double>(Tn) * static_cast<double>(l.n * l.k);
          const int reps = flops > 4e9 ? 3 : flops > 2e8 ? 7 : 21;
          char name[96];
          if (!filter.int8_only) {
            const bench::Timing t = bench::time_calls(
                [&] {
                  orca::cpu::quant_linear<float>(x.data(), ws[at].data(), f.type, nullptr, nullptr, out.data(), Tn,
                                                 l.k, l.n);
                  at = (at + 1) % ws.size();
                },
                reps, 1);
            std::snprintf(name, sizeof name, "%s %s/%s T=%lld", f.name, l.name, orca::cpu::quant_path_name(p),
                          static_cast<long long>(Tn));
            bench::report(name, t, flops, w_bytes, c);
          }
          // The int8-activation design on the same weights, where the format has it.
          if (!orca::cpu::quant_int8_supported(f.type)) continue;
          const bench::Timing t8 = bench::time_calls(
              [&] {
                int8_linear(x.data(), ws[at].data(), f.type, out.data(), Tn, l.k, l.n);
                at = (at + 1) % ws.size();
              },
              reps, 1);
          std::snprintf(name, sizeof name, "%s %s/%s-int8act T=%lld", f.name, l.name, orca::cpu::quant_path_name(p),
                        static_cast<long long>(Tn));
          bench::report(name, t8, flops, w_bytes, c);
        }
      }
    }
  }
}

}  // namespace

// Arguments: [--validate-only] or any of --quick (T = 1 and 16), --tokens=1,4,64,
// --layers=NAME (only the layers whose name contains NAME, e.g. smollm2 or llama1b),
// --formats=Q4_K,Q8_0, --paths=avx512 and --int8-only (only the int8-activation timings).
int main(int argc, char** argv) {
  const bool ok = validate_all();
  PerfFilter filter;
  std::vector<int64_t>& tokens = filter.tokens;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) tokens = {1, 16};
    if (std::strcmp(argv[i], "--int8-only") == 0) filter.int8_only = true;
    if (std::strncmp(argv[i], "--formats=", 10) == 0) filter.formats = argv[i] + 10;
    if (std::strncmp(argv[i], "--paths=", 8) == 0) filter.paths = argv[i] + 8;
    if (std::strncmp(argv[i], "--tokens=", 9) == 0) {
      tokens.clear();
      for (const char* p = argv[i] + 9; *p != '\0';) {
        char* end = nullptr;
        const long long v = std::strtoll(p, &end, 10);
        if (end == p || v < 1 || v > 4096) break;
        tokens.push_back(v);
        p = *end == ',' ? end + 1 : end;
      }
    }
    if (std::strncmp(argv[i], "--layers=", 9) == 0) filter.layers = argv[i] + 9;
  }
  return bench::finish_main(argc, argv, ok, [&](const bench::Ceilings& c) { perf(c, filter); });
}
