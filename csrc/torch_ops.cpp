// Checks -> device dispatch -> dtype dispatch for the kernels (see torch_ops.h).
#include "torch_ops.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/cpu_kernels.h"
#ifdef ORCA_WITH_CUDA
#include "cuda/cuda_ops.h"
#endif

namespace orca {
namespace {

std::string shape_str(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

void check_rank(const at::Tensor& t, int64_t rank, const char* name, const char* layout) {
  TORCH_CHECK_VALUE(t.defined(), name, " is undefined");
  TORCH_CHECK_VALUE(t.dim() == rank, name, " must be ", rank, "-D ", layout, ", got shape ", shape_str(t));
}

void check_same_device(const at::Tensor& ref, const at::Tensor& t, const char* ref_name, const char* name) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), name, " is on ", t.device(), " but ", ref_name, " is on ",
                    ref.device(), "; all tensors must be on one device");
}

void check_same_dtype(const at::Tensor& ref, const at::Tensor& t, const char* ref_name, const char* name) {
  TORCH_CHECK_VALUE(t.scalar_type() == ref.scalar_type(), name, " has dtype ", t.scalar_type(), " but ",
                    ref_name, " has ", ref.scalar_type(), "; they must match");
}

// Float dtypes each backend implements.
void check_float_dtype(const at::Tensor& t, const char* name) {
  const auto st = t.scalar_type();
  if (t.is_cpu()) {
    TORCH_CHECK_VALUE(st == at::kFloat || st == at::kBFloat16, name, " has dtype ", st,
                      "; on CPU only float32 and bfloat16 are supported");
  } else if (t.is_cuda()) {
#ifdef ORCA_WITH_CUDA
    TORCH_CHECK_VALUE(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, name, " has dtype ", st,
                      "; on CUDA only float32, float16 and bfloat16 are supported");
#else
    TORCH_CHECK(false, name, " is a CUDA tensor but orca_ext._C was built without CUDA support; "
                "reinstall with a CUDA build of torch (pip install --no-build-isolation .)");
#endif
  } else {
    TORCH_CHECK_VALUE(false, name, " is on unsupported device ", t.device(), " (expected cpu or cuda)");
  }
}

void check_index(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.defined(), name, " is undefined");
  TORCH_CHECK_VALUE(t.dim() == 1, name, " must be a 1-D index tensor, got shape ", shape_str(t));
  TORCH_CHECK_VALUE(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, name, " must be int32 or int64, got ",
                    t.scalar_type());
}

void check_eps(double eps) {
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps > 0.0, "eps must be finite and > 0, got ", eps);
}

template <typename I>
std::vector<int64_t> to_vec(const at::Tensor& t) {
  const I* p = t.data_ptr<I>();
  return std::vector<int64_t>(p, p + t.numel());
}

std::vector<int64_t> index_values(const at::Tensor& t) {
  return t.scalar_type() == at::kInt ? to_vec<int32_t>(t) : to_vec<int64_t>(t);
}

// Calls f(tag) with a value whose type is the element type of a CPU float tensor.
template <typename F>
void dispatch_cpu_float(at::ScalarType st, F&& f) {
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

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  check_rank(x_in, 2, "x", "[T, H]");
  check_rank(weight_in, 1, "weight", "[H]");
  TORCH_CHECK_VALUE(weight_in.size(0) == x_in.size(1), "weight has ", weight_in.size(0),
                    " elements but x has hidden size ", x_in.size(1));
  check_float_dtype(x_in, "x");
  check_same_dtype(x_in, weight_in, "x", "weight");
  check_same_device(x_in, weight_in, "x", "weight");
  check_eps(eps);
#ifdef ORCA_WITH_CUDA
  if (x_in.is_cuda()) return cuda_ops::rms_norm(x_in.contiguous(), weight_in.contiguous(), eps);
#endif
  const at::Tensor x = x_in.contiguous(), w = weight_in.contiguous();
  at::Tensor out = at::empty_like(x);
  if (x.numel() == 0) return out;
  dispatch_cpu_float(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::rmsnorm<T>(ptr<T>(x), ptr<T>(w), ptr<T>(out), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

at::Tensor rmsnorm_qkv(const at::Tensor& x_in, const at::Tensor& norm_weight_in, const at::Tensor& qkv_weight_in,
                       const std::optional<at::Tensor>& qkv_bias_in, double eps) {
  check_rank(x_in, 2, "x", "[T, H]");
  check_rank(norm_weight_in, 1, "norm_weight", "[H]");
  check_rank(qkv_weight_in, 2, "qkv_weight", "[Nq*D + 2*Nkv*D, H]");
  const int64_t hidden = x_in.size(1), n_out = qkv_weight_in.size(0);
  TORCH_CHECK_VALUE(norm_weight_in.size(0) == hidden, "norm_weight has ", norm_weight_in.size(0),
                    " elements but x has hidden size ", hidden);
  TORCH_CHECK_VALUE(qkv_weight_in.size(1) == hidden, "qkv_weight has ", qkv_weight_in.size(1),
                    " columns but x has hidden size ", hidden);
  check_float_dtype(x_in, "x");
  check_same_dtype(x_in, norm_weight_in, "x", "norm_weight");
  check_same_dtype(x_in, qkv_weight_in, "x", "qkv_weight");
  check_same_device(x_in, norm_weight_in, "x", "norm_weight");
  check_same_device(x_in, qkv_weight_in, "x", "qkv_weight");
  const bool has_bias = qkv_bias_in.has_value() && qkv_bias_in->defined();
  if (has_bias) {
    check_rank(*qkv_bias_in, 1, "qkv_bias", "[Nq*D + 2*Nkv*D]");
    TORCH_CHECK_VALUE(qkv_bias_in->size(0) == n_out, "qkv_bias has ", qkv_bias_in->size(0),
                      " elements but qkv_weight has ", n_out, " rows");
    check_same_dtype(x_in, *qkv_bias_in, "x", "qkv_bias");
    check_same_device(x_in, *qkv_bias_in, "x", "qkv_bias");
  }
  check_eps(eps);
#ifdef ORCA_WITH_CUDA
  if (x_in.is_cuda())
    return cuda_ops::rmsnorm_qkv(x_in.contiguous(), norm_weight_in.contiguous(), qkv_weight_in.contiguous(),
                                 has_bias ? std::optional<at::Tensor>(qkv_bias_in->contiguous()) : std::nullopt, eps);
#endif
  const at::Tensor x = x_in.contiguous(), nw = norm_weight_in.contiguous(), w = qkv_weight_in.contiguous();
  const at::Tensor bias = has_bias ? qkv_bias_in->contiguous() : at::Tensor();
  const bool is_float = x.scalar_type() == at::kFloat;
  const int64_t fused_max = !is_float ? kCpuFusedMaxTokensBf16
                            : n_out >= kCpuWideOutputs ? kCpuFusedMaxTokensWide
                                                       : kCpuFusedMaxTokensFloat;
  if (x.size(0) > fused_max) {
    // Prefill-sized: our norm kernel, then one GEMM through ATen.
    return at::linear(rms_norm(x, nw, eps), w, has_bias ? std::optional<at::Tensor>(bias) : std::nullopt);
  }
  at::Tensor out = at::empty({x.size(0), n_out}, x.options());
  if (x.size(0) == 0 || n_out == 0) return out;
  dispatch_cpu_float(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    cpu::rmsnorm_qkv<T>(ptr<T>(x), ptr<T>(nw), ptr<T>(w), has_bias ? ptr<T>(bias) : nullptr, ptr<T>(out),
                        x.size(0), hidden, n_out, static_cast<float>(eps));
  });
  return out;
}

void slab_write(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k_in, const at::Tensor& v_in,
                const at::Tensor& slots_in) {
  check_rank(k_cache, 3, "k_cache", "[S, Hkv, D]");
  check_rank(v_cache, 3, "v_cache", "[S, Hkv, D]");
  check_rank(k_in, 3, "k", "[T, Hkv, D]");
  check_rank(v_in, 3, "v", "[T, Hkv, D]");
  check_index(slots_in, "slots");
  TORCH_CHECK_VALUE(v_cache.sizes() == k_cache.sizes(), "v_cache shape ", shape_str(v_cache),
                    " differs from k_cache shape ", shape_str(k_cache));
  TORCH_CHECK_VALUE(v_in.sizes() == k_in.sizes(), "v shape ", shape_str(v_in), " differs from k shape ",
                    shape_str(k_in));
  TORCH_CHECK_VALUE(k_in.size(1) == k_cache.size(1) && k_in.size(2) == k_cache.size(2), "k rows are ",
                    shape_str(k_in), " but k_cache rows are ", shape_str(k_cache), "; Hkv and D must match");
  TORCH_CHECK_VALUE(slots_in.size(0) == k_in.size(0), "slots has ", slots_in.size(0), " entries but k has ",
                    k_in.size(0), " rows");
  TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous(),
                    "k_cache and v_cache must be contiguous (they are written in place)");
  check_float_dtype(k_cache, "k_cache");
  const std::pair<const at::Tensor*, const char*> others[] = {{&v_cache, "v_cache"}, {&k_in, "k"}, {&v_in, "v"}};
  for (const auto& [t, name] : others) {
    check_same_dtype(k_cache, *t, "k_cache", name);
    check_same_device(k_cache, *t, "k_cache", name);
  }
  check_same_device(k_cache, slots_in, "k_cache", "slots");
#ifdef ORCA_WITH_CUDA
  if (k_cache.is_cuda()) {
    // Index values are not checked here (that would need a host sync); the kernel skips bad slots.
    cuda_ops::slab_write(k_cache, v_cache, k_in.contiguous(), v_in.contiguous(), slots_in.contiguous());
    return;
  }
#endif
  const at::Tensor k = k_in.contiguous(), v = v_in.contiguous(), slots = slots_in.contiguous();
  const int64_t n_slots = k_cache.size(0);
  for (int64_t s : index_values(slots))
    TORCH_CHECK_VALUE(s >= 0 && s < n_slots, "slots contains ", s, ", outside the cache of ", n_slots, " slots");
  if (k.size(0) == 0) return;
  dispatch_cpu_float(k.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    dispatch_index(slots.scalar_type(), [&](auto itag) {
      using I = decltype(itag);
      cpu::slab_write<T, I>(ptr<T>(k_cache), ptr<T>(v_cache), ptr<T>(k), ptr<T>(v), slots.data_ptr<I>(), k.size(0),
                            k.size(1) * k.size(2));
    });
  });
}

at::Tensor ragged_attention(const at::Tensor& q_in, const at::Tensor& k_cache_in, const at::Tensor& v_cache_in,
                            const at::Tensor& q_start_in, const at::Tensor& q_len_in, const at::Tensor& kv_start_in,
                            const at::Tensor& kv_len_in, double scale) {
  check_rank(q_in, 3, "q", "[T, Hq, D]");
  check_rank(k_cache_in, 3, "k_cache", "[S, Hkv, D]");
  check_rank(v_cache_in, 3, "v_cache", "[S, Hkv, D]");
  TORCH_CHECK_VALUE(v_cache_in.sizes() == k_cache_in.sizes(), "v_cache shape ", shape_str(v_cache_in),
                    " differs from k_cache shape ", shape_str(k_cache_in));
  const int64_t n_q_heads = q_in.size(1), n_kv_heads = k_cache_in.size(1), head_dim = q_in.size(2);
  TORCH_CHECK_VALUE(k_cache_in.size(2) == head_dim, "q has head dim ", head_dim, " but k_cache has ",
                    k_cache_in.size(2));
  TORCH_CHECK_VALUE(n_kv_heads >= 1 && n_q_heads % n_kv_heads == 0, "q heads (", n_q_heads,
                    ") must be a multiple of k_cache heads (", n_kv_heads, ")");
  TORCH_CHECK_VALUE(std::isfinite(scale), "scale must be finite, got ", scale);
  check_float_dtype(q_in, "q");
  check_same_dtype(q_in, k_cache_in, "q", "k_cache");
  check_same_dtype(q_in, v_cache_in, "q", "v_cache");
  check_same_device(q_in, k_cache_in, "q", "k_cache");
  check_same_device(q_in, v_cache_in, "q", "v_cache");
  const at::Tensor* idx[4] = {&q_start_in, &q_len_in, &kv_start_in, &kv_len_in};
  const char* idx_names[4] = {"q_start", "q_len", "kv_start", "kv_len"};
  for (int i = 0; i < 4; ++i) {
    check_index(*idx[i], idx_names[i]);
    check_same_device(q_in, *idx[i], "q", idx_names[i]);
    TORCH_CHECK_VALUE(idx[i]->size(0) == q_start_in.size(0), idx_names[i], " has ", idx[i]->size(0),
                      " entries but q_start has ", q_start_in.size(0), "; all index tensors need one entry per request");
  }
  // One index type for the kernel: mixed int32/int64 inputs are widened to int64.
  const bool same_index_type = q_len_in.scalar_type() == q_start_in.scalar_type() &&
                               kv_start_in.scalar_type() == q_start_in.scalar_type() &&
                               kv_len_in.scalar_type() == q_start_in.scalar_type();
  auto prep = [&](const at::Tensor& t) { return (same_index_type ? t : t.to(at::kLong)).contiguous(); };
  const at::Tensor q_start = prep(q_start_in), q_len = prep(q_len_in), kv_start = prep(kv_start_in),
                   kv_len = prep(kv_len_in);
#ifdef ORCA_WITH_CUDA
  if (q_in.is_cuda())  // index values are guarded inside the kernel (no host sync)
    return cuda_ops::ragged_attention(q_in.contiguous(), k_cache_in.contiguous(), v_cache_in.contiguous(), q_start,
                                      q_len, kv_start, kv_len, scale);
#endif
  const at::Tensor q = q_in.contiguous(), k_cache = k_cache_in.contiguous(), v_cache = v_cache_in.contiguous();
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
  dispatch_cpu_float(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    dispatch_index(q_start.scalar_type(), [&](auto itag) {
      using I = decltype(itag);
      cpu::ragged_attention<T, I>(ptr<T>(q), ptr<T>(k_cache), ptr<T>(v_cache), q_start.data_ptr<I>(),
                                  q_len.data_ptr<I>(), kv_start.data_ptr<I>(), kv_len.data_ptr<I>(), ptr<T>(out),
                                  static_cast<int64_t>(qs.size()), n_q_heads, n_kv_heads, head_dim,
                                  static_cast<float>(scale));
    });
  });
  return out;
}

}  // namespace orca
