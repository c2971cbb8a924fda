// Microbenchmark of the CUDA ragged_attention (csrc/cuda/attention): validates every case against
// the float64 reference (bench/common/reference.h) on random data first (exit 1 on mismatch), then
// times the launcher (work-list kernel + attention kernel) and prints median time with achieved
// GB/s (decode) or TFLOP/s (prefill) next to the measured copy ceiling. Target shapes (the floors
// are in bench/RESULTS.md):
//   decode  B=64, contexts U[128, 2048], Hq 16 / Hkv 8, D 128, bf16
//   prefill 4 x 2048 causal, same heads
// --small runs only small validation cases (for compute-sanitizer).
#include <numeric>

#include "bench_util.cuh"
#include "common/reference.h"
#include "cuda/launchers.h"

namespace {

using namespace bench;
namespace kern = orca::kernels;

struct Case {
  std::string name;
  std::vector<int> q_len, kv_len;
  int hq = 16, hkv = 8, d = 128;
  bool timed = false;
  bool int64_index = false;
  bool batch_invariant = false;  // every row through prefill tiles (no decode splits)
  int sample_rows = 64;  // rows per request checked against the CPU reference (all if fewer)
  int extra_rows = 0;    // trailing query rows owned by no request: must come out as zeros
};

template <typename I>
const void* upload_index(const std::vector<int>& v, std::vector<std::unique_ptr<DevBuf<I>>>& keep) {
  std::vector<I> h(v.begin(), v.end());
  keep.push_back(std::make_unique<DevBuf<I>>(h));
  return keep.back()->ptr;
}

template <typename T>
bool run_case(const Case& c, const Args& args, double copy_gbps, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int B = static_cast<int>(c.q_len.size());
  const int hq = c.hq, hkv = c.hkv, D = c.d;
  // Query rows in a shuffled request order; slabs scattered with gaps, also shuffled.
  std::vector<int> order(B);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<int> q_start(B), kv_start(B);
  int64_t n_tokens = 0;
  for (int b : order) q_start[b] = static_cast<int>(n_tokens), n_tokens += c.q_len[b];
  n_tokens += c.extra_rows;
  std::shuffle(order.begin(), order.end(), rng);
  int64_t n_slots = static_cast<int64_t>(rng() % 7);
  for (int b : order) kv_start[b] = static_cast<int>(n_slots), n_slots += c.kv_len[b] + static_cast<int64_t>(rng() % 9);
  n_slots += 3;

  const std::vector<T> q = random_vec<T>(size_t(n_tokens) * hq * D, rng, 2.f);
  const std::vector<T> kc = random_vec<T>(size_t(n_slots) * hkv * D, rng);
  const std::vector<T> vc = random_vec<T>(size_t(n_slots) * hkv * D, rng);
  DevBuf<T> dq(q), dk(kc), dv(vc), dout(size_t(n_tokens) * hq * D);
  // NaN everywhere: a row the kernel neither computes nor zeroes fails the validation below.
  BENCH_CHECK(cudaMemset(dout.ptr, 0xff, dout.n * sizeof(T)));
  std::vector<std::unique_ptr<DevBuf<int32_t>>> keep32;
  std::vector<std::unique_ptr<DevBuf<int64_t>>> keep64;
  auto up = [&](const std::vector<int>& v) {
    return c.int64_index ? upload_index<int64_t>(v, keep64) : upload_index<int32_t>(v, keep32);
  };
  const void* d_qs = up(q_start);
  const void* d_ql = up(c.q_len);
  const void* d_ks = up(kv_start);
  const void* d_kl = up(c.kv_len);

  const kern::DType dt = dtype_of<T>();
  const size_t ws_bytes = kern::ragged_attention_workspace_bytes(dt, n_tokens, B, hq, hkv, D);
  DevBuf<uint8_t> ws(ws_bytes);
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  auto launch = [&] {
    BENCH_CHECK(kern::ragged_attention(dt, c.int64_index ? kern::IndexType::kInt64 : kern::IndexType::kInt32, dq.ptr,
                                       dk.ptr, dv.ptr, d_qs, d_ql, d_ks, d_kl, dout.ptr, ws.ptr, ws_bytes, n_tokens, B,
                                       n_slots, hq, hkv, D, scale, c.batch_invariant, nullptr));
  };
  launch();
  BENCH_CHECK(cudaDeviceSynchronize());
  const std::vector<T> out = dout.download();

  // CPU reference (double) on a sample of rows of every request, all heads and dims.
  const double atol = sizeof(T) == 4 ? 1e-4 : (std::is_same<T, __half>::value ? 3e-3 : 1e-2);
  const double rtol = sizeof(T) == 4 ? 1e-4 : (std::is_same<T, __half>::value ? 1e-2 : 2e-2);
  Checker chk{atol, rtol};
  std::vector<double> o(size_t(hq) * D);
  for (int b = 0; b < B; ++b) {
    const int ql = c.q_len[b], kl = c.kv_len[b];
    std::vector<int> rows;
    if (ql <= c.sample_rows) {
      rows.resize(ql);
      std::iota(rows.begin(), rows.end(), 0);
    } else {
      rows = {0, ql - 1};
      while (static_cast<int>(rows.size()) < c.sample_rows) rows.push_back(static_cast<int>(rng() % ql));
    }
    for (int i : rows) {
      const size_t base = size_t(q_start[b] + i) * hq * D;
      ref::attention_row(&q[base], kc.data(), vc.data(), kv_start[b], kl - ql + i + 1, hq, hkv, D, scale, ToDouble{},
                         o.data());
      for (size_t e = 0; e < o.size(); ++e) chk.add(to_f(out[base + e]), o[e], "out", base + e);
    }
  }
  for (size_t i = size_t(n_tokens - c.extra_rows) * hq * D; i < out.size(); ++i) chk.add(to_f(out[i]), 0.0, "unowned", i);
  const std::string label = c.name + " (" + type_name<T>() + ", D=" + std::to_string(D) + ", Hq/Hkv=" +
                            std::to_string(hq) + "/" + std::to_string(hkv) + ", B=" + std::to_string(B) + ")";
  if (!chk.report(label.c_str())) return false;
  if (!c.timed || args.small) return true;

  const double ms = median_ms(launch, args.warmup, args.reps);
  // Bytes that must move: every request's K and V once per KV head, q read, out written.
  double kv_tokens = 0.0, pairs = 0.0;
  for (int b = 0; b < B; ++b) {
    const double ql = c.q_len[b], kl = c.kv_len[b];
    kv_tokens += kl;
    pairs += ql * (kl - ql) + ql * (ql + 1) / 2;  // (query, key) pairs under the causal mask
  }
  const double bytes = kv_tokens * hkv * D * 2 * sizeof(T) + 2.0 * double(n_tokens) * hq * D * sizeof(T);
  const double gbps = bytes / (ms * 1e-3) / 1e9;
  const double tflops = 4.0 * pairs * hq * D / (ms * 1e-3) / 1e12;
  std::printf("%-28s median %9.2f us  %8.1f GB/s (%5.1f%% of copy %.0f GB/s)  %7.1f TFLOP/s\n", c.name.c_str(),
              ms * 1e3, gbps, 100.0 * gbps / copy_gbps, copy_gbps, tflops);
  Result()
      .str("bench", "ragged_attention")
      .str("case", c.name)
      .str("dtype", type_name<T>())
      .num("B", B)
      .num("T", double(n_tokens))
      .num("Hq", hq)
      .num("Hkv", hkv)
      .num("D", D)
      .num("median_us", ms * 1e3)
      .num("gbps", gbps)
      .num("copy_gbps", copy_gbps)
      .num("pct_of_copy", 100.0 * gbps / copy_gbps)
      .num("tflops", tflops)
      .print();
  return true;
}

std::vector<int> uniform_lengths(std::mt19937_64& rng, int n, int lo, int hi) {
  std::uniform_int_distribution<int> dist(lo, hi);
  std::vector<int> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse_args(argc, argv);
  bool ok = true;
  std::mt19937_64 rng(20240607);

  // Small validation cases: every head dim of the tensor-core path, GQA 1/2/4/8, decodes,
  // prefills (several 128-row tiles), prefix prefills on both paths, long contexts that split.
  {
    Case c{"small_mixed", {1, 1, 1, 1, 1, 37, 150, 9, 5, 2}, {5, 70, 300, 1100, 2600, 37, 150, 200, 77, 64}};
    ok &= run_case<__nv_bfloat16>(c, args, NAN, 1);
    ok &= run_case<__half>(c, args, NAN, 2);
    c.int64_index = true;
    c.extra_rows = 3;
    ok &= run_case<__nv_bfloat16>(c, args, NAN, 3);
    c.name = "small_mixed_invariant";
    c.batch_invariant = true;
    ok &= run_case<__half>(c, args, NAN, 10);
  }
  {
    Case c{"small_gqa8_d64", {1, 1, 2, 3, 40, 1}, {33, 700, 90, 129, 40, 1}, 8, 1, 64};
    ok &= run_case<__half>(c, args, NAN, 4);
    ok &= run_case<__nv_bfloat16>(c, args, NAN, 5);
  }
  {
    Case c{"small_mha_d80", {1, 17, 1, 64, 3}, {1000, 17, 65, 300, 3}, 4, 4, 80};
    ok &= run_case<__nv_bfloat16>(c, args, NAN, 6);
  }
  {
    Case c{"small_gqa4_d96", {1, 1, 130, 7}, {512, 3000, 130, 400}, 8, 2, 96};
    ok &= run_case<__half>(c, args, NAN, 7);
  }
  {
    Case c{"small_fallback_d48", {1, 20, 4}, {70, 20, 33}, 6, 2, 48};  // CUDA-core path
    c.extra_rows = 2;
    ok &= run_case<__nv_bfloat16>(c, args, NAN, 8);
    ok &= run_case<float>(Case{"small_fp32_d128", {1, 30, 2}, {300, 30, 50}, 4, 2, 128}, args, NAN, 9);
  }
  if (!ok) return 1;
  if (args.small) return 0;

  const double copy = copy_ceiling_gbps();
  std::printf("copy ceiling (cudaMemcpy D2D, read+write): %.1f GB/s\n", copy);
  {
    Case c{"decode_ragged_128_2048", std::vector<int>(64, 1), uniform_lengths(rng, 64, 128, 2048)};
    c.timed = true;
    ok &= run_case<__nv_bfloat16>(c, args, copy, 11);
  }
  {
    Case c{"decode_ctx1024", std::vector<int>(64, 1), std::vector<int>(64, 1024)};
    c.timed = true;
    ok &= run_case<__nv_bfloat16>(c, args, copy, 12);
    c.name = "decode_ctx1024_invariant";  // the cost of giving up flash-decoding splits
    c.batch_invariant = true;
    ok &= run_case<__nv_bfloat16>(c, args, copy, 15);
  }
  {
    Case c{"prefill_4x2048", std::vector<int>(4, 2048), std::vector<int>(4, 2048)};
    c.timed = true;
    c.sample_rows = 24;
    ok &= run_case<__nv_bfloat16>(c, args, copy, 13);
  }
  {
    // A mixed iteration: 56 decodes, 4 prefills, 4 prefills over a cached prefix.
    std::vector<int> ql(56, 1), kl = uniform_lengths(rng, 56, 128, 2048);
    for (int i = 0; i < 4; ++i) ql.push_back(600), kl.push_back(600);
    for (int i = 0; i < 4; ++i) ql.push_back(200), kl.push_back(1500);
    Case c{"mixed_56d_4p_4pp", ql, kl};
    c.timed = true;
    c.sample_rows = 24;
    ok &= run_case<__nv_bfloat16>(c, args, copy, 14);
  }
  return ok ? 0 : 1;
}
