// rmsnorm_qkv: out[T, N] = linear(rms_norm(x) * norm_weight, W[N, H], bias[N]).
//
// Plan: normalise x once into a float32 scratch xn[T, H]; then out = xn * W^T as a tiled
// product. Work items are (output-row tile, token tile) pairs:
//  * Small T (decodes): one token tile holds every token, so each thread streams its slice of
//    W exactly once and dots each weight row with all T normalised rows -- the op is bound by
//    reading W, and W is read once in total.
//  * Large T (prefills): token tiles of 96 rows (221 KB of xn at H=576) and 64-row weight
//    tiles keep both operands in L2 while the 3x4 register-blocked micro-kernel runs
//    (about 2/3 of the FMA peak on one Zen 4 core, see bench/cpu/bench_rmsnorm_qkv.cpp).
// bf16 weights are converted to float32 a tile at a time (once per tile per thread, reused
// across consecutive token tiles), so the micro-kernel always sees float32.
#include <algorithm>
#include <cstdint>

#include "cpu_kernels.h"
#include "gemm_impl.h"
#include "rms_norm_impl.h"
#include "vec.h"

namespace orca {
namespace cpu {
namespace {

constexpr int64_t kTokenTile = 96;       // multiple of 3 (micro-kernel rows)
constexpr int64_t kRowTileLarge = 64;    // output rows per tile when T is large
constexpr int64_t kRowTileDecode = 32;   // smaller tiles when there is one token tile: more items

template <typename T>
inline void write_tile(const float* __restrict c,  // [tb, nb]
                       const T* __restrict bias,   // [nb] or nullptr
                       T* __restrict out, int64_t ldo, int64_t tb, int64_t nb) {
  for (int64_t t = 0; t < tb; ++t) {
    const float* cr = c + t * nb;
    T* o = out + t * ldo;
    if (bias != nullptr) {
      for (int64_t n = 0; n < nb; ++n) o[n] = from_float<T>(cr[n] + to_float(bias[n]));
    } else {
      for (int64_t n = 0; n < nb; ++n) o[n] = from_float<T>(cr[n]);
    }
  }
}

// Rows [n0, n0+nb) of W as float32, with their leading dimension in *ld: the weight itself
// for float, a converted per-thread copy (64-byte aligned rows) for bf16.
inline const float* weight_tile(const float* w, int64_t n0, int64_t, int64_t hidden, int64_t*, int64_t* ld) {
  *ld = hidden;
  return w + n0 * hidden;
}
inline const float* weight_tile(const bf16* w, int64_t n0, int64_t nb, int64_t hidden,
                                int64_t* converted_n0, int64_t* ld) {
  *ld = detail::padded_ld(hidden);
  float* buf = detail::thread_scratch(1, static_cast<size_t>(nb * *ld));
  if (*converted_n0 != n0) {
    for (int64_t n = 0; n < nb; ++n) detail::load_row(w + (n0 + n) * hidden, buf + n * *ld, hidden);
    *converted_n0 = n0;
  }
  return buf;
}

}  // namespace

template <typename T>
void rmsnorm_qkv(const T* x,            // [T, H]
                 const T* norm_weight,  // [H]
                 const T* qkv_weight,   // [N, H]
                 const T* qkv_bias,     // [N] or nullptr
                 T* out,                // [T, N]
                 int64_t n_tokens, int64_t hidden, int64_t n_out, float eps) {
  if (n_tokens <= 0 || n_out <= 0) return;
  const int64_t ldx = detail::padded_ld(hidden);
  float* xn = detail::thread_scratch(0, static_cast<size_t>(n_tokens * ldx));  // [T, H], rows ldx apart

#pragma omp parallel for schedule(static) if (n_tokens > 1 && n_tokens * hidden >= (int64_t{1} << 15))
  for (int64_t t = 0; t < n_tokens; ++t) {
    if (norm_weight != nullptr) detail::rms_normalize_row(x + t * hidden, norm_weight, xn + t * ldx, hidden, eps);
    else detail::load_row(x + t * hidden, xn + t * ldx, hidden);
  }

  const int64_t token_tile = n_tokens <= kTokenTile ? n_tokens : kTokenTile;
  const int64_t t_tiles = (n_tokens + token_tile - 1) / token_tile;
  const int64_t row_tile = t_tiles == 1 ? kRowTileDecode : kRowTileLarge;
  const int64_t n_tiles = (n_out + row_tile - 1) / row_tile;
  const int64_t n_items = n_tiles * t_tiles;
  // Tiny products (a single decode token against a small head) are not worth a team wake-up.
  const bool parallel = n_items > 1 && n_tokens * n_out * hidden >= (int64_t{1} << 18);

#pragma omp parallel if (parallel)
  {
    int64_t converted_n0 = -1;  // bf16: which weight tile this thread's scratch holds
    float* c = detail::thread_scratch(2, static_cast<size_t>(token_tile * row_tile));
    // Items are ordered weight-tile-major and scheduled statically in contiguous chunks, so a
    // thread's consecutive items mostly share one weight tile.
#pragma omp for schedule(static)
    for (int64_t item = 0; item < n_items; ++item) {
      const int64_t n0 = (item / t_tiles) * row_tile;
      const int64_t t0 = (item % t_tiles) * token_tile;
      const int64_t nb = std::min(row_tile, n_out - n0);
      const int64_t tb = std::min(token_tile, n_tokens - t0);
      int64_t ldw = 0;
      const float* w = weight_tile(qkv_weight, n0, nb, hidden, &converted_n0, &ldw);
      detail::gemm_nt(xn + t0 * ldx, ldx, w, ldw, c, nb, tb, nb, hidden);
      write_tile(c, qkv_bias != nullptr ? qkv_bias + n0 : nullptr, out + t0 * n_out + n0, n_out, tb, nb);
    }
  }
}

template void rmsnorm_qkv<float>(const float*, const float*, const float*, const float*, float*,
                                 int64_t, int64_t, int64_t, float);
template void rmsnorm_qkv<bf16>(const bf16*, const bf16*, const bf16*, const bf16*, bf16*, int64_t,
                                int64_t, int64_t, float);

}  // namespace cpu
}  // namespace orca
