// slab_move: slab compaction of the KV pools (semantics in cpu_kernels.h).
//
// In every pool the rows of one move are one contiguous byte range, so a move is one memmove per
// pool, which copies overlapping ranges correctly. Pools are independent of one another: threads
// split the pools, and each thread applies the moves to its pools in the given order, which is
// what makes a later move see the result of an earlier one.
#include <cstdint>
#include <cstring>

#include "cpu_kernels.h"

namespace orca {
namespace cpu {

void slab_move(void* pools,               // [P, S, row_bytes]
               int64_t n_pools, int64_t n_slots, int64_t row_bytes,
               const int64_t* moves,      // [M, 3] (src, dst, n)
               int64_t n_moves) {
  if (n_pools <= 0 || n_moves <= 0 || row_bytes <= 0) return;
  int64_t moved_rows = 0;
  for (int64_t m = 0; m < n_moves; ++m) moved_rows += moves[3 * m + 2];
  char* base = static_cast<char*>(pools);
  const int64_t pool_bytes = n_slots * row_bytes;
  // A few KB per pool is not worth waking the thread team.
#pragma omp parallel for schedule(static) if (n_pools > 1 && moved_rows * row_bytes >= (int64_t{1} << 16))
  for (int64_t p = 0; p < n_pools; ++p) {
    char* pool = base + p * pool_bytes;
    for (int64_t m = 0; m < n_moves; ++m) {
      const int64_t src = moves[3 * m], dst = moves[3 * m + 1], n = moves[3 * m + 2];
      if (n > 0 && src != dst) std::memmove(pool + dst * row_bytes, pool + src * row_bytes, static_cast<size_t>(n * row_bytes));
    }
  }
}

}  // namespace cpu
}  // namespace orca
