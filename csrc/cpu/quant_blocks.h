// The register-blocked panel kernels over quantized weight rows (quant_kernels.h), written once
// over an instruction-set policy `Ops` (as skinny_gemm_blocks.h):
//
//   using Acc, X, W;                   accumulator, activation and weight registers (float32)
//   static constexpr int kStep;        k elements one dot() consumes (8 or 16)
//   static constexpr int kRows;        activation rows per block when there are many tokens
//   Acc zero();  X load_x(const float*);  W load_w(const float*);  Acc dot(Acc, X, W);  float hsum(Acc);
//   template <int F> bool kWidensInRegisters;   format F widens straight into registers, with
//   widen<F>(row, unit, chunk, ChunkScales, W[2]) and store_w(float*, W)  (kStep 16 only)
//
// Per unit (kDequantUnit: 32 elements; a whole 256-element super-block of Q4_K, so that its d
// and packed scales are decoded once), each of the block's weight rows is dequantized (quant_formats.h)
// into a float buffer that stays in L1, then every activation row of the block consumes it kStep
// elements at a time. Where the policy widens a format's chunks straight into registers (the
// AVX-512 panels, 4-bit formats), the FMAs take the registers instead of the buffer. Each
// output's accumulator takes its k range in kStep steps from k = 0 upwards, then one hsum,
// whatever the block shape: the blocking (chosen from T) never changes a result.
//
// Like skinny_gemm_blocks.h, everything is local to the including translation unit, compiled for
// its instruction set.
#pragma once
#include <cstdint>
#include <type_traits>

#include "quant_formats.h"
#include "skinny_gemm_blocks.h"  // hsum8_tree
#include "skinny_gemm_impl.h"

namespace orca {
namespace cpu {
namespace detail {
namespace {

// c[m * ldc + j] = dot(x row m, dequantized w[j]) for m < MB, j < NB; K = kDequantUnit<F> * n_units.
// Rows: where a unit's dequantized rows come from. kOwn: dequantized into an L1 buffer of the
// block's own; kKeep: dequantized into `kept` (row j at kept + j * K, 64-byte aligned) and left
// there; kReuse: read from `kept` as an earlier kKeep block left them. Dequantizing overlaps the
// block's FMAs; reusing leaves only the FMAs, in the same k order, so every mode gives the same bits.
enum class Rows { kOwn, kKeep, kReuse };

// acc[m][j] += x row m . w[j] over every unit, through a buffer: each unit of the block's rows is
// dequantized (quant_formats.h) into an L1 buffer (or `kept`), then every activation row of the
// block consumes it kStep elements at a time.
template <class Ops, int F, int MB, int NB, Rows kRowsFrom>
inline void accumulate_buffered(typename Ops::Acc (&acc)[MB][NB], const float* __restrict x, int64_t ldx,
                                const uint8_t* const* w, int64_t n_units, float* __restrict kept) {
  constexpr int kUnit = kDequantUnit<F>;
  alignas(64) float local[NB][kUnit];
  const int64_t k = n_units * kUnit;
  for (int64_t u = 0; u < n_units; ++u) {
    // The unit's dequantized rows: this block's own L1 buffer, or the kept rows' unit.
    float* wt[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
      if constexpr (kRowsFrom == Rows::kOwn)
        wt[j] = local[j];
      else
        wt[j] = kept + j * k + u * kUnit;
      if constexpr (kRowsFrom != Rows::kReuse) dequant_unit<F>(w[j], u, wt[j]);
    }
    const float* xc = x + u * kUnit;
#pragma GCC unroll 4
    for (int s = 0; s < kUnit; s += Ops::kStep) {
      typename Ops::X xv[MB];
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) xv[m] = Ops::load_x(xc + m * ldx + s);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) {
        const typename Ops::W wv = Ops::load_w(wt[j] + s);
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) acc[m][j] = Ops::dot(acc[m][j], xv[m], wv);
      }
    }
  }
}

// The same sums with every 32-element chunk widened straight into two registers (Ops::widen,
// for the formats where Ops::kWidensInRegisters<F>): no buffer between widening and the FMAs
// (kKeep still stores the chunk to `kept` for the blocks that reuse it).
template <class Ops, int F, int MB, int NB, Rows kRowsFrom>
inline void accumulate_in_registers(typename Ops::Acc (&acc)[MB][NB], const float* __restrict x, int64_t ldx,
                                    const uint8_t* const* w, int64_t n_units, float* __restrict kept) {
  static_assert(Ops::kStep == 16 && kRowsFrom != Rows::kReuse, "a chunk is two steps; reuse reads `kept`");
  constexpr int kUnit = kDequantUnit<F>;
  const int64_t k = n_units * kUnit;
  for (int64_t u = 0; u < n_units; ++u) {
    ChunkScales scales[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) chunk_scales<F>(w[j], u, scales[j]);
#pragma GCC unroll 8
    for (int c = 0; c < kUnit / 32; ++c) {
      const float* xc = x + u * kUnit + c * 32;
      typename Ops::X xv[MB][2];
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) xv[m][0] = Ops::load_x(xc + m * ldx), xv[m][1] = Ops::load_x(xc + m * ldx + 16);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) {
        typename Ops::W wv[2];  // elements 0..15 and 16..31 of the chunk
        Ops::template widen<F>(w[j], u, c, scales[j], wv);
        if constexpr (kRowsFrom == Rows::kKeep) {
          float* dst = kept + j * k + u * kUnit + c * 32;
          Ops::store_w(dst, wv[0]), Ops::store_w(dst + 16, wv[1]);
        }
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) acc[m][j] = Ops::dot(Ops::dot(acc[m][j], xv[m][0], wv[0]), xv[m][1], wv[1]);
      }
    }
  }
}

template <class Ops, int F, int MB, int NB, Rows kRowsFrom = Rows::kOwn>
inline void quant_dot_block(const float* __restrict x, int64_t ldx, const uint8_t* const* w, int64_t n_units,
                            float* __restrict c, int64_t ldc, float* __restrict kept = nullptr) {
  typename Ops::Acc acc[MB][NB];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) acc[m][j] = Ops::zero();
  if constexpr (kRowsFrom != Rows::kReuse && Ops::template kWidensInRegisters<F>)
    accumulate_in_registers<Ops, F, MB, NB, kRowsFrom>(acc, x, ldx, w, n_units, kept);
  else
    accumulate_buffered<Ops, F, MB, NB, kRowsFrom>(acc, x, ldx, w, n_units, kept);
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) c[m * ldc + j] = Ops::hsum(acc[m][j]);
}

// Rows of tokens [m, M) against 4 weight rows, kRows tokens per block, then the remainder.
// Block(MB, m) runs one block of MB tokens starting at token m.
template <class Ops, class Block>
inline void token_blocks(int64_t M, Block&& block) {
  int64_t m = 0;
  for (; m + Ops::kRows <= M; m += Ops::kRows) block(std::integral_constant<int, Ops::kRows>{}, m);
  switch (M - m) {
    case 1: block(std::integral_constant<int, 1>{}, m); break;
    case 2: block(std::integral_constant<int, 2>{}, m); break;
    case 3: block(std::integral_constant<int, 3>{}, m); break;
    default: break;
  }
}

// One panel (PanelFn<float, uint8_t>): a single token streams all 8 rows at once; more tokens
// take the rows 4 at a time in blocks of kRows tokens, each dequantized unit serving the block
// from L1 while its FMAs run. Past one block, the first block also leaves the 4 dequantized rows
// in a thread buffer (4 x K floats, L1 or L2) that the other blocks read: dequantizing a row
// costs several times one token's FMAs over it, and redoing it per block made a fifth token cost
// ~50% more per step than the fourth, and a prefill tile pay it T / 4 times.
template <class Ops, int F>
inline void quant_panel(const float* x, int64_t ldx, int64_t M, const uint8_t* const* w, int64_t K, float* c) {
  constexpr int R = kPanelRows;
  static_assert(R == 8, "the blocks below cover 8 weight rows");
  static_assert(Ops::kRows <= 4, "token_blocks covers remainders of up to 3 tokens");
  const int64_t n_chunks = K / kDequantUnit<F>;
  if (M == 1) {
    quant_dot_block<Ops, F, 1, 8>(x, ldx, w, n_chunks, c, R);
    return;
  }
  float* wf = M > Ops::kRows ? thread_scratch<float>(2, static_cast<size_t>(4 * K)) : nullptr;  // [4, K]
  for (int h = 0; h < R; h += 4) {
    if (wf == nullptr) {
      token_blocks<Ops>(M, [&](auto mb, int64_t m) {
        quant_dot_block<Ops, F, decltype(mb)::value, 4>(x + m * ldx, ldx, w + h, n_chunks, c + m * R + h, R);
      });
      continue;
    }
    quant_dot_block<Ops, F, Ops::kRows, 4, Rows::kKeep>(x, ldx, w + h, n_chunks, c + h, R, wf);
    token_blocks<Ops>(M - Ops::kRows, [&](auto mb, int64_t m) {
      const int64_t m0 = Ops::kRows + m;
      quant_dot_block<Ops, F, decltype(mb)::value, 4, Rows::kReuse>(x + m0 * ldx, ldx, w + h, n_chunks,
                                                                    c + m0 * R + h, R, wf);
    });
  }
}

// The panel function of ggml type `type` for policy Ops, or nullptr.
template <class Ops>
inline PanelFn<float, uint8_t> quant_panel_for(int type) {
  PanelFn<float, uint8_t> fn = nullptr;
  dispatch_quant_format(type, [&](auto f) { fn = &quant_panel<Ops, decltype(f)::value>; });
  return fn;
}

}  // namespace
}  // namespace detail
}  // namespace cpu
}  // namespace orca
