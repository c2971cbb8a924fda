// Weight-only quantized projection for fp16 / bf16 activations on tensor cores, at every T:
//
//   out[t, n] = sum_k x[t, k] * deq(W)[n, k] (+ bias[n]) (+ residual[t, n]), float32 accumulation,
//   or silu(gate) * up of the rows n and I + n.
//
// Each block owns 32 weight rows (or 16 gate + 16 up rows) and one tile of 16 * MT tokens. Per
// K chunk (512 columns at decode, else 256; see Smem): x goes global -> shared by cp.async, the weight's quantized bytes are loaded
// into registers one chunk ahead (quant_blocks.cuh), dequantized to the activation type and stored
// into a shared tile, and the 8 warps run mma.sync m16n8k16 on it: warp w owns columns
// [32w, 32w + 32) of every 256-column slice (two k16 steps), the same split at every T. The 8 partial sums of
// an output are added in shared memory in warp order.
//
// Batch invariance: an output's arithmetic is fixed by K alone (the warp split, the sequence of
// k16 steps, the order of the final sum); T only picks MT (and with it the chunk size, which
// changes no step) and the number of token tiles, and an mma computes each row of its tile on its
// own. So a token's result is bit for bit the same at any T and in any batch, with no switch to
// another kernel at any size.
//
// Why one tensor-core kernel at every T rather than a CUDA-core GEMV for decode: a GEMV's float
// FMAs cannot reproduce the mma's rounding, so a switch between the two at some T would break
// batch invariance. At T = 1 the mma wastes 15 of its 16 rows, which costs nothing that matters:
// at decode the time goes to fetching and dequantizing the weight, not to the mma. Why not dequantize into a scratch and call cuBLAS for
// prefill: cuBLAS chooses its kernel (and reduction order) from the shape, i.e. from T, and the
// scratch would cost a write and a read of a bf16 copy of every weight.
#include <atomic>

#include "cuda/common.cuh"
#include "cuda/quant/quant_blocks.cuh"
#include "cuda/quant/quant_kernels.h"

namespace orca::kernels::quant {
namespace {

using namespace orca::kernels::detail;

constexpr int kThreads = 256;        // 8 warps
constexpr int kRowsW = 32;           // weight rows per block

// Per MT: the K chunk (columns per pipeline stage) and the shared tiles. Decode (MT = 1) takes
// 512-column chunks, twice the weight bytes in flight per thread and half the serial chunk steps;
// the larger token tiles take 256 to stay within shared memory. Within a chunk warp w always owns
// the columns 32w .. 32w + 31 of each 256-column slice, so both chunkings give every output the
// same sequence of k16 mma steps.
template <int MT>
struct Smem {
  static constexpr int kKC = MT == 1 ? 512 : 256;
  static constexpr int kLD = kKC + 8;  // padded shared row (elements): an odd multiple of 16 bytes, conflict-free ldmatrix
  static constexpr int kGroups = kRowsW * kKC / 8 / kThreads;  // 8-element weight groups per thread: 8 or 4
  static constexpr int kRowsX = 16 * MT;
  static constexpr int kXElems = kRowsX * kLD;
  static constexpr int kWElems = kRowsW * kLD;
  static constexpr int kRedLD = kRowsW + 4;
  static constexpr size_t kPipeBytes = size_t(2) * (kXElems + kWElems) * 2;  // two stages of x and W
  static constexpr size_t kEpiBytes = size_t(8) * kRowsX * kRedLD * 4;      // [8 warps][rows][cols]
  static constexpr size_t kBytes = kPipeBytes > kEpiBytes ? kPipeBytes : kEpiBytes;
};

__device__ __forceinline__ float silu(float v) { return v / (1.f + __expf(-v)); }

template <typename T, typename Fmt, int MT, Epilogue E>
__global__ void __launch_bounds__(kThreads)
    quant_linear_mma_kernel(const T* __restrict__ x,          // [T, K]
                            const uint8_t* __restrict__ w,    // [N_rows, row_bytes]
                            const T* __restrict__ bias,       // [N_rows] or nullptr
                            const T* __restrict__ residual,   // [T, N] or nullptr
                            T* __restrict__ out,              // [T, n_out]
                            int n_tokens, int k_dim, int n_out, int64_t row_bytes) {
  using S = Smem<MT>;
  constexpr int R = S::kRowsX, kKC = S::kKC, kLD = S::kLD, kGroupsPerThread = S::kGroups;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  T* sx_base = smem;                   // [2][R][kLD]
  T* sw_base = smem + 2 * S::kXElems;  // [2][kRowsW][kLD]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c4 = lane & 3;
  const int t0 = blockIdx.y * R;
  const int n_chunks = static_cast<int>(ceil_div(k_dim, kKC));
  // Outputs [o0, o0 + outs) of this block; weight row of tile row r (-1 when past the end).
  constexpr int kOuts = E == Epilogue::kSiluMul ? kRowsW / 2 : kRowsW;
  const int o0 = blockIdx.x * kOuts;
  auto weight_row = [&](int r) -> int64_t {
    if (E == Epilogue::kSiluMul) {
      const int o = o0 + (r & 15);
      return o < n_out ? (r < 16 ? o : int64_t(n_out) + o) : -1;
    }
    return o0 + r < n_out ? o0 + r : -1;
  };

  auto load_x = [&](int stage, int chunk) {
    T* sx = sx_base + stage * S::kXElems;
    const int k0 = chunk * kKC;
    for (int c = tid; c < R * (kKC / 8); c += kThreads) {
      const int r = c / (kKC / 8), col = (c % (kKC / 8)) * 8, t = t0 + r, k = k0 + col;
      const bool ok = t < n_tokens && k < k_dim;
      cp_async16(sx + r * kLD + col, ok ? x + static_cast<int64_t>(t) * k_dim + k : x, ok);
    }
  };

  // This thread's weight groups of a chunk: group i is row (tid + i * 256) / 32, columns 8 * (tid % 32).
  typename Fmt::Group grp[kGroupsPerThread];
  bool grp_ok[kGroupsPerThread];
  auto fetch_w = [&](int chunk) {
#pragma unroll
    for (int i = 0; i < kGroupsPerThread; ++i) {
      const int gi = tid + i * kThreads, r = gi / (kKC / 8), col = (gi % (kKC / 8)) * 8;
      const int64_t n = weight_row(r), k = int64_t(chunk) * kKC + col;
      grp_ok[i] = n >= 0 && k < k_dim;
      if (grp_ok[i]) grp[i] = Fmt::load(w + n * row_bytes, k);
    }
  };
  auto store_w = [&](int stage) {
    T* sw = sw_base + stage * S::kWElems;
#pragma unroll
    for (int i = 0; i < kGroupsPerThread; ++i) {
      const int gi = tid + i * kThreads, r = gi / (kKC / 8), col = (gi % (kKC / 8)) * 8;
      float v[8];
      if (grp_ok[i]) {
        Fmt::dequant(grp[i], v);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = 0.f;
      }
      uint4 packed;
      packed.x = pack2<T>(v[0], v[1]);
      packed.y = pack2<T>(v[2], v[3]);
      packed.z = pack2<T>(v[4], v[5]);
      packed.w = pack2<T>(v[6], v[7]);
      *reinterpret_cast<uint4*>(sw + r * kLD + col) = packed;
    }
  };

  float acc[MT][4][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;

  load_x(0, 0);
  cp_async_commit();
  fetch_w(0);
  store_w(0);
  for (int chunk = 0; chunk < n_chunks; ++chunk) {
    const int cur = chunk & 1, nxt = cur ^ 1;
    const bool more = chunk + 1 < n_chunks;
    if (more) {
      load_x(nxt, chunk + 1);
      fetch_w(chunk + 1);  // in flight during the mma below
    }
    cp_async_commit();
    cp_async_wait<1>();  // x of `chunk` has landed
    __syncthreads();     // and every thread's W of `chunk` is stored

    const T* sx = sx_base + cur * S::kXElems;
    const T* sw = sw_base + cur * S::kWElems;
#pragma unroll
    for (int step = 0; step < kKC / 128; ++step) {
      const int kcol = (step >> 1) * 256 + warp * 32 + (step & 1) * 16;
      // Steps wholly past K (K is a multiple of 32) are skipped, so that every chunking runs the
      // same steps; kcol grows with step, and the condition is uniform over the warp.
      if (chunk * kKC + kcol >= k_dim) break;
      uint32_t b[2][4];
#pragma unroll
      for (int np = 0; np < 2; ++np)
        ldmatrix_x4(b[np], sw + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * kLD + kcol + ((lane >> 3) & 1) * 8);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        uint32_t a[4];
        ldmatrix_x4(a, sx + (mt * 16 + (lane & 15)) * kLD + kcol + (lane >> 4) * 8);
        mma16816<T>(acc[mt][0], a, b[0][0], b[0][1]);
        mma16816<T>(acc[mt][1], a, b[0][2], b[0][3]);
        mma16816<T>(acc[mt][2], a, b[1][0], b[1][1]);
        mma16816<T>(acc[mt][3], a, b[1][2], b[1][3]);
      }
    }
    if (more) store_w(nxt);  // stage nxt was last read before the previous iteration's final barrier
    __syncthreads();         // stage cur is refilled by the next iteration
  }
  cp_async_wait<0>();
  __syncthreads();

  // Epilogue: the 8 warps' partial sums, added in warp order (reusing the pipeline buffers).
  float* red = reinterpret_cast<float*>(smem_raw);  // [8][R][kRedLD]
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        red[(warp * R + mt * 16 + g + 8 * (e >> 1)) * S::kRedLD + nt * 8 + 2 * c4 + (e & 1)] = acc[mt][nt][e];
  __syncthreads();
  auto total = [&](int r, int col) {
    float v = 0.f;
#pragma unroll
    for (int wi = 0; wi < 8; ++wi) v += red[(wi * R + r) * S::kRedLD + col];
    return v;
  };
  for (int c = tid; c < R * kOuts; c += kThreads) {
    const int r = c / kOuts, j = c % kOuts, t = t0 + r, o = o0 + j;
    if (t >= n_tokens || o >= n_out) continue;
    float v;
    if (E == Epilogue::kSiluMul) {
      float gate = total(r, j), up = total(r, j + 16);
      if (bias != nullptr) {
        gate += to_float(bias[o]);
        up += to_float(bias[int64_t(n_out) + o]);
      }
      v = silu(gate) * up;
    } else {
      v = total(r, j);
      if (bias != nullptr) v += to_float(bias[o]);
      if (residual != nullptr) v += to_float(residual[int64_t(t) * n_out + o]);
    }
    out[int64_t(t) * n_out + o] = from_float<T>(v);
  }
}

// Opt in to > 48 KiB of dynamic shared memory once per device and instantiation.
template <typename T, typename Fmt, int MT, Epilogue E>
cudaError_t prepare() {
  constexpr int kMaxDevices = 64;
  static std::atomic<bool> done[kMaxDevices];
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev >= 0 && dev < kMaxDevices && done[dev].load(std::memory_order_relaxed)) return cudaSuccess;
  err = cudaFuncSetAttribute(quant_linear_mma_kernel<T, Fmt, MT, E>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(Smem<MT>::kBytes));
  if (err == cudaSuccess && dev >= 0 && dev < kMaxDevices) done[dev].store(true, std::memory_order_relaxed);
  return err;
}

template <typename T, typename Fmt, int MT, Epilogue E>
cudaError_t launch(const LinearArgs& a, cudaStream_t stream) {
  cudaError_t err = prepare<T, Fmt, MT, E>();
  if (err != cudaSuccess) return err;
  constexpr int kOuts = E == Epilogue::kSiluMul ? kRowsW / 2 : kRowsW;
  const dim3 grid(static_cast<unsigned>(ceil_div(a.n_out, kOuts)), static_cast<unsigned>(ceil_div(a.n_tokens, 16 * MT)));
  const int64_t row_bytes = a.k / Fmt::kBlockElems * Fmt::kBlockBytes;
  quant_linear_mma_kernel<T, Fmt, MT, E><<<grid, kThreads, Smem<MT>::kBytes, stream>>>(
      static_cast<const T*>(a.x), a.w, static_cast<const T*>(a.bias), static_cast<const T*>(a.residual),
      static_cast<T*>(a.out), static_cast<int>(a.n_tokens), static_cast<int>(a.k), static_cast<int>(a.n_out),
      row_bytes);
  return cudaGetLastError();
}

// Token tile: 16 rows up to 16 tokens, 32 up to 32, then 64-row tiles (more tiles at large T).
template <typename T, typename Fmt, Epilogue E>
cudaError_t dispatch_tokens(const LinearArgs& a, cudaStream_t stream) {
  if (a.n_tokens <= 16) return launch<T, Fmt, 1, E>(a, stream);
  if (a.n_tokens <= 32) return launch<T, Fmt, 2, E>(a, stream);
  return launch<T, Fmt, 4, E>(a, stream);
}

template <typename T, typename Fmt>
cudaError_t dispatch_epilogue(const LinearArgs& a, cudaStream_t stream) {
  return a.epilogue == Epilogue::kSiluMul ? dispatch_tokens<T, Fmt, Epilogue::kSiluMul>(a, stream)
                                          : dispatch_tokens<T, Fmt, Epilogue::kLinear>(a, stream);
}

}  // namespace

cudaError_t linear_mma(DType dtype, int64_t qtype, const LinearArgs& a, cudaStream_t stream) {
  if (dtype == DType::kFloat32 || !aligned16(a.x) || a.k % 8 != 0) return cudaErrorInvalidValue;
  // The kernel's indices are int; grid.y (token tiles of up to 64) is at most 65535.
  if (ceil_div(a.n_tokens, 64) > 65535 || a.k > 0x7fffffff || a.n_out > 0x3fffffff) return cudaErrorInvalidValue;
  cudaError_t err = cudaErrorInvalidValue;
  const bool known = visit_format(qtype, [&](auto fmt) {
    using Fmt = decltype(fmt);
    err = dtype == DType::kFloat16 ? dispatch_epilogue<__half, Fmt>(a, stream)
                                   : dispatch_epilogue<__nv_bfloat16, Fmt>(a, stream);
  });
  return known ? err : cudaErrorInvalidValue;
}

}  // namespace orca::kernels::quant
