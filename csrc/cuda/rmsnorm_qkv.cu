// Fused rmsnorm + QKV projection for decode-sized T (<= kRmsnormQkvFusedMaxTokens).
//
//   out[t, n] = inv_rms[t] * sum_k x[t, k] * (norm_weight[k] * W[n, k]) + bias[n]
//
// Each block owns 32 rows of W and streams them exactly once (cp.async, 6-stage pipeline over
// 128-wide K chunks) while re-reading the small activation block [T, chunk] from L2. The norm
// weight is folded into the W fragments in registers and the row norms into the epilogue, so the
// activations go to the tensor cores unmodified and each thread accumulates the row sums of
// squares from the A fragments it already holds: no extra pass and no extra synchronisation.
// 8 warps: warp w takes the w-th 16-column slice of every chunk (a K split inside the block), the
// partial sums are added in shared memory at the end.
//
// Why the switch to cuBLAS above 64 tokens: every block re-reads T*H activations, so at T=64 the
// L2 traffic is already twice the weight traffic and the GEMM reaches ~64 FLOP per weight byte;
// beyond that the problem is compute-bound and a tiled cuBLAS GEMM (through torch) is faster.
#include <atomic>

#include "cuda/common.cuh"

namespace orca::kernels {
namespace {

using namespace detail;

constexpr int kThreads = 256;  // 8 warps
constexpr int kRowsW = 32;     // weight rows (outputs) per block
constexpr int kKC = 128;       // K chunk: 8 warps x 16
constexpr int kLD = kKC + 8;   // padded smem row (elements): conflict-free ldmatrix
constexpr int kStages = 6;  // ~1 block per SM: keep 5 chunks (40 KiB of W) in flight

template <int MT>
struct Smem {
  static constexpr int kRowsX = 16 * MT;
  static constexpr int kXElems = kRowsX * kLD;
  static constexpr int kWElems = kRowsW * kLD;
  static constexpr int kStageElems = kXElems + kWElems + kKC;
  static constexpr int kRedLD = kRowsW + 4;
  static constexpr size_t kPipeBytes = size_t(kStages) * kStageElems * 2;
  static constexpr size_t kEpiBytes = size_t(8) * kRowsX * (kRedLD + 1) * 4;
  static constexpr size_t kBytes = kPipeBytes > kEpiBytes ? kPipeBytes : kEpiBytes;
};

template <typename T, int MT>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_qkv_fused_kernel(const T* __restrict__ x,     // [T, H]
                             const T* __restrict__ nw,    // [H]
                             const T* __restrict__ w,     // [N, H]
                             const T* __restrict__ bias,  // [N] or nullptr
                             T* __restrict__ out,         // [T, N]
                             int n_tokens, int hidden, int n_out, float eps, bool vec_store) {
  using S = Smem<MT>;
  constexpr int R = S::kRowsX;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  __shared__ float s_inv[R];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c4 = lane & 3;
  const int n0 = blockIdx.x * kRowsW;
  const int n_chunks = static_cast<int>(ceil_div(hidden, kKC));

  auto load_stage = [&](int s, int chunk) {
    T* sx = smem + s * S::kStageElems;
    T* sw = sx + S::kXElems;
    T* snw = sw + S::kWElems;
    const int k0 = chunk * kKC;
    for (int c = tid; c < R * 16; c += kThreads) {
      const int r = c >> 4, k = k0 + (c & 15) * 8;
      const bool ok = r < n_tokens && k < hidden;
      cp_async16(sx + r * kLD + (c & 15) * 8, ok ? x + static_cast<int64_t>(r) * hidden + k : x, ok);
    }
    for (int c = tid; c < kRowsW * 16; c += kThreads) {
      const int r = c >> 4, k = k0 + (c & 15) * 8, n = n0 + r;
      const bool ok = n < n_out && k < hidden;
      cp_async16(sw + r * kLD + (c & 15) * 8, ok ? w + static_cast<int64_t>(n) * hidden + k : w, ok);
    }
    if (tid < 16) {
      const int k = k0 + tid * 8;
      cp_async16(snw + tid * 8, k < hidden ? nw + k : nw, k < hidden);
    }
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_chunks) load_stage(s, s);
    cp_async_commit();
  }

  float acc[MT][4][4];
  float ss[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    ss[mt][0] = ss[mt][1] = 0.f;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
  }

  for (int chunk = 0; chunk < n_chunks; ++chunk) {
    const int pre = chunk + kStages - 1;
    if (pre < n_chunks) load_stage(pre % kStages, pre);
    cp_async_commit();
    cp_async_wait<kStages - 1>();  // the group of `chunk` has landed
    __syncthreads();

    const T* sx = smem + (chunk % kStages) * S::kStageElems;
    const T* sw = sx + S::kXElems;
    const T* snw = sw + S::kWElems;
    const int kcol = warp * 16;  // this warp's 16 columns of the chunk

    // B fragments of W rows [n0, n0+32) x 16 columns, times the norm weight of those columns.
    uint32_t b[2][4];
#pragma unroll
    for (int np = 0; np < 2; ++np)
      ldmatrix_x4(b[np], sw + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * kLD + kcol + ((lane >> 3) & 1) * 8);
    const uint32_t nw_lo = *reinterpret_cast<const uint32_t*>(snw + kcol + 2 * c4);
    const uint32_t nw_hi = *reinterpret_cast<const uint32_t*>(snw + kcol + 8 + 2 * c4);
#pragma unroll
    for (int np = 0; np < 2; ++np) {
      b[np][0] = mul2<T>(b[np][0], nw_lo);
      b[np][1] = mul2<T>(b[np][1], nw_hi);
      b[np][2] = mul2<T>(b[np][2], nw_lo);
      b[np][3] = mul2<T>(b[np][3], nw_hi);
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      uint32_t a[4];
      ldmatrix_x4(a, sx + (mt * 16 + (lane & 15)) * kLD + kcol + (lane >> 4) * 8);
      // Every element of x is in exactly one A fragment of one warp: accumulate the norms here.
      const float2 f0 = unpack2<T>(a[0]), f1 = unpack2<T>(a[1]), f2 = unpack2<T>(a[2]), f3 = unpack2<T>(a[3]);
      ss[mt][0] += f0.x * f0.x + f0.y * f0.y + f2.x * f2.x + f2.y * f2.y;
      ss[mt][1] += f1.x * f1.x + f1.y * f1.y + f3.x * f3.x + f3.y * f3.y;
      mma16816<T>(acc[mt][0], a, b[0][0], b[0][1]);
      mma16816<T>(acc[mt][1], a, b[0][2], b[0][3]);
      mma16816<T>(acc[mt][2], a, b[1][0], b[1][1]);
      mma16816<T>(acc[mt][3], a, b[1][2], b[1][3]);
    }
    __syncthreads();  // the stage is refilled by the next iteration
  }
  cp_async_wait<0>();
  __syncthreads();

  // Epilogue: add the 8 warps' partial sums in shared memory (reusing the pipeline buffers).
  float* red = reinterpret_cast<float*>(smem_raw);  // [8][R][kRedLD]
  float* ssr = red + 8 * R * S::kRedLD;             // [8][R]
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float v = ss[mt][h];
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      if (c4 == 0) ssr[warp * R + mt * 16 + g + 8 * h] = v;
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        red[(warp * R + mt * 16 + g + 8 * (e >> 1)) * S::kRedLD + nt * 8 + 2 * c4 + (e & 1)] = acc[mt][nt][e];
  }
  __syncthreads();
  if (tid < R) {
    float t = 0.f;
#pragma unroll
    for (int wi = 0; wi < 8; ++wi) t += ssr[wi * R + tid];
    s_inv[tid] = rsqrtf(t / static_cast<float>(hidden) + eps);
  }
  __syncthreads();
  for (int c = tid; c < R * (kRowsW / 8); c += kThreads) {
    const int r = c >> 2, cg = (c & 3) * 8;
    if (r >= n_tokens) continue;
    const int n = n0 + cg;
    if (n >= n_out) continue;
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float t = 0.f;
#pragma unroll
      for (int wi = 0; wi < 8; ++wi) t += red[(wi * R + r) * S::kRedLD + cg + e];
      v[e] = t * s_inv[r];
      if (bias != nullptr && n + e < n_out) v[e] += to_float(bias[n + e]);
    }
    T* dst = out + static_cast<int64_t>(r) * n_out + n;
    if (vec_store && n + 8 <= n_out) {
      uint4 o;
      T* oe = reinterpret_cast<T*>(&o);
#pragma unroll
      for (int e = 0; e < 8; ++e) oe[e] = from_float<T>(v[e]);
      *reinterpret_cast<uint4*>(dst) = o;
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e)
        if (n + e < n_out) dst[e] = from_float<T>(v[e]);
    }
  }
}

// Opt in to > 48 KiB of dynamic shared memory once per device.
template <typename T, int MT>
cudaError_t prepare() {
  constexpr int kMaxDevices = 64;
  static std::atomic<bool> done[kMaxDevices];
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev >= 0 && dev < kMaxDevices && done[dev].load(std::memory_order_relaxed)) return cudaSuccess;
  err = cudaFuncSetAttribute(rmsnorm_qkv_fused_kernel<T, MT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(Smem<MT>::kBytes));
  if (err == cudaSuccess && dev >= 0 && dev < kMaxDevices) done[dev].store(true, std::memory_order_relaxed);
  return err;
}

template <typename T, int MT>
cudaError_t launch(const void* x, const void* nw, const void* w, const void* bias, void* out, int64_t n_tokens,
                   int64_t hidden, int64_t n_out, float eps, cudaStream_t stream) {
  cudaError_t err = prepare<T, MT>();
  if (err != cudaSuccess) return err;
  const bool vec_store = n_out % 8 == 0 && aligned16(out);
  const unsigned blocks = static_cast<unsigned>(ceil_div(n_out, kRowsW));
  rmsnorm_qkv_fused_kernel<T, MT><<<blocks, kThreads, Smem<MT>::kBytes, stream>>>(
      static_cast<const T*>(x), static_cast<const T*>(nw), static_cast<const T*>(w), static_cast<const T*>(bias),
      static_cast<T*>(out), static_cast<int>(n_tokens), static_cast<int>(hidden), static_cast<int>(n_out), eps,
      vec_store);
  return cudaGetLastError();
}

template <typename T>
cudaError_t dispatch_tokens(const void* x, const void* nw, const void* w, const void* bias, void* out,
                            int64_t n_tokens, int64_t hidden, int64_t n_out, float eps, cudaStream_t stream) {
  if (n_tokens <= 16) return launch<T, 1>(x, nw, w, bias, out, n_tokens, hidden, n_out, eps, stream);
  if (n_tokens <= 32) return launch<T, 2>(x, nw, w, bias, out, n_tokens, hidden, n_out, eps, stream);
  return launch<T, 4>(x, nw, w, bias, out, n_tokens, hidden, n_out, eps, stream);
}

}  // namespace

bool rmsnorm_qkv_fused_supported(DType dtype, int64_t n_tokens, int64_t hidden, const void* x,
                                 const void* norm_weight, const void* qkv_weight) {
  return dtype != DType::kFloat32 && n_tokens >= 1 && n_tokens <= kRmsnormQkvFusedMaxTokens && hidden >= 8 &&
         hidden % 8 == 0 && hidden <= 0x7fffffff && aligned16(x) && aligned16(norm_weight) &&
         aligned16(qkv_weight);
}

cudaError_t rmsnorm_qkv_fused(DType dtype, const void* x, const void* norm_weight, const void* qkv_weight,
                              const void* qkv_bias, void* out, int64_t n_tokens, int64_t hidden, int64_t n_out,
                              float eps, cudaStream_t stream) {
  if (!rmsnorm_qkv_fused_supported(dtype, n_tokens, hidden, x, norm_weight, qkv_weight) || n_out < 0 ||
      n_out > 0x7fffffff)
    return cudaErrorInvalidValue;
  if (n_out == 0) return cudaSuccess;
  if (dtype == DType::kFloat16)
    return dispatch_tokens<__half>(x, norm_weight, qkv_weight, qkv_bias, out, n_tokens, hidden, n_out, eps, stream);
  return dispatch_tokens<__nv_bfloat16>(x, norm_weight, qkv_weight, qkv_bias, out, n_tokens, hidden, n_out, eps,
                                        stream);
}

}  // namespace orca::kernels
