// The ways ragged_attention processes one work item (request b, KV head g, a tile of
// consecutive query rows with all R = Hq/Hkv query heads of the group, or a run of a decode's
// key blocks). All are flash-attention style over 64-key blocks with softmax statistics in
// float32, in the log2 domain (queries are pre-scaled by scale*log2(e), so exp becomes exp2).
//
//  * attend_rows -- for few query vectors (short prompt chunks). S = Q K^T row-major, softmax
//    along each row, O += P V.
//  * attend_decode_blocks + decode_merge -- for decodes (one query row): every (block, KV head)
//    unit computes its own statistics and output, on whichever thread, and the blocks are merged
//    in key order afterwards.
//  * attend_tile -- for many query vectors (prefill tiles, M up to 64). Everything is kept
//    transposed so the vector axis is the query axis m: S^T = K Q^T, the softmax statistics
//    are per-lane vectors, O^T = V^T P^T. Both products are then "broadcast one element, FMA
//    a row of 32 queries" with no horizontal sums, which a dot product over a short D (64)
//    cannot avoid. The transposes happen once per item (Q in, O out), not per key block.
//
// Batch invariance: attend_tile's arithmetic for a query row is that row's own (its lane never
// mixes with another), so it does not depend on which rows share the tile, and it is written in
// block-local form: each key block gets its own max, sum and output, folded into the running
// state by merge_block in key order. attend_rows<T, true> and attend_decode_blocks<T, true>
// repeat that arithmetic operation for operation in row-major form (scores as FMA chains over d
// in order against K^T, sums added in key order; "the batch-invariant order" below), so a row
// gets the same bits on every path, and a decode's blocks can be spread over the threads as its
// batch allows. The <T, false> forms keep the faster dot-product scores and vector sums, whose
// rounding differs: without batch_invariant, a prompt row computed in a short chunk (row path)
// can differ in the last bits from the same row in a long one (tile path).
#pragma once
#include <algorithm>
#include <cstdint>
#include <limits>

#include "cpu_kernels.h"
#include "gemm_impl.h"
#include "transpose.h"
#include "vec.h"

namespace orca {
namespace cpu {
namespace detail {

// Geometry of one work item, in the request's own coordinates.
struct AttnItem {
  int64_t t_first;     // flat token index of the tile's first query row
  int64_t nq;          // query rows in the tile
  int64_t r;           // query heads per KV head
  int64_t g;           // KV head
  int64_t first_last;  // last visible key (context position) of the tile's first row
  int64_t kv_row0;     // slot of context position 0
  int64_t n_keys;      // keys visible to the tile's last row = first_last + nq
};

// attend_tile compiled for AVX-512 (attention_tile_avx512.cpp): the same arithmetic per lane
// with 16-lane registers, so it gives the same bits as the baseline attend_tile. Call it only
// where f32_path_supported(F32Path::kAvx512).
template <typename T>
void attend_tile_avx512(const AttnItem& it, const T* q, const T* k_cache, const T* v_cache, T* out,
                        int64_t n_q_heads, int64_t n_kv_heads, int64_t d, float qscale);

// A decode's per-block results: for block b and query head h, o[(b * Hq + h) * ldd + k] (the
// unnormalised output, rows 64-byte aligned), mx[b * Hq + h] (the block's max score, log2
// domain) and sum[b * Hq + h].
struct DecodeBlocks {
  float* o;
  float* mx;
  float* sum;
  int64_t ldd;
};

// attend_decode_blocks<T, true> (the batch-invariant order) compiled for AVX-512
// (attention_tile_avx512.cpp), with the zmm register block: the same bits as the baseline one.
// Call it only where f32_path_supported(F32Path::kAvx512).
template <typename T>
void attend_decode_blocks_avx512(int64_t t, int64_t kv_row0, int64_t n_keys, int64_t blk0, int64_t blk1, int64_t g0,
                                 int64_t g1, const T* q, const T* k_cache, const T* v_cache, const DecodeBlocks& res,
                                 int64_t n_q_heads, int64_t n_kv_heads, int64_t d, float qscale);

// The rest has internal linkage: the AVX-512 unit includes this header too, and its copies must
// never replace the baseline ones at link time (see gemm_impl.h).
namespace {

constexpr int64_t kKeyBlock = 64;  // keys per softmax block
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// attend_tile's initial running max: finite (unlike -inf) so the rescale factor of the first
// block needs no special case, and far below any real score.
constexpr float kTileInitMax = -1e30f;

// Rows [row0, row0+nj) of one KV head as float32 rows with leading dimension *ld: the cache
// itself for float, a converted copy (64-byte aligned rows) for bf16.
inline const float* kv_block(const float* cache, int64_t row0, int64_t, int64_t ld_cache, int64_t, float*,
                             int64_t* ld) {
  *ld = ld_cache;
  return cache + row0 * ld_cache;
}
inline const float* kv_block(const bf16* cache, int64_t row0, int64_t nj, int64_t ld_cache, int64_t d,
                             float* buf, int64_t* ld) {
  const int64_t ldb = padded_ld(d);
  for (int64_t j = 0; j < nj; ++j) load_row(cache + (row0 + j) * ld_cache, buf + j * ldb, d);
  *ld = ldb;
  return buf;
}

// Hint the next key block's K and V rows into cache while the current one is processed.
// Decodes are bound by streaming K/V from memory, and each KV head reads only D of every
// Hkv*D elements of a slot, a pattern the hardware prefetchers follow poorly.
template <typename T>
inline void prefetch_rows(const T* rows, int64_t n, int64_t ld, int64_t d) {
  const int64_t bytes = d * static_cast<int64_t>(sizeof(T));
  for (int64_t j = 0; j < n; ++j) {
    const char* p = reinterpret_cast<const char*>(rows + j * ld);
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
  }
}

// ---- few query vectors: row-major S ------------------------------------------------------

// The largest of s[0..n) (-inf for n = 0). Spelled as a comparison: GCC vectorizes this form of
// the max reduction, not std::max's. A maximum is exact, so the lanes' grouping gives the same
// value; only the sign of a zero maximum can differ, and every use subtracts it or compares it.
inline float block_max(const float* __restrict s, int64_t n) {
  float m = kNegInf;
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = m < s[j] ? s[j] : m;
  return m;
}

// s[j] = exp2(s[j] - m) for j < n (m >= every s[j]); returns their sum.
inline float exp2_shifted_sum(float* __restrict s, int64_t n, float m) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const float p = exp2_nonpos(s[j] - m);
    s[j] = p;
    sum += p;
  }
  return sum;
}

// Online-softmax update of one row for one key block. s[0..nj) holds scores (log2 domain);
// only the first `valid` are visible to this row (causal limit). On return s[0..nj) holds the
// unnormalised probabilities (0 beyond `valid`), and *mx, *l, o[0..D) are updated.
inline void softmax_row(float* __restrict s, int64_t nj, int64_t valid, float* __restrict mx,
                        float* __restrict l, float* __restrict o, int64_t d) {
  if (valid <= 0) {
    for (int64_t j = 0; j < nj; ++j) s[j] = 0.0f;
    return;
  }
  const float m_old = *mx;
  const float m_new = std::max(m_old, block_max(s, valid));
  const float sum = exp2_shifted_sum(s, valid, m_new);
  for (int64_t j = valid; j < nj; ++j) s[j] = 0.0f;
  if (m_old == kNegInf) {
    *l = sum;  // first block of this row: O is still zero
  } else if (m_new > m_old) {
    const float corr = exp2_nonpos(m_old - m_new);
    *l = *l * corr + sum;
    for (int64_t k = 0; k < d; ++k) o[k] *= corr;
  } else {
    *l += sum;
  }
  *mx = m_new;
}

// ---- the batch-invariant order: block-local statistics, merged in key order -------------
//
// In the batch-invariant mode every query row is computed with the same float32 operations on
// each path (attend_tile, attend_rows<T, true>, attend_decode_blocks<T, true> + decode_merge):
// per 64-key block, the scores as FMA chains over d; the block's own max over the visible keys;
// p = exp2(s - max); the block's sum of p added in key order; its unnormalised output as FMA
// chains over the keys in order; then merge_block folds the block into the running state. A
// block's results depend only on its keys, so a decode can compute its blocks on any threads
// and merge them afterwards with the bits a prefill tile gives the same row.

// For rows h < r of s (ld apart, n keys each, bmax[h] >= every score of row h):
// s[h][j] = exp2(s[h][j] - bmax[h]), and sum[h] = their sum, added in key order. Four rows'
// additions are interleaved: four chains of dependent additions overlap instead of running one
// after another.
inline void exp2_shifted_sums_in_order(float* __restrict s, int64_t ld, int64_t r, int64_t n,
                                       const float* __restrict bmax, float* __restrict sum) {
  for (int64_t h = 0; h < r; ++h)
    for (int64_t j = 0; j < n; ++j) s[h * ld + j] = exp2_nonpos(s[h * ld + j] - bmax[h]);
  int64_t h = 0;
  for (; h + 4 <= r; h += 4) {
    const float* s0 = s + h * ld;
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      a0 += s0[j];
      a1 += s0[ld + j];
      a2 += s0[2 * ld + j];
      a3 += s0[3 * ld + j];
    }
    sum[h] = a0;
    sum[h + 1] = a1;
    sum[h + 2] = a2;
    sum[h + 3] = a3;
  }
  for (; h < r; ++h) {
    float a = 0.0f;
    for (int64_t j = 0; j < n; ++j) a += s[h * ld + j];
    sum[h] = a;
  }
}

// One block folded into a row's running state (max *mx, sum *l, unnormalised output o[0..d)):
// both sides rescaled to the larger max. The products go straight into fmadd, so no contraction
// can round them differently on another path. The state starts as {kTileInitMax, 0, 0}; a block
// with no visible key (max -inf, sum 0, output 0) leaves it unchanged.
inline void merge_block(float* __restrict mx, float* __restrict l, float* __restrict o, float bmax, float bsum,
                        const float* __restrict ob, int64_t d) {
  const float m_new = std::max(*mx, bmax);
  const float a = exp2_nonpos(*mx - m_new), b = exp2_nonpos(bmax - m_new);
  *l = fmadd(*l, a, bsum * b);
  for (int64_t k = 0; k < d; ++k) o[k] = fmadd(o[k], a, ob[k] * b);
  *mx = m_new;
}

template <typename T, bool kInOrder>
void attend_rows(const AttnItem& it, const T* q, const T* k_cache, const T* v_cache, T* out, int64_t n_q_heads,
                 int64_t n_kv_heads, int64_t d, float qscale) {
  const int64_t r = it.r;
  const int64_t m_rows = it.nq * r;  // query vectors, m = i*r + h
  const int64_t ld_kv = n_kv_heads * d;
  // Scratch rows are padded to 64-byte multiples (ldd) so vector loads stay aligned.
  const int64_t ldd = padded_ld(d);
  float* qs = thread_scratch(0, static_cast<size_t>(m_rows * ldd));                         // [M, D]
  float* o = thread_scratch(1, static_cast<size_t>((kInOrder ? 2 : 1) * m_rows * ldd));     // [M, D]
  float* ob = o + m_rows * ldd;                                  // in order: one block's P V [M, D]
  float* stats = thread_scratch(2, static_cast<size_t>(4 * m_rows));
  float* s = thread_scratch(3, static_cast<size_t>(m_rows * kKeyBlock));   // [M, KB]
  float* kbuf = thread_scratch(4, static_cast<size_t>(kKeyBlock * ldd));   // bf16 only
  float* vbuf = thread_scratch(5, static_cast<size_t>(kKeyBlock * ldd));   // bf16 only
  float* kt = kInOrder ? thread_scratch(6, static_cast<size_t>(d * kKeyBlock)) : nullptr;  // [D, KB] K^T
  float* mx = stats;                 // running max
  float* lsum = stats + m_rows;      // running sum
  float* bmax = stats + 2 * m_rows;  // in order: the block's own max and sum
  float* bsum = stats + 3 * m_rows;

  // The r heads of one token are contiguous in q; head h of query row i is row i*r + h of qs.
  for (int64_t i = 0; i < it.nq; ++i) {
    const T* src = q + ((it.t_first + i) * n_q_heads + it.g * r) * d;
    for (int64_t h = 0; h < r; ++h) {
      const T* sh = src + h * d;
      float* dst = qs + (i * r + h) * ldd;
      for (int64_t k = 0; k < d; ++k) dst[k] = to_float(sh[k]) * qscale;
    }
  }
  for (int64_t k = 0; k < m_rows * ldd; ++k) o[k] = 0.0f;
  for (int64_t m = 0; m < m_rows; ++m) {
    mx[m] = kInOrder ? kTileInitMax : kNegInf;
    lsum[m] = 0.0f;
  }

  const T* k_head = k_cache + it.g * d;
  const T* v_head = v_cache + it.g * d;
  for (int64_t j0 = 0; j0 < it.n_keys; j0 += kKeyBlock) {
    const int64_t nj = std::min(kKeyBlock, it.n_keys - j0);
    if (j0 + nj < it.n_keys) {
      const int64_t next = std::min(kKeyBlock, it.n_keys - j0 - nj);
      prefetch_rows(k_head + (it.kv_row0 + j0 + nj) * ld_kv, next, ld_kv, d);
      prefetch_rows(v_head + (it.kv_row0 + j0 + nj) * ld_kv, next, ld_kv, d);
    }
    int64_t ldk = 0;
    const float* kb = kv_block(k_head, it.kv_row0 + j0, nj, ld_kv, d, kbuf, &ldk);
    if constexpr (kInOrder) {
      // S[m][j] = sum_d Q[m][d] K[j][d] as an FMA chain over d, vectorized over keys.
      transpose(kb, ldk, nj, d, kt, kKeyBlock);
      gemm_nn(qs, ldd, 1, kt, kKeyBlock, s, kKeyBlock, m_rows, d, nj);
    } else {
      gemm_nt(qs, ldd, kb, ldk, s, kKeyBlock, m_rows, nj, d);
    }
    for (int64_t m = 0; m < m_rows; ++m) {
      const int64_t last = it.first_last + m / r;  // last visible key of this row
      const int64_t valid = std::min(nj, last - j0 + 1);
      float* sm = s + m * kKeyBlock;
      if constexpr (kInOrder) {
        bmax[m] = valid > 0 ? block_max(sm, valid) : kNegInf;
        bsum[m] = 0.0f;
        if (valid > 0) exp2_shifted_sums_in_order(sm, kKeyBlock, 1, valid, bmax + m, bsum + m);
        for (int64_t j = std::max<int64_t>(valid, 0); j < nj; ++j) sm[j] = 0.0f;
      } else {
        softmax_row(sm, nj, valid, mx + m, lsum + m, o + m * ldd, d);
      }
    }
    int64_t ldv = 0;
    const float* vb = kv_block(v_head, it.kv_row0 + j0, nj, ld_kv, d, vbuf, &ldv);
    if constexpr (kInOrder) {
      gemm_nn(s, kKeyBlock, 1, vb, ldv, ob, ldd, m_rows, nj, d);
      for (int64_t m = 0; m < m_rows; ++m)
        if (bmax[m] != kNegInf) merge_block(mx + m, lsum + m, o + m * ldd, bmax[m], bsum[m], ob + m * ldd, d);
    } else {
      gemm_nn_acc(s, kKeyBlock, 1, vb, ldv, o, ldd, m_rows, nj, d);
    }
  }

  for (int64_t i = 0; i < it.nq; ++i) {
    T* dst = out + ((it.t_first + i) * n_q_heads + it.g * r) * d;
    for (int64_t h = 0; h < r; ++h) {
      const int64_t m = i * r + h;
      const float inv = 1.0f / lsum[m];  // lsum >= 1: the row's max element contributes 1
      const float* om = o + m * ldd;
      T* dm = dst + h * d;
      for (int64_t k = 0; k < d; ++k) dm[k] = from_float<T>(om[k] * inv);
    }
  }
}

// ---- decodes: independent key blocks, merged in key order ---------------------------------
//
// Without batch invariance, a decode (one query row, all Hq heads) is cut into its 64-key blocks,
// and every (block, KV head) unit computes its own softmax statistics: the block's max, the sum of
// exp2(s - max) and the unnormalised output P V. decode_merge then combines the blocks in key
// order. The arithmetic of a unit depends only on its keys, so a decode's bits depend only on its
// own context, never on how the units are grouped into work items (the thread count, the other
// requests): the grouping can follow the batch. One item covers a run of blocks and a range of KV
// heads, blocks outer, and streams the next block's K and V slots into L2 while it computes the
// current one, so only an item's first block waits on memory: few long items beat many short
// ones. (A decode's K and V come from memory: a forward streams every layer's weights between
// two reads of the same layer's cache.) The hints go to whole slots in address order, every
// KV head at once: a KV head reads only D of every Hkv * D elements of a slot, and hints that
// followed that pattern, 16 keys ahead of each head's products, left a Zen 4 reading K and V at
// 10-13 GB/s of its 35; whole slots reached 22-31 GB/s.

// Blocks [blk0, blk1) of the decode whose query row is q[t] and whose n_keys keys start at slot
// kv_row0, for KV heads [g0, g1). kInOrder: the batch-invariant order (scores as FMA chains over
// d against K^T, sums in key order), else dot-product scores and vector sums. Shape: the
// register block of the two products (gemm_impl.h), which never changes a result.
template <typename T, bool kInOrder, class Shape = NnYmm>
void attend_decode_blocks(int64_t t, int64_t kv_row0, int64_t n_keys, int64_t blk0, int64_t blk1, int64_t g0,
                          int64_t g1, const T* q, const T* k_cache, const T* v_cache, const DecodeBlocks& res,
                          int64_t n_q_heads, int64_t n_kv_heads, int64_t d, float qscale) {
  const int64_t r = n_q_heads / n_kv_heads;
  const int64_t ld_kv = n_kv_heads * d;
  const int64_t ldd = padded_ld(d);
  const int64_t h0 = g0 * r, nh = (g1 - g0) * r;  // the item's query heads
  // Keys per score step: gemm_nt's 4-key micro-kernels, or 16 columns of K^T.
  constexpr int64_t kStepKeys = kInOrder ? 16 : 4;
  // Each score step streams a share of the next block (below). The in-order path's 4 steps per
  // KV head are followed by its longest stretches of work without a hint (the softmax sums, V
  // and P V): three more shares go between them. With the hints only among the scores, a
  // Llama-shaped decode (32 query heads, 8 KV heads) read its cache from memory at 2,048 and
  // 8,192 keys 1.1-1.2x slower (Zen 4, bench/RESULTS.md).
  constexpr int64_t kExtraStreams = kInOrder ? 3 : 0;
  float* qs = thread_scratch(0, static_cast<size_t>(nh * ldd));            // [nh, D]
  float* s = thread_scratch(3, static_cast<size_t>(r * kKeyBlock));        // [r, KB]
  float* kbuf = thread_scratch(4, static_cast<size_t>(kKeyBlock * ldd));   // bf16 only
  float* vbuf = thread_scratch(5, static_cast<size_t>(kKeyBlock * ldd));   // bf16 only
  float* kt = kInOrder ? thread_scratch(6, static_cast<size_t>(d * kKeyBlock)) : nullptr;  // [D, KB] K^T
  for (int64_t h = 0; h < nh; ++h) {
    const T* src = q + (t * n_q_heads + h0 + h) * d;
    for (int64_t k = 0; k < d; ++k) qs[h * ldd + k] = to_float(src[k]) * qscale;
  }
  const int64_t keys_end = std::min(n_keys, blk1 * kKeyBlock);  // the item's last key + 1
  for (int64_t blk = blk0; blk < blk1; ++blk) {
    const int64_t j0 = blk * kKeyBlock, nj = std::min(kKeyBlock, n_keys - j0);
    // The next block's K and V slots, streamed into L2 over this block's score products. An item
    // of several blocks covers every KV head (ragged_attention), so they are two contiguous
    // ranges of slots, read in address order.
    PrefetchAhead next_k, next_v;
    if (j0 + nj < keys_end) {
      const int64_t bytes = std::min(kKeyBlock, keys_end - j0 - nj) * ld_kv * static_cast<int64_t>(sizeof(T));
      next_k = PrefetchAhead(k_cache + (kv_row0 + j0 + nj) * ld_kv, bytes);
      next_v = PrefetchAhead(v_cache + (kv_row0 + j0 + nj) * ld_kv, bytes);
      const int64_t steps = (g1 - g0) * ((nj + kStepKeys - 1) / kStepKeys + kExtraStreams);
      next_k.plan(steps);
      next_v.plan(steps);
    }
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t hq = g * r;  // the group's first query head
      const float* qg = qs + (hq - h0) * ldd;
      int64_t ldk = 0;
      const float* kb = kv_block(k_cache + g * d, kv_row0 + j0, nj, ld_kv, d, kbuf, &ldk);
      if constexpr (kInOrder) transpose(kb, ldk, nj, d, kt, kKeyBlock);
      // The scores a step of keys at a time (the same arithmetic per element as one call), each
      // step streaming a share of the next block.
      for (int64_t n = 0; n < nj; n += kStepKeys) {
        next_k.step();
        next_v.step();
        const int64_t nn = std::min(kStepKeys, nj - n);
        if constexpr (kInOrder) {
          gemm_nn<Shape>(qg, ldd, 1, kt + n, kKeyBlock, s + n, kKeyBlock, r, d, nn);
        } else {
          gemm_nt(qg, ldd, kb + n * ldk, ldk, s + n, kKeyBlock, r, nn, d);
        }
      }
      float* o = res.o + (blk * n_q_heads + hq) * ldd;
      float* bmax = res.mx + blk * n_q_heads + hq;
      float* bsum = res.sum + blk * n_q_heads + hq;
      for (int64_t h = 0; h < r; ++h) bmax[h] = block_max(s + h * kKeyBlock, nj);
      if constexpr (kInOrder) {
        exp2_shifted_sums_in_order(s, kKeyBlock, r, nj, bmax, bsum);
      } else {
        for (int64_t h = 0; h < r; ++h) bsum[h] = exp2_shifted_sum(s + h * kKeyBlock, nj, bmax[h]);
      }
      auto stream_extra = [&] {
        if constexpr (kExtraStreams > 0) {
          next_k.step();
          next_v.step();
        }
      };
      stream_extra();
      int64_t ldv = 0;
      const float* vb = kv_block(v_cache + g * d, kv_row0 + j0, nj, ld_kv, d, vbuf, &ldv);
      stream_extra();
      gemm_nn<Shape>(s, kKeyBlock, 1, vb, ldv, o, ldd, r, nj, d);
      stream_extra();
    }
  }
}

// out[t, h, :] for query heads [h0, h1) of a decode of n_blocks blocks: the blocks folded into
// the running state in key order (merge_block), then divided by the sum.
template <typename T>
void decode_merge(int64_t t, int64_t n_blocks, int64_t h0, int64_t h1, const DecodeBlocks& res, T* out,
                  int64_t n_q_heads, int64_t d) {
  float* acc = thread_scratch(1, static_cast<size_t>(d));
  for (int64_t h = h0; h < h1; ++h) {
    float mx = kTileInitMax, sum = 0.0f;
    for (int64_t k = 0; k < d; ++k) acc[k] = 0.0f;
    for (int64_t b = 0; b < n_blocks; ++b)
      merge_block(&mx, &sum, acc, res.mx[b * n_q_heads + h], res.sum[b * n_q_heads + h],
                  res.o + (b * n_q_heads + h) * res.ldd, d);
    const float inv = 1.0f / sum;  // sum >= 1: the block holding the max contributes 1
    T* dst = out + (t * n_q_heads + h) * d;
    for (int64_t k = 0; k < d; ++k) dst[k] = from_float<T>(acc[k] * inv);
  }
}

// ---- many query vectors: everything transposed, vectorized over queries ------------------

// Shape: gemm_nn_acc's register block for this unit's vector width (gemm_impl.h).
template <typename T, class Shape = NnYmm>
void attend_tile(const AttnItem& it, const T* q, const T* k_cache, const T* v_cache, T* out, int64_t n_q_heads,
                 int64_t n_kv_heads, int64_t d, float qscale) {
  const int64_t r = it.r;
  const int64_t m_rows = it.nq * r;             // query vectors, m = i*r + h
  const int64_t mp = padded_ld(m_rows);         // lanes, padded to 16
  const int64_t ld_kv = n_kv_heads * d;
  const int64_t ldd = padded_ld(d);
  float* qt = thread_scratch(0, static_cast<size_t>(d * mp));          // [D, Mp]  Q^T
  float* ot = thread_scratch(1, static_cast<size_t>(2 * d * mp));      // [D, Mp]  O^T
  float* obt = ot + d * mp;                                            // [D, Mp]  one block's (P V)^T
  float* st = thread_scratch(3, static_cast<size_t>(kKeyBlock * mp));  // [KB, Mp] S^T, then P^T
  float* kbuf = thread_scratch(4, static_cast<size_t>(kKeyBlock * ldd));
  float* vbuf = thread_scratch(5, static_cast<size_t>(kKeyBlock * ldd));
  float* stats = thread_scratch(2, static_cast<size_t>(6 * mp));
  float* mx = stats;               // running max
  float* lsum = stats + mp;        // running sum
  float* bmax = stats + 2 * mp;    // the block's own max and sum
  float* bsum = stats + 3 * mp;
  float* wa = stats + 4 * mp;      // merge weights of the running state and of the block
  float* wb = stats + 5 * mp;
  // Last visible key per lane (int32: the masks are integer compares, see keep_if).
  int32_t* last = thread_scratch<int32_t>(0, static_cast<size_t>(mp));

  // Q^T; padding lanes get zero queries (finite scores, results discarded) and the widest
  // causal limit so they never hit the all-masked case.
  for (int64_t k = 0; k < d * mp; ++k) qt[k] = 0.0f;
  for (int64_t m = 0; m < m_rows; ++m) {
    const T* src = q + ((it.t_first + m / r) * n_q_heads + it.g * r + m % r) * d;
    for (int64_t k = 0; k < d; ++k) qt[k * mp + m] = to_float(src[k]) * qscale;
  }
  for (int64_t k = 0; k < d * mp; ++k) ot[k] = 0.0f;
  for (int64_t m = 0; m < mp; ++m) {
    mx[m] = kTileInitMax;
    lsum[m] = 0.0f;
    last[m] = static_cast<int32_t>(it.first_last + std::min(m, m_rows - 1) / r);
  }

  const T* k_head = k_cache + it.g * d;
  const T* v_head = v_cache + it.g * d;
  const int64_t first_last = it.first_last;
  for (int64_t j0 = 0; j0 < it.n_keys; j0 += kKeyBlock) {
    const int64_t nj = std::min(kKeyBlock, it.n_keys - j0);
    int64_t ldk = 0;
    const float* kb = kv_block(k_head, it.kv_row0 + j0, nj, ld_kv, d, kbuf, &ldk);
    gemm_nn<Shape>(kb, ldk, 1, qt, mp, st, mp, nj, d, mp);  // S^T[j][m] = sum_d K[j][d] Q^T[d][m]

    // Keys past the first row's limit are masked for some lanes: only the diagonal blocks. The
    // block's statistics per lane (merge_block's order, see above), over its visible keys; a lane
    // that sees none has max -inf, and min(., 0) keeps its masked exponents finite.
    const bool masked = j0 + nj - 1 > first_last;
    for (int64_t m = 0; m < mp; ++m) {
      bmax[m] = kNegInf;
      bsum[m] = 0.0f;
    }
    for (int64_t j = 0; j < nj; ++j) {
      const float* sj = st + j * mp;
      const int32_t key = static_cast<int32_t>(j0 + j);
      if (masked) {
        for (int64_t m = 0; m < mp; ++m) bmax[m] = std::max(bmax[m], key <= last[m] ? sj[m] : kNegInf);
      } else {
        for (int64_t m = 0; m < mp; ++m) bmax[m] = std::max(bmax[m], sj[m]);
      }
    }
    for (int64_t j = 0; j < nj; ++j) {
      float* sj = st + j * mp;
      const int32_t key = static_cast<int32_t>(j0 + j);
      if (masked) {
        for (int64_t m = 0; m < mp; ++m)
          sj[m] = keep_if(exp2_nonpos(std::min(sj[m] - bmax[m], 0.0f)), key <= last[m]);
      } else {
        for (int64_t m = 0; m < mp; ++m) sj[m] = exp2_nonpos(sj[m] - bmax[m]);
      }
      for (int64_t m = 0; m < mp; ++m) bsum[m] += sj[m];
    }
    int64_t ldv = 0;
    const float* vb = kv_block(v_head, it.kv_row0 + j0, nj, ld_kv, d, vbuf, &ldv);
    gemm_nn<Shape>(vb, 1, ldv, st, mp, obt, mp, d, nj, mp);  // (P V)^T[d][m] = sum_j V[j][d] P^T[j][m]

    // merge_block, lane-wise.
    for (int64_t m = 0; m < mp; ++m) {
      const float m_new = std::max(mx[m], bmax[m]);
      wa[m] = exp2_nonpos(mx[m] - m_new);
      wb[m] = exp2_nonpos(bmax[m] - m_new);
      lsum[m] = fmadd(lsum[m], wa[m], bsum[m] * wb[m]);
      mx[m] = m_new;
    }
    for (int64_t k = 0; k < d; ++k) {
      float* ok = ot + k * mp;
      const float* bk = obt + k * mp;
      for (int64_t m = 0; m < mp; ++m) ok[m] = fmadd(ok[m], wa[m], bk[m] * wb[m]);
    }
  }

  for (int64_t m = 0; m < m_rows; ++m) lsum[m] = 1.0f / lsum[m];
  for (int64_t m = 0; m < m_rows; ++m) {
    T* dst = out + ((it.t_first + m / r) * n_q_heads + it.g * r + m % r) * d;
    for (int64_t k = 0; k < d; ++k) dst[k] = from_float<T>(ot[k * mp + m] * lsum[m]);
  }
}

}  // namespace
}  // namespace detail
}  // namespace cpu
}  // namespace orca
