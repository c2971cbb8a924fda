// ragged_attention: causal attention over a flat batch of decodes, prefills and prefills over
// a cached prefix, in one call (semantics in cpu_kernels.h and docs/DESIGN.md section 4).
//
// Work decomposition: one work item = (request b, KV head g, tile of consecutive query rows).
// The item handles all R = Hq/Hkv query heads that share KV head g together, so every K/V row
// it touches is read once per group. Items are sorted longest-first and handed out
// dynamically, so a few long prefills and many short decodes balance over the threads.
// The per-item math is in attention_impl.h: row-major for a few query vectors (decodes),
// query-vectorized tiles for many (prefills), the tiles in 16-lane registers on the `avx512`
// float32 path (attention_tile_avx512.cpp).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention_impl.h"
#include "cpu_kernels.h"

namespace orca {
namespace cpu {
namespace {

constexpr int64_t kTileRows = 64;     // query vectors (rows x group heads) per work item
constexpr int64_t kMinTileRows = 12;  // below this many, the row-major path is faster
constexpr float kLog2e = 1.4426950408889634f;

struct WorkItem {
  int64_t b;     // request
  int64_t g;     // KV head
  int64_t i0;    // first query row of the tile, relative to the request
  int64_t nq;    // query rows in the tile
  int64_t cost;  // nq * keys visited: the sort key
};

}  // namespace

template <typename T, typename I>
void ragged_attention(const T* q,         // [T, Hq, D]
                      const T* k_cache,   // [S, Hkv, D]
                      const T* v_cache,   // [S, Hkv, D]
                      const I* q_start,   // [B]
                      const I* q_len,     // [B]
                      const I* kv_start,  // [B]
                      const I* kv_len,    // [B]
                      T* out,             // [T, Hq, D]
                      int64_t n_requests, int64_t n_q_heads, int64_t n_kv_heads, int64_t head_dim,
                      float scale, bool batch_invariant) {
  if (n_requests <= 0 || n_q_heads <= 0 || n_kv_heads <= 0 || head_dim <= 0) return;
  const int64_t r = n_q_heads / n_kv_heads;
  const int64_t qt = std::max<int64_t>(1, kTileRows / r);  // query rows per item

  std::vector<WorkItem> items;
  int64_t total_cost = 0;
  for (int64_t b = 0; b < n_requests; ++b) {
    const int64_t ql = static_cast<int64_t>(q_len[b]);
    const int64_t ctx0 = static_cast<int64_t>(kv_len[b]) - ql;  // context before query row 0
    for (int64_t i0 = 0; i0 < ql; i0 += qt) {
      const int64_t nq = std::min(qt, ql - i0);
      const int64_t cost = nq * (ctx0 + i0 + nq);
      for (int64_t g = 0; g < n_kv_heads; ++g) items.push_back({b, g, i0, nq, cost});
      total_cost += cost * n_kv_heads;
    }
  }
  // Longest first: with a dynamic schedule the long prefill tiles start early and the many
  // short decode items fill the gaps at the end.
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });

  const float qscale = scale * kLog2e;
  // Prefill tiles follow the float32 path (same bits either way: attention_tile_avx512.cpp).
  const bool zmm_tiles = f32_path() == F32Path::kAvx512;
  const int64_t n_items = static_cast<int64_t>(items.size());
  // A handful of short decodes (cost ~ keys * D * R flops) is cheaper than a team wake-up.
  const bool parallel = n_items > 1 && total_cost * r * head_dim >= (int64_t{1} << 16);
#pragma omp parallel for schedule(dynamic, 1) if (parallel)
  for (int64_t n = 0; n < n_items; ++n) {
    const WorkItem& w = items[static_cast<size_t>(n)];
    const int64_t ql = static_cast<int64_t>(q_len[w.b]);
    detail::AttnItem it;
    it.t_first = static_cast<int64_t>(q_start[w.b]) + w.i0;
    it.nq = w.nq;
    it.r = r;
    it.g = w.g;
    it.first_last = static_cast<int64_t>(kv_len[w.b]) - ql + w.i0;
    it.kv_row0 = static_cast<int64_t>(kv_start[w.b]);
    it.n_keys = it.first_last + w.nq;
    if (w.nq * r >= kMinTileRows) {
      if (zmm_tiles)
        detail::attend_tile_avx512(it, q, k_cache, v_cache, out, n_q_heads, n_kv_heads, head_dim, qscale);
      else
        detail::attend_tile(it, q, k_cache, v_cache, out, n_q_heads, n_kv_heads, head_dim, qscale);
    } else if (batch_invariant) {  // the tile path's arithmetic, row-major (attention_impl.h)
      detail::attend_rows<T, true>(it, q, k_cache, v_cache, out, n_q_heads, n_kv_heads, head_dim, qscale);
    } else {
      detail::attend_rows<T, false>(it, q, k_cache, v_cache, out, n_q_heads, n_kv_heads, head_dim, qscale);
    }
  }
}

#define ORCA_INSTANTIATE_ATTENTION(T, I)                                                       \
  template void ragged_attention<T, I>(const T*, const T*, const T*, const I*, const I*,      \
                                       const I*, const I*, T*, int64_t, int64_t, int64_t,     \
                                       int64_t, float, bool);
ORCA_INSTANTIATE_ATTENTION(float, int32_t)
ORCA_INSTANTIATE_ATTENTION(float, int64_t)
ORCA_INSTANTIATE_ATTENTION(bf16, int32_t)
ORCA_INSTANTIATE_ATTENTION(bf16, int64_t)
#undef ORCA_INSTANTIATE_ATTENTION

}  // namespace cpu
}  // namespace orca
