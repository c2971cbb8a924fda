// Shared body of attention_mma_{bf16,fp16}.cu: per-device one-time setup (dynamic shared memory
// opt-in, occupancy) and the launch of the persistent tensor-core kernel.
#pragma once
#include <atomic>

#include "cuda/attention/attention_mma.cuh"
#include "cuda/attention/attention_mma_launch.h"

namespace orca::kernels::attn {

template <typename T, int D>
cudaError_t launch_mma_dim(const Params& p, int64_t max_blocks, cudaStream_t stream) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> blocks_per_sm[kMaxDevices];  // 0 = not set up on that device yet
  const size_t smem = Tile<T, D>::BYTES;
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  int occ = (dev >= 0 && dev < kMaxDevices) ? blocks_per_sm[dev].load(std::memory_order_relaxed) : 0;
  if (occ == 0) {
    err = cudaFuncSetAttribute(ragged_attention_mma_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, ragged_attention_mma_kernel<T, D>, kThreads, smem);
    if (err != cudaSuccess) return err;
    if (occ < 1) occ = 1;
    if (dev >= 0 && dev < kMaxDevices) blocks_per_sm[dev].store(occ, std::memory_order_relaxed);
  }
  int sms = detail::current_device_sm_count();
  int64_t blocks = static_cast<int64_t>(occ) * (sms > 0 ? sms : 1);
  if (blocks > max_blocks) blocks = max_blocks;
  if (blocks < 1) blocks = 1;
  ragged_attention_mma_kernel<T, D><<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(p);
  return cudaGetLastError();
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

}  // namespace orca::kernels::attn
