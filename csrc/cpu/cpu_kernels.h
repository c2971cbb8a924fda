// Raw-pointer CPU kernels (C++17, OpenMP). No torch headers: the torch glue in
// csrc/torch/cpu_ops.cpp and the microbenchmarks in bench/cpu/ both call these.
// All arrays are contiguous row-major. Semantics: docs/DESIGN.md section 4 (the kernel contract).
#pragma once
#include <cstdint>
#include <cstring>

namespace orca {

// bfloat16 stored as its upper 16 bits of a float32. Conversion to float is exact;
// conversion from float rounds to nearest even (NaN stays NaN).
struct bf16 {
  uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
template <typename T> inline T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
template <> inline bf16 from_float<bf16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return bf16{static_cast<uint16_t>((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

namespace cpu {

// out[T, H] = rms_norm(x) * weight, the norm computed in float32. Used on its own for the
// post-attention and final norms, and by the torch glue's large-T path of rmsnorm_qkv
// (normalise here, then one GEMM through ATen).
template <typename T>
void rms_norm(const T* x,       // [T, H]
              const T* weight,  // [H]
              T* out,           // [T, H]
              int64_t n_tokens, int64_t hidden, float eps);

// out[T, N] = linear(rms_norm(x) * norm_weight, qkv_weight, qkv_bias); N = Nq*D + 2*Nkv*D.
// The norm is computed in float32; accumulation is float32. norm_weight == nullptr skips the norm
// (out = x W^T + b, the plain linear layer of the batch-invariant mode).
// Batch invariance: every output element is one dot product over H accumulated in one fixed lane
// order, whichever micro-kernel (3x4, 2x4, 1x4, 3x1, 1x1 rows x columns) computes it and however
// the tokens are tiled, so a token's outputs do not depend on T or on the other rows.
template <typename T>
void rmsnorm_qkv(const T* x,            // [T, H]
                 const T* norm_weight,  // [H]
                 const T* qkv_weight,   // [N, H]
                 const T* qkv_bias,     // [N] or nullptr
                 T* out,                // [T, N]
                 int64_t n_tokens, int64_t hidden, int64_t n_out, float eps);

// k_cache[slots[t]] = k[t], v_cache[slots[t]] = v[t]. Index type I is int32_t or int64_t.
// The caller has checked 0 <= slots[t] < n_slots.
template <typename T, typename I>
void slab_write(T* k_cache,        // [S, Hkv, D]
                T* v_cache,        // [S, Hkv, D]
                const T* k,        // [T, Hkv, D]
                const T* v,        // [T, Hkv, D]
                const I* slots,    // [T]
                int64_t n_tokens, int64_t row_elems /* Hkv*D */);

// Ragged causal attention over a mixed batch (decodes, prefills, prefills over a cached prefix).
// Request b owns query rows q[q_start[b] .. q_start[b]+q_len[b]); they are the last q_len[b]
// positions of its kv_len[b]-token context at k_cache[kv_start[b] ..]. Row i attends to context
// positions 0 .. kv_len[b]-q_len[b]+i. Head h reads KV head h / (Hq/Hkv). Softmax in float32
// with a running max. The caller has validated every index.
// batch_invariant: every query row takes the query-vectorized tile path, whose arithmetic per
// row depends only on that row's own context, never on how many rows share its tile. Without
// it, a few rows (decodes, short prompt chunks) take the faster row-major path instead, so a
// prompt row's result can change with the chunk it was computed in.
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
                      float scale, bool batch_invariant);

// out[T, I] = silu(gate_up[:, :I]) * gate_up[:, I:] in float32, rounded once. Each row is
// computed whole by one thread, so every element's arithmetic depends only on its column (the
// batch-invariant replacement of ATen's silu, whose vector/scalar split points move with T).
template <typename T>
void silu_mul(const T* gate_up,  // [T, 2I]
              T* out,            // [T, I]
              int64_t n_tokens, int64_t n_inter);

// Slab compaction of the KV pools: for each move (src, dst, n), in the given order, rows
// [src, src+n) of every pool are copied to rows [dst, dst+n) as if through a temporary (the two
// ranges may overlap). Rows are opaque bytes, so every dtype shares this kernel. The caller has
// checked every range against the pool size.
void slab_move(void* pools,               // [P, S, row_bytes]
               int64_t n_pools, int64_t n_slots, int64_t row_bytes,
               const int64_t* moves,      // [M, 3] (src, dst, n)
               int64_t n_moves);

}  // namespace cpu
}  // namespace orca
