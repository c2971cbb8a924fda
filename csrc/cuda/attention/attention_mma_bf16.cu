// bfloat16 instantiations of the tensor-core ragged attention (head dims 64, 80, 96, 128).
#include "cuda/attention/attention_mma_instantiate.cuh"

namespace orca::kernels::attn {

template <>
cudaError_t launch_mma<__nv_bfloat16>(const Params& p, int head_dim, int64_t max_blocks, cudaStream_t stream) {
  return launch_mma_impl<__nv_bfloat16>(p, head_dim, max_blocks, stream);
}

}  // namespace orca::kernels::attn
