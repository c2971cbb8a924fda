// Checks -> contiguous inputs -> device dispatch (see ops.h).
#include "ops.h"

#include <ATen/ops/linear.h>
#include <ATen/ops/silu.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <iterator>
#include <string>
#include <utility>

#include "checks.h"
#include "cpu/quant_kernels.h"
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

// The product of linear / linear_silu_mul off the CPU: cuBLAS through ATen, or with
// batch_invariant (CUDA) cuBLAS on fixed-shape row chunks.
at::Tensor invariant_or_aten_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                    bool batch_invariant) {
#ifdef ORCA_WITH_CUDA
  if (batch_invariant && x.is_cuda()) return cuda_ops::linear_batch_invariant(x.contiguous(), weight.contiguous(), bias);
#endif
  (void)batch_invariant;
  return at::linear(x, weight, bias);
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

std::tuple<at::Tensor, at::Tensor> row_argmax(const at::Tensor& x_in) {
  checks::rank(x_in, 2, "x", "[R, V]");
  TORCH_CHECK_VALUE(x_in.scalar_type() == at::kFloat, "x must be float32, got ", x_in.scalar_type());
  TORCH_CHECK_VALUE(x_in.size(1) >= 1, "x has ", x_in.size(1), " columns; a row needs at least one");
  TORCH_CHECK_VALUE(x_in.is_cpu(), "row_argmax has no CUDA kernel: x is on ", x_in.device(),
                    "; use torch.max(x, dim=-1) there");
  return cpu_ops::row_argmax(x_in.contiguous());
}

at::Tensor rope_slab_write(const at::Tensor& qkv_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                           at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots_in, int64_t n_q_heads,
                           int64_t n_kv_heads) {
  checks::rank(qkv_in, 2, "qkv", "[T, (Hq + 2*Hkv) * D]");
  checks::rank(cos_in, 2, "cos", "[T, D/2]");
  checks::rank(sin_in, 2, "sin", "[T, D/2]");
  checks::rank(k_cache, 3, "k_cache", "[S, Hkv, D]");
  checks::rank(v_cache, 3, "v_cache", "[S, Hkv, D]");
  checks::index_tensor(slots_in, "slots");
  TORCH_CHECK_VALUE(n_q_heads >= 1, "n_q_heads must be >= 1, got ", n_q_heads);
  TORCH_CHECK_VALUE(n_kv_heads >= 1, "n_kv_heads must be >= 1, got ", n_kv_heads);
  TORCH_CHECK_VALUE(v_cache.sizes() == k_cache.sizes(), "v_cache shape ", checks::shape_str(v_cache),
                    " differs from k_cache shape ", checks::shape_str(k_cache));
  TORCH_CHECK_VALUE(k_cache.size(1) == n_kv_heads, "k_cache has ", k_cache.size(1), " KV heads but n_kv_heads is ",
                    n_kv_heads);
  const int64_t n_tokens = qkv_in.size(0), head_dim = k_cache.size(2);
  TORCH_CHECK_VALUE(head_dim >= 2 && head_dim % 2 == 0, "head_dim (k_cache.size(2)) must be even and >= 2 for the "
                    "half-split rotation, got ", head_dim);
  TORCH_CHECK_VALUE(qkv_in.size(1) == (n_q_heads + 2 * n_kv_heads) * head_dim, "qkv has ", qkv_in.size(1),
                    " columns but (n_q_heads + 2*n_kv_heads) * head_dim = (", n_q_heads, " + 2*", n_kv_heads, ") * ",
                    head_dim, " = ", (n_q_heads + 2 * n_kv_heads) * head_dim);
  const std::pair<const at::Tensor*, const char*> tables[] = {{&cos_in, "cos"}, {&sin_in, "sin"}};
  for (const auto& [t, name] : tables) {
    TORCH_CHECK_VALUE(t->size(0) == n_tokens && t->size(1) == head_dim / 2, name, " has shape ", checks::shape_str(*t),
                      " but must be [T, D/2] = [", n_tokens, ", ", head_dim / 2, "]");
    TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat, name, " has dtype ", t->scalar_type(),
                      " but the rope tables must be float32");
    checks::same_device(qkv_in, *t, "qkv", name);
  }
  TORCH_CHECK_VALUE(slots_in.size(0) == n_tokens, "slots has ", slots_in.size(0), " entries but qkv has ", n_tokens,
                    " rows");
  TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous(),
                    "k_cache and v_cache must be contiguous (they are written in place)");
  checks::float_dtype(qkv_in, "qkv");
  checks::same_dtype(qkv_in, k_cache, "qkv", "k_cache");
  checks::same_dtype(qkv_in, v_cache, "qkv", "v_cache");
  checks::same_device(qkv_in, k_cache, "qkv", "k_cache");
  checks::same_device(qkv_in, v_cache, "qkv", "v_cache");
  checks::same_device(qkv_in, slots_in, "qkv", "slots");
  TORCH_CHECK_VALUE(qkv_in.is_cpu(), "rope_slab_write has no CUDA kernel: qkv is on ", qkv_in.device(),
                    "; use rope then slab_write there");
  const at::Tensor qkv = qkv_in.contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous(),
                   slots = slots_in.contiguous();
  return cpu_ops::rope_slab_write(qkv, cos, sin, k_cache, v_cache, slots, n_q_heads);
}

namespace {

// The four index tensors of ragged_attention: 1-D int32/int64, one entry per request, on `device`.
void check_attention_index(const std::array<const at::Tensor*, 4>& idx, const at::Device& device,
                           const char* device_owner) {
  static const char* const names[4] = {"q_start", "q_len", "kv_start", "kv_len"};
  for (int i = 0; i < 4; ++i) {
    checks::index_tensor(*idx[i], names[i]);
    TORCH_CHECK_VALUE(idx[i]->device() == device, names[i], " is on ", idx[i]->device(), " but ", device_owner,
                      " is on ", device, "; all tensors must be on one device");
    TORCH_CHECK_VALUE(idx[i]->size(0) == idx[0]->size(0), names[i], " has ", idx[i]->size(0),
                      " entries but q_start has ", idx[0]->size(0), "; all index tensors need one entry per request");
  }
}

// `plan` was built for this call: the same device, dtype, shapes and index tensors.
void check_plan_matches(const RaggedAttentionPlan& plan, const at::Tensor& q, const at::Tensor& k_cache,
                        const std::array<const at::Tensor*, 4>& idx, bool batch_invariant) {
  auto mismatch = [&](const char* what, int64_t planned, int64_t given) {
    TORCH_CHECK_VALUE(planned == given, "plan was built for ", what, "=", planned, " but this call has ", given);
  };
  TORCH_CHECK_VALUE(plan.device == q.device(), "plan was built for device ", plan.device, " but q is on ", q.device());
  TORCH_CHECK_VALUE(plan.dtype == q.scalar_type(), "plan was built for dtype ", plan.dtype, " but q has dtype ",
                    q.scalar_type());
  mismatch("n_tokens", plan.n_tokens, q.size(0));
  mismatch("n_q_heads", plan.n_q_heads, q.size(1));
  mismatch("head_dim", plan.head_dim, q.size(2));
  mismatch("n_slots", plan.n_slots, k_cache.size(0));
  mismatch("n_kv_heads", plan.n_kv_heads, k_cache.size(1));
  mismatch("n_requests", plan.n_requests, idx[0]->size(0));
  TORCH_CHECK_VALUE(plan.batch_invariant == batch_invariant, "plan was built with batch_invariant=",
                    plan.batch_invariant ? "True" : "False", " but this call has batch_invariant=",
                    batch_invariant ? "True" : "False");
  static const char* const names[4] = {"q_start", "q_len", "kv_start", "kv_len"};
  for (int i = 0; i < 4; ++i)
    TORCH_CHECK_VALUE(plan.source[i] == idx[i]->data_ptr(), "plan was built from another ", names[i],
                      " tensor; pass the index tensors the plan was built from");
}

}  // namespace

std::shared_ptr<RaggedAttentionPlan> ragged_attention_plan(const at::Tensor& q_start, const at::Tensor& q_len,
                                                           const at::Tensor& kv_start, const at::Tensor& kv_len,
                                                           int64_t n_tokens, int64_t n_slots, int64_t n_q_heads,
                                                           int64_t n_kv_heads, int64_t head_dim, at::ScalarType dtype,
                                                           int64_t items_per_sm, int64_t decode_stages,
                                                           bool batch_invariant) {
  checks::index_tensor(q_start, "q_start");
  check_attention_index({&q_start, &q_len, &kv_start, &kv_len}, q_start.device(), "q_start");
  TORCH_CHECK_VALUE(n_tokens >= 0, "n_tokens must be >= 0, got ", n_tokens);
  TORCH_CHECK_VALUE(n_slots >= 0, "n_slots must be >= 0, got ", n_slots);
  TORCH_CHECK_VALUE(head_dim >= 1, "head_dim must be >= 1, got ", head_dim);
  TORCH_CHECK_VALUE(n_kv_heads >= 1 && n_q_heads >= 1 && n_q_heads % n_kv_heads == 0, "n_q_heads (", n_q_heads,
                    ") must be a positive multiple of n_kv_heads (", n_kv_heads, ")");
  const bool cuda = q_start.is_cuda();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16 || (cuda && dtype == at::kHalf), "dtype ", dtype,
                    " is not supported on ", q_start.device().type(),
                    cuda ? " (float32, float16, bfloat16)" : " (float32, bfloat16)");
  TORCH_CHECK_VALUE(items_per_sm >= 1 && items_per_sm <= 256, "items_per_sm must be in [1, 256], got ",
                    items_per_sm);
  TORCH_CHECK_VALUE(decode_stages == 0 || decode_stages == 2 || decode_stages == 3,
                    "decode_stages must be 0 (the shared kernel), 2 or 3, got ", decode_stages);
  TORCH_CHECK_VALUE(!batch_invariant || decode_stages == 0, "decode_stages must be 0 with batch_invariant=True "
                    "(batch-invariant attention runs every request as prefill tiles of the shared kernel), got ",
                    decode_stages);
  auto plan = std::make_shared<RaggedAttentionPlan>();
  const auto index = checks::with_common_index_type({q_start, q_len, kv_start, kv_len});
  const at::Tensor* given[4] = {&q_start, &q_len, &kv_start, &kv_len};
  for (int i = 0; i < 4; ++i) {
    plan->index[i] = index[i];
    plan->source[i] = given[i]->data_ptr();
  }
  plan->dtype = dtype;
  plan->device = q_start.device();
  plan->n_tokens = n_tokens;
  plan->n_requests = q_start.size(0);
  plan->n_slots = n_slots;
  plan->n_q_heads = n_q_heads;
  plan->n_kv_heads = n_kv_heads;
  plan->head_dim = head_dim;
  plan->items_per_sm = items_per_sm;
  plan->decode_stages = decode_stages;
  plan->batch_invariant = batch_invariant;
  if (cuda) {
#ifdef ORCA_WITH_CUDA
    cuda_ops::build_ragged_attention_plan(*plan);
#else
    TORCH_CHECK(false, "q_start is a CUDA tensor but orca_ext._C was built without CUDA support; "
                "reinstall with a CUDA build of torch (pip install --no-build-isolation .)");
#endif
  }
  return plan;
}

at::Tensor ragged_attention(const at::Tensor& q_in, const at::Tensor& k_cache_in, const at::Tensor& v_cache_in,
                            const at::Tensor& q_start_in, const at::Tensor& q_len_in, const at::Tensor& kv_start_in,
                            const at::Tensor& kv_len_in, double scale, const RaggedAttentionPlan* plan,
                            bool batch_invariant) {
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
  const std::array<const at::Tensor*, 4> given = {&q_start_in, &q_len_in, &kv_start_in, &kv_len_in};
  check_attention_index(given, q_in.device(), "q");
  if (plan != nullptr) check_plan_matches(*plan, q_in, k_cache_in, given, batch_invariant);
  const at::Tensor q = q_in.contiguous(), k_cache = k_cache_in.contiguous(), v_cache = v_cache_in.contiguous();
#ifdef ORCA_WITH_CUDA
  if (q.is_cuda()) {
    if (plan != nullptr) return cuda_ops::ragged_attention_with_plan(q, k_cache, v_cache, *plan, scale);
    const auto index = checks::with_common_index_type({q_start_in, q_len_in, kv_start_in, kv_len_in});
    return cuda_ops::ragged_attention(q, k_cache, v_cache, index[0], index[1], index[2], index[3], scale,
                                      batch_invariant);
  }
#endif
  // The CPU kernel validates every index value itself; a plan has nothing to add there.
  const auto index = checks::with_common_index_type({q_start_in, q_len_in, kv_start_in, kv_len_in});
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

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& weight_in, const std::optional<at::Tensor>& bias_in,
                  const std::optional<at::Tensor>& residual_in, bool batch_invariant) {
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
    at::Tensor out = invariant_or_aten_linear(x_in, weight_in, bias, batch_invariant);
    return residual.has_value() ? out.add_(*residual) : out;
  }
  return cpu_ops::linear(x_in.contiguous(), weight_in.contiguous(), bias, residual, batch_invariant);
}

at::Tensor linear_silu_mul(const at::Tensor& x_in, const at::Tensor& gate_up_weight_in,
                           const std::optional<at::Tensor>& gate_up_bias_in, bool batch_invariant) {
  const std::optional<at::Tensor> bias = check_projection(x_in, gate_up_weight_in, gate_up_bias_in, "gate_up_weight",
                                                          "[2*I, K]", "gate_up_bias", "[2*I]");
  const int64_t n_rows = gate_up_weight_in.size(0);
  TORCH_CHECK_VALUE(n_rows % 2 == 0, "gate_up_weight has ", n_rows,
                    " rows; it must stack I gate rows on I up rows ([2*I, K])");
  if (!x_in.is_cpu()) {
    // ATen's elementwise CUDA kernels run the same per-element code for every element, so only the
    // product needs the invariant path.
    const at::Tensor gate_up = invariant_or_aten_linear(x_in, gate_up_weight_in, bias, batch_invariant);
    return at::silu(gate_up.narrow(1, 0, n_rows / 2)).mul_(gate_up.narrow(1, n_rows / 2, n_rows / 2));
  }
  return cpu_ops::linear_silu_mul(x_in.contiguous(), gate_up_weight_in.contiguous(), bias, batch_invariant);
}

// ---- quantized weights ------------------------------------------------------------------------

namespace {

// qweight [N, row_bytes] uint8 holding rows of k elements in ggml type qtype; returns it contiguous.
at::Tensor check_quant_weight(const at::Tensor& qweight, int64_t qtype, int64_t k, const char* layout) {
  const cpu::QuantFormat* f = (qtype >= 0 && qtype <= 1024) ? cpu::quant_format(static_cast<int>(qtype)) : nullptr;
  if (f == nullptr) {
    std::string ids;
    for (int t : cpu::kQuantTypes) {
      const cpu::QuantFormat* g = cpu::quant_format(t);
      ids += (ids.empty() ? "" : ", ") + std::to_string(t) + " (" + g->name + ")";
    }
    TORCH_CHECK_VALUE(false, "qtype ", qtype, " is not a supported ggml type; supported: ", ids);
  }
  TORCH_CHECK_VALUE(k >= 1 && k <= (int64_t{1} << 30) && k % f->block_elems == 0, "k must be a positive multiple of ",
                    f->block_elems, " (the ", f->name, " block size) up to 2^30, got ", k);
  checks::rank(qweight, 2, "qweight", layout);
  TORCH_CHECK_VALUE(qweight.scalar_type() == at::kByte, "qweight has dtype ", qweight.scalar_type(),
                    " but must be uint8 (raw ", f->name, " blocks)");
  const int64_t row_bytes = k / f->block_elems * f->block_bytes;
  TORCH_CHECK_VALUE(qweight.size(1) == row_bytes, "qweight rows are ", qweight.size(1), " bytes but k = ", k, " in ",
                    f->name, " needs ", row_bytes, " (", k / f->block_elems, " blocks of ", f->block_bytes, " bytes)");
  return qweight.contiguous();
}

// x [T, k] on qweight's device.
void check_quant_input(const at::Tensor& x, const at::Tensor& qweight, int64_t k) {
  checks::rank(x, 2, "x", "[T, K]");
  TORCH_CHECK_VALUE(x.size(1) == k, "x has ", x.size(1), " columns but k is ", k);
  checks::float_dtype(x, "x");
  checks::same_device(x, qweight, "x", "qweight");
}

// The optional bias: [n] in x's dtype, on x's device; returned contiguous.
std::optional<at::Tensor> check_quant_bias(const at::Tensor& x, const std::optional<at::Tensor>& v, int64_t n) {
  if (!v.has_value() || !v->defined()) return std::nullopt;
  checks::rank(*v, 1, "bias", "[N]");
  TORCH_CHECK_VALUE(v->size(0) == n, "bias has ", v->size(0), " elements but qweight has ", n, " rows");
  checks::same_dtype(x, *v, "x", "bias");
  checks::same_device(x, *v, "x", "bias");
  return v->contiguous();
}

}  // namespace

at::Tensor quant_linear(const at::Tensor& x_in, const at::Tensor& qweight_in, int64_t qtype, int64_t k,
                        const std::optional<at::Tensor>& bias_in, const std::optional<at::Tensor>& residual_in,
                        bool batch_invariant, bool int8_activations) {
  (void)batch_invariant;  // CPU: invariant at every T; CUDA: the kernel's own contract
  const at::Tensor qweight = check_quant_weight(qweight_in, qtype, k, "[N, row_bytes]");
  check_quant_input(x_in, qweight, k);
  const int64_t n_out = qweight.size(0);
  const std::optional<at::Tensor> bias = check_quant_bias(x_in, bias_in, n_out);
  std::optional<at::Tensor> residual;
  if (residual_in.has_value() && residual_in->defined()) {
    checks::rank(*residual_in, 2, "residual", "[T, N]");
    TORCH_CHECK_VALUE(residual_in->size(0) == x_in.size(0) && residual_in->size(1) == n_out, "residual has shape ",
                      checks::shape_str(*residual_in), " but the output is [", x_in.size(0), ", ", n_out, "]");
    checks::same_dtype(x_in, *residual_in, "x", "residual");
    checks::same_device(x_in, *residual_in, "x", "residual");
    residual = residual_in->contiguous();
  }
  const at::Tensor x = x_in.contiguous();
#ifdef ORCA_WITH_CUDA
  if (x.is_cuda()) return cuda_ops::quant_linear(x, qweight, qtype, k, bias, residual);
#endif
  TORCH_CHECK(x.is_cpu(), "x is a CUDA tensor but orca_ext._C was built without CUDA support");
  return cpu_ops::quant_linear(x, qweight, qtype, k, bias, residual, int8_activations);
}

at::Tensor quant_linear_silu_mul(const at::Tensor& x_in, const at::Tensor& qweight_in, int64_t qtype, int64_t k,
                                 const std::optional<at::Tensor>& bias_in, bool batch_invariant,
                                 bool int8_activations) {
  (void)batch_invariant;
  const at::Tensor qweight = check_quant_weight(qweight_in, qtype, k, "[2*I, row_bytes]");
  check_quant_input(x_in, qweight, k);
  const int64_t n_rows = qweight.size(0);
  TORCH_CHECK_VALUE(n_rows % 2 == 0, "qweight has ", n_rows, " rows; it must stack I gate rows on I up rows ([2*I, row_bytes])");
  const std::optional<at::Tensor> bias = check_quant_bias(x_in, bias_in, n_rows);
  const at::Tensor x = x_in.contiguous();
#ifdef ORCA_WITH_CUDA
  if (x.is_cuda()) return cuda_ops::quant_linear_silu_mul(x, qweight, qtype, k, bias);
#endif
  TORCH_CHECK(x.is_cpu(), "x is a CUDA tensor but orca_ext._C was built without CUDA support");
  return cpu_ops::quant_linear_silu_mul(x, qweight, qtype, k, bias, int8_activations);
}

at::Tensor quant_rmsnorm_qkv(const at::Tensor& x_in, const at::Tensor& norm_weight_in, const at::Tensor& qweight_in,
                             int64_t qtype, int64_t k, const std::optional<at::Tensor>& bias_in, double eps,
                             bool batch_invariant, bool int8_activations) {
  (void)batch_invariant;
  const at::Tensor qweight = check_quant_weight(qweight_in, qtype, k, "[N, row_bytes]");
  check_quant_input(x_in, qweight, k);
  checks::rank(norm_weight_in, 1, "norm_weight", "[K]");
  TORCH_CHECK_VALUE(norm_weight_in.size(0) == k, "norm_weight has ", norm_weight_in.size(0), " elements but k is ", k);
  checks::same_dtype(x_in, norm_weight_in, "x", "norm_weight");
  checks::same_device(x_in, norm_weight_in, "x", "norm_weight");
  const std::optional<at::Tensor> bias = check_quant_bias(x_in, bias_in, qweight.size(0));
  checks::eps(eps);
  const at::Tensor x = x_in.contiguous(), norm_weight = norm_weight_in.contiguous();
#ifdef ORCA_WITH_CUDA
  if (x.is_cuda())
    return cuda_ops::quant_linear(cuda_ops::rms_norm(x, norm_weight, eps), qweight, qtype, k, bias, std::nullopt);
#endif
  TORCH_CHECK(x.is_cpu(), "x is a CUDA tensor but orca_ext._C was built without CUDA support");
  return cpu_ops::quant_rmsnorm_qkv(x, norm_weight, qweight, qtype, k, bias, eps, int8_activations);
}

at::Tensor quant_embedding(const at::Tensor& qweight_in, int64_t qtype, int64_t k, const at::Tensor& token_ids_in,
                           at::ScalarType dtype) {
  const at::Tensor qweight = check_quant_weight(qweight_in, qtype, k, "[V, row_bytes]");
  checks::index_tensor(token_ids_in, "token_ids");
  checks::same_device(qweight, token_ids_in, "qweight", "token_ids");
  const bool cuda = qweight.is_cuda();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16 || (cuda && dtype == at::kHalf), "dtype ", dtype,
                    " is not supported on ", qweight.device().type(),
                    cuda ? " (float32, float16, bfloat16)" : " (float32, bfloat16)");
#ifdef ORCA_WITH_CUDA
  if (cuda) return cuda_ops::quant_embedding(qweight, qtype, k, token_ids_in.to(at::kLong).contiguous(), dtype);
#endif
  TORCH_CHECK(qweight.is_cpu(), "qweight is a CUDA tensor but orca_ext._C was built without CUDA support");
  return cpu_ops::quant_embedding(qweight, qtype, k, token_ids_in.contiguous(), dtype);
}

std::vector<int64_t> quant_types() { return std::vector<int64_t>(std::begin(cpu::kQuantTypes), std::end(cpu::kQuantTypes)); }

std::vector<int64_t> quant_int8_types() {
  std::vector<int64_t> types;
  for (int t : cpu::kQuantTypes)
    if (cpu::quant_int8_supported(t)) types.push_back(t);
  return types;
}

}  // namespace orca
