// rms_norm: one block per row. Pass 1 accumulates the sum of squares in float32 with 16-byte
// loads, a block reduction gives 1/rms, pass 2 re-reads the row (now in L1) and writes
// round(x * inv_rms * weight) -- one rounding, as the float64 reference.
#include "cuda/common.cuh"

namespace orca::kernels {
namespace {

using detail::from_float;
using detail::to_float;

template <typename T, bool kVec>
__global__ void rms_norm_kernel(const T* __restrict__ x,       // [T, H]
                                const T* __restrict__ weight,  // [H]
                                T* __restrict__ out,           // [T, H]
                                int64_t hidden, float eps) {
  constexpr int E = detail::kVecElems<T>;
  const int64_t row = blockIdx.x;
  const T* xr = x + row * hidden;
  T* orow = out + row * hidden;
  float ss = 0.f;
  if constexpr (kVec) {
    const int64_t n_vec = hidden / E;
    for (int64_t i = threadIdx.x; i < n_vec; i += blockDim.x) {
      const uint4 u = __ldg(reinterpret_cast<const uint4*>(xr) + i);
      const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
      for (int j = 0; j < E; ++j) {
        const float f = to_float(e[j]);
        ss += f * f;
      }
    }
  } else {
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
      const float f = to_float(xr[i]);
      ss += f * f;
    }
  }
  ss = detail::block_sum(ss);
  const float inv = rsqrtf(ss / static_cast<float>(hidden) + eps);
  if constexpr (kVec) {
    const int64_t n_vec = hidden / E;
    for (int64_t i = threadIdx.x; i < n_vec; i += blockDim.x) {
      const uint4 u = __ldg(reinterpret_cast<const uint4*>(xr) + i);
      const uint4 w = __ldg(reinterpret_cast<const uint4*>(weight) + i);
      const T* xe = reinterpret_cast<const T*>(&u);
      const T* we = reinterpret_cast<const T*>(&w);
      uint4 o;
      T* oe = reinterpret_cast<T*>(&o);
#pragma unroll
      for (int j = 0; j < E; ++j) oe[j] = from_float<T>(to_float(xe[j]) * inv * to_float(we[j]));
      reinterpret_cast<uint4*>(orow)[i] = o;
    }
  } else {
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x)
      orow[i] = from_float<T>(to_float(xr[i]) * inv * to_float(weight[i]));
  }
}

template <typename T>
cudaError_t launch(const void* x, const void* w, void* out, int64_t n_tokens, int64_t hidden, float eps,
                   cudaStream_t stream) {
  constexpr int E = detail::kVecElems<T>;
  const bool vec = hidden % E == 0 && detail::aligned16(x) && detail::aligned16(w) && detail::aligned16(out);
  const int64_t work = vec ? hidden / E : hidden;
  // Enough threads for one vector each (H=1024 bf16 -> 128), within [32, 1024].
  int threads = static_cast<int>(detail::ceil_div(work < 1 ? 1 : work, 32) * 32);
  threads = threads > 1024 ? 1024 : threads;
  const dim3 grid(static_cast<unsigned>(n_tokens));
  if (vec)
    rms_norm_kernel<T, true><<<grid, threads, 0, stream>>>(static_cast<const T*>(x), static_cast<const T*>(w),
                                                           static_cast<T*>(out), hidden, eps);
  else
    rms_norm_kernel<T, false><<<grid, threads, 0, stream>>>(static_cast<const T*>(x), static_cast<const T*>(w),
                                                            static_cast<T*>(out), hidden, eps);
  return cudaGetLastError();
}

}  // namespace

cudaError_t rms_norm(DType dtype, const void* x, const void* weight, void* out, int64_t n_tokens, int64_t hidden,
                     float eps, cudaStream_t stream) {
  if (n_tokens < 0 || hidden < 1 || n_tokens > 0x7fffffff) return cudaErrorInvalidValue;
  if (n_tokens == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32: return launch<float>(x, weight, out, n_tokens, hidden, eps, stream);
    case DType::kFloat16: return launch<__half>(x, weight, out, n_tokens, hidden, eps, stream);
    case DType::kBFloat16: return launch<__nv_bfloat16>(x, weight, out, n_tokens, hidden, eps, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace orca::kernels
