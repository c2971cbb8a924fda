// stream_read: the streaming-read bandwidth probe that the CPU benchmarks print as their ceiling.
// Each thread reads its contiguous chunk as 8 interleaved forward streams (a panel of the linear
// kernels reads 8 weight rows at once; one stream per core measured ~1.5x below what several
// reach on the dev machine) and folds them into XOR lanes. Integer XOR reassociates, so the loop
// vectorizes to one load and one vpxor per 32 bytes and never waits on arithmetic.
#include <omp.h>

#include <cstdint>

#include "cpu_kernels.h"

namespace orca {
namespace cpu {
namespace {

constexpr int kStreams = 8;
constexpr int64_t kLaneWords = 8;  // 64 bytes per stream per step

uint64_t fold_streams(const uint64_t* __restrict p, int64_t n) {
  const int64_t len = n / kStreams / kLaneWords * kLaneWords;  // words per stream
  uint64_t lanes[kStreams][kLaneWords] = {};
  for (int64_t i = 0; i < len; i += kLaneWords)
    for (int s = 0; s < kStreams; ++s)
      for (int64_t l = 0; l < kLaneWords; ++l) lanes[s][l] ^= p[s * len + i + l];
  uint64_t r = 0;
  for (int s = 0; s < kStreams; ++s)
    for (int64_t l = 0; l < kLaneWords; ++l) r ^= lanes[s][l];
  for (int64_t i = kStreams * len; i < n; ++i) r ^= p[i];
  return r;
}

}  // namespace

uint64_t stream_read(const uint64_t* data,  // [n]
                     int64_t n_words) {
  uint64_t total = 0;
#pragma omp parallel reduction(^ : total) if (n_words >= (int64_t{1} << 16))
  {
    const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t begin = n_words * id / nt, end = n_words * (id + 1) / nt;
    total ^= fold_streams(data + begin, end - begin);
  }
  return total;
}

}  // namespace cpu
}  // namespace orca
