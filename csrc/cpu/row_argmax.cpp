// row_argmax: each row's maximum and the first column holding it (the greedy token of a row of
// logits). Two passes over a row: a vectorized max (a NaN only sets a flag, so it cannot hide in
// the max), then a search for the first column equal to it. Semantics: cpu_kernels.h.
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu_kernels.h"

namespace orca {
namespace cpu {

void row_argmax(const float* x,  // [R, V]
                int64_t n_rows, int64_t n_cols,
                int64_t* index,  // [R]
                float* value) {  // [R]
#pragma omp parallel for schedule(static) if (n_rows > 1 && n_rows * n_cols >= (int64_t{1} << 18))
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* row = x + r * n_cols;
    float mx = -std::numeric_limits<float>::infinity();
    int nan = 0;
#pragma omp simd reduction(max : mx) reduction(| : nan)
    for (int64_t c = 0; c < n_cols; ++c) {
      nan |= row[c] != row[c];
      mx = row[c] > mx ? row[c] : mx;
    }
    int64_t at = 0;
    if (nan) {
      while (row[at] == row[at]) ++at;
      mx = row[at];
    } else {
      while (row[at] != mx) ++at;  // found: mx is one of the row's values
    }
    index[r] = at;
    value[r] = mx;
  }
}

}  // namespace cpu
}  // namespace orca
