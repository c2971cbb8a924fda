// slab_write: one block per token copies its K and V rows ([Hkv*D] each) into the token's slot.
// 16-byte vector copies when the row size and all pointers allow; a slot outside [0, S) is
// skipped so bad indices can never write out of bounds. The copy only depends on the element
// size, so fp16 and bf16 share one instantiation.
#include "cuda/common.cuh"

namespace orca::kernels {
namespace {

template <typename V, typename I>
__global__ void slab_write_kernel(V* __restrict__ k_cache,      // [S, row_vecs]
                                  V* __restrict__ v_cache,      // [S, row_vecs]
                                  const V* __restrict__ k,      // [T, row_vecs]
                                  const V* __restrict__ v,      // [T, row_vecs]
                                  const I* __restrict__ slots,  // [T]
                                  int64_t n_slots, int64_t row_vecs) {
  const int64_t t = blockIdx.x;
  const int64_t slot = static_cast<int64_t>(slots[t]);
  if (slot < 0 || slot >= n_slots) return;
  const V* ks = k + t * row_vecs;
  const V* vs = v + t * row_vecs;
  V* kd = k_cache + slot * row_vecs;
  V* vd = v_cache + slot * row_vecs;
  for (int64_t i = threadIdx.x; i < row_vecs; i += blockDim.x) {
    const V a = __ldg(ks + i);
    const V b = __ldg(vs + i);
    kd[i] = a;
    vd[i] = b;
  }
}

template <typename V, typename I>
cudaError_t launch_typed(void* kc, void* vc, const void* k, const void* v, const void* slots, int64_t n_tokens,
                         int64_t n_slots, int64_t row_vecs, cudaStream_t stream) {
  int threads = static_cast<int>(detail::ceil_div(row_vecs, 32) * 32);
  threads = threads > 256 ? 256 : threads;
  slab_write_kernel<V, I><<<static_cast<unsigned>(n_tokens), threads, 0, stream>>>(
      static_cast<V*>(kc), static_cast<V*>(vc), static_cast<const V*>(k), static_cast<const V*>(v),
      static_cast<const I*>(slots), n_slots, row_vecs);
  return cudaGetLastError();
}

template <typename I>
cudaError_t launch_index(size_t elem_bytes, void* kc, void* vc, const void* k, const void* v, const void* slots,
                         int64_t n_tokens, int64_t n_slots, int64_t row_elems, cudaStream_t stream) {
  const int64_t row_bytes = row_elems * static_cast<int64_t>(elem_bytes);
  const bool vec = row_bytes % 16 == 0 && detail::aligned16(kc) && detail::aligned16(vc) &&
                   detail::aligned16(k) && detail::aligned16(v);
  if (vec) return launch_typed<uint4, I>(kc, vc, k, v, slots, n_tokens, n_slots, row_bytes / 16, stream);
  if (elem_bytes == 4) return launch_typed<uint32_t, I>(kc, vc, k, v, slots, n_tokens, n_slots, row_elems, stream);
  return launch_typed<uint16_t, I>(kc, vc, k, v, slots, n_tokens, n_slots, row_elems, stream);
}

}  // namespace

cudaError_t slab_write(DType dtype, IndexType index_type, void* k_cache, void* v_cache, const void* k, const void* v,
                       const void* slots, int64_t n_tokens, int64_t n_slots, int64_t row_elems, cudaStream_t stream) {
  if (n_tokens < 0 || n_tokens > 0x7fffffff || n_slots < 0 || row_elems < 0) return cudaErrorInvalidValue;
  if (n_tokens == 0 || row_elems == 0) return cudaSuccess;
  const size_t elem_bytes = dtype == DType::kFloat32 ? 4 : 2;
  if (index_type == IndexType::kInt32)
    return launch_index<int32_t>(elem_bytes, k_cache, v_cache, k, v, slots, n_tokens, n_slots, row_elems, stream);
  return launch_index<int64_t>(elem_bytes, k_cache, v_cache, k, v, slots, n_tokens, n_slots, row_elems, stream);
}

}  // namespace orca::kernels
