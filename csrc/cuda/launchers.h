// Host entry points of the hand-written CUDA kernels (csrc/cuda/*.cu, csrc/cuda/attention/*.cu).
// Plain C++: usable from the torch glue (csrc/torch/cuda_ops.cpp) and the cudart-only
// microbenchmarks (bench/cuda/*.cu). No torch headers here or in any kernel source.
//
// Conventions: every array is contiguous, row-major, 16-byte aligned unless said otherwise; every
// launcher enqueues on `stream`, never synchronises, and returns the first CUDA error it met
// (cudaErrorInvalidValue for arguments it cannot serve). Nothing reads device memory on the host,
// so every launcher is CUDA-graph capturable. Semantics: docs/DESIGN.md section 4, the kernel
// contract.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace orca::kernels {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };
enum class IndexType : int { kInt32 = 0, kInt64 = 1 };

// ---- rms_norm --------------------------------------------------------------------------------
// out[t] = rms_norm(x[t]) * weight, the norm computed in float32, one rounding at the end.
cudaError_t rms_norm(DType dtype,
                     const void* x,       // [T, H]
                     const void* weight,  // [H]
                     void* out,           // [T, H]
                     int64_t n_tokens, int64_t hidden, float eps, cudaStream_t stream);

// ---- rmsnorm_qkv (decode-sized T) --------------------------------------------------------------
// One fused kernel: every block normalises all T rows (the row norms are folded into the GEMM
// epilogue) and streams its 32 rows of the QKV weight exactly once through tensor cores.
// Up to kRmsnormQkvFusedMaxTokens tokens; above that each block would re-read T*H activations
// for every 32 weight rows and the GEMM turns compute-bound, where cuBLAS (through torch) wins.
constexpr int64_t kRmsnormQkvFusedMaxTokens = 64;

// True when rmsnorm_qkv_fused can serve these arguments: fp16/bf16, 1 <= T <= 64, H % 8 == 0 and
// x, norm_weight, qkv_weight 16-byte aligned. Otherwise normalise with rms_norm and use a GEMM.
bool rmsnorm_qkv_fused_supported(DType dtype, int64_t n_tokens, int64_t hidden, const void* x,
                                 const void* norm_weight, const void* qkv_weight);

cudaError_t rmsnorm_qkv_fused(DType dtype,
                              const void* x,            // [T, H]
                              const void* norm_weight,  // [H]
                              const void* qkv_weight,   // [N, H]
                              const void* qkv_bias,     // [N] or nullptr
                              void* out,                // [T, N]
                              int64_t n_tokens, int64_t hidden, int64_t n_out, float eps,
                              cudaStream_t stream);

// ---- slab_write --------------------------------------------------------------------------------
// k_cache[slots[t]] = k[t], v_cache[slots[t]] = v[t]; a token whose slot is outside [0, S) is
// skipped (the glue cannot check index values without a host sync). 16-byte copies whenever the
// row size and pointers allow.
cudaError_t slab_write(DType dtype, IndexType index_type,
                       void* k_cache,      // [S, Hkv, D]
                       void* v_cache,      // [S, Hkv, D]
                       const void* k,      // [T, Hkv, D]
                       const void* v,      // [T, Hkv, D]
                       const void* slots,  // [T]
                       int64_t n_tokens, int64_t n_slots, int64_t row_elems /* Hkv*D */,
                       cudaStream_t stream);

// ---- ragged_attention --------------------------------------------------------------------------
// One iteration's attention in one launch (after a tiny work-list kernel): decodes, prefills and
// prefills over a cached prefix. fp16/bf16 with head_dim in {64, 80, 96, 128} use tensor cores
// (mma.sync m16n8k16); float32 and other head dims (<= 256) use a simple CUDA-core kernel.
// Requests whose indices are invalid (q_len < 0, kv_len < q_len, rows outside [0, T), slots
// outside [0, S)) are skipped. Every row of `out` owned by no valid request is set to zero (so
// `out` may be uninitialised); requests are assumed not to share query rows.
// batch_invariant: no flash-decoding splits and no decode tiles, so each row's result depends only
// on its own request's context (never on batch-mates or on the prompt chunk it is in). The
// CUDA-core path is batch-invariant either way (one warp per row over fixed 32-key blocks).
//
// The tensor-core path runs in two steps, so that one work list serves every layer of a forward
// pass (all layers share the per-request indices):
//   ragged_attention_plan       validates the requests and writes the work list into `plan`;
//   ragged_attention_with_plan  one attention call from a plan, as many times as needed.
// ragged_attention does both. The CUDA-core path needs no plan (its plan size is 0).

// Runtime knobs of the tensor-core path (bench/cuda/bench_ragged_attention.cu sweeps them).
struct RaggedAttentionTuning {
  // Decode work items wanted per SM, 1..kRaggedAttentionMaxItemsPerSm. With the iteration's
  // total decode keys it sets the KV split size: more items shorten the last wave, fewer leave
  // fewer partial results to merge.
  int items_per_sm = 16;
  // 0: decode items run in the shared kernel (128-row query tile, 2 K/V stages). 2 or 3: a decode
  // kernel with a 16-row query tile and that many K/V stages runs the whole iteration (less
  // shared memory and fewer registers per block, so more blocks and bytes in flight per SM).
  // Prefill work then runs as 16-row tiles: correct, but slower; meant for decode iterations.
  int decode_stages = 0;
  // No decode-kind items (see batch_invariant above): every request runs as prefill tiles of the
  // shared kernel, so decode_stages must be 0 with it.
  bool batch_invariant = false;
};
constexpr int kRaggedAttentionMaxItemsPerSm = 256;

// True when the launchers accept `tuning` (items_per_sm in range, decode_stages 0, 2 or 3; 0 when
// batch_invariant).
bool ragged_attention_tuning_valid(const RaggedAttentionTuning& tuning);

// True when (dtype, head_dim) runs on the tensor-core path (otherwise the CUDA-core fallback).
bool ragged_attention_uses_tensor_cores(DType dtype, int64_t head_dim);

// Bytes of a plan for these shapes: an upper bound computed from the shapes alone, so no device
// value is read on the host. 0 on the CUDA-core path, or for an invalid tuning.
size_t ragged_attention_plan_bytes(DType dtype, int64_t n_tokens, int64_t n_requests, int64_t n_q_heads,
                                   int64_t n_kv_heads, int64_t head_dim, const RaggedAttentionTuning& tuning);

// Builds a plan (tensor-core path only). The index arrays are read in stream order here: a plan
// is a snapshot of them, stale once they change. One stream uses a plan at a time: it also holds
// the per-launch counters and partial results, which every launch leaves as it found them.
cudaError_t ragged_attention_plan(DType dtype, IndexType index_type,
                                  const void* q_start,   // [B]
                                  const void* q_len,     // [B]
                                  const void* kv_start,  // [B]
                                  const void* kv_len,    // [B]
                                  void* plan,            // ragged_attention_plan_bytes(...), 16-byte aligned
                                  size_t plan_bytes,
                                  int64_t n_tokens, int64_t n_requests, int64_t n_slots, int64_t n_q_heads,
                                  int64_t n_kv_heads, int64_t head_dim, const RaggedAttentionTuning& tuning,
                                  cudaStream_t stream);

// One attention call from a plan built for the same dtype, shapes and tuning.
cudaError_t ragged_attention_with_plan(DType dtype,
                                       const void* q,        // [T, Hq, D]
                                       const void* k_cache,  // [S, Hkv, D]
                                       const void* v_cache,  // [S, Hkv, D]
                                       void* out,            // [T, Hq, D]
                                       void* plan, size_t plan_bytes,
                                       int64_t n_tokens, int64_t n_requests, int64_t n_q_heads, int64_t n_kv_heads,
                                       int64_t head_dim, float scale, const RaggedAttentionTuning& tuning,
                                       cudaStream_t stream);

// Plan and attention in one call, with the default tuning; `workspace` holds the plan: at least
// ragged_attention_workspace_bytes(...) bytes (= ragged_attention_plan_bytes with the default
// tuning; any content).
size_t ragged_attention_workspace_bytes(DType dtype, int64_t n_tokens, int64_t n_requests,
                                        int64_t n_q_heads, int64_t n_kv_heads, int64_t head_dim);

cudaError_t ragged_attention(DType dtype, IndexType index_type,
                             const void* q,         // [T, Hq, D]
                             const void* k_cache,   // [S, Hkv, D]
                             const void* v_cache,   // [S, Hkv, D]
                             const void* q_start,   // [B]
                             const void* q_len,     // [B]
                             const void* kv_start,  // [B]
                             const void* kv_len,    // [B]
                             void* out,             // [T, Hq, D]
                             void* workspace, size_t workspace_bytes,
                             int64_t n_tokens, int64_t n_requests, int64_t n_slots,
                             int64_t n_q_heads, int64_t n_kv_heads, int64_t head_dim,
                             float scale, bool batch_invariant, cudaStream_t stream);

// ---- slab_move -----------------------------------------------------------------------------------
// Slab compaction of the KV pools: for each move (src, dst, n) of `moves`, in the given order,
// rows [src, src+n) of every pool are copied to rows [dst, dst+n) as if through a temporary (the
// ranges may overlap). Rows are opaque bytes (any dtype). `moves` is HOST memory: the launcher
// walks it to enqueue device copies, so nothing is read back from the device. An overlapping move
// is staged through `scratch` (any content, may be nullptr) when it holds more rows per pool than
// the move's shift, else copied in pieces of `shift` rows. Pools larger than the device's maximum
// 2-D copy pitch (2^31 - 1 bytes) are copied pool by pool (the plan: slab_move_plan.h).
// cudaErrorInvalidValue for a range outside [0, S).
cudaError_t slab_move(void* pools,             // [P, S, row_bytes]
                      int64_t n_pools, int64_t n_slots, int64_t row_bytes,
                      const int64_t* moves,    // [M, 3] (src, dst, n), host memory
                      int64_t n_moves, void* scratch, size_t scratch_bytes, cudaStream_t stream);

// ---- quantized weights (GGUF blocks): quant_linear, quant_linear_silu_mul, quant_embedding ------
// A weight [N, K] is N rows of K / QK blocks in llama.cpp's ggml layout, exactly as a GGUF stores
// them: qtype is the ggml type id, Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q8_0 (8), Q4_K (12), Q5_K
// (13) or Q6_K (14); K must be a multiple of the block's QK (32, or 256 for the K-quants); row r
// starts at r * row_bytes with row_bytes = K / QK * block_bytes (any alignment). Blocks are
// dequantized in registers and never written out. Accumulation is float32 with one rounding at the
// end. Batch-invariant at every T: a token's result does not depend on T or on the other tokens
// (fixed reduction order per output; fp16/bf16 run one tensor-core kernel at every T, float32 a
// CUDA-core one). Details: csrc/cuda/quant/quant_linear_mma.cu and docs/DESIGN.md section 4.

// QK (elements per block) and bytes per block of a ggml type id; 0 for a type not served here.
int64_t quant_block_elems(int64_t qtype);
int64_t quant_block_bytes(int64_t qtype);

// True when quant_linear / quant_linear_silu_mul accept these activations: fp16/bf16 need x
// 16-byte aligned (cp.async); float32 has no requirement.
bool quant_linear_supported(DType dtype, const void* x);

// out = x deq(W)^T + bias + residual, the two optional terms added before the one rounding.
cudaError_t quant_linear(DType dtype, int64_t qtype,
                         const void* x,         // [T, K]
                         const void* qweight,   // [N, row_bytes] uint8
                         const void* bias,      // [N] or nullptr
                         const void* residual,  // [T, N] or nullptr
                         void* out,             // [T, N]
                         int64_t n_tokens, int64_t k, int64_t n_out, cudaStream_t stream);

// out = silu(gate) * up with gate = x deq(W[:I])^T + bias[:I], up = x deq(W[I:])^T + bias[I:].
cudaError_t quant_linear_silu_mul(DType dtype, int64_t qtype,
                                  const void* x,        // [T, K]
                                  const void* qweight,  // [2I, row_bytes] uint8: gate rows, then up rows
                                  const void* bias,     // [2I] or nullptr
                                  void* out,            // [T, I]
                                  int64_t n_tokens, int64_t k, int64_t n_inter, cudaStream_t stream);

// out[t] = deq(qweight[token_ids[t]]) in float32, rounded once to dtype (float32: bit for bit
// gguf.quants.dequantize). A token id outside [0, V) gives a row of zeros.
cudaError_t quant_embedding(DType dtype, int64_t qtype,
                            const void* qweight,       // [V, row_bytes] uint8
                            const int64_t* token_ids,  // [T]
                            void* out,                 // [T, K]
                            int64_t n_tokens, int64_t n_rows /* V */, int64_t k, cudaStream_t stream);

}  // namespace orca::kernels
