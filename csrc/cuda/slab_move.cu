// slab_move: slab compaction of the KV pools (semantics in launchers.h). The copies and their order
// are planned on the host by slab_move_plan.h; here they are enqueued on `stream` as device copies.
// Nothing is synchronised.
#include "cuda/common.cuh"
#include "cuda/slab_move_plan.h"

namespace orca::kernels {
namespace {

// The plan's copies as asynchronous device-to-device copies; keeps the first error.
struct DeviceCopier {
  cudaStream_t stream;
  cudaError_t err = cudaSuccess;

  bool copy_1d(char* dst, const char* src, size_t bytes) {
    err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
    return err == cudaSuccess;
  }
  bool copy_2d(char* dst, size_t dpitch, const char* src, size_t spitch, size_t width, size_t height) {
    err = cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, cudaMemcpyDeviceToDevice, stream);
    return err == cudaSuccess;
  }
};

}  // namespace

cudaError_t slab_move(void* pools, int64_t n_pools, int64_t n_slots, int64_t row_bytes, const int64_t* moves,
                      int64_t n_moves, void* scratch, size_t scratch_bytes, cudaStream_t stream) {
  DeviceCopier copier{stream};
  switch (slab_plan::slab_move(copier, static_cast<char*>(pools), n_pools, n_slots, row_bytes, moves, n_moves,
                               static_cast<char*>(scratch), scratch_bytes, detail::current_device_max_pitch())) {
    case slab_plan::SlabMoveStatus::kOk: return cudaSuccess;
    case slab_plan::SlabMoveStatus::kInvalidValue: return cudaErrorInvalidValue;
    case slab_plan::SlabMoveStatus::kCopyFailed: break;
  }
  return copier.err;
}

}  // namespace orca::kernels
