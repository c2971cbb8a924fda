// Microbenchmark of the CUDA ragged_attention (csrc/cuda/attention): validates every case against
// the float64 reference (bench/common/reference.h) on random data first (exit 1 on mismatch), then
// times the launcher (work-list kernel + attention kernel) with CUDA graph replays
// (bench_util.cuh) and prints the time per call with achieved GB/s (decode) or TFLOP/s (prefill)
// next to the measured copy ceiling. Target shapes (the floors are in bench/RESULTS.md):
//   decode  B=64, contexts U[128, 2048], Hq 16 / Hkv 8, D 128, bf16: >= 80% of copy bandwidth
//   prefill 4 x 2048 causal, same heads: >= 50% of torch SDPA (bench/gpu_reference.py)
// No input rotation: the decode cases read 270-290 MB of K/V per call, several times the L2, and
// the prefill case is compute-bound.
// --small runs only small validation cases (for compute-sanitizer).
// Cases of one shape share their random inputs and reference rows (made once, see Inputs), so the
// sweep validates every variant without regenerating ~140 M random numbers per variant.
// Sweep of the runtime knobs (RaggedAttentionTuning) on the decode cases, in the same run:
//   --items-per-sm LIST   decode work items per SM (default 4,16,64)
//   --decode-stages LIST  0 = the shared kernel, 2/3 = the decode kernel (default 0,2,3)
// plus, per kernel, the attention alone from a plan built once (what each layer of a forward pass
// pays) next to plan + attention.
#include <map>
#include <memory>
#include <numeric>
#include <sstream>

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
  int sample_rows = 64;  // rows per request checked against the CPU reference (all if fewer)
  int extra_rows = 0;    // trailing query rows owned by no request: must come out as zeros
  // Non-default knobs: plan + attention launchers with them (batch_invariant alone uses the one-call
  // launcher: every row through prefill tiles, no decode splits).
  kern::RaggedAttentionTuning tuning{};
  bool reuse_plan = false;  // plan built once; each launch is the attention alone (one layer)
};

template <typename I>
const void* upload_index(const std::vector<int>& v, std::vector<std::unique_ptr<DevBuf<I>>>& keep) {
  std::vector<I> h(v.begin(), v.end());
  keep.push_back(std::make_unique<DevBuf<I>>(h));
  return keep.back()->ptr;
}

// The inputs of one case shape (lengths, heads, index width, unowned rows, seed): random q, K and V
// on the device, and the float64 reference of the rows validation checks. Built once per shape and
// shared by every case of that shape: the knob sweep runs 24 variants over two decode shapes, each
// ~140 M random numbers and a reference that one host thread would otherwise redo per variant.
template <typename T>
struct Inputs {
  int64_t n_tokens = 0, n_slots = 0;
  std::vector<int> q_start, kv_start;
  std::unique_ptr<DevBuf<T>> dq, dk, dv;
  std::vector<std::unique_ptr<DevBuf<int32_t>>> keep32;
  std::vector<std::unique_ptr<DevBuf<int64_t>>> keep64;
  const void *d_qs = nullptr, *d_ql = nullptr, *d_ks = nullptr, *d_kl = nullptr;
  std::vector<size_t> checked;    // element offset of each checked query row ([Hq, D] values)
  std::vector<double> expected;   // [checked rows, Hq, D]
};

template <typename T>
std::unique_ptr<Inputs<T>> make_inputs(const Case& c, uint64_t seed) {
  auto in = std::make_unique<Inputs<T>>();
  std::mt19937_64 rng(seed);
  const int B = static_cast<int>(c.q_len.size());
  const int hq = c.hq, hkv = c.hkv, D = c.d;
  // Query rows in a shuffled request order; slabs scattered with gaps, also shuffled.
  std::vector<int> order(B);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  in->q_start.resize(B);
  in->kv_start.resize(B);
  for (int b : order) in->q_start[b] = static_cast<int>(in->n_tokens), in->n_tokens += c.q_len[b];
  in->n_tokens += c.extra_rows;
  std::shuffle(order.begin(), order.end(), rng);
  in->n_slots = static_cast<int64_t>(rng() % 7);
  for (int b : order)
    in->kv_start[b] = static_cast<int>(in->n_slots), in->n_slots += c.kv_len[b] + static_cast<int64_t>(rng() % 9);
  in->n_slots += 3;

  const std::vector<T> q = random_vec<T>(size_t(in->n_tokens) * hq * D, rng, 2.f);
  const std::vector<T> kc = random_vec<T>(size_t(in->n_slots) * hkv * D, rng);
  const std::vector<T> vc = random_vec<T>(size_t(in->n_slots) * hkv * D, rng);
  in->dq = std::make_unique<DevBuf<T>>(q);
  in->dk = std::make_unique<DevBuf<T>>(kc);
  in->dv = std::make_unique<DevBuf<T>>(vc);
  auto up = [&](const std::vector<int>& v) {
    return c.int64_index ? upload_index<int64_t>(v, in->keep64) : upload_index<int32_t>(v, in->keep32);
  };
  in->d_qs = up(in->q_start);
  in->d_ql = up(c.q_len);
  in->d_ks = up(in->kv_start);
  in->d_kl = up(c.kv_len);

  // CPU reference (double) on a sample of rows of every request, all heads and dims.
  const float scale = 1.f / std::sqrt(static_cast<float>(D));  // as run_case passes it
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
      const size_t base = size_t(in->q_start[b] + i) * hq * D;
      ref::attention_row(&q[base], kc.data(), vc.data(), in->kv_start[b], kl - ql + i + 1, hq, hkv, D, scale,
                         ToDouble{}, o.data());
      in->checked.push_back(base);
      in->expected.insert(in->expected.end(), o.begin(), o.end());
    }
  }
  return in;
}

template <typename T>
std::map<std::string, std::unique_ptr<Inputs<T>>>& inputs_cache() {
  static std::map<std::string, std::unique_ptr<Inputs<T>>> cache;
  return cache;
}

// Frees the shared inputs when main returns, while the CUDA runtime is still up (a static's
// destructor would run after its teardown, and cudaFree would fail there).
struct InputsScope {
  ~InputsScope() {
    inputs_cache<__nv_bfloat16>().clear();
    inputs_cache<__half>().clear();
    inputs_cache<float>().clear();
  }
};

// The shared inputs of `c`'s shape with `seed` (made on first use).
template <typename T>
const Inputs<T>& inputs_of(const Case& c, uint64_t seed) {
  auto& cache = inputs_cache<T>();
  std::ostringstream key;
  key << seed << ' ' << c.hq << ' ' << c.hkv << ' ' << c.d << ' ' << c.int64_index << ' ' << c.extra_rows << ' '
      << c.sample_rows << " q";
  for (int x : c.q_len) key << ' ' << x;
  key << " kv";
  for (int x : c.kv_len) key << ' ' << x;
  std::unique_ptr<Inputs<T>>& slot = cache[key.str()];
  if (!slot) slot = make_inputs<T>(c, seed);
  return *slot;
}

template <typename T>
bool run_case(const Case& c, const Args& args, double copy_gbps, uint64_t seed) {
  const Inputs<T>& in = inputs_of<T>(c, seed);
  const int B = static_cast<int>(c.q_len.size());
  const int hq = c.hq, hkv = c.hkv, D = c.d;
  const int64_t n_tokens = in.n_tokens, n_slots = in.n_slots;
  const void *d_qs = in.d_qs, *d_ql = in.d_ql, *d_ks = in.d_ks, *d_kl = in.d_kl;
  const DevBuf<T>& dq = *in.dq;
  const DevBuf<T>& dk = *in.dk;
  const DevBuf<T>& dv = *in.dv;
  DevBuf<T> dout(size_t(n_tokens) * hq * D);
  // NaN everywhere: a row the kernel neither computes nor zeroes fails the validation below.
  BENCH_CHECK(cudaMemset(dout.ptr, 0xff, dout.n * sizeof(T)));

  const kern::DType dt = dtype_of<T>();
  const size_t ws_bytes = std::max(kern::ragged_attention_workspace_bytes(dt, n_tokens, B, hq, hkv, D),
                                   kern::ragged_attention_plan_bytes(dt, n_tokens, B, hq, hkv, D, c.tuning));
  DevBuf<uint8_t> ws(ws_bytes);
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const kern::IndexType it = c.int64_index ? kern::IndexType::kInt64 : kern::IndexType::kInt32;
  const bool planned = c.reuse_plan || c.tuning.items_per_sm != kern::RaggedAttentionTuning{}.items_per_sm ||
                       c.tuning.decode_stages != kern::RaggedAttentionTuning{}.decode_stages;
  auto plan = [&](cudaStream_t stream) {
    return kern::ragged_attention_plan(dt, it, d_qs, d_ql, d_ks, d_kl, ws.ptr, ws_bytes, n_tokens, B, n_slots, hq,
                                       hkv, D, c.tuning, stream);
  };
  auto attend = [&](cudaStream_t stream) {
    return kern::ragged_attention_with_plan(dt, dq.ptr, dk.ptr, dv.ptr, dout.ptr, ws.ptr, ws_bytes, n_tokens, B, hq,
                                            hkv, D, scale, c.tuning, stream);
  };
  auto launch = [&](cudaStream_t stream, int) {
    if (planned) {
      if (!c.reuse_plan) {
        const cudaError_t err = plan(stream);
        if (err != cudaSuccess) return err;
      }
      return attend(stream);
    }
    return kern::ragged_attention(dt, it, dq.ptr, dk.ptr, dv.ptr, d_qs, d_ql, d_ks, d_kl, dout.ptr, ws.ptr, ws_bytes,
                                  n_tokens, B, n_slots, hq, hkv, D, scale, c.tuning.batch_invariant, stream);
  };
  if (c.reuse_plan) {
    // A reused plan must serve the next launch as it is: validate the second launch, over NaNs.
    BENCH_CHECK(plan(nullptr));
    BENCH_CHECK(attend(nullptr));
    BENCH_CHECK(cudaMemset(dout.ptr, 0xff, dout.n * sizeof(T)));
  }
  BENCH_CHECK(launch(nullptr, 0));
  BENCH_CHECK(cudaDeviceSynchronize());
  const std::vector<T> out = dout.download();

  const double atol = sizeof(T) == 4 ? 1e-4 : (std::is_same<T, __half>::value ? 3e-3 : 1e-2);
  const double rtol = sizeof(T) == 4 ? 1e-4 : (std::is_same<T, __half>::value ? 1e-2 : 2e-2);
  Checker chk{atol, rtol};
  const size_t row = size_t(hq) * D;
  for (size_t r = 0; r < in.checked.size(); ++r)
    for (size_t e = 0; e < row; ++e) chk.add(to_f(out[in.checked[r] + e]), in.expected[r * row + e], "out", in.checked[r] + e);
  for (size_t i = size_t(n_tokens - c.extra_rows) * hq * D; i < out.size(); ++i) chk.add(to_f(out[i]), 0.0, "unowned", i);
  const std::string label = c.name + " (" + type_name<T>() + ", D=" + std::to_string(D) + ", Hq/Hkv=" +
                            std::to_string(hq) + "/" + std::to_string(hkv) + ", B=" + std::to_string(B) + ")";
  if (!chk.report(label.c_str())) return false;
  if (!c.timed || args.small) return true;

  const KernelTime kt = kernel_time(launch, args);
  const double us = kt.us();
  // Bytes that must move: every request's K and V once per KV head, q read, out written.
  double kv_tokens = 0.0, pairs = 0.0;
  for (int b = 0; b < B; ++b) {
    const double ql = c.q_len[b], kl = c.kv_len[b];
    kv_tokens += kl;
    pairs += ql * (kl - ql) + ql * (ql + 1) / 2;  // (query, key) pairs under the causal mask
  }
  const double bytes = kv_tokens * hkv * D * 2 * sizeof(T) + 2.0 * double(n_tokens) * hq * D * sizeof(T);
  const double gbps = bytes / (us * 1e-6) / 1e9;
  const double tflops = 4.0 * pairs * hq * D / (us * 1e-6) / 1e12;
  std::printf("%-40s %9.2f us (%s; back-to-back %.2f us)  %8.1f GB/s (%5.1f%% of copy %.0f GB/s)  %7.1f TFLOP/s\n",
              c.name.c_str(), us, kt.method(), kt.b2b_us, gbps, 100.0 * gbps / copy_gbps, copy_gbps, tflops);
  Result r;
  r.str("bench", "ragged_attention").str("case", c.name).str("dtype", type_name<T>()).num("B", B)
      .num("T", double(n_tokens)).num("Hq", hq).num("Hkv", hkv).num("D", D);
  add_timing(r, kt);
  r.num("gbps", gbps).num("copy_gbps", copy_gbps).num("pct_of_copy", 100.0 * gbps / copy_gbps).num("tflops", tflops)
      .num("items_per_sm", c.tuning.items_per_sm).num("decode_stages", c.tuning.decode_stages)
      .num("reuse_plan", c.reuse_plan ? 1 : 0).print();
  return true;
}

std::vector<int> uniform_lengths(std::mt19937_64& rng, int n, int lo, int hi) {
  std::uniform_int_distribution<int> dist(lo, hi);
  std::vector<int> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// "4,8,16" -> {4, 8, 16}; exits with a usage message on anything else.
std::vector<int> int_list(const char* flag, const char* text) {
  std::vector<int> v;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    const long x = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || x < 0 || x > 4096) {
      std::fprintf(stderr, "%s: expected a comma-separated list of integers, got '%s'\n", flag, text);
      std::exit(2);
    }
    v.push_back(static_cast<int>(x));
  }
  return v;
}

// The sweep's knobs, taken out of argv before parse_args sees it.
struct Sweep {
  std::vector<int> items_per_sm{4, 16, 64};
  std::vector<int> decode_stages{0, 2, 3};
};

Sweep take_sweep_args(int& argc, char** argv) {
  Sweep sw;
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    const bool ips = !std::strcmp(argv[i], "--items-per-sm"), ds = !std::strcmp(argv[i], "--decode-stages");
    if ((ips || ds) && i + 1 < argc) {
      (ips ? sw.items_per_sm : sw.decode_stages) = int_list(argv[i], argv[i + 1]);
      ++i;
    } else {
      argv[kept++] = argv[i];
    }
  }
  argc = kept;
  for (int d : sw.decode_stages) {
    for (int n : sw.items_per_sm) {
      kern::RaggedAttentionTuning t;
      t.items_per_sm = n;
      t.decode_stages = d;
      if (!kern::ragged_attention_tuning_valid(t)) {
        std::fprintf(stderr, "invalid knobs: items_per_sm %d (1..%d), decode_stages %d (0, 2 or 3)\n", n,
                     kern::kRaggedAttentionMaxItemsPerSm, d);
        std::exit(2);
      }
    }
  }
  return sw;
}

}  // namespace

int main(int argc, char** argv) {
  const InputsScope inputs_scope;
  const Sweep sweep = take_sweep_args(argc, argv);
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
    // The decode kernel (prefill work as 16-row tiles) and a reused plan, with unowned rows.
    c.tuning.decode_stages = 3;
    c.tuning.items_per_sm = 256;
    c.reuse_plan = true;
    ok &= run_case<__nv_bfloat16>(c, args, NAN, 31);
    c.tuning.decode_stages = 2;
    c.tuning.items_per_sm = 1;
    ok &= run_case<__half>(c, args, NAN, 32);
    // Batch-invariant work lists, through the one-call launcher and through a reused plan.
    c.name = "small_mixed_invariant";
    c.tuning = kern::RaggedAttentionTuning{};
    c.tuning.batch_invariant = true;
    c.reuse_plan = false;
    ok &= run_case<__half>(c, args, NAN, 10);
    c.name = "small_mixed_invariant_plan";
    c.reuse_plan = true;
    ok &= run_case<__half>(c, args, NAN, 11);
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
    c.tuning.batch_invariant = true;
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

  // The knob sweep on the decode cases (each variant validated first, like every case).
  std::printf("sweep: items per SM x decode stages (0 = shared kernel); 'reuse' = attention alone from a plan\n");
  const std::vector<std::pair<std::string, std::vector<int>>> decodes = {
      {"decode_ragged_128_2048", uniform_lengths(rng, 64, 128, 2048)}, {"decode_ctx1024", std::vector<int>(64, 1024)}};
  auto run_variant = [&](const std::string& base, const std::vector<int>& kv_len, int items, int stages, bool reuse) {
    Case c{"sweep:" + base + " ips=" + std::to_string(items) + " ds=" + std::to_string(stages) + (reuse ? " reuse" : ""),
           std::vector<int>(64, 1), kv_len};
    c.timed = true;
    c.tuning.items_per_sm = items;
    c.tuning.decode_stages = stages;
    c.reuse_plan = reuse;
    return run_case<__nv_bfloat16>(c, args, copy, 15);
  };
  for (const auto& [base, kv_len] : decodes) {
    for (int stages : sweep.decode_stages) {
      for (int items : sweep.items_per_sm) ok &= run_variant(base, kv_len, items, stages, false);
      // The plan's share of a launch does not depend on the knobs: one reused-plan run per kernel.
      ok &= run_variant(base, kv_len, kern::RaggedAttentionTuning{}.items_per_sm, stages, true);
    }
  }
  return ok ? 0 : 1;
}
