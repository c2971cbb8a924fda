// attend_tile and attend_decode_blocks (attention_impl.h) compiled for AVX-512: the prefill tiles
// and the decode blocks of ragged_attention on CPUs with the `avx512` float32 path. The build
// targets x86-64-v3, so this unit alone is compiled for AVX-512 (the pragma below), and
// ragged_attention calls it only where the CPU has it.
//
// Same bits as the baseline: every output element is the same sequence of float32 operations
// (FMA chains over d and over keys, lane-wise max, exp2 and sums, vec.h's fmadd where an FMA is
// meant), whatever the vector width; only the register block of the two products grows
// (gemm_impl.h: NnZmm). Decodes take this unit in the batch-invariant order only, whose sums run
// in key order (the other order's vector sums depend on the width). There the zmm block holds a
// KV head's 4 query heads (GQA 4, as in Llama 3) against a whole head row of V in 16 independent
// chains, where the ymm block left a fourth head alone on chains that waited on the FMA latency.
// tests/test_kernels_cpu.py compares the paths bit for bit.
#include <cstdint>

#include "cpu_kernels.h"
#include "vec.h"  // before the pragma: its inline functions stay baseline code

// Explicit instantiations of attend_decode_blocks_avx512 (in either branch below).
#define ORCA_DECODE_BLOCKS_AVX512(T)                                                                           \
  template void attend_decode_blocks_avx512<T>(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,     \
                                               const T*, const T*, const T*, const DecodeBlocks&, int64_t, int64_t, \
                                               int64_t, float);

#if defined(__x86_64__) && defined(__GNUC__)

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq")
// GCC 12's own avx512fintrin.h trips -W(maybe-)uninitialized (its _mm512_undefined operands).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include "attention_impl.h"

namespace orca {
namespace cpu {
namespace detail {

template <typename T>
void attend_tile_avx512(const AttnItem& it, const T* q, const T* k_cache, const T* v_cache, T* out,
                        int64_t n_q_heads, int64_t n_kv_heads, int64_t d, float qscale) {
  attend_tile<T, NnZmm>(it, q, k_cache, v_cache, out, n_q_heads, n_kv_heads, d, qscale);
}

template void attend_tile_avx512<float>(const AttnItem&, const float*, const float*, const float*, float*, int64_t,
                                        int64_t, int64_t, float);
template void attend_tile_avx512<bf16>(const AttnItem&, const bf16*, const bf16*, const bf16*, bf16*, int64_t,
                                       int64_t, int64_t, float);

template <typename T>
void attend_decode_blocks_avx512(int64_t t, int64_t kv_row0, int64_t n_keys, int64_t blk0, int64_t blk1, int64_t g0,
                                 int64_t g1, const T* q, const T* k_cache, const T* v_cache, const DecodeBlocks& res,
                                 int64_t n_q_heads, int64_t n_kv_heads, int64_t d, float qscale) {
  attend_decode_blocks<T, true, NnZmm>(t, kv_row0, n_keys, blk0, blk1, g0, g1, q, k_cache, v_cache, res, n_q_heads,
                                       n_kv_heads, d, qscale);
}

ORCA_DECODE_BLOCKS_AVX512(float)
ORCA_DECODE_BLOCKS_AVX512(bf16)

}  // namespace detail
}  // namespace cpu
}  // namespace orca
#pragma GCC diagnostic pop
#pragma GCC pop_options

#else  // not x86-64: the path does not exist

#include <stdexcept>

#include "attention_impl.h"

namespace orca {
namespace cpu {
namespace detail {
template <typename T>
void attend_tile_avx512(const AttnItem&, const T*, const T*, const T*, T*, int64_t, int64_t, int64_t, float) {
  throw std::logic_error("the avx512 attention tile exists only on x86-64");
}
template void attend_tile_avx512<float>(const AttnItem&, const float*, const float*, const float*, float*, int64_t,
                                        int64_t, int64_t, float);
template void attend_tile_avx512<bf16>(const AttnItem&, const bf16*, const bf16*, const bf16*, bf16*, int64_t,
                                       int64_t, int64_t, float);
template <typename T>
void attend_decode_blocks_avx512(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, const T*, const T*,
                                 const T*, const DecodeBlocks&, int64_t, int64_t, int64_t, float) {
  throw std::logic_error("the avx512 decode blocks exist only on x86-64");
}
ORCA_DECODE_BLOCKS_AVX512(float)
ORCA_DECODE_BLOCKS_AVX512(bf16)
}  // namespace detail
}  // namespace cpu
}  // namespace orca
#endif
#undef ORCA_DECODE_BLOCKS_AVX512
