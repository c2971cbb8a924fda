// Microbenchmark of the CPU ragged_attention kernel.
// 1. Validates against the scalar double-precision reference (bench/common/reference.h): mixed
//    batches of decodes, full prefills and prefills over a cached prefix; GQA ratios 1, 3, 7; head
//    dims 64, 80, 128 and odd ones; slabs with gaps of garbage between them; requests stored in q
//    in shuffled order; large logits (running-max path); float and bf16; int32 and int64 indices.
//    Exits 1 on any mismatch.
// 2. Times SmolLM2-135M shapes (Hq=9, Hkv=3, D=64): 32 decodes with contexts U[16, 512], a
//    prefill of 4 x 512 tokens, a mix of both, one decode over 256, 1,024 and 8,192 keys, and 4 over
//    4,096 keys; and one batch-invariant decode of Llama-3.2-1B's shape (Hq=32, Hkv=8) over 256,
//    2,048 and 8,192 keys, and over 256 and 2,048 keys with one K/V pool reused (its compute,
//    with K and V in cache);
//    prints GFLOP/s and GB/s (K/V bytes read once per KV head) next to the measured ceilings. Both steps run on every float32 path the CPU
//    has (the prefill tiles follow it; the avx512 lines are against the zmm FMA peak). Several copies of the KV pools (one per layer)
//    are rotated so that K/V come from memory, as in a forward pass over all layers.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <vector>

#include "bench_util.h"
#include "common/reference.h"
#include "cpu/cpu_kernels.h"

namespace {

using orca::bf16;

struct Req {
  int64_t q_len, kv_len;
};

// Flat batch layout: q rows of the requests in a shuffled order, one slab per request in a pool
// of n_slots with random gaps between slabs (the gaps hold random values too).
struct Layout {
  std::vector<int64_t> q_start, q_len, kv_start, kv_len;
  int64_t n_tokens = 0, n_slots = 0;
};

Layout make_layout(const std::vector<Req>& reqs, bench::Rng& rng, int64_t max_gap) {
  Layout L;
  const size_t B = reqs.size();
  std::vector<size_t> order(B);
  std::iota(order.begin(), order.end(), size_t{0});
  for (size_t i = B; i > 1; --i) std::swap(order[i - 1], order[static_cast<size_t>(rng.next() % i)]);
  L.q_start.resize(B);
  L.q_len.resize(B);
  L.kv_start.resize(B);
  L.kv_len.resize(B);
  for (size_t o : order) {
    L.q_start[o] = L.n_tokens;
    L.n_tokens += reqs[o].q_len;
  }
  int64_t slot = rng.randint(0, max_gap);
  for (size_t b = 0; b < B; ++b) {
    L.q_len[b] = reqs[b].q_len;
    L.kv_len[b] = reqs[b].kv_len;
    L.kv_start[b] = slot;
    slot += reqs[b].kv_len + rng.randint(0, max_gap);
  }
  L.n_slots = slot + 1;
  return L;
}

template <typename I>
std::vector<I> cast_index(const std::vector<int64_t>& v) {
  return std::vector<I>(v.begin(), v.end());
}

template <typename T, typename I>
bool check_case(const char* label, const std::vector<Req>& reqs, int64_t Hq, int64_t Hkv, int64_t D, float q_range,
                uint64_t seed, bool invariant = false) {
  bench::Rng rng(seed);
  const Layout L = make_layout(reqs, rng, 37);
  bench::Vec<T> q(L.n_tokens * Hq * D), k(L.n_slots * Hkv * D), v(L.n_slots * Hkv * D), out(L.n_tokens * Hq * D);
  bench::fill_random(q, rng, -q_range, q_range);
  bench::fill_random(k, rng);
  bench::fill_random(v, rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const auto qs = cast_index<I>(L.q_start), ql = cast_index<I>(L.q_len), ks = cast_index<I>(L.kv_start),
             kl = cast_index<I>(L.kv_len);
  orca::cpu::ragged_attention<T, I>(q.data(), k.data(), v.data(), qs.data(), ql.data(), ks.data(), kl.data(),
                                    out.data(), static_cast<int64_t>(reqs.size()), Hq, Hkv, D, scale, invariant);
  const std::vector<double> ref = bench::ref::ragged_attention(
      q.data(), k.data(), v.data(), L.q_start.data(), L.q_len.data(), L.kv_start.data(), L.kv_len.data(),
      static_cast<int64_t>(reqs.size()), L.n_tokens, Hq, Hkv, D, scale, bench::ToDouble{});
  char name[200];
  std::snprintf(name, sizeof name, "ragged_attention<%s,%s> %s%s B=%zu T=%lld Hq=%lld Hkv=%lld D=%lld",
                sizeof(T) == 2 ? "bf16" : "f32", sizeof(I) == 4 ? "i32" : "i64", label,
                invariant ? " (batch-invariant)" : "", reqs.size(),
                static_cast<long long>(L.n_tokens), static_cast<long long>(Hq), static_cast<long long>(Hkv),
                static_cast<long long>(D));
  const bool is_bf16 = sizeof(T) == 2;
  return bench::check_close(name, bench::to_double(out), ref, is_bf16 ? 2e-4 : 2e-5, is_bf16 ? 1.0 / 256 : 1e-4);
}

// Decodes, full prefills, prefills over a cached prefix, a single-token context and a context
// long enough for many key blocks.
std::vector<Req> mixed_batch(bench::Rng& rng) {
  std::vector<Req> r;
  for (int i = 0; i < 5; ++i) r.push_back({1, rng.randint(1, 300)});
  r.push_back({1, 1});
  r.push_back({83, 83});
  r.push_back({7, 150});
  r.push_back({1, 64});
  r.push_back({65, 65});
  r.push_back({5, 700});
  r.push_back({2, 2});
  return r;
}

template <typename T, typename I>
bool validate_all() {
  bool ok = true;
  uint64_t seed = 100 + 10 * sizeof(T) + sizeof(I);
  bench::Rng rng(seed);
  struct Heads {
    int64_t hq, hkv;
  };
  const Heads heads[] = {{9, 3}, {4, 4}, {14, 2}, {7, 1}};
  const int64_t dims[] = {64, 80, 128};
  for (const Heads& h : heads)
    for (int64_t D : dims) ok &= check_case<T, I>("mixed", mixed_batch(rng), h.hq, h.hkv, D, 1.0f, ++seed);
  for (const Heads& h : heads) ok &= check_case<T, I>("mixed", mixed_batch(rng), h.hq, h.hkv, 64, 1.0f, ++seed, true);
  ok &= check_case<T, I>("odd D", mixed_batch(rng), 6, 2, 72, 1.0f, ++seed);
  ok &= check_case<T, I>("odd D", mixed_batch(rng), 3, 1, 13, 1.0f, ++seed);
  ok &= check_case<T, I>("single decode", {{1, 1}}, 9, 3, 64, 1.0f, ++seed);
  ok &= check_case<T, I>("single decode", {{1, 517}}, 9, 3, 64, 1.0f, ++seed);
  ok &= check_case<T, I>("single decode GQA 4", {{1, 517}}, 32, 8, 64, 1.0f, ++seed, true);
  ok &= check_case<T, I>("single prefill", {{200, 200}}, 9, 3, 64, 1.0f, ++seed);
  // Logits in the hundreds: only a running-max softmax stays finite and accurate.
  ok &= check_case<T, I>("large logits", mixed_batch(rng), 9, 3, 64, 40.0f, ++seed);
  return ok;
}

template <typename T>
void perf(const char* dtype, const char* path, const bench::Ceilings& c) {
  const int64_t D = 64;
  const float scale = 0.125f;
  bench::Rng rng(5);
  struct Case {
    const char* name;
    std::vector<Req> reqs;
    bool invariant = false;
    int64_t Hq = 9, Hkv = 3;  // SmolLM2-135M's heads
    bool resident = false;    // one K/V pool, reused: its compute alone, from L2/L3
  };
  std::vector<Case> cases(17);
  cases[0].name = "decode";
  for (int i = 0; i < 32; ++i) cases[0].reqs.push_back({1, rng.randint(16, 512)});
  cases[1].name = "prefill";
  for (int i = 0; i < 4; ++i) cases[1].reqs.push_back({512, 512});
  cases[2].name = "mixed";
  cases[2].reqs = cases[0].reqs;
  cases[2].reqs.resize(28);
  for (int i = 0; i < 2; ++i) cases[2].reqs.push_back({512, 512});
  for (int i = 0; i < 2; ++i) cases[2].reqs.push_back({256, 768});
  // The batch-invariant mode: every row on the tile path (its cost is the decodes').
  cases[3] = {"decode batch-invariant", cases[0].reqs, true};
  cases[4] = {"mixed batch-invariant", cases[2].reqs, true};
  // One stream: its key blocks are the only work there is to share out.
  cases[5] = {"1 decode, 256 keys", {{1, 256}}};
  cases[6] = {"1 decode, 1024 keys", {{1, 1024}}};
  // Long contexts, where a decode is bound by streaming its K and V.
  cases[7] = {"1 decode, 8192 keys", {{1, 8192}}};
  cases[8] = {"4 decodes, 4096 keys", {{1, 4096}, {1, 4096}, {1, 4096}, {1, 4096}}};
  // Llama-3.2-1B's heads (32 query, 8 KV: GQA 4), one stream in the batch-invariant order, as
  // the engine runs it on CPUs.
  cases[9] = {"1 decode, 256 keys, 32/8 heads, batch-invariant", {{1, 256}}, true, 32, 8};
  cases[10] = {"1 decode, 2048 keys, 32/8 heads, batch-invariant", {{1, 2048}}, true, 32, 8};
  cases[11] = {"1 decode, 8192 keys, 32/8 heads, batch-invariant", {{1, 8192}}, true, 32, 8};
  cases[12] = {"1 decode, 256 keys, 32/8 heads, batch-invariant, cache-resident", {{1, 256}}, true, 32, 8, true};
  cases[13] = {"1 decode, 2048 keys, 32/8 heads, batch-invariant, cache-resident", {{1, 2048}}, true, 32, 8, true};
  // The default model's own stream (SmolLM2-135M, GQA 3) at a chat's contexts, and GQA 7
  // (Qwen2.5-0.5B's 14/2 heads): query heads that the 4-row register block does not divide.
  cases[14] = {"1 decode, 128 keys, batch-invariant", {{1, 128}}, true};
  cases[15] = {"1 decode, 1024 keys, batch-invariant", {{1, 1024}}, true};
  cases[16] = {"1 decode, 2048 keys, 14/2 heads, batch-invariant", {{1, 2048}}, true, 14, 2};
  const size_t es = sizeof(T);
  for (const Case& cs : cases) {
    const int64_t Hq = cs.Hq, Hkv = cs.Hkv;
    const Layout L = make_layout(cs.reqs, rng, 0);
    const size_t pool = static_cast<size_t>(L.n_slots * Hkv * D);
    const int layers =
        cs.resident ? 1 : static_cast<int>(std::max<size_t>(2, (size_t{96} << 20) / (2 * pool * es) + 1));
    std::vector<bench::Vec<T>> k(static_cast<size_t>(layers), bench::Vec<T>(pool)), v = k;
    for (int l = 0; l < layers; ++l) {
      bench::fill_random(k[static_cast<size_t>(l)], rng);
      bench::fill_random(v[static_cast<size_t>(l)], rng);
    }
    bench::Vec<T> q(L.n_tokens * Hq * D), out(L.n_tokens * Hq * D);
    bench::fill_random(q, rng);
    const auto qs = cast_index<int32_t>(L.q_start), ql = cast_index<int32_t>(L.q_len),
               ks = cast_index<int32_t>(L.kv_start), kl = cast_index<int32_t>(L.kv_len);
    double flops = 0.0, bytes = 0.0;
    for (const Req& r : cs.reqs) {
      for (int64_t i = 0; i < r.q_len; ++i) flops += 4.0 * D * Hq * static_cast<double>(r.kv_len - r.q_len + i + 1);
      bytes += static_cast<double>(es) * (2.0 * r.kv_len * Hkv * D + 2.0 * r.q_len * Hq * D);
    }
    int layer = 0;
    const bench::Timing t = bench::time_calls(
        [&] {
          orca::cpu::ragged_attention<T, int32_t>(q.data(), k[static_cast<size_t>(layer)].data(),
                                                  v[static_cast<size_t>(layer)].data(), qs.data(), ql.data(), ks.data(),
                                                  kl.data(), out.data(), static_cast<int64_t>(cs.reqs.size()), Hq, Hkv,
                                                  D, scale, cs.invariant);
          layer = (layer + 1) % layers;
        },
        flops > 1e9 ? 7 : 41, layers);
    char label[160];
    std::snprintf(label, sizeof label, "ragged_attention %s/%s %s B=%zu T=%lld", dtype, path, cs.name,
                  cs.reqs.size(), static_cast<long long>(L.n_tokens));
    bench::report(label, t, flops, bytes, c);
  }
}

std::vector<orca::cpu::F32Path> runnable_f32_paths() {
  std::vector<orca::cpu::F32Path> paths;
  for (auto p : {orca::cpu::F32Path::kAvx2, orca::cpu::F32Path::kAvx512})
    if (orca::cpu::f32_path_supported(p)) paths.push_back(p);
  return paths;
}

}  // namespace

int main(int argc, char** argv) {
  bool ok = true;
  for (auto path : runnable_f32_paths()) {
    orca::cpu::set_f32_path(path);
    ok &= validate_all<float, int32_t>();
    ok &= validate_all<float, int64_t>();
    ok &= validate_all<bf16, int32_t>();
    ok &= validate_all<bf16, int64_t>();
  }
  return bench::finish_main(argc, argv, ok, [](const bench::Ceilings& measured) {
    const double zmm = bench::measure_fma_gflops_zmm();
    if (zmm > 0.0) std::printf("zmm FMA %.1f GFLOP/s (the ceiling of the avx512 lines)\n", zmm);
    for (auto path : runnable_f32_paths()) {
      orca::cpu::set_f32_path(path);
      bench::Ceilings c = measured;
      if (path == orca::cpu::F32Path::kAvx512) c.fma_gflops = std::max(c.fma_gflops, zmm);
      const char* name = orca::cpu::f32_path_name(path);
      perf<float>("f32", name, c);
      perf<bf16>("bf16", name, c);
    }
  });
}
