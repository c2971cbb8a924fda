// Microbenchmark of the CUDA quantized-weight projections (quant_linear, quant_linear_silu_mul;
// csrc/cuda/quant). Validates first (exit 1 on mismatch) against a double-precision product of the
// dequantized weights on random valid blocks of every format, at awkward sizes and fp16 / bf16 /
// float32 activations; the block decoding itself is checked against gguf.quants.dequantize by
// tests/cuda/test_quant_cuda.py, so here the host decodes with the same quant_blocks.cuh. Then
// times SmolLM2-135M- and Llama-3.2-1B-shaped layers at T = 1, 8, 512 (CUDA graph replays, rotating
// over weight copies so that the timed calls read device memory, not L2) and prints GB/s of bytes
// moved (quantized weight + activations + output) against the measured copy ceiling, and TFLOP/s.
#include "bench_util.cuh"
#include "cuda/launchers.h"
#include "cuda/quant/quant_blocks.cuh"

namespace {

using namespace bench;
namespace kern = orca::kernels;
namespace quant = orca::kernels::quant;

const char* qtype_name(int qtype) {
  switch (qtype) {
    case 2: return "Q4_0";
    case 3: return "Q4_1";
    case 6: return "Q5_0";
    case 7: return "Q5_1";
    case 8: return "Q8_0";
    case 12: return "Q4_K";
    case 13: return "Q5_K";
    case 14: return "Q6_K";
    default: return "?";
  }
}

uint16_t f16_bits(float v) {
  const __half h = __float2half_rn(v);
  uint16_t b;
  std::memcpy(&b, &h, sizeof b);
  return b;
}

// [rows, row_bytes] of random valid blocks: random quants, fp16 scales (and mins) that make the
// weights about 1/sqrt(K) in size.
std::vector<uint8_t> random_blocks(int qtype, int64_t rows, int64_t k, std::mt19937_64& rng) {
  const int64_t qk = kern::quant_block_elems(qtype), bb = kern::quant_block_bytes(qtype);
  std::vector<uint8_t> raw(size_t(rows) * (k / qk) * bb);
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& b : raw) b = static_cast<uint8_t>(byte(rng));
  const float s = 1.f / std::sqrt(float(k));
  std::normal_distribution<float> n01(0.f, 1.f);
  auto put = [&](uint8_t* p, float v) {
    const uint16_t b = f16_bits(v);
    p[0] = static_cast<uint8_t>(b & 0xff);
    p[1] = static_cast<uint8_t>(b >> 8);
  };
  for (size_t off = 0; off < raw.size(); off += bb) {
    uint8_t* blk = raw.data() + off;
    switch (qtype) {
      case 8: put(blk, n01(rng) * s / 64); break;
      case 2: put(blk, n01(rng) * s / 4); break;
      case 3: put(blk, n01(rng) * s / 8), put(blk + 2, n01(rng) * s); break;
      case 6: put(blk, n01(rng) * s / 8); break;
      case 7: put(blk, n01(rng) * s / 16), put(blk + 2, n01(rng) * s); break;
      case 12: put(blk, n01(rng) * s / 256), put(blk + 2, n01(rng) * s / 256); break;
      case 13: put(blk, n01(rng) * s / 512), put(blk + 2, n01(rng) * s / 256); break;
      case 14: put(blk + 208, n01(rng) * s / 2048); break;
    }
  }
  return raw;
}

// Dequantized weights [rows, K] in double (the host side of quant_blocks.cuh).
std::vector<double> dequantize(int qtype, const std::vector<uint8_t>& raw, int64_t rows, int64_t k) {
  std::vector<double> w(size_t(rows) * k);
  quant::visit_format(qtype, [&](auto fmt) {
    using Fmt = decltype(fmt);
    const int64_t rb = k / Fmt::kBlockElems * Fmt::kBlockBytes;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < k; c += 8) {
        float v[8];
        Fmt::dequant(Fmt::load(raw.data() + r * rb, c), v);
        for (int e = 0; e < 8; ++e) w[size_t(r) * k + c + e] = v[e];
      }
  });
  return w;
}

// One call: quant_linear (with bias and residual when `extras`) or quant_linear_silu_mul.
template <typename T>
cudaError_t call(bool silu, int qtype, const T* x, const uint8_t* w, const T* bias, const T* residual, T* out,
                 int64_t t, int64_t k, int64_t n_out, cudaStream_t s) {
  return silu ? kern::quant_linear_silu_mul(dtype_of<T>(), qtype, x, w, bias, out, t, k, n_out, s)
              : kern::quant_linear(dtype_of<T>(), qtype, x, w, bias, residual, out, t, k, n_out, s);
}

template <typename T>
bool validate(int qtype, int64_t t, int64_t k, int64_t n_out, bool silu, bool extras, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t rows = silu ? 2 * n_out : n_out;
  const std::vector<uint8_t> raw = random_blocks(qtype, rows, k, rng);
  const std::vector<double> w = dequantize(qtype, raw, rows, k);
  const std::vector<T> x = random_vec<T>(size_t(t) * k, rng);
  const std::vector<T> b = random_vec<T>(rows, rng), res = random_vec<T>(size_t(t) * n_out, rng);
  DevBuf<uint8_t> dw(raw);
  DevBuf<T> dx(x), db(b), dres(res), dout(size_t(t) * n_out);
  BENCH_CHECK(cudaMemset(dout.ptr, 0xff, dout.n * sizeof(T)));  // NaN: an unwritten output fails
  BENCH_CHECK(call<T>(silu, qtype, dx.ptr, dw.ptr, extras ? db.ptr : nullptr, extras && !silu ? dres.ptr : nullptr,
                      dout.ptr, t, k, n_out, nullptr));
  BENCH_CHECK(cudaDeviceSynchronize());
  const std::vector<T> out = dout.download();
  const bool f16 = std::is_same<T, __half>::value, f32 = std::is_same<T, float>::value;
  Checker chk{f32 ? 1e-4 : f16 ? 5e-3 : 3e-2, f32 ? 1e-4 : f16 ? 5e-3 : 2e-2};
  for (int64_t i = 0; i < t; ++i)
    for (int64_t o = 0; o < n_out; ++o) {
      auto dot = [&](int64_t r) {
        double acc = extras ? to_f(b[r]) : 0.0;
        for (int64_t c = 0; c < k; ++c) acc += double(to_f(x[size_t(i) * k + c])) * w[size_t(r) * k + c];
        return acc;
      };
      double want;
      if (silu) {
        const double g = dot(o), u = dot(n_out + o);
        want = g / (1.0 + std::exp(-g)) * u;
      } else {
        want = dot(o) + (extras ? to_f(res[size_t(i) * n_out + o]) : 0.0);
      }
      chk.add(to_f(out[size_t(i) * n_out + o]), want, "out", size_t(i * n_out + o));
    }
  char label[160];
  std::snprintf(label, sizeof label, "%s %s T=%lld K=%lld N=%lld extras=%d (%s)", silu ? "quant_linear_silu_mul"
                : "quant_linear", qtype_name(qtype), (long long)t, (long long)k, (long long)n_out, int(extras),
                type_name<T>());
  return chk.report(label);
}

// Times one layer shape; weight rows = n_out (linear) or 2 * n_out (silu_mul).
bool time_case(const char* model, const char* layer, int qtype, int64_t t, int64_t k, int64_t n_out, bool silu,
               const Args& args, double copy_gbps) {
  using T = __nv_bfloat16;
  std::mt19937_64 rng(uint64_t(qtype) * 1000003 + uint64_t(k) * 31 + uint64_t(n_out) + uint64_t(t));
  const int64_t rows = silu ? 2 * n_out : n_out;
  const std::vector<uint8_t> raw = random_blocks(qtype, rows, k, rng);
  const double w_bytes = double(raw.size());
  const int copies = rotation_copies(w_bytes);
  std::vector<std::unique_ptr<DevBuf<uint8_t>>> ws;
  for (int c = 0; c < copies; ++c) ws.push_back(std::make_unique<DevBuf<uint8_t>>(raw));
  DevBuf<T> dx(random_vec<T>(size_t(t) * k, rng)), dout(size_t(t) * n_out);
  const KernelTime kt = kernel_time(
      [&](cudaStream_t s, int i) {
        return call<T>(silu, qtype, dx.ptr, ws[i % copies]->ptr, nullptr, nullptr, dout.ptr, t, k, n_out, s);
      },
      args);
  const double us = kt.us();
  const double bytes = w_bytes + double(t) * k * sizeof(T) + double(t) * n_out * sizeof(T);
  const double gbps = bytes / (us * 1e-6) / 1e9;
  const double floor_us = bytes / (copy_gbps * 1e9) * 1e6;
  const double tflops = 2.0 * double(t) * double(k) * double(rows) / (us * 1e-6) / 1e12;
  std::printf("%-6s %-9s %s T=%-4lld K=%-5lld rows=%-6lld %9.2f us  %7.1f GB/s (%4.1f%% of copy)  %6.1f TFLOP/s\n",
              model, layer, qtype_name(qtype), (long long)t, (long long)k, (long long)rows, us, gbps,
              100.0 * gbps / copy_gbps, tflops);
  Result r;
  r.str("bench", "quant_linear").str("model", model).str("layer", layer).str("qtype", qtype_name(qtype))
      .str("dtype", "bfloat16").num("T", double(t)).num("K", double(k)).num("rows", double(rows));
  add_timing(r, kt);
  r.num("gbps", gbps).num("copy_gbps", copy_gbps).num("pct_of_copy", 100.0 * gbps / copy_gbps)
      .num("floor_us", floor_us).num("tflops", tflops).num("rotated_copies", copies).print();
  return std::isfinite(us);
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse_args(argc, argv);
  bool ok = true;
  // Validation: every format, awkward sizes (N not a multiple of the 32-row tile, K an odd number
  // of blocks), token counts on both sides of every token-tile size.
  for (int qtype : {8, 2, 3, 6, 7, 12, 13, 14}) {
    const int64_t k = kern::quant_block_elems(qtype) == 32 ? 19 * 32 : 3 * 256;
    ok &= validate<__nv_bfloat16>(qtype, 1, k, 77, false, false, 1);
    ok &= validate<__nv_bfloat16>(qtype, 37, k, 45, true, true, 2);
    ok &= validate<__half>(qtype, 70, k, 33, false, true, 3);
    ok &= validate<float>(qtype, 9, k, 21, true, false, 4);
  }
  if (!ok) return 1;
  if (args.small) return 0;

  const double copy = copy_ceiling_gbps();
  std::printf("copy ceiling (cudaMemcpy D2D, read+write): %.1f GB/s\n", copy);
  struct Layer {
    const char* model;
    const char* name;
    int64_t k, n_out;
    bool silu;
  };
  const Layer layers[] = {
      {"smollm", "qkv", 576, 576 + 2 * 192, false},  {"smollm", "o", 576, 576, false},
      {"smollm", "gate_up", 576, 1536, true},        {"smollm", "down", 1536, 576, false},
      {"smollm", "lm_head", 576, 49152, false},      {"llama1b", "qkv", 2048, 2048 + 2 * 512, false},
      {"llama1b", "o", 2048, 2048, false},           {"llama1b", "gate_up", 2048, 8192, true},
      {"llama1b", "down", 8192, 2048, false},
  };
  for (int qtype : {12, 8})
    for (const Layer& l : layers)
      for (int64_t t : {1, 8, 512}) {
        if (qtype != 12 && t == 512) continue;  // prefill: one format is enough to see the compute rate
        ok &= time_case(l.model, l.name, qtype, t, l.k, l.n_out, l.silu, args, copy);
      }
  return ok ? 0 : 1;
}
