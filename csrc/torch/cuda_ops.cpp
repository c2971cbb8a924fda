// CUDA glue (see cuda_ops.h): device guard -> current stream -> dtype dispatch -> raw-pointer
// launcher in csrc/cuda. The few checks here protect the launchers' own assumptions.
#include "cuda_ops.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include "cuda/launchers.h"

namespace orca::cuda_ops {
namespace {

namespace kern = orca::kernels;

kern::DType float_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return kern::DType::kFloat32;
    case at::kHalf: return kern::DType::kFloat16;
    case at::kBFloat16: return kern::DType::kBFloat16;
    default: break;
  }
  TORCH_CHECK_VALUE(false, name, " has dtype ", t.scalar_type(),
                    "; the CUDA kernels support float32, float16 and bfloat16");
  return kern::DType::kFloat32;  // unreachable
}

kern::IndexType index_type(const at::Tensor& t, const char* name) {
  if (t.scalar_type() == at::kInt) return kern::IndexType::kInt32;
  TORCH_CHECK_VALUE(t.scalar_type() == at::kLong, name, " must be int32 or int64, got ", t.scalar_type());
  return kern::IndexType::kInt64;
}

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.is_cuda(), name, " must be a CUDA tensor, got device ", t.device());
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "orca_ext ", op, ": CUDA launch failed: ", cudaGetErrorName(err), " (",
              cudaGetErrorString(err), ")");
}

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

kern::DType kernel_dtype(at::ScalarType st) {
  return st == at::kHalf ? kern::DType::kFloat16 : st == at::kBFloat16 ? kern::DType::kBFloat16 : kern::DType::kFloat32;
}

kern::RaggedAttentionTuning tuning_of(const RaggedAttentionPlan& plan) {
  kern::RaggedAttentionTuning t;
  t.items_per_sm = static_cast<int>(plan.items_per_sm);
  t.decode_stages = static_cast<int>(plan.decode_stages);
  t.batch_invariant = plan.batch_invariant;
  return t;
}

// Turns a launcher's error into the Python exception the contract names.
void check_attention_launch(cudaError_t err, kern::DType dt, int64_t head_dim) {
  TORCH_CHECK_VALUE(err != cudaErrorMisalignedAddress,
                    "ragged_attention: q, k_cache and v_cache must start at 16-byte aligned addresses");
  TORCH_CHECK_VALUE(err != cudaErrorInvalidValue || kern::ragged_attention_uses_tensor_cores(dt, head_dim) ||
                        head_dim <= 256,
                    "ragged_attention: head_dim ", head_dim, " is not supported (at most 256)");
  check_launch(err, "ragged_attention");
}
// Rows per cuBLAS call of the batch-invariant linear. cuBLAS picks its kernel, and with it every
// output's reduction order (tile shape, split-K), from the problem shape; giving every call the
// same shape gives every row the same arithmetic. 64 rows keep a decode's padding cheap: the
// weight is read once per call and 64 rows of FLOPs stay below that read for any dense layer.
constexpr int64_t kInvariantRows = 64;

// Largest scratch slab_move may stage overlapping moves through.
constexpr int64_t kSlabMoveScratchBytes = int64_t{64} << 20;

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_cuda(x, "x");
  check_cuda(weight, "weight");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return out;
  check_launch(kern::rms_norm(float_dtype(x, "x"), x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.size(0),
                              x.size(1), static_cast<float>(eps), current_stream()),
               "rms_norm");
  return out;
}

at::Tensor linear_batch_invariant(const at::Tensor& x, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias) {
  check_cuda(x, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n_tokens = x.size(0), k = x.size(1), n_out = weight.size(0);
  at::Tensor out = at::empty({n_tokens, n_out}, x.options());
  if (n_tokens == 0 || n_out == 0) return out;
  at::Tensor chunk = at::zeros({kInvariantRows, k}, x.options());  // padding rows stay zero
  for (int64_t t0 = 0; t0 < n_tokens; t0 += kInvariantRows) {
    const int64_t n = std::min(kInvariantRows, n_tokens - t0);
    if (n < kInvariantRows) chunk.narrow(0, n, kInvariantRows - n).zero_();
    chunk.narrow(0, 0, n).copy_(x.narrow(0, t0, n));
    out.narrow(0, t0, n).copy_(at::linear(chunk, weight, bias).narrow(0, 0, n));
  }
  return out;
}

at::Tensor rmsnorm_qkv(const at::Tensor& x, const at::Tensor& norm_weight, const at::Tensor& qkv_weight,
                       const std::optional<at::Tensor>& qkv_bias, double eps, bool batch_invariant) {
  check_cuda(x, "x");
  check_cuda(qkv_weight, "qkv_weight");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n_tokens = x.size(0), hidden = x.size(1), n_out = qkv_weight.size(0);
  if (n_tokens == 0 || n_out == 0) return at::empty({n_tokens, n_out}, x.options());
  if (hidden == 0) return at::linear(x, qkv_weight, qkv_bias);  // no norm of an empty row: zeros (+ bias)
  // The fused kernel serves only decode-sized T, so the invariant path never uses it.
  if (batch_invariant) return linear_batch_invariant(rms_norm(x, norm_weight, eps), qkv_weight, qkv_bias);

  const kern::DType dt = float_dtype(x, "x");
  // Decode-sized T: one fused kernel streams the weight once. Larger T (or shapes it cannot
  // serve): our rms_norm, then one cuBLAS GEMM through ATen (see kRmsnormQkvFusedMaxTokens).
  if (kern::rmsnorm_qkv_fused_supported(dt, n_tokens, hidden, x.data_ptr(), norm_weight.data_ptr(),
                                        qkv_weight.data_ptr())) {
    at::Tensor out = at::empty({n_tokens, n_out}, x.options());
    check_launch(kern::rmsnorm_qkv_fused(dt, x.data_ptr(), norm_weight.data_ptr(), qkv_weight.data_ptr(),
                                         qkv_bias.has_value() ? qkv_bias->data_ptr() : nullptr, out.data_ptr(),
                                         n_tokens, hidden, n_out, static_cast<float>(eps), current_stream()),
                 "rmsnorm_qkv");
    return out;
  }
  return at::linear(rms_norm(x, norm_weight, eps), qkv_weight, qkv_bias);
}

void slab_write(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                const at::Tensor& slots) {
  check_cuda(k_cache, "k_cache");
  check_cuda(slots, "slots");
  const c10::cuda::CUDAGuard guard(k_cache.device());
  const int64_t n_tokens = k.size(0), row_elems = k.size(1) * k.size(2);
  if (n_tokens == 0 || row_elems == 0) return;
  check_launch(kern::slab_write(float_dtype(k_cache, "k_cache"), index_type(slots, "slots"), k_cache.data_ptr(),
                                v_cache.data_ptr(), k.data_ptr(), v.data_ptr(), slots.data_ptr(), n_tokens,
                                k_cache.size(0), row_elems, current_stream()),
               "slab_write");
}

at::Tensor ragged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& q_start, const at::Tensor& q_len, const at::Tensor& kv_start,
                            const at::Tensor& kv_len, double scale, bool batch_invariant) {
  check_cuda(q, "q");
  check_cuda(q_start, "q_start");
  // The launcher reads all four index arrays with the one type it is given.
  TORCH_INTERNAL_ASSERT(q_len.scalar_type() == q_start.scalar_type() &&
                        kv_start.scalar_type() == q_start.scalar_type() &&
                        kv_len.scalar_type() == q_start.scalar_type());
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t n_tokens = q.size(0), n_q_heads = q.size(1), head_dim = q.size(2);
  const int64_t n_slots = k_cache.size(0), n_kv_heads = k_cache.size(1), n_requests = q_start.size(0);
  // The launcher zeroes rows owned by no valid request (as the reference does), so no memset here.
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (n_tokens == 0 || head_dim == 0) return out;
  if (n_requests == 0) return out.zero_();

  const kern::DType dt = float_dtype(q, "q");
  const size_t ws_bytes =
      kern::ragged_attention_workspace_bytes(dt, n_tokens, n_requests, n_q_heads, n_kv_heads, head_dim);
  at::Tensor ws;
  if (ws_bytes > 0) ws = at::empty({static_cast<int64_t>(ws_bytes)}, q.options().dtype(at::kByte));
  const cudaError_t err = kern::ragged_attention(
      dt, index_type(q_start, "q_start"), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), q_start.data_ptr(),
      q_len.data_ptr(), kv_start.data_ptr(), kv_len.data_ptr(), out.data_ptr(), ws_bytes > 0 ? ws.data_ptr() : nullptr,
      ws_bytes, n_tokens, n_requests, n_slots, n_q_heads, n_kv_heads, head_dim, static_cast<float>(scale),
      batch_invariant, current_stream());
  check_attention_launch(err, dt, head_dim);
  return out;
}

void build_ragged_attention_plan(RaggedAttentionPlan& plan) {
  const c10::cuda::CUDAGuard guard(plan.device);
  const kern::DType dt = kernel_dtype(plan.dtype);
  const kern::RaggedAttentionTuning tuning = tuning_of(plan);
  const size_t bytes = kern::ragged_attention_plan_bytes(dt, plan.n_tokens, plan.n_requests, plan.n_q_heads,
                                                         plan.n_kv_heads, plan.head_dim, tuning);
  if (bytes == 0) return;  // CUDA-core path or an empty batch: nothing to plan
  plan.workspace = at::empty({static_cast<int64_t>(bytes)}, plan.index[0].options().dtype(at::kByte));
  const cudaError_t err = kern::ragged_attention_plan(
      dt, index_type(plan.index[0], "q_start"), plan.index[0].data_ptr(), plan.index[1].data_ptr(),
      plan.index[2].data_ptr(), plan.index[3].data_ptr(), plan.workspace.data_ptr(), bytes, plan.n_tokens,
      plan.n_requests, plan.n_slots, plan.n_q_heads, plan.n_kv_heads, plan.head_dim, tuning, current_stream());
  TORCH_CHECK_VALUE(err != cudaErrorInvalidValue, "ragged_attention_plan: shapes out of range (n_tokens=",
                    plan.n_tokens, ", n_requests=", plan.n_requests, ", n_slots=", plan.n_slots,
                    "; each must be below 2^31)");
  check_launch(err, "ragged_attention_plan");
}

at::Tensor ragged_attention_with_plan(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                      const RaggedAttentionPlan& plan, double scale) {
  // No device plan: the CUDA-core path (or an empty batch), which reads the indices directly.
  if (!plan.workspace.defined())
    return ragged_attention(q, k_cache, v_cache, plan.index[0], plan.index[1], plan.index[2], plan.index[3], scale,
                            plan.batch_invariant);
  check_cuda(q, "q");
  const c10::cuda::CUDAGuard guard(q.device());
  // Every row is written by the attention kernel (owned rows by their items, the others zeroed).
  at::Tensor out = at::empty(q.sizes(), q.options());
  const kern::DType dt = float_dtype(q, "q");
  const cudaError_t err = kern::ragged_attention_with_plan(
      dt, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), plan.workspace.data_ptr(),
      static_cast<size_t>(plan.workspace.numel()), plan.n_tokens, plan.n_requests, plan.n_q_heads, plan.n_kv_heads,
      plan.head_dim, static_cast<float>(scale), tuning_of(plan), current_stream());
  check_attention_launch(err, dt, plan.head_dim);
  return out;
}

void slab_move(at::Tensor& pools, const at::Tensor& moves) {
  check_cuda(pools, "pools");
  const c10::cuda::CUDAGuard guard(pools.device());
  const int64_t n_pools = pools.size(0), n_slots = pools.size(1), n_moves = moves.size(0);
  if (n_pools == 0 || n_slots == 0 || n_moves == 0) return;
  const int64_t row_bytes = pools.numel() / (n_pools * n_slots) * static_cast<int64_t>(pools.element_size());
  // Scratch for overlapping moves: enough for the longest move's rows in every pool, capped.
  const int64_t* m = moves.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t i = 0; i < n_moves; ++i) longest = std::max(longest, m[3 * i + 2]);
  const int64_t scratch_bytes = std::min(kSlabMoveScratchBytes, longest * n_pools * row_bytes);
  at::Tensor scratch;
  if (scratch_bytes > 0) scratch = at::empty({scratch_bytes}, pools.options().dtype(at::kByte));
  check_launch(kern::slab_move(pools.data_ptr(), n_pools, n_slots, row_bytes, m, n_moves,
                               scratch_bytes > 0 ? scratch.data_ptr() : nullptr, static_cast<size_t>(scratch_bytes),
                               current_stream()),
               "slab_move");
}

}  // namespace orca::cuda_ops
