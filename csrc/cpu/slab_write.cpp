// slab_write: k_cache[slots[t]] = k[t], v_cache[slots[t]] = v[t]. Pure row copies; the rows
// of one token are contiguous ([Hkv, D]), so each is a single memcpy. Split over tokens when
// there is enough data to amortise waking the OpenMP team (a batch of decodes writes a few
// tens of KB and is faster on one thread).
#include <cstdint>
#include <cstring>

#include "cpu_kernels.h"

namespace orca {
namespace cpu {

template <typename T, typename I>
void slab_write(T* k_cache,        // [S, Hkv, D]
                T* v_cache,        // [S, Hkv, D]
                const T* k,        // [T, Hkv, D]
                const T* v,        // [T, Hkv, D]
                const I* slots,    // [T]
                int64_t n_tokens, int64_t row_elems /* Hkv*D */) {
  const size_t row_bytes = static_cast<size_t>(row_elems) * sizeof(T);
  const bool parallel = n_tokens > 1 && static_cast<size_t>(n_tokens) * row_bytes >= (size_t{1} << 18);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t t = 0; t < n_tokens; ++t) {
    const int64_t s = static_cast<int64_t>(slots[t]);
    std::memcpy(k_cache + s * row_elems, k + t * row_elems, row_bytes);
    std::memcpy(v_cache + s * row_elems, v + t * row_elems, row_bytes);
  }
}

template void slab_write<float, int32_t>(float*, float*, const float*, const float*, const int32_t*,
                                         int64_t, int64_t);
template void slab_write<float, int64_t>(float*, float*, const float*, const float*, const int64_t*,
                                         int64_t, int64_t);
template void slab_write<bf16, int32_t>(bf16*, bf16*, const bf16*, const bf16*, const int32_t*,
                                        int64_t, int64_t);
template void slab_write<bf16, int64_t>(bf16*, bf16*, const bf16*, const bf16*, const int64_t*,
                                        int64_t, int64_t);

}  // namespace cpu
}  // namespace orca
