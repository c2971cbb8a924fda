// ragged_attention launchers: the plan (the work-list kernel) and the persistent tensor-core
// launch that reads it (fp16/bf16, head dims 64/80/96/128), or the CUDA-core fallback (float32,
// other head dims <= 256), which needs no plan.
#include <cmath>

#include "cuda/attention/attention_generic.cuh"
#include "cuda/attention/attention_mma_launch.h"

namespace orca::kernels {
namespace {

using attn::Layout;
using attn::Params;

constexpr float kLog2e = 1.4426950408889634f;

bool shapes_ok(int64_t n_tokens, int64_t n_requests, int64_t n_slots, int64_t n_q_heads, int64_t n_kv_heads,
               int64_t head_dim) {
  return n_tokens >= 0 && n_tokens < 0x7fffffff && n_requests >= 0 && n_requests < 0x7fffffff && n_slots >= 0 &&
         n_slots < 0x7fffffff && n_kv_heads >= 1 && n_q_heads >= n_kv_heads && n_q_heads % n_kv_heads == 0 &&
         n_q_heads <= 65535 && head_dim >= 1;
}

template <typename T, typename I>
cudaError_t launch_generic(const void* q, const void* k, const void* v, const void* qs, const void* ql,
                           const void* ks, const void* kl, void* out, int64_t n_tokens, int64_t n_requests,
                           int64_t n_slots, int64_t n_q_heads, int64_t n_kv_heads, int64_t head_dim,
                           float scale_log2, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(n_requests), static_cast<unsigned>(n_q_heads));
  attn::ragged_attention_generic_kernel<T, I><<<grid, attn::kGenericThreads, 0, stream>>>(
      static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), static_cast<const I*>(qs),
      static_cast<const I*>(ql), static_cast<const I*>(ks), static_cast<const I*>(kl), static_cast<T*>(out),
      n_tokens, n_slots, static_cast<int>(n_q_heads), static_cast<int>(n_kv_heads), static_cast<int>(head_dim),
      scale_log2);
  return cudaGetLastError();
}

template <typename T>
cudaError_t dispatch_generic(IndexType it, const void* q, const void* k, const void* v, const void* qs,
                             const void* ql, const void* ks, const void* kl, void* out, int64_t n_tokens,
                             int64_t n_requests, int64_t n_slots, int64_t n_q_heads, int64_t n_kv_heads,
                             int64_t head_dim, float scale_log2, cudaStream_t stream) {
  if (it == IndexType::kInt32)
    return launch_generic<T, int32_t>(q, k, v, qs, ql, ks, kl, out, n_tokens, n_requests, n_slots, n_q_heads,
                                      n_kv_heads, head_dim, scale_log2, stream);
  return launch_generic<T, int64_t>(q, k, v, qs, ql, ks, kl, out, n_tokens, n_requests, n_slots, n_q_heads,
                                    n_kv_heads, head_dim, scale_log2, stream);
}

template <typename I>
cudaError_t launch_builder(const void* qs, const void* ql, const void* ks, const void* kl, const Params& p,
                           int64_t target_items, cudaStream_t stream) {
  attn::build_worklist_kernel<I><<<1, attn::kBuilderThreads, 0, stream>>>(
      static_cast<const I*>(qs), static_cast<const I*>(ql), static_cast<const I*>(ks), static_cast<const I*>(kl), p,
      static_cast<long long>(target_items));
  return cudaGetLastError();
}

Layout layout_of(int64_t n_tokens, int64_t n_requests, int64_t n_q_heads, int64_t n_kv_heads, int64_t head_dim,
                 const RaggedAttentionTuning& tuning) {
  return attn::make_layout(n_tokens, n_requests, n_q_heads, n_kv_heads, head_dim, detail::current_device_sm_count(),
                           tuning.items_per_sm, tuning.decode_stages > 0 ? attn::kDecodeRows : attn::kPrefillRows);
}

// The plan's pointers and the shapes, as both kernels see them (q, caches, out left null).
Params plan_params(void* plan, const Layout& L, DType dtype, int64_t n_tokens, int64_t n_requests, int64_t n_slots,
                   int64_t n_q_heads, int64_t n_kv_heads, int64_t head_dim, const RaggedAttentionTuning& tuning) {
  char* ws = static_cast<char*>(plan);
  Params p{};
  p.ctrl = reinterpret_cast<int*>(ws + L.off_ctrl);
  p.req = reinterpret_cast<int4*>(ws + L.off_req);
  p.sched = reinterpret_cast<int4*>(ws + L.off_sched);
  p.items = reinterpret_cast<int4*>(ws + L.off_items);
  p.pair_count = reinterpret_cast<int*>(ws + L.off_pair);
  p.part_lse = reinterpret_cast<float*>(ws + L.off_lse);
  p.part_o = reinterpret_cast<float*>(ws + L.off_o);
  p.row_mark = reinterpret_cast<unsigned char*>(ws + L.off_mark);
  p.out_row_vecs = n_q_heads * head_dim * (dtype == DType::kFloat32 ? 4 : 2) / 16;
  p.n_tokens = n_tokens;
  p.n_slots = n_slots;
  p.n_requests = static_cast<int>(n_requests);
  p.n_q_heads = static_cast<int>(n_q_heads);
  p.n_kv_heads = static_cast<int>(n_kv_heads);
  p.group = static_cast<int>(n_q_heads / n_kv_heads);
  p.items_cap = static_cast<int>(L.items_cap);
  p.prefill_rows = L.prefill_rows;
  p.prow_cap = L.prow_cap;
  p.batch_invariant = tuning.batch_invariant ? 1 : 0;
  return p;
}

// Arguments of the tensor-core path that neither step can serve.
cudaError_t check_planned(DType dtype, const Layout& L, const void* plan, size_t plan_bytes, int64_t n_tokens,
                          int64_t n_requests, int64_t n_q_heads, int64_t n_kv_heads, int64_t head_dim,
                          const RaggedAttentionTuning& tuning) {
  if (!ragged_attention_tuning_valid(tuning) || !ragged_attention_uses_tensor_cores(dtype, head_dim))
    return cudaErrorInvalidValue;
  if (!shapes_ok(n_tokens, n_requests, 0, n_q_heads, n_kv_heads, head_dim) || n_tokens == 0 || n_requests == 0)
    return cudaErrorInvalidValue;
  if (L.items_cap > 0x7fffffffLL || L.prow_cap > 0x7fffffffLL) return cudaErrorInvalidValue;
  if (plan == nullptr || plan_bytes < L.total || !detail::aligned16(plan)) return cudaErrorInvalidValue;
  return cudaSuccess;
}

}  // namespace

bool ragged_attention_tuning_valid(const RaggedAttentionTuning& tuning) {
  return tuning.items_per_sm >= 1 && tuning.items_per_sm <= kRaggedAttentionMaxItemsPerSm &&
         (tuning.decode_stages == 0 || attn::decode_stages_supported(tuning.decode_stages)) &&
         !(tuning.batch_invariant && tuning.decode_stages != 0);
}

bool ragged_attention_uses_tensor_cores(DType dtype, int64_t head_dim) {
  return dtype != DType::kFloat32 && attn::mma_head_dim_supported(head_dim);
}

size_t ragged_attention_plan_bytes(DType dtype, int64_t n_tokens, int64_t n_requests, int64_t n_q_heads,
                                   int64_t n_kv_heads, int64_t head_dim, const RaggedAttentionTuning& tuning) {
  if (!ragged_attention_uses_tensor_cores(dtype, head_dim) || !ragged_attention_tuning_valid(tuning) ||
      n_kv_heads < 1 || n_tokens <= 0 || n_requests <= 0)
    return 0;
  return layout_of(n_tokens, n_requests, n_q_heads, n_kv_heads, head_dim, tuning).total;
}

size_t ragged_attention_workspace_bytes(DType dtype, int64_t n_tokens, int64_t n_requests, int64_t n_q_heads,
                                        int64_t n_kv_heads, int64_t head_dim) {
  return ragged_attention_plan_bytes(dtype, n_tokens, n_requests, n_q_heads, n_kv_heads, head_dim,
                                     RaggedAttentionTuning{});
}

cudaError_t ragged_attention_plan(DType dtype, IndexType index_type, const void* q_start, const void* q_len,
                                  const void* kv_start, const void* kv_len, void* plan, size_t plan_bytes,
                                  int64_t n_tokens, int64_t n_requests, int64_t n_slots, int64_t n_q_heads,
                                  int64_t n_kv_heads, int64_t head_dim, const RaggedAttentionTuning& tuning,
                                  cudaStream_t stream) {
  if (!shapes_ok(n_tokens, n_requests, n_slots, n_q_heads, n_kv_heads, head_dim)) return cudaErrorInvalidValue;
  const Layout L = layout_of(n_tokens, n_requests, n_q_heads, n_kv_heads, head_dim, tuning);
  const cudaError_t bad =
      check_planned(dtype, L, plan, plan_bytes, n_tokens, n_requests, n_q_heads, n_kv_heads, head_dim, tuning);
  if (bad != cudaSuccess) return bad;
  const Params p = plan_params(plan, L, dtype, n_tokens, n_requests, n_slots, n_q_heads, n_kv_heads, head_dim, tuning);
  return index_type == IndexType::kInt32
             ? launch_builder<int32_t>(q_start, q_len, kv_start, kv_len, p, L.target_items, stream)
             : launch_builder<int64_t>(q_start, q_len, kv_start, kv_len, p, L.target_items, stream);
}

cudaError_t ragged_attention_with_plan(DType dtype, const void* q, const void* k_cache, const void* v_cache,
                                       void* out, void* plan, size_t plan_bytes, int64_t n_tokens,
                                       int64_t n_requests, int64_t n_q_heads, int64_t n_kv_heads, int64_t head_dim,
                                       float scale, const RaggedAttentionTuning& tuning, cudaStream_t stream) {
  if (!std::isfinite(scale)) return cudaErrorInvalidValue;
  const Layout L = layout_of(n_tokens, n_requests, n_q_heads, n_kv_heads, head_dim, tuning);
  const cudaError_t bad =
      check_planned(dtype, L, plan, plan_bytes, n_tokens, n_requests, n_q_heads, n_kv_heads, head_dim, tuning);
  if (bad != cudaSuccess) return bad;
  // The tensor-core kernels read q and the caches with 16-byte copies.
  if (!detail::aligned16(q) || !detail::aligned16(k_cache) || !detail::aligned16(v_cache) ||
      !detail::aligned16(out))
    return cudaErrorMisalignedAddress;
  Params p = plan_params(plan, L, dtype, n_tokens, n_requests, 0, n_q_heads, n_kv_heads, head_dim, tuning);
  p.q = q;
  p.k_cache = k_cache;
  p.v_cache = v_cache;
  p.out = out;
  p.scale_log2 = scale * kLog2e;
  const int d = static_cast<int>(head_dim);
  if (tuning.decode_stages > 0) {
    if (dtype == DType::kFloat16) return attn::launch_decode<__half>(p, d, tuning.decode_stages, L.items_cap, stream);
    return attn::launch_decode<__nv_bfloat16>(p, d, tuning.decode_stages, L.items_cap, stream);
  }
  if (dtype == DType::kFloat16) return attn::launch_mma<__half>(p, d, L.items_cap, stream);
  return attn::launch_mma<__nv_bfloat16>(p, d, L.items_cap, stream);
}

cudaError_t ragged_attention(DType dtype, IndexType index_type, const void* q, const void* k_cache,
                             const void* v_cache, const void* q_start, const void* q_len, const void* kv_start,
                             const void* kv_len, void* out, void* workspace, size_t workspace_bytes,
                             int64_t n_tokens, int64_t n_requests, int64_t n_slots, int64_t n_q_heads,
                             int64_t n_kv_heads, int64_t head_dim, float scale, bool batch_invariant,
                             cudaStream_t stream) {
  if (!shapes_ok(n_tokens, n_requests, n_slots, n_q_heads, n_kv_heads, head_dim) || !std::isfinite(scale))
    return cudaErrorInvalidValue;
  const size_t out_bytes =
      size_t(n_tokens) * size_t(n_q_heads) * size_t(head_dim) * (dtype == DType::kFloat32 ? 4 : 2);
  if (n_tokens == 0) return cudaSuccess;
  if (n_requests == 0) return cudaMemsetAsync(out, 0, out_bytes, stream);

  if (!ragged_attention_uses_tensor_cores(dtype, head_dim)) {
    if (head_dim > attn::kGenericMaxDim) return cudaErrorInvalidValue;
    // Rows owned by no valid request read as zero: clear everything first (this path is not
    // the fast one).
    const cudaError_t zero_err = cudaMemsetAsync(out, 0, out_bytes, stream);
    if (zero_err != cudaSuccess) return zero_err;
    const float scale_log2 = scale * kLog2e;
    switch (dtype) {
      case DType::kFloat32:
        return dispatch_generic<float>(index_type, q, k_cache, v_cache, q_start, q_len, kv_start, kv_len, out,
                                       n_tokens, n_requests, n_slots, n_q_heads, n_kv_heads, head_dim, scale_log2,
                                       stream);
      case DType::kFloat16:
        return dispatch_generic<__half>(index_type, q, k_cache, v_cache, q_start, q_len, kv_start, kv_len, out,
                                        n_tokens, n_requests, n_slots, n_q_heads, n_kv_heads, head_dim, scale_log2,
                                        stream);
      case DType::kBFloat16:
        return dispatch_generic<__nv_bfloat16>(index_type, q, k_cache, v_cache, q_start, q_len, kv_start, kv_len,
                                               out, n_tokens, n_requests, n_slots, n_q_heads, n_kv_heads, head_dim,
                                               scale_log2, stream);
    }
    return cudaErrorInvalidValue;
  }

  // Misaligned tensors are reported before anything is enqueued.
  if (!detail::aligned16(q) || !detail::aligned16(k_cache) || !detail::aligned16(v_cache) ||
      !detail::aligned16(out))
    return cudaErrorMisalignedAddress;
  RaggedAttentionTuning tuning{};
  tuning.batch_invariant = batch_invariant;
  const cudaError_t err = ragged_attention_plan(dtype, index_type, q_start, q_len, kv_start, kv_len, workspace,
                                                workspace_bytes, n_tokens, n_requests, n_slots, n_q_heads,
                                                n_kv_heads, head_dim, tuning, stream);
  if (err != cudaSuccess) return err;
  return ragged_attention_with_plan(dtype, q, k_cache, v_cache, out, workspace, workspace_bytes, n_tokens,
                                    n_requests, n_q_heads, n_kv_heads, head_dim, scale, tuning, stream);
}

}  // namespace orca::kernels
