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

}  // namespace orca
