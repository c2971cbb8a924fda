// Host-side launch of the tensor-core attention kernel, one definition per element type
// (attention_mma_bf16.cu, attention_mma_fp16.cu) so the heavy instantiations compile in parallel.
#pragma once
#include "cuda/attention/attention_worklist.cuh"

namespace orca::kernels::attn {

// Head dims with a tensor-core instantiation.
inline bool mma_head_dim_supported(int64_t d) { return d == 64 || d == 80 || d == 96 || d == 128; }

// Launches ragged_attention_mma_kernel<T, head_dim> with at most `max_blocks` persistent blocks.
template <typename T>
cudaError_t launch_mma(const Params& p, int head_dim, int64_t max_blocks, cudaStream_t stream);

}  // namespace orca::kernels::attn
