// Shared body of attention_mma_{bf16,fp16}.cu and attention_decode_{bf16,fp16}.cu: per-device
// one-time setup of each kernel (dynamic shared memory opt-in, occupancy) and the launch of its
// persistent blocks.
#pragma once
#include <atomic>

#include "cuda/attention/attention_mma.cuh"
#include "cuda/attention/attention_mma_launch.h"

namespace orca::kernels::attn {

// One call site per kernel instantiation, so each keeps its own per-device occupancy cache.
template <typename Kernel>
cudaError_t launch_persistent(Kernel kernel, size_t smem, std::atomic<int> (&blocks_per_sm)[64], const Params& p,
                              int64_t max_blocks, cudaStream_t stream) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const bool cached = dev >= 0 && dev < 64;
  int occ = cached ? blocks_per_sm[dev].load(std::memory_order_relaxed) : 0;  // 0 = not set up yet
  if (occ == 0) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, kThreads, smem);
    if (err != cudaSuccess) return err;
    if (occ < 1) occ = 1;
    if (cached) blocks_per_sm[dev].store(occ, std::memory_order_relaxed);
  }
  const int sms = detail::current_device_sm_count();
  int64_t blocks = static_cast<int64_t>(occ) * (sms > 0 ? sms : 1);
  if (blocks > max_blocks) blocks = max_blocks;
  if (blocks < 1) blocks = 1;
  kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t launch_mma_dim(const Params& p, int64_t max_blocks, cudaStream_t stream) {
  static std::atomic<int> blocks_per_sm[64];
  return launch_persistent(ragged_attention_mma_kernel<T, D>, Tile<T, D>::BYTES, blocks_per_sm, p, max_blocks,
                           stream);
}

template <typename T, int D, int STAGES>
cudaError_t launch_decode_dim(const Params& p, int64_t max_blocks, cudaStream_t stream) {
  static std::atomic<int> blocks_per_sm[64];
  return launch_persistent(ragged_attention_decode_kernel<T, D, STAGES>, DecodeTile<T, D, STAGES>::BYTES,
                           blocks_per_sm, p, max_blocks, stream);
}

template <typename T>
cudaError_t launch_mma_impl(const Params& p, int head_dim, int64_t max_blocks, cudaStream_t stream) {
  switch (head_dim) {
    case 64: return launch_mma_dim<T, 64>(p, max_blocks, stream);
    case 80: return launch_mma_dim<T, 80>(p, max_blocks, stream);
    case 96: return launch_mma_dim<T, 96>(p, max_blocks, stream);
    case 128: return launch_mma_dim<T, 128>(p, max_blocks, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T, int STAGES>
cudaError_t launch_decode_stages(const Params& p, int head_dim, int64_t max_blocks, cudaStream_t stream) {
  switch (head_dim) {
    case 64: return launch_decode_dim<T, 64, STAGES>(p, max_blocks, stream);
    case 80: return launch_decode_dim<T, 80, STAGES>(p, max_blocks, stream);
    case 96: return launch_decode_dim<T, 96, STAGES>(p, max_blocks, stream);
    case 128: return launch_decode_dim<T, 128, STAGES>(p, max_blocks, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t launch_decode_impl(const Params& p, int head_dim, int stages, int64_t max_blocks, cudaStream_t stream) {
  if (stages == 2) return launch_decode_stages<T, 2>(p, head_dim, max_blocks, stream);
  if (stages == 3) return launch_decode_stages<T, 3>(p, head_dim, max_blocks, stream);
  return cudaErrorInvalidValue;
}

}  // namespace orca::kernels::attn
