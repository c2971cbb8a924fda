// The copy plan of slab_move (semantics in launchers.h): which device copies a slab compaction
// enqueues, in which order. Host code free of CUDA, so that it is tested without a GPU:
// slab_move.cu runs it with cudaMemcpy2DAsync / cudaMemcpyAsync, tests/test_slab_move_plan.py with
// memcpy and a small maximum pitch.
//
// In every pool the rows of one move are one contiguous byte range, and the P pools sit at a fixed
// pitch (one pool's bytes), so a move is one 2-D device copy (P rows of n*row_bytes bytes) when its
// source and destination do not overlap and the pitch is one the device accepts. Device copies
// must not overlap, so an overlapping move is split:
//  * through the caller's scratch buffer in chunks of C rows (two copies per chunk) when the
//    scratch holds more rows than the move shifts them by, or
//  * directly in pieces of `shift` rows, which never overlap one another: walking toward the
//    destination side, each piece only overwrites rows whose contents were already copied.
#pragma once

#include <cstddef>
#include <cstdint>

namespace orca::kernels::slab_plan {

// How `height` ranges of `width` bytes, `dpitch` / `spitch` bytes apart, are copied.
//   kTwoD:      one 2-D copy.
//   kRowByRow:  one 1-D copy per range (in slab_move a range is one pool's rows: pool by pool).
// cudaMemcpy2D* reject a pitch above the device's cudaDevAttrMaxPitch (2^31 - 1 bytes on current
// GPUs), and a KV pool passes 2 GiB easily (a Qwen3-0.6B-shaped model's 56 pools under a 90% memory
// budget on an H200 hold ~2.3 GB each), so a larger pitch is copied range by range. A single range
// needs no pitch at all. max_pitch 0 (unknown) always copies range by range.
enum class PitchedCopy { kTwoD, kRowByRow };

constexpr PitchedCopy choose_pitched_copy(size_t dpitch, size_t spitch, size_t height, size_t max_pitch) {
  return height > 1 && dpitch <= max_pitch && spitch <= max_pitch ? PitchedCopy::kTwoD : PitchedCopy::kRowByRow;
}

// Copier: bool copy_1d(char* dst, const char* src, size_t bytes) and
//         bool copy_2d(char* dst, size_t dpitch, const char* src, size_t spitch, size_t width, size_t height),
// each enqueueing one copy (false: it failed; the copier keeps the reason).
template <class Copier>
bool pitched_copy(Copier& copier, char* dst, size_t dpitch, const char* src, size_t spitch, size_t width,
                  size_t height, size_t max_pitch) {
  if (width == 0 || height == 0) return true;
  if (choose_pitched_copy(dpitch, spitch, height, max_pitch) == PitchedCopy::kTwoD)
    return copier.copy_2d(dst, dpitch, src, spitch, width, height);
  for (size_t r = 0; r < height; ++r)
    if (!copier.copy_1d(dst + r * dpitch, src + r * spitch, width)) return false;
  return true;
}

enum class SlabMoveStatus { kOk, kInvalidValue, kCopyFailed };

// The copies of slab_move over pools [P, S, row_bytes] at `pools`, in move order.
template <class Copier>
SlabMoveStatus slab_move(Copier& copier, char* pools, int64_t n_pools, int64_t n_slots, int64_t row_bytes,
                         const int64_t* moves,  // [M, 3] (src, dst, n)
                         int64_t n_moves, char* scratch, size_t scratch_bytes, size_t max_pitch) {
  if (n_pools < 0 || n_slots < 0 || row_bytes < 0 || n_moves < 0 || (n_moves > 0 && moves == nullptr))
    return SlabMoveStatus::kInvalidValue;
  if (n_pools == 0 || row_bytes == 0) return SlabMoveStatus::kOk;
  const size_t pitch = static_cast<size_t>(n_slots) * static_cast<size_t>(row_bytes);
  const size_t pools_n = static_cast<size_t>(n_pools);
  // Rows per pool the scratch holds, laid out [P, C, row_bytes].
  const int64_t chunk =
      scratch == nullptr ? 0 : static_cast<int64_t>(scratch_bytes / (pools_n * static_cast<size_t>(row_bytes)));
  const size_t chunk_pitch = static_cast<size_t>(chunk) * static_cast<size_t>(row_bytes);
  // Rows [src, src+len) -> [dst, dst+len) of every pool, the two ranges disjoint.
  auto copy_rows = [&](int64_t src, int64_t dst, int64_t len) {
    return pitched_copy(copier, pools + dst * row_bytes, pitch, pools + src * row_bytes, pitch,
                        static_cast<size_t>(len * row_bytes), pools_n, max_pitch);
  };
  for (int64_t m = 0; m < n_moves; ++m) {
    const int64_t src = moves[3 * m], dst = moves[3 * m + 1], n = moves[3 * m + 2];
    if (src < 0 || dst < 0 || n < 0 || src > n_slots - n || dst > n_slots - n) return SlabMoveStatus::kInvalidValue;
    if (n == 0 || src == dst) continue;
    const int64_t shift = src > dst ? src - dst : dst - src;
    bool ok = true;
    if (shift >= n) {
      ok = copy_rows(src, dst, n);
    } else if (chunk > shift) {
      // Staged: chunks in the order that reads every source row before it is overwritten.
      for (int64_t done = 0; done < n && ok; done += chunk) {
        const int64_t len = chunk < n - done ? chunk : n - done;
        const int64_t off = dst < src ? done : n - done - len;
        const size_t width = static_cast<size_t>(len * row_bytes);
        ok = pitched_copy(copier, scratch, chunk_pitch, pools + (src + off) * row_bytes, pitch, width, pools_n,
                          max_pitch) &&
             pitched_copy(copier, pools + (dst + off) * row_bytes, pitch, scratch, chunk_pitch, width, pools_n,
                          max_pitch);
      }
    } else {
      for (int64_t done = 0; done < n && ok; done += shift) {
        const int64_t len = shift < n - done ? shift : n - done;
        const int64_t off = dst < src ? done : n - done - len;
        ok = copy_rows(src + off, dst + off, len);
      }
    }
    if (!ok) return SlabMoveStatus::kCopyFailed;
  }
  return SlabMoveStatus::kOk;
}

}  // namespace orca::kernels::slab_plan
