// CPU glue (see cpu_ops.h): index-value checks -> dtype dispatch -> csrc/cpu kernels.
#include "cpu_ops.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>

#include <vector>

#include "cpu/cpu_kernels.h"

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

}  // namespace

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
  const bool is_float = x.scalar_type() == at::kFloat;
  const int64_t fused_max = !is_float ? kCpuFusedMaxTokensBf16
                            : n_out >= kCpuWideOutputs ? kCpuFusedMaxTokensWide
                                                       : kCpuFusedMaxTokensFloat;
  if (n_tokens > fused_max && !batch_invariant) {
    // Prefill-sized: our norm kernel, then one GEMM through ATen.
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

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const int64_t n_tokens = x.size(0), k = x.size(1), n_out = weight.size(0);
  at::Tensor out = at::empty({n_tokens, n_out}, x.options());
  if (n_tokens == 0 || n_out == 0) return out;
  if (k == 0) {  // empty dot products: zeros (+ bias)
    out.zero_();
    if (bias.has_value()) out.add_(*bias);
    return out;
  }
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::rmsnorm_qkv<T>(ptr<T>(x), /*norm_weight=*/nullptr, ptr<T>(weight), bias.has_value() ? ptr<T>(*bias) : nullptr,
                        ptr<T>(out), n_tokens, k, n_out, /*eps=*/0.0f);
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  const int64_t n_tokens = gate_up.size(0), n_inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({n_tokens, n_inter}, gate_up.options());
  if (n_tokens == 0 || n_inter == 0) return out;
  dispatch_float(gate_up.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::silu_mul<T>(ptr<T>(gate_up), ptr<T>(out), n_tokens, n_inter);
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

}  // namespace orca::cpu_ops
