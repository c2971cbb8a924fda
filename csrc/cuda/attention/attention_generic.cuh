// ragged_attention, part 3: the CUDA-core fallback for float32 and for head dims the tensor-core
// path does not instantiate (any D <= 256). One block per (request, query head), one warp per
// query row: lanes score 32 keys at a time, then accumulate P V with lane-parallel head dims.
// Simple and exact enough (float32 throughout); not tuned.
#pragma once
#include "cuda/common.cuh"

namespace orca::kernels::attn {

constexpr int kGenericThreads = 128;
constexpr int kGenericMaxDim = 256;

template <typename T, typename I>
__global__ void __launch_bounds__(kGenericThreads)
    ragged_attention_generic_kernel(const T* __restrict__ q,        // [T, Hq, D]
                                    const T* __restrict__ k_cache,  // [S, Hkv, D]
                                    const T* __restrict__ v_cache,  // [S, Hkv, D]
                                    const I* __restrict__ q_start, const I* __restrict__ q_len,
                                    const I* __restrict__ kv_start, const I* __restrict__ kv_len,
                                    T* __restrict__ out,            // [T, Hq, D]
                                    int64_t n_tokens, int64_t n_slots, int n_q_heads, int n_kv_heads,
                                    int head_dim, float scale_log2) {
  constexpr int kWarps = kGenericThreads / 32;
  constexpr int kPerLane = kGenericMaxDim / 32;
  __shared__ float sq[kWarps][kGenericMaxDim];
  const int b = blockIdx.x, h = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long qs = static_cast<long long>(q_start[b]), ql = static_cast<long long>(q_len[b]);
  const long long ks = static_cast<long long>(kv_start[b]), kl = static_cast<long long>(kv_len[b]);
  if (!(ql >= 1 && kl >= ql && qs >= 0 && qs <= n_tokens - ql && ks >= 0 && ks <= n_slots - kl)) return;
  const int kvh = h / (n_q_heads / n_kv_heads);
  const int D = head_dim;
  const int64_t kv_stride = static_cast<int64_t>(n_kv_heads) * D;
  const T* kb = k_cache + (ks * n_kv_heads + kvh) * D;
  const T* vb = v_cache + (ks * n_kv_heads + kvh) * D;

  for (long long i = warp; i < ql; i += kWarps) {
    const T* qrow = q + ((qs + i) * n_q_heads + h) * D;
    for (int d = lane; d < D; d += 32) sq[warp][d] = detail::to_float(qrow[d]) * scale_log2;
    __syncwarp();
    const long long limit = kl - ql + i;  // last visible key
    float m = -INFINITY, l = 0.f, o[kPerLane];
#pragma unroll
    for (int u = 0; u < kPerLane; ++u) o[u] = 0.f;
    for (long long k0 = 0; k0 <= limit; k0 += 32) {
      const long long key = k0 + lane;
      float s = -INFINITY;
      if (key <= limit) {
        const T* krow = kb + key * kv_stride;
        float acc = 0.f;
        for (int d = 0; d < D; ++d) acc += sq[warp][d] * detail::to_float(krow[d]);
        s = acc;
      }
      const float m_new = fmaxf(m, detail::warp_max(s));  // finite: key k0 <= limit
      const float alpha = exp2f(m - m_new);
      const float pr = key <= limit ? exp2f(s - m_new) : 0.f;
      l = l * alpha + detail::warp_sum(pr);
#pragma unroll
      for (int u = 0; u < kPerLane; ++u) o[u] *= alpha;
      const int n = static_cast<int>(limit - k0 + 1 < 32 ? limit - k0 + 1 : 32);
      for (int jj = 0; jj < n; ++jj) {
        const float pj = __shfl_sync(0xffffffffu, pr, jj);
        const T* vrow = vb + (k0 + jj) * kv_stride;
#pragma unroll
        for (int u = 0; u < kPerLane; ++u) {
          const int d = lane + 32 * u;
          if (d < D) o[u] += pj * detail::to_float(vrow[d]);
        }
      }
      m = m_new;
    }
    T* orow = out + ((qs + i) * n_q_heads + h) * D;
    const float inv = 1.f / l;
#pragma unroll
    for (int u = 0; u < kPerLane; ++u) {
      const int d = lane + 32 * u;
      if (d < D) orow[d] = detail::from_float<T>(o[u] * inv);
    }
    __syncwarp();  // sq[warp] is rewritten for the next row
  }
}

}  // namespace orca::kernels::attn
