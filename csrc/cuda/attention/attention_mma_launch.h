// Host-side launch of the tensor-core attention kernels, one definition per element type
// (attention_mma_{bf16,fp16}.cu: the shared kernel; attention_decode_{bf16,fp16}.cu: the decode
// kernel) so the heavy instantiations compile in parallel.
#pragma once
#include "cuda/attention/attention_worklist.cuh"

namespace orca::kernels::attn {

// Head dims with a tensor-core instantiation.
inline bool mma_head_dim_supported(int64_t d) { return d == 64 || d == 80 || d == 96 || d == 128; }

// K/V pipeline depths the decode kernel is instantiated for.
inline bool decode_stages_supported(int stages) { return stages == 2 || stages == 3; }

// Launches ragged_attention_mma_kernel<T, head_dim> with at most `max_blocks` persistent blocks.
template <typename T>
cudaError_t launch_mma(const Params& p, int head_dim, int64_t max_blocks, cudaStream_t stream);

// Launches ragged_attention_decode_kernel<T, head_dim, stages> (plan built with prefill_rows 16).
template <typename T>
cudaError_t launch_decode(const Params& p, int head_dim, int stages, int64_t max_blocks, cudaStream_t stream);

}  // namespace orca::kernels::attn
