// CPU glue (see cpu_ops.h): index-value checks -> dtype dispatch -> csrc/cpu kernels.
#include "cpu_ops.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <string>
#include <vector>

#include "cpu/cpu_kernels.h"
#include "cpu/quant_kernels.h"

namespace orca::cpu_ops {
namespace {

template <typename I>
std::vector<int64_t> to_vec(const at::Tensor& t) {
  const I* p = t.data_ptr<I>();
  return std::vector<int64_t>(p, p + t.numel());
}

// Index values as int64 on the host, whichever of the two index types t has.
std::vector<int64_t> index_values(const at::Tensor& t) {
  return t.scalar_type() == at::kInt ? to_vec<int32_t>(t) : to_vec<int64_t>(t);
}

// Calls f(tag) with a value whose type is the element type of a CPU float tensor.
template <typename F>
void dispatch_float(at::ScalarType st, F&& f) {
  if (st == at::kFloat) f(float{});
  else f(orca::bf16{});
}

template <typename F>
void dispatch_index(at::ScalarType st, F&& f) {
  if (st == at::kInt) f(int32_t{});
  else f(int64_t{});
}

template <typename T>
T* ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

// The crossover per dtype: index 0 float32, 1 bfloat16.
std::atomic<int64_t> g_stream_max_tokens[2] = {kStreamMaxTokensFloat, kStreamMaxTokensBf16};

std::atomic<int64_t>& crossover(at::ScalarType st) { return g_stream_max_tokens[st == at::kFloat ? 0 : 1]; }

std::atomic<int64_t>& crossover(const std::string& dtype) {
  TORCH_CHECK_VALUE(dtype == "float32" || dtype == "bfloat16", "dtype must be \"float32\" or \"bfloat16\", got \"",
                    dtype.substr(0, 32), "\"");
  return g_stream_max_tokens[dtype == "float32" ? 0 : 1];
}

bool use_aten(const at::Tensor& x) { return x.size(0) > crossover(x.scalar_type()).load(); }

constexpr cpu::Bf16Path kBf16Paths[] = {cpu::Bf16Path::kAvx2, cpu::Bf16Path::kAvx512Bf16,
                                        cpu::Bf16Path::kAvx512Bf16Emulated, cpu::Bf16Path::kAmxBf16};
constexpr cpu::F32Path kF32Paths[] = {cpu::F32Path::kAvx2, cpu::F32Path::kAvx512};

}  // namespace

int64_t stream_max_tokens(const std::string& dtype) { return crossover(dtype).load(); }

void set_stream_max_tokens(const std::string& dtype, int64_t max_tokens) {
  TORCH_CHECK_VALUE(max_tokens >= 0, "max_tokens must be >= 0, got ", max_tokens);
  crossover(dtype).store(max_tokens);
}

std::string bf16_path() { return cpu::bf16_path_name(cpu::bf16_path()); }

void set_bf16_path(const std::string& name) {
  for (cpu::Bf16Path p : kBf16Paths) {
    if (name != cpu::bf16_path_name(p)) continue;
    TORCH_CHECK_VALUE(cpu::bf16_path_supported(p), "this CPU cannot run the bf16 path ", name);
    cpu::set_bf16_path(p);
    return;
  }
  TORCH_CHECK_VALUE(false, "unknown bf16 path \"", name.substr(0, 32),
                    "\"; expected avx2, avx512_bf16 or avx512_bf16_emulated");
}

std::vector<std::string> bf16_paths() {
  std::vector<std::string> names;
  for (cpu::Bf16Path p : kBf16Paths)
    if (cpu::bf16_path_supported(p)) names.emplace_back(cpu::bf16_path_name(p));
  return names;
}

std::string f32_path() { return cpu::f32_path_name(cpu::f32_path()); }

void set_f32_path(const std::string& name) {
  for (cpu::F32Path p : kF32Paths) {
    if (name != cpu::f32_path_name(p)) continue;
    TORCH_CHECK_VALUE(cpu::f32_path_supported(p), "this CPU cannot run the float32 path ", name);
    cpu::set_f32_path(p);
    return;
  }
  TORCH_CHECK_VALUE(false, "unknown float32 path \"", name.substr(0, 32), "\"; expected avx2 or avx512");
}

std::vector<std::string> f32_paths() {
  std::vector<std::string> names;
  for (cpu::F32Path p : kF32Paths)
    if (cpu::f32_path_supported(p)) names.emplace_back(cpu::f32_path_name(p));
  return names;
}

uint64_t stream_read(const at::Tensor& words) {
  TORCH_CHECK_VALUE(words.defined() && words.is_cpu() && words.is_contiguous() && words.scalar_type() == at::kLong,
                    "words must be a contiguous CPU int64 tensor");
  return cpu::stream_read(reinterpret_cast<const uint64_t*>(words.data_ptr()), words.numel());
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty_like(x);
  if (x.numel() == 0) return out;
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::rms_norm<T>(ptr<T>(x), ptr<T>(weight), ptr<T>(out), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

at::Tensor rmsnorm_qkv(const at::Tensor& x, const at::Tensor& norm_weight, const at::Tensor& qkv_weight,
                       const std::optional<at::Tensor>& qkv_bias, double eps, bool batch_invariant) {
  const int64_t n_tokens = x.size(0), hidden = x.size(1), n_out = qkv_weight.size(0);
  if (use_aten(x) && !batch_invariant) {  // above the crossover: our norm kernel, then one GEMM through ATen
    return at::linear(rms_norm(x, norm_weight, eps), qkv_weight, qkv_bias);
  }
  at::Tensor out = at::empty({n_tokens, n_out}, x.options());
  if (n_tokens == 0 || n_out == 0) return out;
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::rmsnorm_qkv<T>(ptr<T>(x), ptr<T>(norm_weight), ptr<T>(qkv_weight),
                        qkv_bias.has_value() ? ptr<T>(*qkv_bias) : nullptr, ptr<T>(out), n_tokens, hidden, n_out,
                        static_cast<float>(eps));
  });
  return out;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  const std::optional<at::Tensor>& residual, bool batch_invariant) {
  if (use_aten(x) && !batch_invariant) {
    at::Tensor out = at::linear(x, weight, bias);
    return residual.has_value() ? out.add_(*residual) : out;
  }
  const int64_t n_tokens = x.size(0), n_out = weight.size(0);
  at::Tensor out = at::empty({n_tokens, n_out}, x.options());
  if (n_tokens == 0 || n_out == 0) return out;
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::linear<T>(ptr<T>(x), ptr<T>(weight), bias.has_value() ? ptr<T>(*bias) : nullptr,
                   residual.has_value() ? ptr<T>(*residual) : nullptr, ptr<T>(out), n_tokens, x.size(1), n_out);
  });
  return out;
}

at::Tensor linear_silu_mul(const at::Tensor& x, const at::Tensor& gate_up_weight,
                           const std::optional<at::Tensor>& gate_up_bias, bool batch_invariant) {
  const int64_t n_tokens = x.size(0), n_inter = gate_up_weight.size(0) / 2;
  if (use_aten(x) && !batch_invariant) {
    const at::Tensor gate_up = at::linear(x, gate_up_weight, gate_up_bias);
    return at::silu(gate_up.narrow(1, 0, n_inter)).mul_(gate_up.narrow(1, n_inter, n_inter));
  }
  at::Tensor out = at::empty({n_tokens, n_inter}, x.options());
  if (n_tokens == 0 || n_inter == 0) return out;
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::linear_silu_mul<T>(ptr<T>(x), ptr<T>(gate_up_weight), gate_up_bias.has_value() ? ptr<T>(*gate_up_bias) : nullptr,
                            ptr<T>(out), n_tokens, x.size(1), n_inter);
  });
  return out;
}

void slab_write(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                const at::Tensor& slots) {
  const int64_t n_slots = k_cache.size(0);
  for (int64_t s : index_values(slots))
    TORCH_CHECK_VALUE(s >= 0 && s < n_slots, "slots contains ", s, ", outside the cache of ", n_slots, " slots");
  if (k.size(0) == 0) return;
  dispatch_float(k.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    dispatch_index(slots.scalar_type(), [&](auto itag) {
      using I = decltype(itag);
      cpu::slab_write<T, I>(ptr<T>(k_cache), ptr<T>(v_cache), ptr<T>(k), ptr<T>(v), slots.data_ptr<I>(), k.size(0),
                            k.size(1) * k.size(2));
    });
  });
}

std::tuple<at::Tensor, at::Tensor> row_argmax(const at::Tensor& x) {
  const int64_t n_rows = x.size(0), n_cols = x.size(1);
  at::Tensor index = at::empty({n_rows}, x.options().dtype(at::kLong));
  at::Tensor value = at::empty({n_rows}, x.options());
  cpu::row_argmax(x.data_ptr<float>(), n_rows, n_cols, index.data_ptr<int64_t>(), value.data_ptr<float>());
  return {index, value};
}

at::Tensor rope_slab_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                           at::Tensor& v_cache, const at::Tensor& slots, int64_t n_q_heads) {
  const int64_t n_tokens = qkv.size(0), n_slots = k_cache.size(0), n_kv_heads = k_cache.size(1),
                head_dim = k_cache.size(2);
  for (int64_t s : index_values(slots))
    TORCH_CHECK_VALUE(s >= 0 && s < n_slots, "slots contains ", s, ", outside the cache of ", n_slots, " slots");
  at::Tensor q = at::empty({n_tokens, n_q_heads, head_dim}, qkv.options());
  if (n_tokens == 0) return q;
  dispatch_float(qkv.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    dispatch_index(slots.scalar_type(), [&](auto itag) {
      using I = decltype(itag);
      cpu::rope_slab_write<T, I>(ptr<T>(qkv), cos.data_ptr<float>(), sin.data_ptr<float>(), ptr<T>(k_cache),
                                 ptr<T>(v_cache), slots.data_ptr<I>(), ptr<T>(q), n_tokens, n_q_heads, n_kv_heads,
                                 head_dim);
    });
  });
  return q;
}

at::Tensor ragged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& q_start, const at::Tensor& q_len, const at::Tensor& kv_start,
                            const at::Tensor& kv_len, double scale, bool batch_invariant) {
  const int64_t n_tokens = q.size(0), n_slots = k_cache.size(0);
  const auto qs = index_values(q_start), ql = index_values(q_len), ks = index_values(kv_start),
             kl = index_values(kv_len);
  for (size_t b = 0; b < qs.size(); ++b) {
    TORCH_CHECK_VALUE(ql[b] >= 0 && kl[b] >= ql[b], "request ", b, ": need 0 <= q_len <= kv_len, got q_len ", ql[b],
                      " and kv_len ", kl[b]);
    TORCH_CHECK_VALUE(qs[b] >= 0 && qs[b] + ql[b] <= n_tokens, "request ", b, ": query rows [", qs[b], ", ",
                      qs[b] + ql[b], ") fall outside q's ", n_tokens, " rows");
    TORCH_CHECK_VALUE(ks[b] >= 0 && ks[b] + kl[b] <= n_slots, "request ", b, ": context slots [", ks[b], ", ",
                      ks[b] + kl[b], ") fall outside the cache of ", n_slots, " slots");
  }
  at::Tensor out = at::zeros_like(q);
  if (qs.empty() || n_tokens == 0) return out;
  dispatch_float(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    dispatch_index(q_start.scalar_type(), [&](auto itag) {
      using I = decltype(itag);
      cpu::ragged_attention<T, I>(ptr<T>(q), ptr<T>(k_cache), ptr<T>(v_cache), q_start.data_ptr<I>(),
                                  q_len.data_ptr<I>(), kv_start.data_ptr<I>(), kv_len.data_ptr<I>(), ptr<T>(out),
                                  static_cast<int64_t>(qs.size()), q.size(1), k_cache.size(1), q.size(2),
                                  static_cast<float>(scale), batch_invariant);
    });
  });
  return out;
}

void slab_move(at::Tensor& pools, const at::Tensor& moves) {
  const int64_t n_pools = pools.size(0), n_slots = pools.size(1);
  if (n_pools == 0 || n_slots == 0) return;
  const int64_t row_bytes = pools.numel() / (n_pools * n_slots) * static_cast<int64_t>(pools.element_size());
  cpu::slab_move(pools.data_ptr(), n_pools, n_slots, row_bytes, moves.data_ptr<int64_t>(), moves.size(0));
}

// ---- quantized weights ------------------------------------------------------------------------

namespace {
constexpr cpu::QuantPath kQuantPaths[] = {cpu::QuantPath::kAvx2, cpu::QuantPath::kAvx512};
cpu::QuantActivations activations(bool int8) {
  return int8 ? cpu::QuantActivations::kInt8 : cpu::QuantActivations::kFloat32;
}
}  // namespace

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, int64_t qtype, int64_t k,
                        const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual,
                        bool int8_activations) {
  const int64_t n_tokens = x.size(0), n_out = qweight.size(0);
  at::Tensor out = at::empty({n_tokens, n_out}, x.options());
  if (n_tokens == 0 || n_out == 0) return out;
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::quant_linear<T>(ptr<T>(x), ptr<uint8_t>(qweight), static_cast<int>(qtype),
                         bias.has_value() ? ptr<T>(*bias) : nullptr, residual.has_value() ? ptr<T>(*residual) : nullptr,
                         ptr<T>(out), n_tokens, k, n_out, activations(int8_activations));
  });
  return out;
}

at::Tensor quant_linear_silu_mul(const at::Tensor& x, const at::Tensor& qweight, int64_t qtype, int64_t k,
                                 const std::optional<at::Tensor>& bias, bool int8_activations) {
  const int64_t n_tokens = x.size(0), n_inter = qweight.size(0) / 2;
  at::Tensor out = at::empty({n_tokens, n_inter}, x.options());
  if (n_tokens == 0 || n_inter == 0) return out;
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::quant_linear_silu_mul<T>(ptr<T>(x), ptr<uint8_t>(qweight), static_cast<int>(qtype),
                                  bias.has_value() ? ptr<T>(*bias) : nullptr, ptr<T>(out), n_tokens, k, n_inter,
                                  activations(int8_activations));
  });
  return out;
}

at::Tensor quant_rmsnorm_qkv(const at::Tensor& x, const at::Tensor& norm_weight, const at::Tensor& qweight,
                             int64_t qtype, int64_t k, const std::optional<at::Tensor>& bias, double eps,
                             bool int8_activations) {
  const int64_t n_tokens = x.size(0), n_out = qweight.size(0);
  at::Tensor out = at::empty({n_tokens, n_out}, x.options());
  if (n_tokens == 0 || n_out == 0) return out;
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::quant_rmsnorm_qkv<T>(ptr<T>(x), ptr<T>(norm_weight), ptr<uint8_t>(qweight), static_cast<int>(qtype),
                              bias.has_value() ? ptr<T>(*bias) : nullptr, ptr<T>(out), n_tokens, k, n_out,
                              static_cast<float>(eps), activations(int8_activations));
  });
  return out;
}

at::Tensor quant_embedding(const at::Tensor& qweight, int64_t qtype, int64_t k, const at::Tensor& token_ids,
                           at::ScalarType dtype) {
  const int64_t n_rows = qweight.size(0);
  const std::vector<int64_t> ids = index_values(token_ids);
  for (size_t t = 0; t < ids.size(); ++t)
    TORCH_CHECK_VALUE(ids[t] >= 0 && ids[t] < n_rows, "token_ids[", t, "] = ", ids[t], " is outside the ", n_rows,
                      " rows of qweight");
  const int64_t n_tokens = static_cast<int64_t>(ids.size());
  at::Tensor out = at::empty({n_tokens, k}, qweight.options().dtype(dtype));
  if (n_tokens == 0) return out;
  dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    cpu::quant_embedding<T>(ptr<uint8_t>(qweight), static_cast<int>(qtype), ids.data(), ptr<T>(out), n_tokens, k);
  });
  return out;
}

std::string quant_path() { return cpu::quant_path_name(cpu::quant_path()); }

void set_quant_path(const std::string& name) {
  for (cpu::QuantPath p : kQuantPaths) {
    if (name != cpu::quant_path_name(p)) continue;
    TORCH_CHECK_VALUE(cpu::quant_path_supported(p), "this CPU cannot run the quantized path ", name);
    cpu::set_quant_path(p);
    return;
  }
  TORCH_CHECK_VALUE(false, "unknown quantized path \"", name.substr(0, 32), "\"; expected avx2 or avx512");
}

std::vector<std::string> quant_paths() {
  std::vector<std::string> names;
  for (cpu::QuantPath p : kQuantPaths)
    if (cpu::quant_path_supported(p)) names.emplace_back(cpu::quant_path_name(p));
  return names;
}

}  // namespace orca::cpu_ops
