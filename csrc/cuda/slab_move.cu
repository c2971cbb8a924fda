// slab_move: slab compaction of the KV pools (semantics in launchers.h).
//
// In every pool the rows of one move are one contiguous byte range, and the P pools sit at a fixed
// pitch, so a move is one 2-D device copy (P rows of n*row_bytes bytes) when its source and
// destination do not overlap. Device copies must not overlap, so an overlapping move is split:
//  * through the caller's scratch buffer in chunks of C rows (two copies per chunk) when the
//    scratch holds more rows than the move shifts them by, or
//  * directly in pieces of `shift` rows, which never overlap one another: walking toward the
//    destination side, each piece only overwrites rows whose contents were already copied.
// Everything is enqueued on `stream` in move order; nothing is synchronised.
#include "cuda/common.cuh"

namespace orca::kernels {
namespace {

// Rows [src, src+n) -> [dst, dst+n) of every pool, the two ranges disjoint.
cudaError_t copy_rows(char* pools, int64_t n_pools, size_t pitch, int64_t row_bytes, int64_t src, int64_t dst,
                      int64_t n, cudaStream_t stream) {
  return cudaMemcpy2DAsync(pools + dst * row_bytes, pitch, pools + src * row_bytes, pitch,
                           static_cast<size_t>(n * row_bytes), static_cast<size_t>(n_pools),
                           cudaMemcpyDeviceToDevice, stream);
}

}  // namespace

cudaError_t slab_move(void* pools, int64_t n_pools, int64_t n_slots, int64_t row_bytes, const int64_t* moves,
                      int64_t n_moves, void* scratch, size_t scratch_bytes, cudaStream_t stream) {
  if (n_pools < 0 || n_slots < 0 || row_bytes < 0 || n_moves < 0 || (n_moves > 0 && moves == nullptr))
    return cudaErrorInvalidValue;
  if (n_pools == 0 || row_bytes == 0) return cudaSuccess;
  char* base = static_cast<char*>(pools);
  const size_t pitch = static_cast<size_t>(n_slots * row_bytes);
  // Rows per pool the scratch holds, laid out [P, C, row_bytes].
  const int64_t chunk = scratch == nullptr ? 0 : static_cast<int64_t>(scratch_bytes / (size_t(n_pools) * row_bytes));
  const size_t chunk_pitch = static_cast<size_t>(chunk * row_bytes);
  for (int64_t m = 0; m < n_moves; ++m) {
    const int64_t src = moves[3 * m], dst = moves[3 * m + 1], n = moves[3 * m + 2];
    if (src < 0 || dst < 0 || n < 0 || src + n > n_slots || dst + n > n_slots) return cudaErrorInvalidValue;
    if (n == 0 || src == dst) continue;
    const int64_t shift = src > dst ? src - dst : dst - src;
    cudaError_t err = cudaSuccess;
    if (shift >= n) {
      err = copy_rows(base, n_pools, pitch, row_bytes, src, dst, n, stream);
    } else if (chunk > shift) {
      // Staged: chunks in the order that reads every source row before it is overwritten.
      for (int64_t done = 0; done < n && err == cudaSuccess; done += chunk) {
        const int64_t len = chunk < n - done ? chunk : n - done;
        const int64_t off = dst < src ? done : n - done - len;
        err = cudaMemcpy2DAsync(scratch, chunk_pitch, base + (src + off) * row_bytes, pitch,
                                static_cast<size_t>(len * row_bytes), static_cast<size_t>(n_pools),
                                cudaMemcpyDeviceToDevice, stream);
        if (err == cudaSuccess)
          err = cudaMemcpy2DAsync(base + (dst + off) * row_bytes, pitch, scratch, chunk_pitch,
                                  static_cast<size_t>(len * row_bytes), static_cast<size_t>(n_pools),
                                  cudaMemcpyDeviceToDevice, stream);
      }
    } else {
      for (int64_t done = 0; done < n && err == cudaSuccess; done += shift) {
        const int64_t len = shift < n - done ? shift : n - done;
        const int64_t off = dst < src ? done : n - done - len;
        err = copy_rows(base, n_pools, pitch, row_bytes, src + off, dst + off, len, stream);
      }
    }
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace orca::kernels
