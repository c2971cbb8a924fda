// ragged_attention: causal attention over a flat batch of decodes, prefills and prefills over
// a cached prefix, in one call (semantics in cpu_kernels.h and docs/DESIGN.md section 4).
//
// Work decomposition: one work item = (request b, KV head g, tile of consecutive query rows).
// The item handles all R = Hq/Hkv query heads that share KV head g together, so every K/V row
// it touches is read once per group. A decode is different: its work is a set of independent
// (64-key block, KV head) units, and an item is a run of blocks over every KV head, or one block
// of a few heads when there are fewer blocks than threads; a second pass merges each decode's
// blocks. Items are sorted longest-first and handed out dynamically, so a few long prefills and
// many short decodes balance over the threads.
// The per-item math is in attention_impl.h: row-major for a few query vectors, key blocks for
// decodes, query-vectorized tiles for many (prefills), the tiles and the batch-invariant decode
// blocks in 16-lane registers on the `avx512` float32 path (attention_tile_avx512.cpp). With
// batch_invariant, the rows and the decode blocks follow the tiles' order of operations, so a
// row's bits do not depend on the path.
#include <omp.h>

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
// Decode work items per thread: one long run of blocks each, since only the first block of an
// item starts without its rows hinted into cache (attend_decode_blocks); with 2 or 4 per thread
// a single stream's attention ran 1.0-1.15x slower (Zen 5, 256 and 1,024 keys).
constexpr int64_t kItemsPerThread = 1;

struct WorkItem {
  int64_t b;     // request
  int64_t g;     // KV head (decode items: the first of g1 - g)
  int64_t i0;    // first query row of the tile, relative to the request (decode items: first block)
  int64_t nq;    // query rows in the tile (decode items: 0)
  int64_t cost;  // query rows x keys visited, summed over the item's KV heads: the sort key
  int64_t g1;    // decode items: one past the last KV head
  int64_t blk1;  // decode items: one past the last block
  int64_t d;     // decode items: index into the decodes
};

// A decode cut into key blocks (attention_impl.h: attend_decode_blocks).
struct Decode {
  int64_t b;
  int64_t n_blocks;
  int64_t res_offset;  // floats into the block results
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
  const int64_t ldd = detail::padded_ld(head_dim);
  // Decodes in key blocks, whose bits do not depend on the grouping; in the batch-invariant mode
  // in the order that gives the tile path's bits (attention_impl.h).
  const bool block_decodes = r < kMinTileRows;

  std::vector<WorkItem> items;
  std::vector<Decode> decodes;
  int64_t total_cost = 0, decode_blocks = 0, res_floats = 0;
  for (int64_t b = 0; b < n_requests; ++b) {
    const int64_t ql = static_cast<int64_t>(q_len[b]);
    const int64_t ctx0 = static_cast<int64_t>(kv_len[b]) - ql;  // context before query row 0
    if (ql == 1 && block_decodes) {
      const int64_t n_blocks = (ctx0 + 1 + detail::kKeyBlock - 1) / detail::kKeyBlock;
      decodes.push_back({b, n_blocks, res_floats});
      res_floats += n_blocks * n_q_heads * (ldd + 2);
      decode_blocks += n_blocks;
      total_cost += (ctx0 + 1) * n_kv_heads;
      continue;
    }
    for (int64_t i0 = 0; i0 < ql; i0 += qt) {
      const int64_t nq = std::min(qt, ql - i0);
      const int64_t cost = nq * (ctx0 + i0 + nq);
      for (int64_t g = 0; g < n_kv_heads; ++g) items.push_back({b, g, i0, nq, cost, g + 1, 0, -1});
      total_cost += cost * n_kv_heads;
    }
  }
  // Decode items: runs of blocks over every KV head (contiguous slots), or single blocks of a
  // few heads when the decodes hold fewer blocks than the threads want items.
  if (!decodes.empty()) {
    const int64_t wanted = kItemsPerThread * omp_get_max_threads();
    const int64_t run = std::max<int64_t>(1, decode_blocks / wanted);
    const int64_t head_pieces =
        decode_blocks >= wanted ? 1 : std::min(n_kv_heads, (wanted + decode_blocks - 1) / decode_blocks);
    for (int64_t di = 0; di < static_cast<int64_t>(decodes.size()); ++di) {
      const Decode& dec = decodes[static_cast<size_t>(di)];
      const int64_t n_keys = static_cast<int64_t>(kv_len[dec.b]);
      for (int64_t blk = 0; blk < dec.n_blocks; blk += run) {
        const int64_t blk1 = std::min(dec.n_blocks, blk + run);
        const int64_t keys = std::min(n_keys, blk1 * detail::kKeyBlock) - blk * detail::kKeyBlock;
        for (int64_t p = 0; p < head_pieces; ++p) {
          const int64_t g0 = n_kv_heads * p / head_pieces, g1 = n_kv_heads * (p + 1) / head_pieces;
          items.push_back({dec.b, g0, blk, 0, keys * (g1 - g0), g1, blk1, di});
        }
      }
    }
  }
  // Longest first: with a dynamic schedule the long prefill tiles start early and the many
  // short decode items fill the gaps at the end.
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });

  const float qscale = scale * kLog2e;
  // Prefill tiles and decode blocks follow the float32 path (same bits either way:
  // attention_tile_avx512.cpp).
  const bool zmm = f32_path() == F32Path::kAvx512;
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t n_decodes = static_cast<int64_t>(decodes.size());
  // The decodes' block results, in the calling thread's buffer (slot 7: the items use 0-6):
  // Hq * (D + 2) floats per 64 keys of each decode, against the 128 * Hkv * D elements of K and V
  // those keys hold (2-6% of their bytes for GQA ratios 3-4, float32 or bf16 caches).
  float* res_base = n_decodes > 0 ? detail::thread_scratch(7, static_cast<size_t>(res_floats)) : nullptr;
  auto results = [&](const Decode& dec) {
    float* o = res_base + dec.res_offset;
    float* mx = o + dec.n_blocks * n_q_heads * ldd;
    return detail::DecodeBlocks{o, mx, mx + dec.n_blocks * n_q_heads, ldd};
  };
  // A handful of short decodes (cost ~ keys * D * R flops) is cheaper than a team wake-up.
  const bool parallel = n_items > 1 && total_cost * r * head_dim >= (int64_t{1} << 16);
#pragma omp parallel if (parallel)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t n = 0; n < n_items; ++n) {
      const WorkItem& w = items[static_cast<size_t>(n)];
      if (w.d >= 0) {
        const Decode& dec = decodes[static_cast<size_t>(w.d)];
        // The in-order blocks in zmm registers where the tiles are: their sums run in key order,
        // so the vector width changes no bit. The others' vector sums would.
        using DecodeFn = decltype(&detail::attend_decode_blocks_avx512<T>);
        const DecodeFn attend = !batch_invariant ? &detail::attend_decode_blocks<T, false>
                                : zmm            ? &detail::attend_decode_blocks_avx512<T>
                                                 : &detail::attend_decode_blocks<T, true>;
        attend(static_cast<int64_t>(q_start[w.b]), static_cast<int64_t>(kv_start[w.b]),
               static_cast<int64_t>(kv_len[w.b]), w.i0, w.blk1, w.g, w.g1, q, k_cache, v_cache, results(dec),
               n_q_heads, n_kv_heads, head_dim, qscale);
        continue;
      }
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
        if (zmm)
          detail::attend_tile_avx512(it, q, k_cache, v_cache, out, n_q_heads, n_kv_heads, head_dim, qscale);
        else
          detail::attend_tile(it, q, k_cache, v_cache, out, n_q_heads, n_kv_heads, head_dim, qscale);
      } else if (batch_invariant) {  // the tile path's arithmetic, row-major (attention_impl.h)
        detail::attend_rows<T, true>(it, q, k_cache, v_cache, out, n_q_heads, n_kv_heads, head_dim, qscale);
      } else {
        detail::attend_rows<T, false>(it, q, k_cache, v_cache, out, n_q_heads, n_kv_heads, head_dim, qscale);
      }
    }
    // Each decode's blocks, merged per KV head group (after the loop's barrier).
#pragma omp for schedule(static)
    for (int64_t u = 0; u < n_decodes * n_kv_heads; ++u) {
      const Decode& dec = decodes[static_cast<size_t>(u / n_kv_heads)];
      const int64_t g = u % n_kv_heads;
      detail::decode_merge(static_cast<int64_t>(q_start[dec.b]), dec.n_blocks, g * r, (g + 1) * r, results(dec), out,
                           n_q_heads, head_dim);
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
