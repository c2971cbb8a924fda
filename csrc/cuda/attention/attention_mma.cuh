// ragged_attention, part 2: the tensor-core work items (mma.sync m16n8k16, fp16/bf16 in, float32
// accumulation and softmax). See attention_worklist.cuh for the packed-row scheme.
//
// Two kernels run a plan's work list (runtime choice, RaggedAttentionTuning::decode_stages):
//   ragged_attention_mma_kernel     the shared kernel: 128-row prefill tiles and decode items
//   ragged_attention_decode_kernel  16-row tiles only, 2 or 3 K/V stages (for decode iterations)
// Shared memory (element type T, rows padded by 8 elements so ldmatrix is conflict-free):
//   shared kernel:  sQ [128][D+8]  query tile (decode items use its first 16 rows)
//                   sK [2][64][D+8], sV [2][64][D+8] double-buffered K/V tiles (16-byte cp.async)
//   decode kernel:  sQ [16][D+8], sK [STAGES][64][D+8], sV [STAGES][64][D+8]
// Scores are kept in the log2 domain (scale * log2(e) folded in) and exponentiated with ex2.
#pragma once
#include "cuda/attention/attention_worklist.cuh"

namespace orca::kernels::attn {

using namespace detail;

template <typename T, int D>
struct Tile {
  static_assert(D % 16 == 0, "head_dim must be a multiple of 16 on the tensor-core path");
  static constexpr int LD = D + 8;                  // padded row (elements)
  static constexpr int CPR = D / 8;                 // 16-byte chunks per row
  static constexpr int Q_ELEMS = kPrefillRows * LD;
  static constexpr int KV_ELEMS = kTileKeys * LD;
  static constexpr size_t BYTES = size_t(Q_ELEMS + 4 * KV_ELEMS) * sizeof(T);
  // Decode cross-warp combine (aliases the K/V buffers after the key loop).
  static constexpr int OLD = D + 8;                 // float row stride
};

// Loads keys [pos0, pos0 + 64) of one KV head; positions >= pos_end are zero-filled (never read).
template <typename T, int D>
__device__ __forceinline__ void load_kv_tile(T* sk, T* sv, const T* kbase, const T* vbase, int64_t row_stride,
                                             int pos0, int pos_end) {
  using TL = Tile<T, D>;
  for (int c = threadIdx.x; c < kTileKeys * TL::CPR; c += kThreads) {
    const int r = c / TL::CPR, ch = c % TL::CPR;
    const int pos = pos0 + r;
    const bool ok = pos < pos_end;
    const int64_t off = (ok ? static_cast<int64_t>(pos) * row_stride : 0) + ch * 8;
    cp_async16(sk + r * TL::LD + ch * 8, kbase + off, ok);
    cp_async16(sv + r * TL::LD + ch * 8, vbase + off, ok);
  }
}

// Loads packed rows [row0, row0 + ROWS) of (request, KV head); rows >= n_rows are zero-filled.
template <typename T, int D, int ROWS>
__device__ __forceinline__ void load_q_tile(T* sq, const T* q, int q_start, int row0, int n_rows, int group,
                                            int n_q_heads, int kv_head) {
  using TL = Tile<T, D>;
  for (int c = threadIdx.x; c < ROWS * TL::CPR; c += kThreads) {
    const int r = c / TL::CPR, ch = c % TL::CPR;
    const int pr = row0 + r;
    const bool ok = pr < n_rows;
    const T* src = q;
    if (ok) {
      const int i = pr / group, h = kv_head * group + pr % group;
      src = q + (static_cast<int64_t>(q_start + i) * n_q_heads + h) * D + ch * 8;
    }
    cp_async16(sq + r * TL::LD + ch * 8, src, ok);
  }
}

// Output row of packed row `pr`.
template <int D>
__device__ __forceinline__ int64_t out_offset(int q_start, int pr, int group, int n_q_heads, int kv_head) {
  return (static_cast<int64_t>(q_start + pr / group) * n_q_heads + kv_head * group + pr % group) * D;
}

// Online-softmax update of one row held by a quad of lanes: `s` are this lane's scores of the
// row (already scaled, -inf when masked), m/l the running max and (lane-partial) sum. Returns the
// factor by which the row's output accumulator must be rescaled; `s` becomes the probabilities.
template <int N>
__device__ __forceinline__ float softmax_update(float (&s)[N], float& m, float& l) {
  float mx = s[0];
#pragma unroll
  for (int i = 1; i < N; ++i) mx = fmaxf(mx, s[i]);
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float m_new = fmaxf(m, mx);
  const float base = m_new == -INFINITY ? 0.f : m_new;  // fully masked so far: keep exp() finite
  const float alpha = fast_exp2(m - base);              // m = -inf -> 0
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    s[i] = fast_exp2(s[i] - base);
    sum += s[i];
  }
  l = l * alpha + sum;
  m = m_new;
  return alpha;
}

// ---- prefill item: 128 packed rows (4 warps x 32), keys [0, causal limit of the tile) ----------------
template <typename T, int D>
__device__ __forceinline__ void prefill_item(const Params& p, int4 req, int kv_head, int row0, T* smem) {
  using TL = Tile<T, D>;
  constexpr int KS = D / 16;  // k-steps over the head dim
  constexpr int NT = D / 8;   // n8 tiles of the output
  constexpr int KSUB = D > 64 ? 32 : 64;
  const int q_start = req.x, q_len = req.y, kv_start = req.z, kv_len = req.w;
  const int G = p.group, n_rows = q_len * G;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c4 = lane & 3;
  T* sQ = smem;
  T* sK = smem + TL::Q_ELEMS;
  T* sV = sK + 2 * TL::KV_ELEMS;

  const int diag = kv_len - q_len;  // query row i sees keys [0, diag + i]
  const int q_hi = min(q_len - 1, (row0 + kPrefillRows - 1) / G);
  const int kv_end = diag + q_hi + 1;
  const int n_tiles = static_cast<int>(ceil_div(kv_end, kTileKeys));

  const int wrow0 = row0 + warp * 32;  // this warp's first packed row
  const bool warp_active = wrow0 < n_rows;
  const int warp_lo = diag + min(q_len - 1, wrow0 / G);       // smallest causal limit of the warp
  const int warp_hi = diag + min(q_len - 1, (wrow0 + 31) / G);  // largest
  int limit[2][2];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) limit[mt][h] = diag + min(q_len - 1, (wrow0 + mt * 16 + g + 8 * h) / G);

  const int64_t row_stride = static_cast<int64_t>(p.n_kv_heads) * D;
  const T* kbase = static_cast<const T*>(p.k_cache) + (static_cast<int64_t>(kv_start) * p.n_kv_heads + kv_head) * D;
  const T* vbase = static_cast<const T*>(p.v_cache) + (static_cast<int64_t>(kv_start) * p.n_kv_heads + kv_head) * D;

  load_q_tile<T, D, kPrefillRows>(sQ, static_cast<const T*>(p.q), q_start, row0, n_rows, G, p.n_q_heads, kv_head);
  load_kv_tile<T, D>(sK, sV, kbase, vbase, row_stride, 0, kv_len);
  cp_async_commit();

  float o[2][NT][4];
  float m[2][2], l[2][2];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      m[mt][h] = -INFINITY;
      l[mt][h] = 0.f;
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][nt][e] = 0.f;
  }

  for (int j = 0; j < n_tiles; ++j) {
    if (j + 1 < n_tiles)
      load_kv_tile<T, D>(sK + ((j + 1) & 1) * TL::KV_ELEMS, sV + ((j + 1) & 1) * TL::KV_ELEMS, kbase, vbase,
                         row_stride, (j + 1) * kTileKeys, kv_len);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const T* cK = sK + (j & 1) * TL::KV_ELEMS;
    const T* cV = sV + (j & 1) * TL::KV_ELEMS;
    const int key0 = j * kTileKeys;
    // Keys are processed in sub-tiles of KSUB (32 for large head dims keeps the 32-row score
    // and output accumulators within 255 registers); sub-tiles past the warp's causal limit are
    // skipped.
#pragma unroll
    for (int sub = 0; sub < kTileKeys / KSUB; ++sub) {
      const int ks0 = key0 + sub * KSUB;
      if (!warp_active || ks0 > warp_hi) break;
      const T* sK_sub = cK + sub * KSUB * TL::LD;
      const T* sV_sub = cV + sub * KSUB * TL::LD;
      // S = Q K^T for 32 rows x KSUB keys.
      float s[2][KSUB / 8][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < KSUB / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) {
        uint32_t a[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
          ldmatrix_x4(a[mt], sQ + (warp * 32 + mt * 16 + (lane & 15)) * TL::LD + kk * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int np = 0; np < KSUB / 16; ++np) {
          uint32_t b[4];
          ldmatrix_x4(b, sK_sub + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * TL::LD + kk * 16 +
                             ((lane >> 3) & 1) * 8);
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            mma16816<T>(s[mt][2 * np], a[mt], b[0], b[1]);
            mma16816<T>(s[mt][2 * np + 1], a[mt], b[2], b[3]);
          }
        }
      }
      // Scale, causal mask (only on sub-tiles that cross the diagonal of some row of this warp).
      const bool need_mask = ks0 + KSUB - 1 > warp_lo;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < KSUB / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = ks0 + nt * 8 + 2 * c4 + (e & 1);
            const float v = s[mt][nt][e] * p.scale_log2;
            s[mt][nt][e] = (need_mask && key > limit[mt][e >> 1]) ? -INFINITY : v;
          }
      // Online softmax per row; rescale the output rows.
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float row[KSUB / 4];
#pragma unroll
          for (int nt = 0; nt < KSUB / 8; ++nt) {
            row[2 * nt] = s[mt][nt][2 * h];
            row[2 * nt + 1] = s[mt][nt][2 * h + 1];
          }
          const float alpha = softmax_update(row, m[mt][h], l[mt][h]);
#pragma unroll
          for (int nt = 0; nt < KSUB / 8; ++nt) {
            s[mt][nt][2 * h] = row[2 * nt];
            s[mt][nt][2 * h + 1] = row[2 * nt + 1];
          }
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            o[mt][nt][2 * h] *= alpha;
            o[mt][nt][2 * h + 1] *= alpha;
          }
        }
      // O += P V: P from the score registers (C layout == A layout), V via ldmatrix.trans.
#pragma unroll
      for (int kk = 0; kk < KSUB / 16; ++kk) {
        uint32_t a[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          a[mt][0] = pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
          a[mt][1] = pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
          a[mt][2] = pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
          a[mt][3] = pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, sV_sub + (kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3)) * TL::LD + dp * 16 +
                                   (lane >> 4) * 8);
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            mma16816<T>(o[mt][2 * dp], a[mt], b[0], b[1]);
            mma16816<T>(o[mt][2 * dp + 1], a[mt], b[2], b[3]);
          }
        }
      }
    }
    __syncthreads();  // this stage is refilled by the next iteration
  }
  cp_async_wait<0>();

  // Normalise, stage the warp's 32 rows in its own rows of sQ, write 16-byte vectors.
  if (warp_active) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float lt = l[mt][h];
        lt += __shfl_xor_sync(0xffffffffu, lt, 1);
        lt += __shfl_xor_sync(0xffffffffu, lt, 2);
        const float inv = lt > 0.f ? 1.f / lt : 0.f;
        T* dst = sQ + (warp * 32 + mt * 16 + g + 8 * h) * TL::LD + 2 * c4;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          *reinterpret_cast<uint32_t*>(dst + nt * 8) = pack2<T>(o[mt][nt][2 * h] * inv, o[mt][nt][2 * h + 1] * inv);
      }
    __syncwarp();
    T* out = static_cast<T*>(p.out);
    for (int c = lane; c < 32 * TL::CPR; c += 32) {
      const int r = c / TL::CPR, ch = c % TL::CPR;
      const int pr = wrow0 + r;
      if (pr >= n_rows) continue;
      *reinterpret_cast<uint4*>(out + out_offset<D>(q_start, pr, G, p.n_q_heads, kv_head) + ch * 8) =
          *reinterpret_cast<const uint4*>(sQ + (warp * 32 + r) * TL::LD + ch * 8);
    }
  }
  __syncthreads();  // sQ is reloaded by the next item
}

// ---- decode item: <= 16 packed rows, one KV split; 4 warps split each 64-key tile ------------------
// Q_ROWS: rows of the shared query buffer of the calling kernel (the shared kernel holds a
// 128-row tile; the decode kernel only 16). STAGES: K/V tiles in flight (cp.async pipeline).
// row0 > 0 only in the decode kernel, which runs prefill work as unsplit 16-row tiles: packed
// rows [row0, row0 + 16) over the keys up to the causal limit of the tile's last row.
// splits / part_row_base: the request's KV splits and first partial-result row (its sched entry).
template <typename T, int D, int Q_ROWS, int STAGES>
__device__ __forceinline__ void decode_item(const Params& p, int4 req, int b, int kv_head, int row0, int split,
                                            int splits, int part_row_base, T* smem) {
  using TL = Tile<T, D>;
  static_assert(Q_ROWS >= kDecodeRows && STAGES >= 2, "decode_item layout");
  static_assert(size_t(4) * kDecodeRows * (TL::OLD + 2) * 4 <= size_t(2) * STAGES * TL::KV_ELEMS * sizeof(T),
                "combine scratch");
  constexpr int KS = D / 16;
  constexpr int NT = D / 8;
  __shared__ int s_last;
  const int q_start = req.x, q_len = req.y, kv_start = req.z, kv_len = req.w;
  const int G = p.group, n_rows = q_len * G;
  const int tile_rows = min(kDecodeRows, n_rows - row0);  // rows of this item (a decode: all of them)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c4 = lane & 3;
  T* sQ = smem;
  T* sK = smem + Q_ROWS * TL::LD;
  T* sV = sK + STAGES * TL::KV_ELEMS;

  const int diag = kv_len - q_len;
  int kv_begin = 0, kv_end = min(kv_len, diag + min(q_len - 1, (row0 + kDecodeRows - 1) / G) + 1);
  if (splits > 1) {
    const int chunk = p.ctrl[kCtrlChunk];
    kv_begin = split * chunk;
    kv_end = min(kv_len, kv_begin + chunk);
  }
  const int n_tiles = static_cast<int>(ceil_div(kv_end - kv_begin, kTileKeys));
  int limit[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) limit[h] = diag + min(q_len - 1, (row0 + g + 8 * h) / G);

  const int64_t row_stride = static_cast<int64_t>(p.n_kv_heads) * D;
  const T* kbase = static_cast<const T*>(p.k_cache) + (static_cast<int64_t>(kv_start) * p.n_kv_heads + kv_head) * D;
  const T* vbase = static_cast<const T*>(p.v_cache) + (static_cast<int64_t>(kv_start) * p.n_kv_heads + kv_head) * D;

  // Pipeline prologue: the query tile and the first STAGES-1 K/V tiles, one commit group each.
  load_q_tile<T, D, kDecodeRows>(sQ, static_cast<const T*>(p.q), q_start, row0, n_rows, G, p.n_q_heads, kv_head);
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if (st < n_tiles)
      load_kv_tile<T, D>(sK + st * TL::KV_ELEMS, sV + st * TL::KV_ELEMS, kbase, vbase, row_stride,
                         kv_begin + st * kTileKeys, kv_end);
    cp_async_commit();
  }

  float o[NT][4];
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[nt][e] = 0.f;
  uint32_t qf[KS][4];

  for (int j = 0; j < n_tiles; ++j) {
    const int ahead = j + STAGES - 1;  // the tile to prefetch into the stage freed last iteration
    if (ahead < n_tiles)
      load_kv_tile<T, D>(sK + (ahead % STAGES) * TL::KV_ELEMS, sV + (ahead % STAGES) * TL::KV_ELEMS, kbase, vbase,
                         row_stride, kv_begin + ahead * kTileKeys, kv_end);
    cp_async_commit();
    cp_async_wait<STAGES - 1>();  // tile j (and the query tile) have landed
    __syncthreads();
    if (j == 0) {
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) ldmatrix_x4(qf[kk], sQ + (lane & 15) * TL::LD + kk * 16 + (lane >> 4) * 8);
    }
    const T* cK = sK + (j % STAGES) * TL::KV_ELEMS + warp * 16 * TL::LD;  // this warp's 16 keys
    const T* cV = sV + (j % STAGES) * TL::KV_ELEMS + warp * 16 * TL::LD;
    const int key0 = kv_begin + j * kTileKeys + warp * 16;
    if (key0 < kv_end) {
      float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) {
        uint32_t bk[4];
        ldmatrix_x4(bk, cK + ((lane & 7) + ((lane >> 4) << 3)) * TL::LD + kk * 16 + ((lane >> 3) & 1) * 8);
        mma16816<T>(s[0], qf[kk], bk[0], bk[1]);
        mma16816<T>(s[1], qf[kk], bk[2], bk[3]);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float row[4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int key = key0 + nt * 8 + 2 * c4 + e;
            const float v = s[nt][2 * h + e] * p.scale_log2;
            row[2 * nt + e] = (key >= kv_end || key > limit[h]) ? -INFINITY : v;
          }
        const float alpha = softmax_update(row, m[h], l[h]);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          s[nt][2 * h] = row[2 * nt];
          s[nt][2 * h + 1] = row[2 * nt + 1];
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          o[nt][2 * h] *= alpha;
          o[nt][2 * h + 1] *= alpha;
        }
      }
      uint32_t a[4];
      a[0] = pack2<T>(s[0][0], s[0][1]);
      a[1] = pack2<T>(s[0][2], s[0][3]);
      a[2] = pack2<T>(s[1][0], s[1][1]);
      a[3] = pack2<T>(s[1][2], s[1][3]);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, cV + ((lane & 7) + (((lane >> 3) & 1) << 3)) * TL::LD + dp * 16 + (lane >> 4) * 8);
        mma16816<T>(o[2 * dp], a, bv[0], bv[1]);
        mma16816<T>(o[2 * dp + 1], a, bv[2], bv[3]);
      }
    }
    __syncthreads();  // stage j % STAGES is refilled by the next iteration
  }
  cp_async_wait<0>();

  // Combine the 4 warps' partial softmax states in shared memory (over the K/V buffers).
  float* cm = reinterpret_cast<float*>(sK);       // [4][16] running max
  float* cl = cm + 4 * kDecodeRows;               // [4][16] sum
  float* co = cl + 4 * kDecodeRows;               // [4][16][OLD] unnormalised output
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float lt = l[h];
    lt += __shfl_xor_sync(0xffffffffu, lt, 1);
    lt += __shfl_xor_sync(0xffffffffu, lt, 2);
    if (c4 == 0) {
      cm[warp * kDecodeRows + g + 8 * h] = m[h];
      cl[warp * kDecodeRows + g + 8 * h] = lt;
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      *reinterpret_cast<float2*>(co + (warp * kDecodeRows + g + 8 * h) * TL::OLD + nt * 8 + 2 * c4) =
          make_float2(o[nt][2 * h], o[nt][2 * h + 1]);
  }
  __syncthreads();

  T* out = static_cast<T*>(p.out);
  const int part_row0 = part_row_base + (kv_head * splits + split) * tile_rows;  // used when splits > 1
  for (int c = threadIdx.x; c < tile_rows * TL::CPR; c += kThreads) {
    const int r = c / TL::CPR, ch = c % TL::CPR;
    float mw[4], M = -INFINITY;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      mw[w] = cm[w * kDecodeRows + r];
      M = fmaxf(M, mw[w]);
    }
    float L = 0.f, acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float e = mw[w] == -INFINITY ? 0.f : fast_exp2(mw[w] - M);
      L += e * cl[w * kDecodeRows + r];
      const float* src = co + (w * kDecodeRows + r) * TL::OLD + ch * 8;
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[k] += e * src[k];
    }
    const float inv = L > 0.f ? 1.f / L : 0.f;
    if (splits <= 1) {
      uint4 v;
      T* ve = reinterpret_cast<T*>(&v);
#pragma unroll
      for (int k = 0; k < 8; ++k) ve[k] = from_float<T>(acc[k] * inv);
      *reinterpret_cast<uint4*>(out + out_offset<D>(q_start, row0 + r, G, p.n_q_heads, kv_head) + ch * 8) = v;
    } else {
      float* dst = p.part_o + static_cast<int64_t>(part_row0 + r) * D + ch * 8;
      reinterpret_cast<float4*>(dst)[0] = make_float4(acc[0] * inv, acc[1] * inv, acc[2] * inv, acc[3] * inv);
      reinterpret_cast<float4*>(dst)[1] = make_float4(acc[4] * inv, acc[5] * inv, acc[6] * inv, acc[7] * inv);
      if (ch == 0) p.part_lse[part_row0 + r] = L > 0.f ? M + __log2f(L) : -INFINITY;
    }
  }

  if (splits > 1) {
    // The block finishing the last split of this (request, KV head) merges all splits (a split
    // item always has row0 = 0 and all n_rows = tile_rows rows).
    int* pair_count = p.pair_count + b * p.n_kv_heads + kv_head;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(pair_count, 1) == splits - 1;
    __syncthreads();
    if (s_last) {
      __threadfence();
      const int pair_row0 = part_row_base + kv_head * splits * tile_rows;
      for (int c = threadIdx.x; c < tile_rows * TL::CPR; c += kThreads) {
        const int r = c / TL::CPR, ch = c % TL::CPR;
        float M = -INFINITY;
        for (int s = 0; s < splits; ++s) M = fmaxf(M, __ldcg(p.part_lse + pair_row0 + s * tile_rows + r));
        float L = 0.f, acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int s = 0; s < splits; ++s) {
          const int prow = pair_row0 + s * tile_rows + r;
          const float lse = __ldcg(p.part_lse + prow);
          const float e = lse == -INFINITY ? 0.f : fast_exp2(lse - M);
          L += e;
          const float4* src = reinterpret_cast<const float4*>(p.part_o + static_cast<int64_t>(prow) * D + ch * 8);
          const float4 x0 = __ldcg(src), x1 = __ldcg(src + 1);
          acc[0] += e * x0.x; acc[1] += e * x0.y; acc[2] += e * x0.z; acc[3] += e * x0.w;
          acc[4] += e * x1.x; acc[5] += e * x1.y; acc[6] += e * x1.z; acc[7] += e * x1.w;
        }
        const float inv = L > 0.f ? 1.f / L : 0.f;
        uint4 v;
        T* ve = reinterpret_cast<T*>(&v);
#pragma unroll
        for (int k = 0; k < 8; ++k) ve[k] = from_float<T>(acc[k] * inv);
        *reinterpret_cast<uint4*>(out + out_offset<D>(q_start, r, G, p.n_q_heads, kv_head) + ch * 8) = v;
      }
      // Every split of the pair has counted: reset its counter so the plan serves the next layer.
      if (threadIdx.x == 0) *pair_count = 0;
    }
  }
  __syncthreads();  // shared buffers are reloaded by the next item
}

// ---- the persistent loop shared by both attention kernels -------------------------------------------
// Rows owned by no valid request are zeroed (only when the plan marked some: never in an engine
// iteration), then each block takes the next item from the counter until the list is exhausted;
// the next index is fetched while the current item runs. The last block to leave resets the
// counters, so the same plan serves the next launch (the next layer) as it is.
template <typename RunItem>
__device__ __forceinline__ void run_work_list(const Params& p, RunItem&& run_item) {
  __shared__ int s_next;
  if (p.ctrl[kCtrlZeroRows]) {
    uint4* out = static_cast<uint4*>(p.out);
    const int64_t n_vecs = p.n_tokens * p.out_row_vecs;
    for (int64_t v = int64_t(blockIdx.x) * kThreads + threadIdx.x; v < n_vecs; v += int64_t(gridDim.x) * kThreads)
      if (!p.row_mark[v / p.out_row_vecs]) out[v] = make_uint4(0, 0, 0, 0);
  }
  const int n_items = p.ctrl[kCtrlItems];
  if (threadIdx.x == 0) s_next = atomicAdd(p.ctrl + kCtrlNext, 1);
  __syncthreads();
  int idx = s_next;
  while (idx < n_items) {
    __syncthreads();  // every thread has read s_next
    if (threadIdx.x == 0) s_next = atomicAdd(p.ctrl + kCtrlNext, 1);
    run_item(p.items[idx]);
    __syncthreads();  // s_next is visible
    idx = s_next;
  }
  if (threadIdx.x == 0) {
    __threadfence();  // this block's last take from kCtrlNext happens before its count below
    if (atomicAdd(p.ctrl + kCtrlDone, 1) == static_cast<int>(gridDim.x) - 1) {
      atomicExch(p.ctrl + kCtrlNext, 0);
      atomicExch(p.ctrl + kCtrlDone, 0);
    }
  }
}

// The shared kernel: 128-row prefill tiles and decode items, 2 K/V stages.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2) ragged_attention_mma_kernel(Params p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  run_work_list(p, [&](int4 it) {
    const int4 req = p.req[it.x];
    if (it.w == kItemPrefill) {
      prefill_item<T, D>(p, req, it.y, it.z, smem);
    } else if (it.w == kItemDecode) {
      const int4 sched = p.sched[it.x];
      decode_item<T, D, kPrefillRows, 2>(p, req, it.x, it.y, 0, it.z, sched.w, sched.z, smem);
    }
  });
}

// ---- the decode kernel (runtime switch RaggedAttentionTuning::decode_stages) ------------------------
// Only the 16-row decode routine, with a 16-row query buffer and STAGES K/V tiles in flight: far
// less shared memory and fewer registers than the shared kernel (which reserves a 128-row query
// tile and the prefill registers), so more blocks fit on an SM and more bytes are in flight.
// Prefill work, if an iteration has any, arrives as 16-row tiles (the plan was built with
// prefill_rows = 16) and runs unsplit through the same routine: correct, but slower than the
// shared kernel's 128-row tiles, so this kernel is meant for decode-only iterations.
//
// Its __launch_bounds__ minimum of blocks per SM is what the shared memory lets fit on a Hopper SM
// (228 KiB, 1 KiB of it reserved per block, plus the kernel's few static bytes), at most 3: a
// promise of more blocks than fit would only cap the registers (65536 / (128 threads x 3 blocks)
// = 170 per thread) for no occupancy. At D = 128 and 3 stages a block takes
// (16 x 136 + 2 x 3 x 64 x 136) x 2 B = 108,800 B, so 2 blocks fit and the registers are not
// capped (2 blocks: 256 per thread, the hardware's 255). On an A100 (164 KiB per SM) the bound may
// name more blocks than fit, which caps nothing below 3.
template <typename T, int D, int STAGES>
struct DecodeTile {
  static constexpr size_t BYTES = size_t(kDecodeRows * Tile<T, D>::LD + 2 * STAGES * Tile<T, D>::KV_ELEMS) * sizeof(T);
  static constexpr size_t kSmemPerSm = 228 * 1024;     // sm_90
  static constexpr size_t kReservedPerBlock = 1024;    // the system's share of each block's shared memory
  static constexpr size_t kStaticBytes = 256;          // __shared__ variables (16 B today), rounded up
  static constexpr size_t kFit = kSmemPerSm / (BYTES + kReservedPerBlock + kStaticBytes);
  static constexpr int MIN_BLOCKS = kFit < 1 ? 1 : kFit > 3 ? 3 : static_cast<int>(kFit);
};
static_assert(DecodeTile<__nv_bfloat16, 128, 3>::BYTES == 108800 && DecodeTile<__nv_bfloat16, 128, 3>::MIN_BLOCKS == 2,
              "head_dim 128, 3 stages: 108,800 B of shared memory per block, 2 blocks per SM");
static_assert(DecodeTile<__nv_bfloat16, 128, 2>::MIN_BLOCKS == 3 && DecodeTile<__nv_bfloat16, 64, 3>::MIN_BLOCKS == 3,
              "73,984 B (D 128, 2 stages) and 57,600 B (D 64, 3 stages) leave room for 3 blocks");

template <typename T, int D, int STAGES>
__global__ void __launch_bounds__(kThreads, DecodeTile<T, D, STAGES>::MIN_BLOCKS)
    ragged_attention_decode_kernel(Params p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  run_work_list(p, [&](int4 it) {
    const int4 req = p.req[it.x];
    if (it.w == kItemPrefill) {
      decode_item<T, D, kDecodeRows, STAGES>(p, req, it.x, it.y, it.z, 0, 1, 0, smem);
    } else if (it.w == kItemDecode) {
      const int4 sched = p.sched[it.x];
      decode_item<T, D, kDecodeRows, STAGES>(p, req, it.x, it.y, 0, it.z, sched.w, sched.z, smem);
    }
  });
}

}  // namespace orca::kernels::attn
