// Checks -> contiguous inputs -> device dispatch (see ops.h).
#include "ops.h"

#include <ATen/ops/linear.h>
#include <ATen/ops/silu.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <utility>

#include "checks.h"
#include "cpu_ops.h"
#ifdef ORCA_WITH_CUDA
#include "cuda_ops.h"
#endif

namespace orca {
namespace {

// x [T, K] against weight [N, K] (ranks, K, dtypes, devices) and the optional bias [N]; returns
// the bias, contiguous, if there is one.
std::optional<at::Tensor> check_projection(const at::Tensor& x, const at::Tensor& weight,
                                           const std::optional<at::Tensor>& bias, const char* weight_name,
                                           const char* weight_layout, const char* bias_name,
                                           const char* bias_layout) {
  checks::rank(x, 2, "x", "[T, K]");
  checks::rank(weight, 2, weight_name, weight_layout);
  TORCH_CHECK_VALUE(weight.size(1) == x.size(1), weight_name, " has ", weight.size(1), " columns but x has ",
                    x.size(1), " (K must match)");
  if (x.is_cpu()) checks::float_dtype(x, "x");  // elsewhere ATen computes it, in any float dtype
  checks::same_dtype(x, weight, "x", weight_name);
  checks::same_device(x, weight, "x", weight_name);
  if (!bias.has_value() || !bias->defined()) return std::nullopt;
  checks::rank(*bias, 1, bias_name, bias_layout);
  TORCH_CHECK_VALUE(bias->size(0) == weight.size(0), bias_name, " has ", bias->size(0), " elements but ",
                    weight_name, " has ", weight.size(0), " rows");
  checks::same_dtype(x, *bias, "x", bias_name);
  checks::same_device(x, *bias, "x", bias_name);
  return bias->contiguous();
}

}  // namespace

bool built_with_cuda() {
#ifdef ORCA_WITH_CUDA
  return true;
#else
  return false;
#endif
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  checks::rank(x_in, 2, "x", "[T, H]");
  checks::rank(weight_in, 1, "weight", "[H]");
  TORCH_CHECK_VALUE(weight_in.size(0) == x_in.size(1), "weight has ", weight_in.size(0),
                    " elements but x has hidden size ", x_in.size(1));
  checks::float_dtype(x_in, "x");
  checks::same_dtype(x_in, weight_in, "x", "weight");
  checks::same_device(x_in, weight_in, "x", "weight");
  checks::eps(eps);
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
#ifdef ORCA_WITH_CUDA
  if (x.is_cuda()) return cuda_ops::rms_norm(x, weight, eps);
#endif
  return cpu_ops::rms_norm(x, weight, eps);
}

at::Tensor rmsnorm_qkv(const at::Tensor& x_in, const at::Tensor& norm_weight_in, const at::Tensor& qkv_weight_in,
                       const std::optional<at::Tensor>& qkv_bias_in, double eps) {
  checks::rank(x_in, 2, "x", "[T, H]");
  checks::rank(norm_weight_in, 1, "norm_weight", "[H]");
  checks::rank(qkv_weight_in, 2, "qkv_weight", "[Nq*D + 2*Nkv*D, H]");
  const int64_t hidden = x_in.size(1), n_out = qkv_weight_in.size(0);
  TORCH_CHECK_VALUE(norm_weight_in.size(0) == hidden, "norm_weight has ", norm_weight_in.size(0),
                    " elements but x has hidden size ", hidden);
  TORCH_CHECK_VALUE(qkv_weight_in.size(1) == hidden, "qkv_weight has ", qkv_weight_in.size(1),
                    " columns but x has hidden size ", hidden);
  checks::float_dtype(x_in, "x");
  checks::same_dtype(x_in, norm_weight_in, "x", "norm_weight");
  checks::same_dtype(x_in, qkv_weight_in, "x", "qkv_weight");
  checks::same_device(x_in, norm_weight_in, "x", "norm_weight");
  checks::same_device(x_in, qkv_weight_in, "x", "qkv_weight");
  std::optional<at::Tensor> bias;
  if (qkv_bias_in.has_value() && qkv_bias_in->defined()) {
    checks::rank(*qkv_bias_in, 1, "qkv_bias", "[Nq*D + 2*Nkv*D]");
    TORCH_CHECK_VALUE(qkv_bias_in->size(0) == n_out, "qkv_bias has ", qkv_bias_in->size(0),
                      " elements but qkv_weight has ", n_out, " rows");
    checks::same_dtype(x_in, *qkv_bias_in, "x", "qkv_bias");
    checks::same_device(x_in, *qkv_bias_in, "x", "qkv_bias");
    bias = qkv_bias_in->contiguous();
  }
  checks::eps(eps);
  const at::Tensor x = x_in.contiguous(), norm_weight = norm_weight_in.contiguous(),
                   qkv_weight = qkv_weight_in.contiguous();
#ifdef ORCA_WITH_CUDA
  if (x.is_cuda()) return cuda_ops::rmsnorm_qkv(x, norm_weight, qkv_weight, bias, eps);
#endif
  return cpu_ops::rmsnorm_qkv(x, norm_weight, qkv_weight, bias, eps);
}

void slab_write(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k_in, const at::Tensor& v_in,
                const at::Tensor& slots_in) {
  checks::rank(k_cache, 3, "k_cache", "[S, Hkv, D]");
  checks::rank(v_cache, 3, "v_cache", "[S, Hkv, D]");
  checks::rank(k_in, 3, "k", "[T, Hkv, D]");
  checks::rank(v_in, 3, "v", "[T, Hkv, D]");
  checks::index_tensor(slots_in, "slots");
  TORCH_CHECK_VALUE(v_cache.sizes() == k_cache.sizes(), "v_cache shape ", checks::shape_str(v_cache),
                    " differs from k_cache shape ", checks::shape_str(k_cache));
  TORCH_CHECK_VALUE(v_in.sizes() == k_in.sizes(), "v shape ", checks::shape_str(v_in), " differs from k shape ",
                    checks::shape_str(k_in));
  TORCH_CHECK_VALUE(k_in.size(1) == k_cache.size(1) && k_in.size(2) == k_cache.size(2), "k rows are ",
                    checks::shape_str(k_in), " but k_cache rows are ", checks::shape_str(k_cache),
                    "; Hkv and D must match");
  TORCH_CHECK_VALUE(slots_in.size(0) == k_in.size(0), "slots has ", slots_in.size(0), " entries but k has ",
                    k_in.size(0), " rows");
  TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous(),
                    "k_cache and v_cache must be contiguous (they are written in place)");
  checks::float_dtype(k_cache, "k_cache");
  const std::pair<const at::Tensor*, const char*> others[] = {{&v_cache, "v_cache"}, {&k_in, "k"}, {&v_in, "v"}};
  for (const auto& [t, name] : others) {
    checks::same_dtype(k_cache, *t, "k_cache", name);
    checks::same_device(k_cache, *t, "k_cache", name);
  }
  checks::same_device(k_cache, slots_in, "k_cache", "slots");
  const at::Tensor k = k_in.contiguous(), v = v_in.contiguous(), slots = slots_in.contiguous();
#ifdef ORCA_WITH_CUDA
  if (k_cache.is_cuda()) return cuda_ops::slab_write(k_cache, v_cache, k, v, slots);
#endif
  cpu_ops::slab_write(k_cache, v_cache, k, v, slots);
}

at::Tensor ragged_attention(const at::Tensor& q_in, const at::Tensor& k_cache_in, const at::Tensor& v_cache_in,
                            const at::Tensor& q_start_in, const at::Tensor& q_len_in, const at::Tensor& kv_start_in,
                            const at::Tensor& kv_len_in, double scale) {
  checks::rank(q_in, 3, "q", "[T, Hq, D]");
  checks::rank(k_cache_in, 3, "k_cache", "[S, Hkv, D]");
  checks::rank(v_cache_in, 3, "v_cache", "[S, Hkv, D]");
  TORCH_CHECK_VALUE(v_cache_in.sizes() == k_cache_in.sizes(), "v_cache shape ", checks::shape_str(v_cache_in),
                    " differs from k_cache shape ", checks::shape_str(k_cache_in));
  const int64_t n_q_heads = q_in.size(1), n_kv_heads = k_cache_in.size(1), head_dim = q_in.size(2);
  TORCH_CHECK_VALUE(k_cache_in.size(2) == head_dim, "q has head dim ", head_dim, " but k_cache has ",
                    k_cache_in.size(2));
  TORCH_CHECK_VALUE(n_kv_heads >= 1 && n_q_heads % n_kv_heads == 0, "q heads (", n_q_heads,
                    ") must be a multiple of k_cache heads (", n_kv_heads, ")");
  TORCH_CHECK_VALUE(std::isfinite(scale), "scale must be finite, got ", scale);
  checks::float_dtype(q_in, "q");
  checks::same_dtype(q_in, k_cache_in, "q", "k_cache");
  checks::same_dtype(q_in, v_cache_in, "q", "v_cache");
  checks::same_device(q_in, k_cache_in, "q", "k_cache");
  checks::same_device(q_in, v_cache_in, "q", "v_cache");
  const at::Tensor* idx[4] = {&q_start_in, &q_len_in, &kv_start_in, &kv_len_in};
  const char* idx_names[4] = {"q_start", "q_len", "kv_start", "kv_len"};
  for (int i = 0; i < 4; ++i) {
    checks::index_tensor(*idx[i], idx_names[i]);
    checks::same_device(q_in, *idx[i], "q", idx_names[i]);
    TORCH_CHECK_VALUE(idx[i]->size(0) == q_start_in.size(0), idx_names[i], " has ", idx[i]->size(0),
                      " entries but q_start has ", q_start_in.size(0),
                      "; all index tensors need one entry per request");
  }
  const auto index = checks::with_common_index_type({q_start_in, q_len_in, kv_start_in, kv_len_in});
  const at::Tensor q = q_in.contiguous(), k_cache = k_cache_in.contiguous(), v_cache = v_cache_in.contiguous();
#ifdef ORCA_WITH_CUDA
  if (q.is_cuda()) return cuda_ops::ragged_attention(q, k_cache, v_cache, index[0], index[1], index[2], index[3], scale);
#endif
  return cpu_ops::ragged_attention(q, k_cache, v_cache, index[0], index[1], index[2], index[3], scale);
}

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& weight_in, const std::optional<at::Tensor>& bias_in,
                  const std::optional<at::Tensor>& residual_in) {
  const std::optional<at::Tensor> bias = check_projection(x_in, weight_in, bias_in, "weight", "[N, K]", "bias", "[N]");
  std::optional<at::Tensor> residual;
  if (residual_in.has_value() && residual_in->defined()) {
    checks::rank(*residual_in, 2, "residual", "[T, N]");
    TORCH_CHECK_VALUE(residual_in->size(0) == x_in.size(0) && residual_in->size(1) == weight_in.size(0),
                      "residual has shape ", checks::shape_str(*residual_in), " but the output is [", x_in.size(0),
                      ", ", weight_in.size(0), "]");
    checks::same_dtype(x_in, *residual_in, "x", "residual");
    checks::same_device(x_in, *residual_in, "x", "residual");
    residual = residual_in->contiguous();
  }
  if (!x_in.is_cpu()) {  // cuBLAS through ATen
    at::Tensor out = at::linear(x_in, weight_in, bias);
    return residual.has_value() ? out.add_(*residual) : out;
  }
  return cpu_ops::linear(x_in.contiguous(), weight_in.contiguous(), bias, residual);
}

at::Tensor linear_silu_mul(const at::Tensor& x_in, const at::Tensor& gate_up_weight_in,
                           const std::optional<at::Tensor>& gate_up_bias_in) {
  const std::optional<at::Tensor> bias = check_projection(x_in, gate_up_weight_in, gate_up_bias_in, "gate_up_weight",
                                                          "[2*I, K]", "gate_up_bias", "[2*I]");
  const int64_t n_rows = gate_up_weight_in.size(0);
  TORCH_CHECK_VALUE(n_rows % 2 == 0, "gate_up_weight has ", n_rows,
                    " rows; it must stack I gate rows on I up rows ([2*I, K])");
  if (!x_in.is_cpu()) {
    const at::Tensor gate_up = at::linear(x_in, gate_up_weight_in, bias);
    return at::silu(gate_up.narrow(1, 0, n_rows / 2)).mul_(gate_up.narrow(1, n_rows / 2, n_rows / 2));
  }
  return cpu_ops::linear_silu_mul(x_in.contiguous(), gate_up_weight_in.contiguous(), bias);
}

}  // namespace orca
