// Raw-pointer CPU kernels over quantized weights kept in their ggml block formats (Q8_0, Q4_0,
// Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; quant_formats.h has the layouts). No torch headers: the torch glue
// (csrc/torch/cpu_ops.cpp) and the microbenchmark (bench/cpu/bench_quant_gemm.cpp) call these.
//
// The products run on the weight-streaming driver of the float kernels (skinny_gemm_impl.h): the
// same thread and panel split, token tiles and epilogues, with panel kernels that dequantize each
// weight row 32 elements at a time into registers and multiply float32 activations (bf16
// activations are widened exactly; a fused norm's output is rounded to bf16 first).
//
// Reduction order: an output's accumulator has L float32 lanes (L = 8 on the avx2 path, 16 on
// avx512); lane l sums x[k] * w[k] over k = l, l + L, ... with one FMA each, then the lanes are
// summed by a fixed tree. It depends only on K and the path, never on T, the batch or the thread
// count, so a token's outputs are bit-identical whatever else is in the batch. On the avx2 path
// the order is that of the float32 `linear` (cpu_kernels.h), so quant_linear(x, W) equals
// linear(x, dequantized W) bit for bit there.
#pragma once
#include <cstdint>

#include "cpu_kernels.h"

namespace orca {
namespace cpu {

// ggml type ids (the GGUF tensor-info type field) of the supported formats.
constexpr int kQuantTypeQ4_0 = 2, kQuantTypeQ4_1 = 3, kQuantTypeQ5_0 = 6, kQuantTypeQ5_1 = 7, kQuantTypeQ8_0 = 8,
              kQuantTypeQ4_K = 12, kQuantTypeQ5_K = 13, kQuantTypeQ6_K = 14;
constexpr int kQuantTypes[] = {kQuantTypeQ4_0, kQuantTypeQ4_1, kQuantTypeQ5_0, kQuantTypeQ5_1,
                               kQuantTypeQ8_0, kQuantTypeQ4_K, kQuantTypeQ5_K, kQuantTypeQ6_K};

struct QuantFormat {
  int type;             // ggml type id
  const char* name;     // "Q4_K"
  int64_t block_elems;  // weights per block
  int64_t block_bytes;  // bytes per block
};

// The format of ggml type `type`, or nullptr when it is not supported.
const QuantFormat* quant_format(int type);

// The instruction paths of the quantized kernels: avx2 (8-lane FMAs, every x86-64-v3 CPU) and
// avx512 (16-lane, AVX-512F). They round differently (see above).
enum class QuantPath : int { kAvx2 = 0, kAvx512 = 1 };
const char* quant_path_name(QuantPath path);
bool quant_path_supported(QuantPath path);
// The best supported path, or ORCA_CPU_QUANT_PATH=avx2|avx512 read once at first use, or the last
// set_quant_path(); set_quant_path throws std::invalid_argument for a path this CPU cannot run.
QuantPath quant_path();
void set_quant_path(QuantPath path);

// How the products treat the activations:
//  kFloat32  x widened exactly to float32, weights dequantized in registers (every format; the
//            reduction order described above).
//  kInt8     each row quantized to int8 (per 32-block for Q8_0/Q4_0/Q4_1/Q5_0/Q5_1, per 256-block
//            for Q4_K/Q5_K/Q6_K) and integer dot products, as llama.cpp computes these formats
//            (quant_int8_act.h and quant_int8_act_k.h have the rounding and the reduction order);
//            every format on AVX2 CPUs (quant_int8_supported()); without AVX2, kFloat32.
// Either way a row's outputs depend only on that row, the weights and the (process-wide) path.
enum class QuantActivations : int { kFloat32 = 0, kInt8 = 1 };
// Whether kInt8 changes the products of ggml type qtype on this build and CPU.
bool quant_int8_supported(int qtype);

// The callers below have checked: qtype is supported, k is a positive multiple of its block size,
// qweight rows are k / block_elems * block_bytes bytes.

// out[T, N] = x[T, K] * W^T + bias[N] (+ residual[T, N], added before the one rounding).
template <typename T>
void quant_linear(const T* x,              // [T, K]
                  const uint8_t* qweight,  // [N, row_bytes]
                  int qtype,
                  const T* bias,      // [N] or nullptr
                  const T* residual,  // [T, N] or nullptr; may alias out
                  T* out,             // [T, N]
                  int64_t n_tokens, int64_t k, int64_t n_out,
                  QuantActivations acts = QuantActivations::kFloat32);

// out[T, I] = silu(x * Wg^T + bg) * (x * Wu^T + bu); rows [0, I) of W are gates, [I, 2I) ups.
template <typename T>
void quant_linear_silu_mul(const T* x,              // [T, K]
                           const uint8_t* qweight,  // [2I, row_bytes]
                           int qtype,
                           const T* bias,  // [2I] or nullptr
                           T* out,         // [T, I]
                           int64_t n_tokens, int64_t k, int64_t n_inter,
                           QuantActivations acts = QuantActivations::kFloat32);

// out[T, N] = quant_linear(rms_norm(x) * norm_weight, W, bias); the norm as in rmsnorm_qkv.
template <typename T>
void quant_rmsnorm_qkv(const T* x,              // [T, K]
                       const T* norm_weight,    // [K]
                       const uint8_t* qweight,  // [N, row_bytes]
                       int qtype,
                       const T* bias,  // [N] or nullptr
                       T* out,         // [T, N]
                       int64_t n_tokens, int64_t k, int64_t n_out, float eps,
                       QuantActivations acts = QuantActivations::kFloat32);

// out[t] = dequantized row token_ids[t] of W, rounded to T. The caller has checked every id.
template <typename T>
void quant_embedding(const uint8_t* qweight,  // [V, row_bytes]
                     int qtype,
                     const int64_t* token_ids,  // [T]
                     T* out,                    // [T, K]
                     int64_t n_tokens, int64_t k);

}  // namespace cpu
}  // namespace orca
