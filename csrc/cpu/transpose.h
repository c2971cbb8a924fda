// dst[c][r] = src[r][c]: a float32 block transposed, for attend_rows' batch-invariant path, which
// needs K^T (keys along the vector axis) for every key block of a decode. A scalar transpose
// was about half of that path's time; on x86-64-v3 full 8 x 8 tiles go through registers
// (8 loads, 24 shuffles, 8 stores) and only the edges stay scalar. Data only moves, so both
// ways give the same bits.
#pragma once
#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace orca {
namespace cpu {
namespace detail {
namespace {  // internal linkage: see gemm_impl.h

#if defined(__AVX2__)
// One 8 x 8 tile: src rows r0..r0+7 (lds apart) -> dst rows (ldd apart).
inline void transpose_tile8(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);      // a0 b0 a1 b1 | a4 b4 a5 b5
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);  // a2 b2 a3 b3 | a6 b6 a7 b7
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);      // a0 b0 c0 d0 | a4 b4 c4 d4
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);  // a1 b1 c1 d1 | a5 b5 c5 d5
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {  // low halves give columns 0-3, high halves columns 4-7
    _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}
#endif

// dst[c * ldd + r] = src[r * lds + c] for r < rows, c < cols.
inline void transpose(const float* __restrict src, int64_t lds, int64_t rows, int64_t cols, float* __restrict dst,
                      int64_t ldd) {
  int64_t scalar_from = 0;  // rows below this one are done
#if defined(__AVX2__)
  const int64_t rows8 = rows - rows % 8, cols8 = cols - cols % 8;
  for (int64_t r = 0; r < rows8; r += 8)
    for (int64_t c = 0; c < cols8; c += 8) transpose_tile8(src + r * lds + c, lds, dst + c * ldd + r, ldd);
  for (int64_t r = 0; r < rows8; ++r)  // the columns the tiles left out
    for (int64_t c = cols8; c < cols; ++c) dst[c * ldd + r] = src[r * lds + c];
  scalar_from = rows8;
#endif
  for (int64_t r = scalar_from; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * ldd + r] = src[r * lds + c];
}

}  // namespace
}  // namespace detail
}  // namespace cpu
}  // namespace orca
