// Checks -> contiguous inputs -> device dispatch (see ops.h).
#include "ops.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <utility>

#include "checks.h"
#include "cpu_ops.h"
#ifdef ORCA_WITH_CUDA
#include "cuda_ops.h"
#endif

namespace orca {

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
                       const std::optional<at::Tensor>& qkv_bias_in, double eps, bool batch_invariant) {
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
  if (x.is_cuda()) return cuda_ops::rmsnorm_qkv(x, norm_weight, qkv_weight, bias, eps, batch_invariant);
#endif
  return cpu_ops::rmsnorm_qkv(x, norm_weight, qkv_weight, bias, eps, batch_invariant);
}

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& weight_in, const std::optional<at::Tensor>& bias_in) {
  checks::rank(x_in, 2, "x", "[T, K]");
  checks::rank(weight_in, 2, "weight", "[N, K]");
  TORCH_CHECK_VALUE(weight_in.size(1) == x_in.size(1), "weight has ", weight_in.size(1),
                    " columns but x has ", x_in.size(1));
  checks::float_dtype(x_in, "x");
  checks::same_dtype(x_in, weight_in, "x", "weight");
  checks::same_device(x_in, weight_in, "x", "weight");
  std::optional<at::Tensor> bias;
  if (bias_in.has_value() && bias_in->defined()) {
    checks::rank(*bias_in, 1, "bias", "[N]");
    TORCH_CHECK_VALUE(bias_in->size(0) == weight_in.size(0), "bias has ", bias_in->size(0),
                      " elements but weight has ", weight_in.size(0), " rows");
    checks::same_dtype(x_in, *bias_in, "x", "bias");
    checks::same_device(x_in, *bias_in, "x", "bias");
    bias = bias_in->contiguous();
  }
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
#ifdef ORCA_WITH_CUDA
  if (x.is_cuda()) return cuda_ops::linear(x, weight, bias);
#endif
  return cpu_ops::linear(x, weight, bias);
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

at::Tensor silu_mul(const at::Tensor& gate_up_in) {
  checks::rank(gate_up_in, 2, "gate_up", "[T, 2I]");
  TORCH_CHECK_VALUE(gate_up_in.size(1) % 2 == 0, "gate_up has ", gate_up_in.size(1),
                    " columns; it must be [T, 2I] (gate columns, then up columns)");
  checks::float_dtype(gate_up_in, "gate_up");
  const at::Tensor gate_up = gate_up_in.contiguous();
#ifdef ORCA_WITH_CUDA
  if (gate_up.is_cuda()) return cuda_ops::silu_mul(gate_up);
#endif
  return cpu_ops::silu_mul(gate_up);
}

at::Tensor ragged_attention(const at::Tensor& q_in, const at::Tensor& k_cache_in, const at::Tensor& v_cache_in,
                            const at::Tensor& q_start_in, const at::Tensor& q_len_in, const at::Tensor& kv_start_in,
                            const at::Tensor& kv_len_in, double scale, bool batch_invariant) {
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
  if (q.is_cuda())
    return cuda_ops::ragged_attention(q, k_cache, v_cache, index[0], index[1], index[2], index[3], scale,
                                      batch_invariant);
#endif
  return cpu_ops::ragged_attention(q, k_cache, v_cache, index[0], index[1], index[2], index[3], scale,
                                   batch_invariant);
}

void slab_move(at::Tensor pools, const at::Tensor& moves) {
  TORCH_CHECK_VALUE(pools.defined() && pools.dim() >= 2, "pools must be [P, S, ...] (at least 2-D), got shape ",
                    pools.defined() ? checks::shape_str(pools) : std::string("undefined"));
  TORCH_CHECK_VALUE(pools.is_contiguous(), "pools must be contiguous (rows are moved in place)");
  TORCH_CHECK_VALUE(pools.is_cpu() || pools.is_cuda(), "pools is on unsupported device ", pools.device(),
                    " (expected cpu or cuda)");
  checks::rank(moves, 2, "moves", "[M, 3]");
  TORCH_CHECK_VALUE(moves.size(1) == 3, "moves must be [M, 3] rows of (src, dst, n), got shape ",
                    checks::shape_str(moves));
  TORCH_CHECK_VALUE(moves.scalar_type() == at::kLong, "moves must be int64, got ", moves.scalar_type());
  TORCH_CHECK_VALUE(moves.is_cpu(), "moves must be a CPU tensor (the host walks it), got device ", moves.device());
  const at::Tensor m = moves.contiguous();
  const int64_t n_slots = pools.size(1);
  const int64_t* v = m.data_ptr<int64_t>();
  for (int64_t i = 0; i < m.size(0); ++i) {
    const int64_t src = v[3 * i], dst = v[3 * i + 1], n = v[3 * i + 2];
    TORCH_CHECK_VALUE(n >= 0 && src >= 0 && dst >= 0 && src <= n_slots - n && dst <= n_slots - n, "moves[", i,
                      "] = (", src, ", ", dst, ", ", n, ") reaches outside the ", n_slots,
                      " slots of pools (need 0 <= src, dst and src + n, dst + n <= S, n >= 0)");
  }
#ifdef ORCA_WITH_CUDA
  if (pools.is_cuda()) return cuda_ops::slab_move(pools, m);
#endif
  TORCH_CHECK(pools.is_cpu(), "pools is a CUDA tensor but orca_ext._C was built without CUDA support");
  cpu_ops::slab_move(pools, m);
}

}  // namespace orca
