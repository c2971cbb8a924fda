// Weight-streaming linear layers: linear, linear_silu_mul, and the driver (stream_weights) that
// rmsnorm_qkv shares. Plan and reduction order: skinny_gemm_impl.h and cpu_kernels.h.
//
// Work split: the outputs are cut into one contiguous range per thread, so at small T every
// weight byte is read from memory exactly once, by one thread (a thread that finishes its range
// early takes what is left of another's from its end). A thread cuts its range again into
// kPanelRows equal streams (for gate_up: 4 gate streams, each with its matching up stream) and
// its panel i takes output i of every stream. A panel's 8 weight rows then lie far apart, and
// walking the panels reads 8 long forward streams, the pattern the hardware prefetchers follow
// best. On a 2-core Zen 2, all projections of a T = 1 step ran 1.16x (float32) and 1.47x (bf16)
// faster than with 8 neighbouring rows per panel, whose 8 streams are a few KiB long each
// (bench_skinny_gemm; bench/RESULTS.md). Software prefetching gained nothing on top.
// That plan serves the few-token (memory-bound) calls. From kNeighbourPanelsFromTokens tokens on
// (compute bound) a panel holds 8 neighbouring outputs instead, and the threads take units from
// a shared counter: one token tile (sized to stay in L2) against one block of panels (~256 KiB
// of weights), so that a panel is reused by the whole tile while it sits in L1, and a block by
// the tiles that follow it from L2.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_kernels.h"
#include "skinny_gemm_impl.h"
#include "vec.h"

namespace orca {
namespace cpu {

// ---- bf16 path selection ----------------------------------------------------------------------

const char* bf16_path_name(Bf16Path path) {
  switch (path) {
    case Bf16Path::kAvx2: return "avx2";
    case Bf16Path::kAvx512Bf16: return "avx512_bf16";
    case Bf16Path::kAvx512Bf16Emulated: return "avx512_bf16_emulated";
    case Bf16Path::kAmxBf16: return "amx_bf16";
  }
  return "unknown";
}

bool bf16_path_supported(Bf16Path path) {
  static const bool native = detail::cpu_has_avx512bf16();
  static const bool amx = native && detail::cpu_has_amx_bf16();
  if (path == Bf16Path::kAvx512Bf16) return native;
  if (path == Bf16Path::kAmxBf16) return amx;
  return true;
}

namespace {

std::atomic<int> g_bf16_path{-1};  // -1: not chosen yet

Bf16Path initial_bf16_path() {
  Bf16Path best = Bf16Path::kAvx2;
  for (Bf16Path p : {Bf16Path::kAvx512Bf16, Bf16Path::kAmxBf16})  // widest last
    if (bf16_path_supported(p)) best = p;
  const char* env = std::getenv("ORCA_CPU_BF16_PATH");
  if (env == nullptr) return best;
  // Only the real paths can be chosen from the environment, and only those this CPU runs; an
  // unknown or unsupported value (or auto) keeps the best path (the torch glue reports the active
  // path as _C.cpu_bf16_path()).
  for (Bf16Path p : {Bf16Path::kAvx2, Bf16Path::kAvx512Bf16, Bf16Path::kAmxBf16})
    if (std::strcmp(env, bf16_path_name(p)) == 0 && bf16_path_supported(p)) return p;
  return best;
}

}  // namespace

Bf16Path bf16_path() {
  int p = g_bf16_path.load(std::memory_order_relaxed);
  if (p < 0) {
    int expected = -1;
    g_bf16_path.compare_exchange_strong(expected, static_cast<int>(initial_bf16_path()));
    p = g_bf16_path.load(std::memory_order_relaxed);
  }
  return static_cast<Bf16Path>(p);
}

void set_bf16_path(Bf16Path path) {
  if (!bf16_path_supported(path))
    throw std::invalid_argument(std::string("this CPU cannot run the bf16 path ") + bf16_path_name(path));
  g_bf16_path.store(static_cast<int>(path), std::memory_order_relaxed);
}

// ---- float32 path selection -------------------------------------------------------------------

const char* f32_path_name(F32Path path) {
  switch (path) {
    case F32Path::kAvx2: return "avx2";
    case F32Path::kAvx512: return "avx512";
  }
  return "unknown";
}

bool f32_path_supported(F32Path path) {
  static const bool avx512 = detail::cpu_has_avx512_f32();
  return path != F32Path::kAvx512 || avx512;
}

namespace {

std::atomic<int> g_f32_path{-1};  // -1: not chosen yet

F32Path initial_f32_path() {
  const F32Path best = f32_path_supported(F32Path::kAvx512) ? F32Path::kAvx512 : F32Path::kAvx2;
  const char* env = std::getenv("ORCA_CPU_F32_PATH");
  // As for bf16: only avx2 can be forced onto a CPU; anything else (avx512, auto, an unknown or
  // unsupported value) keeps the best path, which _C.cpu_f32_path() reports.
  if (env != nullptr && std::strcmp(env, "avx2") == 0) return F32Path::kAvx2;
  return best;
}

}  // namespace

F32Path f32_path() {
  int p = g_f32_path.load(std::memory_order_relaxed);
  if (p < 0) {
    int expected = -1;
    g_f32_path.compare_exchange_strong(expected, static_cast<int>(initial_f32_path()));
    p = g_f32_path.load(std::memory_order_relaxed);
  }
  return static_cast<F32Path>(p);
}

void set_f32_path(F32Path path) {
  if (!f32_path_supported(path))
    throw std::invalid_argument(std::string("this CPU cannot run the float32 path ") + f32_path_name(path));
  g_f32_path.store(static_cast<int>(path), std::memory_order_relaxed);
}

namespace detail {
namespace {

// write_panel for a panel of kPanelRows neighbouring outputs [o0, o0 + 8) (the walk from
// kNeighbourPanelsFromTokens tokens on): per token, one contiguous run that vectorizes, with the
// bias and residual branches decided once per panel instead of per output. Same operations, in
// the same order, as the general form below.
template <bool kBias, bool kResidual, typename T>
void write_neighbours(const float* __restrict c, int64_t tb, int64_t o0, const T* bias, const T* residual,
                      T* __restrict out, int64_t ldo) {
  float b[kPanelRows];
  if constexpr (kBias)
    for (int j = 0; j < kPanelRows; ++j) b[j] = to_float(bias[o0 + j]);
  for (int64_t t = 0; t < tb; ++t) {
    const float* ct = c + t * kPanelRows;
    T* o = out + t * ldo + o0;
    float v[kPanelRows];
    for (int j = 0; j < kPanelRows; ++j) {
      v[j] = ct[j];
      if constexpr (kBias) v[j] += b[j];
      if constexpr (kResidual) v[j] += to_float(residual[t * ldo + o0 + j]);
    }
    for (int j = 0; j < kPanelRows; ++j) o[j] = from_float<T>(v[j]);
  }
}

// Writes one panel's outputs for tb tokens. c is [tb][kPanelRows]; panel column j holds output
// idx[j] (j < ng) of rows of ldo elements: out = c + bias (+ residual), rounded.
template <typename T>
void write_panel(const float* __restrict c, int64_t tb, const int64_t* idx, int64_t ng, const T* bias,
                 const T* residual, T* out, int64_t ldo) {
  if (ng == kPanelRows && idx[ng - 1] == idx[0] + ng - 1) {
    const int64_t o0 = idx[0];
    if (bias != nullptr) {
      if (residual != nullptr) write_neighbours<true, true>(c, tb, o0, bias, residual, out, ldo);
      else write_neighbours<true, false>(c, tb, o0, bias, residual, out, ldo);
    } else {
      if (residual != nullptr) write_neighbours<false, true>(c, tb, o0, bias, residual, out, ldo);
      else write_neighbours<false, false>(c, tb, o0, bias, residual, out, ldo);
    }
    return;
  }
  for (int64_t t = 0; t < tb; ++t) {
    const float* ct = c + t * kPanelRows;
    const T* r = residual != nullptr ? residual + t * ldo : nullptr;
    T* o = out + t * ldo;
    for (int64_t j = 0; j < ng; ++j) {
      float v = ct[j];
      if (bias != nullptr) v += to_float(bias[idx[j]]);
      if (r != nullptr) v += to_float(r[idx[j]]);
      o[idx[j]] = from_float<T>(v);
    }
  }
}

// The gate_up form of write_panel: columns [0, 4) are gate sums and [4, 8) the matching up sums
// of outputs idx[j]; with their biases added they go to gate[t][idx[j] - o_begin] and
// up[t][idx[j] - o_begin] (rows of ld floats), for silu_mul_range to finish. Neighbouring
// outputs (a full panel of consecutive idx) take a branch-free contiguous form.
template <bool kBias, typename T>
void stage_neighbours(const float* __restrict c, int64_t tb, int64_t o0, const T* bias, int64_t n_out,
                      int64_t o_begin, float* __restrict gate, float* __restrict up, int64_t ld) {
  constexpr int kHalf = kPanelRows / 2;
  float bg[kHalf], bu[kHalf];
  if constexpr (kBias)
    for (int j = 0; j < kHalf; ++j) bg[j] = to_float(bias[o0 + j]), bu[j] = to_float(bias[n_out + o0 + j]);
  for (int64_t t = 0; t < tb; ++t) {
    const float* ct = c + t * kPanelRows;
    float* g = gate + t * ld + o0 - o_begin;
    float* u = up + t * ld + o0 - o_begin;
    for (int j = 0; j < kHalf; ++j) {
      float gj = ct[j], uj = ct[kHalf + j];
      if constexpr (kBias) gj += bg[j], uj += bu[j];
      g[j] = gj;
      u[j] = uj;
    }
  }
}

template <typename T>
void stage_gate_up(const float* __restrict c, int64_t tb, const int64_t* idx, int64_t ng, const T* bias,
                   int64_t n_out, int64_t o_begin, float* __restrict gate, float* __restrict up, int64_t ld) {
  if (ng == kPanelRows / 2 && idx[ng - 1] == idx[0] + ng - 1) {
    if (bias != nullptr) stage_neighbours<true>(c, tb, idx[0], bias, n_out, o_begin, gate, up, ld);
    else stage_neighbours<false>(c, tb, idx[0], bias, n_out, o_begin, gate, up, ld);
    return;
  }
  for (int64_t t = 0; t < tb; ++t) {
    const float* ct = c + t * kPanelRows;
    for (int64_t j = 0; j < ng; ++j) {
      float g = ct[j], u = ct[kPanelRows / 2 + j];
      if (bias != nullptr) {
        g += to_float(bias[idx[j]]);
        u += to_float(bias[n_out + idx[j]]);
      }
      gate[t * ld + idx[j] - o_begin] = g;
      up[t * ld + idx[j] - o_begin] = u;
    }
  }
}

// out[t][0, n) = silu(gate[t]) * up[t], rounded: one vectorized pass over a contiguous range (a
// per-panel epilogue evaluated silu one output at a time).
template <typename T>
void silu_mul_range(const float* __restrict gate, const float* __restrict up, int64_t ld, int64_t tb, int64_t n,
                    T* __restrict out, int64_t ldo) {
  for (int64_t t = 0; t < tb; ++t) {
    const float* g = gate + t * ld;
    const float* u = up + t * ld;
    T* o = out + t * ldo;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) o[i] = from_float<T>(silu(g[i]) * u[i]);
  }
}

// Activation rows per token tile: about 192 KiB of them (they are re-read from L2 for every
// panel), a multiple of 12 so that both the 3-row and the 4-row blocks divide it.
inline int64_t token_tile_rows(int64_t ld, size_t elem_bytes) {
  const size_t row_bytes = static_cast<size_t>(std::max<int64_t>(ld, 1)) * elem_bytes;
  const int64_t rows = static_cast<int64_t>((size_t{192} << 10) / row_bytes);
  return std::max<int64_t>(12, rows / 12 * 12);
}

// Panels per block: about 256 KiB of weight rows, which fit L2 next to a token tile (192 KiB) on
// a 512 KiB L2. A thread runs every token tile against one block before it moves on, so at large
// T a weight row comes from memory once and from L2 for the other tiles, and the activation tiles
// come from the last-level cache once per block. Walking all panels per tile instead streamed the
// weights from memory once per tile: a Llama-3.2-1B-sized layer (K = 2048, 24-token tiles) at
// T = 128 ran 45-53 GFLOP/s on one Zen 4 core that way and 58-67 with blocks (loaded machine).
inline int64_t panels_per_block(int64_t panel_row_bytes) {
  return std::max<int64_t>(1, (int64_t{256} << 10) / (kPanelRows * std::max<int64_t>(panel_row_bytes, 1)));
}

// Two walks over the panels, chosen by the number of tokens.
// - Few tokens (T < kNeighbourPanelsFromTokens) are memory bound, so the order in which the
//   weights are read is what matters: each thread owns a contiguous range of outputs and reads its
//   weights once, as kPanelRows long forward streams (see the top of this file).
// - From kNeighbourPanelsFromTokens tokens on, calls are compute bound. A panel then holds 8
//   neighbouring outputs, so that its results land in one or two cache lines per token, and the
//   threads take (block of panels, token tile) units from a shared counter, so that a thread slowed
//   down (by the host, or by the epilogue's cache misses) takes fewer units instead of holding up
//   the others at the barrier. With streams, a tile's scattered writes spanned [tile][outputs of
//   the thread] (442 KiB per sum at 72 tokens and 1,536 gate outputs, more than this L2), and the
//   SiLU pass ran over runs of ~14 outputs.
// Paired A/B runs on a 2-core Zen 3, 2 threads, against the streams walk at every T: SmolLM2-135M
// at T = 512, gate_up + SiLU 1.33x, qkv 1.08x; at T = 128, o_proj 1.12x, down 1.18x; Llama-3.2-1B
// gate_up 1.12x at T = 16 and 1.17x at T = 24; at T = 12, 1.07-1.21x; at T = 8 -4% to +4%, and at
// T = 4 0.95x. Which outputs share a panel, and which thread computes them, never changes a
// result: every output has its own accumulator sequence.
constexpr int64_t kNeighbourPanelsFromTokens = 12;

// What every panel of one call shares: the operands, and the panel kernel with its epilogue.
template <typename T, typename XT, typename WT>
struct PanelCall {
  const XT* x;
  int64_t ldx;
  PanelFn<XT, WT> panel_fn;
  const WT* w;
  int64_t w_stride;
  const T* bias;
  const T* residual;
  T* out;
  int64_t k, n_out;
  bool silu;

  int64_t per_panel() const { return silu ? kPanelRows / 2 : kPanelRows; }

  // Tokens [t0, t0 + tb) against the panel of outputs idx[0, ng) (a partial panel repeats its
  // last live row in the columns past ng: computed, never written). The sums go to out, or for
  // SiLU to gate[t][idx[j] - o_base] and up[...] (rows of ld floats) for silu_mul_range.
  void run(int64_t t0, int64_t tb, const int64_t* idx, int64_t ng, float* c, float* gate, float* up,
           int64_t o_base, int64_t ld) const {
    const int64_t pp = per_panel();
    const WT* rows[kPanelRows];
    for (int64_t s = 0; s < pp; ++s) rows[s] = w + idx[std::min(s, ng - 1)] * w_stride;
    if (silu)
      for (int64_t s = 0; s < pp; ++s) rows[pp + s] = rows[s] + n_out * w_stride;
    panel_fn(x + t0 * ldx, ldx, tb, rows, k, c);
    if (silu)
      stage_gate_up(c, tb, idx, ng, bias, n_out, o_base, gate, up, ld);
    else
      write_panel(c, tb, idx, ng, bias, residual != nullptr ? residual + t0 * n_out : nullptr, out + t0 * n_out,
                  n_out);
  }
};

// The smallest claim: about 32 KiB of weight rows, a couple of microseconds of reading. The last
// claims of a call are what its threads can still disagree on: with each thread held to its own
// range, the two threads of a T = 1 projection of SmolLM2-135M in bf16 finished 4.7-6.6 us apart
// on average (58 us calls, Zen 4; which one was slower changed from run to run), and 1.5 us apart
// with claims.
inline int64_t min_positions_per_claim(int64_t panel_row_bytes) {
  return std::max<int64_t>(1, (int64_t{32} << 10) / (kPanelRows * std::max<int64_t>(panel_row_bytes, 1)));
}

// Few tokens (one token tile: token_tile_rows is at least 12): per thread, a contiguous range of
// outputs walked as kPanelRows streams; position i of a range is output i of each of its streams.
// A thread claims its own positions from the front, and then helps with the others' from the
// back, so a thread that the host slows down holds up nobody at the barrier. Every weight byte is
// still read once, by one thread, and which thread computes an output never changes its bits.
template <typename T, typename XT, typename WT>
void walk_streams(const PanelCall<T, XT, WT>& call, int64_t n_tokens, int64_t min_claim, WorkClaims* claims,
                  int64_t ranges) {
  const int64_t per_panel = call.per_panel(), n_out = call.n_out;
  const int64_t max_range = (n_out + ranges - 1) / ranges;
  float* c = thread_scratch<float>(7, static_cast<size_t>(n_tokens * kPanelRows));
  // SiLU: the gate and up sums of the claimed outputs, each at its offset in its range (rows of
  // max_range floats per token). Slot 5 is free here: prepare_activations used it only before.
  float* gate = call.silu ? thread_scratch<float>(5, static_cast<size_t>(2 * n_tokens * max_range)) : nullptr;
  float* up = call.silu ? gate + n_tokens * max_range : nullptr;
  // Positions [i0, i1) of range r.
  auto run = [&](int64_t r, int64_t i0, int64_t i1) {
    const int64_t o_begin = n_out * r / ranges, o_end = n_out * (r + 1) / ranges;
    const int64_t range = o_end - o_begin;
    const int64_t stream_len = (range + per_panel - 1) / per_panel;  // outputs per stream
    for (int64_t i = i0; i < i1; ++i) {
      // Output i of each stream; the streams that are already done form a suffix.
      int64_t idx[kPanelRows];
      int64_t ng = 0;
      for (int64_t s = 0; s < per_panel && o_begin + s * stream_len + i < o_end; ++s)
        idx[ng++] = o_begin + s * stream_len + i;
      call.run(0, n_tokens, idx, ng, c, gate, up, o_begin, max_range);
    }
    if (call.silu)  // the claimed outputs: [i0, i1) of each stream
      for (int64_t s = 0; s < per_panel; ++s) {
        const int64_t lo = s * stream_len + i0, n = std::min(range, s * stream_len + i1) - lo;
        if (n > 0) silu_mul_range(gate + lo, up + lo, max_range, n_tokens, n, call.out + o_begin + lo, n_out);
      }
  };
  take_shares(claims, ranges, min_claim, omp_get_thread_num(), run);
}

// Many tokens: panel i holds outputs [i * per_panel, (i + 1) * per_panel), and the threads take
// (block of panels, token tile) units from `next`, block-major, so that a thread that takes
// consecutive units reuses the block's weights from its L2, and a thread slowed down (by the
// epilogue's cache misses or by the host) takes fewer units instead of holding up the barrier.
template <typename T, typename XT, typename WT>
void walk_neighbours(const PanelCall<T, XT, WT>& call, int64_t n_tokens, int64_t tile, int64_t block,
                     std::atomic<int64_t>& next) {
  const int64_t per_panel = call.per_panel(), n_out = call.n_out;
  const int64_t n_panels = (n_out + per_panel - 1) / per_panel;
  const int64_t n_tiles = (n_tokens + tile - 1) / tile;
  const int64_t n_units = (n_panels + block - 1) / block * n_tiles;
  const int64_t ld = block * per_panel;  // staged gate/up sums: [tile][block's outputs]
  float* c = thread_scratch<float>(7, static_cast<size_t>(tile * kPanelRows));
  float* gate = call.silu ? thread_scratch<float>(5, static_cast<size_t>(2 * tile * ld)) : nullptr;
  float* up = call.silu ? gate + tile * ld : nullptr;
  take_units(next, n_units, [&](int64_t u) {
    const int64_t i0 = u / n_tiles * block, i1 = std::min(n_panels, i0 + block);
    const int64_t t0 = u % n_tiles * tile, tb = std::min(tile, n_tokens - t0);
    const int64_t o_lo = i0 * per_panel, o_hi = std::min(n_out, i1 * per_panel);
    for (int64_t i = i0; i < i1; ++i) {
      int64_t idx[kPanelRows];
      int64_t ng = 0;
      for (int64_t o = i * per_panel; o < std::min(n_out, (i + 1) * per_panel); ++o) idx[ng++] = o;
      call.run(t0, tb, idx, ng, c, gate, up, o_lo, ld);
    }
    if (call.silu) silu_mul_range(gate, up, ld, tb, o_hi - o_lo, call.out + t0 * n_out + o_lo, n_out);
  });
}

template <typename T, typename XT, typename WT>
void run_panels(const XT* x, int64_t ldx, PanelFn<XT, WT> panel_fn, const WT* w, int64_t w_stride, const T* bias,
                const T* residual, T* out, int64_t n_tokens, int64_t k, int64_t n_rows, Epilogue epilogue) {
  const bool silu = epilogue == Epilogue::kSiluMul;
  const PanelCall<T, XT, WT> call{x, ldx, panel_fn, w, w_stride, bias, residual, out, k, silu ? n_rows / 2 : n_rows,
                                  silu};
  const int64_t n_panels = (call.n_out + call.per_panel() - 1) / call.per_panel();
  const int64_t tile = std::min(n_tokens, token_tile_rows(ldx, sizeof(XT)));
  const int64_t n_tiles = (n_tokens + tile - 1) / tile;
  const int64_t block = panels_per_block(w_stride * static_cast<int64_t>(sizeof(WT)) * (silu ? 2 : 1));
  // Waking the team costs a few microseconds: not worth it for a product this small.
  const bool parallel = n_panels * n_tiles > 1 && n_tokens * n_rows * k >= (int64_t{1} << 16);
  if (n_tokens < kNeighbourPanelsFromTokens) {
    static_assert(kNeighbourPanelsFromTokens <= 12, "the streams walk takes one token tile (token_tile_rows >= 12)");
    const int64_t ranges = std::min<int64_t>(parallel ? omp_get_max_threads() : 1, n_panels);
    std::vector<WorkClaims> claims = even_share_claims(call.n_out, ranges, call.per_panel());
    const int64_t min_claim = min_positions_per_claim(w_stride * static_cast<int64_t>(sizeof(WT)) * (silu ? 2 : 1));
#pragma omp parallel if (parallel)
    walk_streams(call, n_tokens, min_claim, claims.data(), ranges);
    return;
  }
  // Blocks of about equal size, and at least 8 units per thread, so that the last units to
  // finish are short: with 4, the 32-token qkv projection of SmolLM2-135M (120 panels, 9 units)
  // ran 0.92x the static split.
  const int64_t threads = parallel ? omp_get_max_threads() : 1;
  const int64_t n_blocks = std::max((n_panels + block - 1) / block, (8 * threads + n_tiles - 1) / n_tiles);
  const int64_t nb = std::max<int64_t>(1, (n_panels + n_blocks - 1) / n_blocks);
  std::atomic<int64_t> next{0};
#pragma omp parallel if (parallel)
  walk_neighbours(call, n_tokens, tile, nb, next);
}

}  // namespace

template <typename T>
void stream_weights(const Activations& a, const T* w, const T* bias, const T* residual, T* out, int64_t n_tokens,
                    int64_t k, int64_t n_rows, Epilogue epilogue) {
  if (n_tokens <= 0 || n_rows <= 0) return;
  if constexpr (std::is_same<T, float>::value) {
    PanelFn<float, float> fn = &panel_avx2;
    if (f32_path() == F32Path::kAvx512) fn = &panel_avx512;
    run_panels<T, float, float>(static_cast<const float*>(a.rows), a.ld, fn, w, k, bias, residual, out, n_tokens, k,
                                n_rows, epilogue);
  } else if (!a.bf16_rows) {
    run_panels<T, float, bf16>(static_cast<const float*>(a.rows), a.ld, &panel_avx2, w, k, bias, residual, out,
                               n_tokens, k, n_rows, epilogue);
  } else {
    const Bf16Path path = bf16_path();
    if (path == Bf16Path::kAmxBf16 && amx_fits(k, n_rows, epilogue == Epilogue::kSiluMul)) {
      stream_weights_amx(a, w, bias, residual, out, n_tokens, k, n_rows, epilogue);
      return;
    }
    // vdpbf16ps also serves the amx_bf16 path's matrices that do not fit the tiles.
    const PanelFn<bf16, bf16> fn =
        path == Bf16Path::kAvx512Bf16Emulated ? &panel_avx512bf16_emulated : &panel_avx512bf16;
    run_panels<T, bf16, bf16>(static_cast<const bf16*>(a.rows), a.ld, fn, w, k, bias, residual, out, n_tokens, k,
                              n_rows, epilogue);
  }
}

template <typename T>
void stream_quant_weights(const Activations& a, const uint8_t* w, int64_t row_bytes, PanelFn<float, uint8_t> panel_fn,
                          const T* bias, const T* residual, T* out, int64_t n_tokens, int64_t k, int64_t n_rows,
                          Epilogue epilogue) {
  if (n_tokens <= 0 || n_rows <= 0) return;
  run_panels<T, float, uint8_t>(static_cast<const float*>(a.rows), a.ld, panel_fn, w, row_bytes, bias, residual, out,
                                n_tokens, k, n_rows, epilogue);
}

template void stream_quant_weights<float>(const Activations&, const uint8_t*, int64_t, PanelFn<float, uint8_t>,
                                          const float*, const float*, float*, int64_t, int64_t, int64_t, Epilogue);
template void stream_quant_weights<bf16>(const Activations&, const uint8_t*, int64_t, PanelFn<float, uint8_t>,
                                         const bf16*, const bf16*, bf16*, int64_t, int64_t, int64_t, Epilogue);
template void stream_weights<float>(const Activations&, const float*, const float*, const float*, float*, int64_t,
                                    int64_t, int64_t, Epilogue);
template void stream_weights<bf16>(const Activations&, const bf16*, const bf16*, const bf16*, bf16*, int64_t,
                                   int64_t, int64_t, Epilogue);

}  // namespace detail

namespace {

template <typename T>
detail::Activations copy_activations(const T* x, int64_t n_tokens, int64_t k) {
  return detail::prepare_activations<T>(n_tokens, k, [=](int64_t t, float* dst) { detail::load_row(x + t * k, dst, k); });
}

}  // namespace

template <typename T>
void linear(const T* x,         // [T, K]
            const T* weight,    // [N, K]
            const T* bias,      // [N] or nullptr
            const T* residual,  // [T, N] or nullptr
            T* out,             // [T, N]
            int64_t n_tokens, int64_t k, int64_t n_out) {
  if (n_tokens <= 0 || n_out <= 0) return;
  if (k == 0) {  // an empty reduction: the bias (and residual) alone
    for (int64_t t = 0; t < n_tokens; ++t)
      for (int64_t n = 0; n < n_out; ++n)
        out[t * n_out + n] = from_float<T>((bias ? to_float(bias[n]) : 0.0f) +
                                           (residual ? to_float(residual[t * n_out + n]) : 0.0f));
    return;
  }
  const detail::Activations a = copy_activations(x, n_tokens, k);
  detail::stream_weights<T>(a, weight, bias, residual, out, n_tokens, k, n_out, detail::Epilogue::kBias);
}

template <typename T>
void linear_silu_mul(const T* x,               // [T, K]
                     const T* gate_up_weight,  // [2I, K]
                     const T* gate_up_bias,    // [2I] or nullptr
                     T* out,                   // [T, I]
                     int64_t n_tokens, int64_t k, int64_t n_inter) {
  if (n_tokens <= 0 || n_inter <= 0) return;
  if (k == 0) {
    for (int64_t t = 0; t < n_tokens; ++t)
      for (int64_t n = 0; n < n_inter; ++n) {
        const float g = gate_up_bias ? to_float(gate_up_bias[n]) : 0.0f;
        const float u = gate_up_bias ? to_float(gate_up_bias[n_inter + n]) : 0.0f;
        out[t * n_inter + n] = from_float<T>(detail::silu(g) * u);
      }
    return;
  }
  const detail::Activations a = copy_activations(x, n_tokens, k);
  detail::stream_weights<T>(a, gate_up_weight, gate_up_bias, nullptr, out, n_tokens, k, 2 * n_inter,
                            detail::Epilogue::kSiluMul);
}

template void linear<float>(const float*, const float*, const float*, const float*, float*, int64_t, int64_t,
                            int64_t);
template void linear<bf16>(const bf16*, const bf16*, const bf16*, const bf16*, bf16*, int64_t, int64_t, int64_t);
template void linear_silu_mul<float>(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t);
template void linear_silu_mul<bf16>(const bf16*, const bf16*, const bf16*, bf16*, int64_t, int64_t, int64_t);

}  // namespace cpu
}  // namespace orca
