// ragged_attention, part 1: the work list (the "plan"), built on the device by one small kernel
// so that a whole iteration runs as one attention launch with no host synchronisation
// (graph-capturable: every per-request value stays in device memory; every size the host needs
// is an upper bound computed from T, B and the head shapes).
//
// One plan serves every layer of a forward pass: all layers share the per-request indices, so
// the work list is built once and the attention kernels of all layers read it. To make that
// possible the attention kernel leaves the plan as it found it: the last block to finish resets
// the item counter, and the block that merges a request's splits resets that pair's counter.
//
// Packed GQA rows. For request b and KV head g, the "packed rows" are (query row i, head in the
// group j) flattened as r = i * G + j (G = Hq / Hkv), so one tile reads K/V of head g once for all
// G query heads. Two kinds of work items:
//   decode  (q_len * G <= 16): one 16-row tile, KV range split into chunks of `chunk` tokens
//           (flash-decoding); 4 warps split each 64-key tile; the block that finishes a request's
//           last split merges the partial results with a log-sum-exp combine.
//   prefill (q_len * G > 16):  tiles of `prefill_rows` packed rows, all keys up to the causal
//           limit of the tile. 128 rows (4 warps x 32 rows) for the shared kernel; 16 rows when
//           the decode kernel runs the iteration (see attention_mma.cuh), whose small shared
//           memory holds no 128-row tile.
// Batch-invariant mode (Params::batch_invariant, from RaggedAttentionTuning::batch_invariant)
// makes every request a prefill-kind item. The decode split size follows from the whole batch's
// decode work, and a decode tile merges its warps' partial results, so a row's arithmetic would
// depend on its batch-mates and on the size of the prompt chunk it sits in. A prefill tile
// computes each row over keys 0.. its own causal limit in fixed 64-key tiles, whatever other rows
// share the tile (a fully masked key tile changes no row's max, sum or output), so its result
// depends only on the request's own context.
// Item order: prefill tiles first (heaviest causal tile of each request first), then decode
// items; attention blocks take items in that order from an atomic counter (persistent blocks).
// The split size follows from the total decode work and the target of `items_per_sm` decode
// items per SM (a runtime knob: more items shorten the tail of the last wave, fewer items mean
// fewer partial results to merge).
#pragma once
#include "cuda/common.cuh"

namespace orca::kernels::attn {

using detail::ceil_div;

constexpr int kThreads = 128;       // 4 warps per attention block
constexpr int kPrefillRows = 128;   // packed rows per prefill tile
constexpr int kDecodeRows = 16;     // packed rows per decode tile
constexpr int kTileKeys = 64;       // keys per shared-memory K/V tile
constexpr int kMinChunk = 256;      // smallest KV split (keys); a multiple of kTileKeys
constexpr int kBuilderThreads = 1024;

// The control words at the start of the plan.
enum Ctrl : int {
  kCtrlItems = 0,     // number of work items
  kCtrlNext = 1,      // next-item counter of the persistent blocks (0 between launches)
  kCtrlChunk = 2,     // decode split size (keys)
  kCtrlZeroRows = 3,  // 1: some query rows are owned by no valid request and must be zeroed
  kCtrlDone = 4,      // blocks of the running attention launch that have finished (0 between launches)
  kCtrlWords = 8,
};

enum ItemKind : int { kItemPrefill = 0, kItemDecode = 1, kItemSkip = 2 };

// Plan layout (byte offsets, each 256-aligned). Computed identically for the size query, the
// plan kernel and the attention launch.
struct Layout {
  int64_t items_cap = 0;    // work items
  int64_t prow_cap = 0;     // partial-result rows of split decode items
  int64_t target_items = 0; // decode items wanted (chooses the split size)
  int prefill_rows = kPrefillRows;  // packed rows per prefill item
  size_t off_ctrl = 0, off_req = 0, off_sched = 0, off_items = 0, off_pair = 0, off_lse = 0, off_o = 0;
  size_t off_mark = 0;
  size_t total = 0;
};

inline size_t align256(size_t x) { return (x + 255) & ~size_t(255); }

// prefill_rows: kPrefillRows, or kDecodeRows when the decode kernel runs the iteration.
inline Layout make_layout(int64_t n_tokens, int64_t n_requests, int64_t n_q_heads, int64_t n_kv_heads,
                          int64_t head_dim, int num_sms, int items_per_sm, int prefill_rows) {
  Layout L;
  const int64_t G = n_q_heads / n_kv_heads;
  L.prefill_rows = prefill_rows;
  L.target_items = int64_t(items_per_sm) * (num_sms > 0 ? num_sms : 132);
  // Prefill tiles: sum_b ceil(q_len_b*G/rows) <= T*G/rows + B per KV head (rows are disjoint).
  const int64_t prefill = n_kv_heads * (ceil_div(n_tokens * G, prefill_rows) + n_requests);
  // Decode items: one per unsplit (request, KV head) pair, plus at most 2*target_items partials
  // (chunk >= W/target and every split pair has more than `chunk` keys).
  const int64_t decode = n_requests * n_kv_heads + 2 * L.target_items;
  L.items_cap = prefill + decode;
  // Partial rows: a split decode item of a one-token decode has G rows, so 2*target_items*G rows
  // hold every split of a pure-decode batch; requests that would not fit (several query rows
  // per decode item) run unsplit instead (see build_worklist_kernel).
  L.prow_cap = 2 * L.target_items * (G < kDecodeRows ? G : kDecodeRows);
  size_t off = 0;
  L.off_ctrl = off;  off = align256(off + kCtrlWords * sizeof(int));
  L.off_req = off;   off = align256(off + size_t(n_requests) * sizeof(int4));
  L.off_sched = off; off = align256(off + size_t(n_requests) * sizeof(int4));
  L.off_items = off; off = align256(off + size_t(L.items_cap) * sizeof(int4));
  L.off_pair = off;  off = align256(off + size_t(n_requests * n_kv_heads) * sizeof(int));
  L.off_lse = off;   off = align256(off + size_t(L.prow_cap) * sizeof(float));
  L.off_o = off;     off = align256(off + size_t(L.prow_cap * head_dim) * sizeof(float));
  L.off_mark = off;  off = align256(off + size_t(n_tokens));
  L.total = off;
  return L;
}

// Everything the plan and attention kernels read; pointers into the caller's tensors and the
// plan. The plan kernel sees no q, caches or out (null there).
struct Params {
  const void* q;        // [T, Hq, D]
  const void* k_cache;  // [S, Hkv, D]
  const void* v_cache;  // [S, Hkv, D]
  void* out;            // [T, Hq, D]
  int* ctrl;            // [kCtrlWords], see Ctrl
  int4* req;            // [B] {q_start, q_len, kv_start, kv_len}; q_len = 0 marks a skipped request
  int4* sched;          // [B] {prefill item base, decode item base, partial row base, splits}
  int4* items;          // [items_cap] {request, kv head, row0 (prefill) or split (decode), kind}
  int* pair_count;      // [B * Hkv] finished splits per (request, KV head)
  float* part_lse;      // [prow_cap] log2-sum-exp of each partial row
  float* part_o;        // [prow_cap, D] normalised partial outputs
  unsigned char* row_mark;  // [T] query rows owned by some valid request (set when kCtrlZeroRows)
  int64_t out_row_vecs; // 16-byte vectors per output row (Hq * D * sizeof(T) / 16)
  int64_t n_tokens, n_slots;
  int n_requests, n_q_heads, n_kv_heads, group;
  int items_cap;
  int prefill_rows;     // packed rows per prefill item (Layout::prefill_rows)
  int64_t prow_cap;
  float scale_log2;     // softmax scale * log2(e): scores live in the log2 domain
  int batch_invariant;  // 1: no decode-kind items (see the header comment)
};

// Whether a request of `rows` packed rows becomes a decode-kind item.
__device__ __forceinline__ bool decode_kind(long long rows, const Params& p) {
  return rows <= kDecodeRows && !p.batch_invariant;
}

// Exclusive prefix sum over the block (kBuilderThreads threads); returns the block total too.
__device__ __forceinline__ long long block_exclusive_scan(long long v, long long& total) {
  __shared__ long long s_warp[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  long long incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const long long n = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += n;
  }
  if (lane == 31) s_warp[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    long long w = lane < static_cast<int>(blockDim.x >> 5) ? s_warp[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const long long n = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += n;
    }
    s_warp[lane] = w;  // inclusive scan of warp totals
  }
  __syncthreads();
  const long long before = (warp > 0 ? s_warp[warp - 1] : 0) + incl - v;
  total = s_warp[(blockDim.x >> 5) - 1];
  __syncthreads();  // s_warp is reused by the next call
  return before;
}

__device__ __forceinline__ long long block_sum_ll(long long v) {
  long long total;
  block_exclusive_scan(v, total);
  return total;
}

// One block of kBuilderThreads threads. Validates every request (invalid ones are skipped, so
// the attention kernel can never index out of bounds), marks the query rows that no valid
// request owns, picks the decode split size from the total decode work, and writes the work
// list. It writes nothing the attention kernel writes (out stays untouched): the zeroing of
// unowned rows belongs to each attention launch, since every layer has its own output.
template <typename I>
__global__ void __launch_bounds__(kBuilderThreads)
    build_worklist_kernel(const I* __restrict__ q_start, const I* __restrict__ q_len,
                          const I* __restrict__ kv_start, const I* __restrict__ kv_len, Params p,
                          long long target_items) {
  const int tid = threadIdx.x;
  const int B = p.n_requests, G = p.group, Hkv = p.n_kv_heads;

  // Pass 1: validate, record, and sum the keys of decode-kind requests and the owned rows.
  long long decode_keys = 0, owned_rows = 0;
  for (int b = tid; b < B; b += blockDim.x) {
    const long long qs = static_cast<long long>(q_start[b]), ql = static_cast<long long>(q_len[b]);
    const long long ks = static_cast<long long>(kv_start[b]), kl = static_cast<long long>(kv_len[b]);
    const bool ok = ql >= 1 && kl >= ql && qs >= 0 && qs <= p.n_tokens - ql && ks >= 0 &&
                    ks <= p.n_slots - kl;
    p.req[b] = ok ? make_int4(static_cast<int>(qs), static_cast<int>(ql), static_cast<int>(ks),
                              static_cast<int>(kl))
                  : make_int4(0, 0, 0, 0);
    if (ok && decode_kind(ql * G, p)) decode_keys += kl;
    if (ok) owned_rows += ql;
  }
  const long long work = block_sum_ll(decode_keys) * Hkv;
  // Rows owned by no valid request must read as zero (the reference's convention). In an
  // engine iteration the requests tile all T rows and there is nothing to mark; otherwise mark
  // the owned rows for the attention kernels (assumes disjoint requests: overlapping ones are
  // invalid input).
  const bool zero_rows = block_sum_ll(owned_rows) != p.n_tokens;
  if (zero_rows) {
    for (long long t = tid; t < p.n_tokens; t += blockDim.x) p.row_mark[t] = 0;
    __syncthreads();
    const int lane = tid & 31, warp = tid >> 5, n_warps = blockDim.x >> 5;
    for (int b = warp; b < B; b += n_warps) {
      const int4 r = p.req[b];
      for (int i = lane; i < r.y; i += 32) p.row_mark[r.x + i] = 1;
    }
  }
  // chunk >= work / target_items bounds the partial results (see make_layout).
  long long chunk = ceil_div(ceil_div(work, target_items), kTileKeys) * kTileKeys;
  if (chunk < kMinChunk) chunk = kMinChunk;
  if (chunk > 0x40000000LL) chunk = 0x40000000LL;

  // Pass 2: per-request item counts -> bases (prefix sums over requests, in chunks of the block).
  long long carry_p = 0, carry_d = 0, carry_r = 0;
  for (int base = 0; base < B; base += blockDim.x) {
    const int b = base + tid;
    long long cnt_p = 0, cnt_d = 0, rows_part = 0, rows = 0;
    int splits = 0;
    if (b < B) {
      const int4 r = p.req[b];  // written by this same thread in pass 1
      if (r.y > 0) {
        rows = static_cast<long long>(r.y) * G;
        if (decode_kind(rows, p)) {
          splits = static_cast<int>(ceil_div(r.w, chunk));
          rows_part = splits > 1 ? static_cast<long long>(Hkv) * splits * rows : 0;
        } else {
          cnt_p = static_cast<long long>(Hkv) * ceil_div(rows, p.prefill_rows);
        }
      }
    }
    long long tot_p, tot_d, tot_r;
    const long long off_r = block_exclusive_scan(rows_part, tot_r);
    // Partial results that would overflow the buffer: run this request unsplit. Offsets only
    // grow, so the requests that keep their splits are a prefix and their offsets stay exact.
    if (rows_part > 0 && carry_r + off_r + rows_part > p.prow_cap) splits = 1;
    if (splits > 0) cnt_d = static_cast<long long>(Hkv) * splits;
    const long long off_p = block_exclusive_scan(cnt_p, tot_p);
    const long long off_d = block_exclusive_scan(cnt_d, tot_d);
    if (b < B) {
      auto clamp = [](long long v) { return static_cast<int>(v > 0x7fffffffLL ? 0x7fffffffLL : v); };
      p.sched[b] = make_int4(clamp(carry_p + off_p), clamp(carry_d + off_d), clamp(carry_r + off_r), splits);
    }
    carry_p += tot_p;
    carry_d += tot_d;
    carry_r += tot_r;
  }
  const long long total_p = carry_p;
  long long n_items = carry_p + carry_d;
  if (n_items > p.items_cap) n_items = p.items_cap;  // only possible with overlapping query rows

  for (long long i = tid; i < static_cast<long long>(B) * Hkv; i += blockDim.x) p.pair_count[i] = 0;
  __syncthreads();  // req/sched are read below by other threads

  // Emit: one warp per request, its lanes write the request's items.
  const int lane = tid & 31, warp = tid >> 5, n_warps = blockDim.x >> 5;
  for (int b = warp; b < B; b += n_warps) {
    const int4 r = p.req[b];
    if (r.y == 0) continue;
    const int4 s = p.sched[b];
    const long long rows = static_cast<long long>(r.y) * G;
    if (!decode_kind(rows, p)) {
      const long long n_tiles = ceil_div(rows, p.prefill_rows);
      const long long cnt = n_tiles * Hkv;
      for (long long j = lane; j < cnt; j += 32) {
        const long long idx = s.x + j;
        if (idx >= n_items) break;
        const int tile = static_cast<int>(n_tiles - 1 - j / Hkv);  // last (heaviest) tile first
        p.items[idx] = make_int4(b, static_cast<int>(j % Hkv), tile * p.prefill_rows, kItemPrefill);
      }
    } else {
      const int splits = s.w;
      const long long cnt = static_cast<long long>(splits) * Hkv;
      // The partial-row bound of make_layout makes this check redundant; it keeps the kernel
      // in bounds even if that reasoning were wrong.
      const bool fits = splits <= 1 || static_cast<long long>(s.z) + cnt * rows <= p.prow_cap;
      for (long long j = lane; j < cnt; j += 32) {
        const long long idx = total_p + s.y + j;
        if (idx >= n_items) break;
        p.items[idx] = make_int4(b, static_cast<int>(j / splits), static_cast<int>(j % splits),
                                 fits ? kItemDecode : kItemSkip);
      }
    }
  }
  if (tid == 0) {
    p.ctrl[kCtrlItems] = static_cast<int>(n_items);
    p.ctrl[kCtrlNext] = 0;
    p.ctrl[kCtrlChunk] = static_cast<int>(chunk);
    p.ctrl[kCtrlZeroRows] = zero_rows ? 1 : 0;
    p.ctrl[kCtrlDone] = 0;
  }
}

}  // namespace orca::kernels::attn
