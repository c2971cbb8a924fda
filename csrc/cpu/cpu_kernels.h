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
// The norm is computed in float32; accumulation is float32.
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
                      float scale);

}  // namespace cpu
}  // namespace orca
