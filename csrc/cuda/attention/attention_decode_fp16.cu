// float16 instantiations of the decode attention kernel (head dims 64, 80, 96, 128; 2 and 3 K/V
// stages).
#include "cuda/attention/attention_mma_instantiate.cuh"

namespace orca::kernels::attn {

template <>
cudaError_t launch_decode<__half>(const Params& p, int head_dim, int stages, int64_t max_blocks,
                                  cudaStream_t stream) {
  return launch_decode_impl<__half>(p, head_dim, stages, max_blocks, stream);
}

}  // namespace orca::kernels::attn
