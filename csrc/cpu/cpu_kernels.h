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
// The norm is computed in float32 (and rounded to bf16 for bf16 inputs, as rmsnorm would); the
// product is the weight-streaming `linear` below, with its T-independent reduction order.
template <typename T>
void rmsnorm_qkv(const T* x,            // [T, H]
                 const T* norm_weight,  // [H]
                 const T* qkv_weight,   // [N, H]
                 const T* qkv_bias,     // [N] or nullptr
                 T* out,                // [T, N]
                 int64_t n_tokens, int64_t hidden, int64_t n_out, float eps);

// value[r] = max(x[r, :]) and index[r] = the first column holding it: the greedy token of a row
// of logits. A row with a NaN gets NaN and the column of its first NaN. n_cols >= 1.
void row_argmax(const float* x,  // [R, V]
                int64_t n_rows, int64_t n_cols,
                int64_t* index,  // [R]
                float* value);   // [R]

// k_cache[slots[t]] = k[t], v_cache[slots[t]] = v[t]. Index type I is int32_t or int64_t.
// The caller has checked 0 <= slots[t] < n_slots.
template <typename T, typename I>
void slab_write(T* k_cache,        // [S, Hkv, D]
                T* v_cache,        // [S, Hkv, D]
                const T* k,        // [T, Hkv, D]
                const T* v,        // [T, Hkv, D]
                const I* slots,    // [T]
                int64_t n_tokens, int64_t row_elems /* Hkv*D */);

// The step between the QKV projection and attention, fused: q and k heads of each token rotated
// by the half-split rotary embedding (x = [x1 | x2] -> [x1*cos - x2*sin | x2*cos + x1*sin], in
// float32 with every product rounded on its own, then rounded once to T: bit-identical to the
// elementwise ops of the unfused path), q_out[t] = rotated q, k_cache[slots[t]] = rotated k,
// v_cache[slots[t]] = v. head_dim is even. The caller has checked 0 <= slots[t] < n_slots.
template <typename T, typename I>
void rope_slab_write(const T* qkv,      // [T, (Hq + 2*Hkv) * D]: q heads, then k heads, then v heads
                     const float* cos,  // [T, D/2]: each token's own position
                     const float* sin,  // [T, D/2]
                     T* k_cache,        // [S, Hkv, D]
                     T* v_cache,        // [S, Hkv, D]
                     const I* slots,    // [T]
                     T* q_out,          // [T, Hq, D]
                     int64_t n_tokens, int64_t n_q_heads, int64_t n_kv_heads, int64_t head_dim);

// Ragged causal attention over a mixed batch (decodes, prefills, prefills over a cached prefix).
// Request b owns query rows q[q_start[b] .. q_start[b]+q_len[b]); they are the last q_len[b]
// positions of its kv_len[b]-token context at k_cache[kv_start[b] ..]. Row i attends to context
// positions 0 .. kv_len[b]-q_len[b]+i. Head h reads KV head h / (Hq/Hkv). Softmax in float32
// over 64-key blocks merged in key order. The caller has validated every index.
// A decode is computed in independent 64-key blocks merged in key order (attention_impl.h), so
// its bits depend only on its own kv_len, whatever the batch or the thread count.
// batch_invariant: short prompt chunks and decodes repeat the prefill tiles' arithmetic operation
// for operation, so every row's result depends only on its own context, never on its batch-mates
// or on the prompt chunk it is in. Without it, they round differently (dot products and vector
// sums) and are somewhat faster.
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

// Slab compaction of the KV pools: for each move (src, dst, n), in the given order, rows
// [src, src+n) of every pool are copied to rows [dst, dst+n) as if through a temporary (the two
// ranges may overlap). Rows are opaque bytes, so every dtype shares this kernel. The caller has
// checked every range against the pool size.
void slab_move(void* pools,               // [P, S, row_bytes]
               int64_t n_pools, int64_t n_slots, int64_t row_bytes,
               const int64_t* moves,      // [M, 3] (src, dst, n)
               int64_t n_moves);

// ---- Weight-streaming linear layers (skinny_gemm.cpp) ------------------------------------------
// out = x * W^T + bias for the decoder's projections. Output rows are split across threads, so
// for a few tokens each weight byte is read from memory once (the op is bound by that read); for
// many tokens the same kernels run over L2-sized token tiles. Accumulation is float32.
//
// Reduction order: every output element is the dot product of one activation row with one weight
// row, accumulated in a fixed lane pattern over k, then summed across lanes by a fixed tree. The
// pattern depends only on K and the instruction path (below), never on T, on the output's
// position in the batch, or on the thread count: a token's outputs are bit-identical whatever else
// is in the batch. float32 paths: `avx2` uses 8-lane FMAs (lane l sums the k with k % 8 == l);
// `avx512` uses 16-lane FMAs (k % 16 == l) and one more level of the same lane tree. bf16 paths:
// `avx2` converts bf16 to float32 and uses the 8-lane pattern; `avx512_bf16` uses vdpbf16ps (16
// lanes, each summing pairs of k, 32 k per step); `amx_bf16` runs each sum as one chain through k
// in AMX tile steps of 32 (skinny_gemm_amx.cpp), for matrices with K a multiple of 32 and at least
// 16 outputs, and vdpbf16ps for the others. Different paths round differently, so outputs
// differ in the last bits between machines with and without the wider instructions (or between
// paths forced on one machine). bf16 activations are used as stored; a fused norm's output is
// rounded to bf16 first.

// The instruction paths of the bf16 kernels. kAvx512Bf16Emulated runs the native path's blocking,
// masks and tails with scalar code that performs the vdpbf16ps arithmetic, so that they are tested
// on CPUs without the instructions (slow; for tests only). kAmxBf16 needs AMX-BF16 (Sapphire
// Rapids and later) and the OS's grant of the tile state.
enum class Bf16Path : int { kAvx2 = 0, kAvx512Bf16 = 1, kAvx512Bf16Emulated = 2, kAmxBf16 = 3 };
const char* bf16_path_name(Bf16Path path);
// Whether this CPU (and OS) can run `path`.
bool bf16_path_supported(Bf16Path path);
// The path bf16 kernels use: the best supported one (amx_bf16, then avx512_bf16, then avx2), or
// ORCA_CPU_BF16_PATH=avx2|avx512_bf16|amx_bf16 (if supported) read once at first use, or the last
// set_bf16_path(). set_bf16_path throws std::invalid_argument for
// a path this CPU cannot run.
Bf16Path bf16_path();
void set_bf16_path(Bf16Path path);

// The instruction paths of the float32 kernels: the portable x86-64-v3 one, and 512-bit FMAs on
// CPUs with AVX-512 F/BW/VL/DQ (skinny_gemm_avx512.cpp).
enum class F32Path : int { kAvx2 = 0, kAvx512 = 1 };
const char* f32_path_name(F32Path path);
bool f32_path_supported(F32Path path);
// The path float32 kernels use: the best supported one, or ORCA_CPU_F32_PATH=avx2|avx512|auto read
// once at first use, or the last set_f32_path(). set_f32_path throws std::invalid_argument for a
// path this CPU cannot run.
F32Path f32_path();
void set_f32_path(F32Path path);

// out[T, N] = x[T, K] * W[N, K]^T + bias[N] (+ residual[T, N]). residual may alias out.
template <typename T>
void linear(const T* x,         // [T, K]
            const T* weight,    // [N, K]
            const T* bias,      // [N] or nullptr
            const T* residual,  // [T, N] or nullptr
            T* out,             // [T, N]
            int64_t n_tokens, int64_t k, int64_t n_out);

// out[T, I] = silu(x * Wg^T + bg) * (x * Wu^T + bu), with Wg = W[0:I] and Wu = W[I:2I] (the fused
// gate_up projection of a SwiGLU MLP). Gate, up and the product stay in float32; out is rounded once.
template <typename T>
void linear_silu_mul(const T* x,               // [T, K]
                     const T* gate_up_weight,  // [2I, K]
                     const T* gate_up_bias,    // [2I] or nullptr
                     T* out,                   // [T, I]
                     int64_t n_tokens, int64_t k, int64_t n_inter);

// ---- Machine probe (read_probe.cpp) ------------------------------------------------------------
// Reads data once with all threads and returns the XOR of its words (so the reads cannot be
// optimised away). The benchmarks time it on a buffer far larger than the caches: that is the
// streaming-read ceiling printed next to each bandwidth-bound figure.
uint64_t stream_read(const uint64_t* data,  // [n]
                     int64_t n_words);

}  // namespace cpu
}  // namespace orca
