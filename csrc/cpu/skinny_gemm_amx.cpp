// The bf16 projections on CPUs with AMX-BF16 (Intel Sapphire Rapids and later): one TDPBF16PS
// multiplies a 16 x 32 bf16 tile by a 32 x 16 one into a 16 x 16 float32 tile, 512 multiply-adds,
// 16 times the work of one vdpbf16ps.
//
// Orientation: the weights are the row operand. A weight tile is 16 weight rows x 32 k, loaded in
// place from the row-major [N, K] matrix with the matrix's row stride, so weights are never
// repacked or copied. The activations are the column operand: per call, pack_token_groups writes
// each group of 16 tokens (all of them when a call has fewer) as [K/2 pairs][tokens][2], the
// pair-interleaved layout the instruction reads (a 32-bit transpose of the activation rows). An
// accumulator tile holds 16 outputs x up to 16 tokens.
//
// Reduction order: every (output, token) sum runs through k in steps of 32, in one accumulator
// tile, from k = 0 up, for every T; the columns of a tile never mix, and a missing token's column
// is zero. A token's outputs therefore do not depend on T or on its batch-mates (bit for bit), the
// promise of the other paths. TDPBF16PS rounds differently from vdpbf16ps, so this path's bits
// differ from avx512_bf16's: a process uses one path for every T.
//
// Work: units are (a block of weight rows of about 256 KiB, all tokens), taken from a shared
// counter. Inside a unit, tokens go in tiles of about 256 KiB of packed activations, and each
// block of 32 outputs (16 for gate_up: 16 gates + their 16 ups) runs against the tile, two token
// groups at a time: 2 weight tiles x 2 token tiles -> 4 accumulators, the 8 tile registers. The
// block's weights stay in L2 across token tiles, and a token tile across the unit's blocks; the
// next block's weights are prefetched while one computes. On a 2-core Xeon (Emerald Rapids),
// against the vdpbf16ps kernel: Llama-3.2-1B-shaped layers 2.6x at T = 8 and 6.3x at T = 512,
// one token level (bench_skinny_gemm, bench/bf16_paths.py; bench/RESULTS.md).
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "cpu_kernels.h"
#include "skinny_gemm_impl.h"
#include "transpose.h"  // before the pragma: baseline code
#include "vec.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace orca {
namespace cpu {
namespace detail {

namespace {

constexpr int64_t kTileTokens = 16;   // columns of an accumulator tile
constexpr int64_t kTileK = 32;        // k per TDPBF16PS
constexpr int64_t kBlockRows = 32;    // weight rows per block: two weight tiles

// The 64-byte operand of LDTILECFG (palette 1): tiles 0-3 accumulate (16 outputs x `width`
// tokens), 4-5 hold weights (16 rows x 32 k), 6-7 token groups (16 k pairs x `width` tokens).
// width is 16, or the token count of a call with fewer tokens: a narrower tile computes the same
// columns the same way (tests/test_skinny_gemm.py checks the bits across T), and spares the
// zero columns' packing, loads and stores.
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

constexpr TileConfig tile_config(int width) {
  TileConfig cfg{1, 0, {}, {}, {}};
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = static_cast<uint16_t>(t == 4 || t == 5 ? 64 : 4 * width);
    cfg.rows[t] = 16;
  }
  return cfg;
}

template <int... kWidths>
struct TileConfigs {
  static constexpr TileConfig of[] = {tile_config(kWidths)...};
};

// Constants in memory, indexed by width: GCC's _tile_loadconfig tells the compiler it reads 8
// bytes only, so stores that built the rest on the stack were dropped.
using Configs = TileConfigs<16, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16>;

}  // namespace

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f")

namespace {

void load_tile_config(int64_t width) { _tile_loadconfig(&Configs::of[width]); }

void release_tiles() { _tile_release(); }

// c[32][32] (rows: weight tile 0's 16 outputs, then tile 1's; columns: tokens of group 0, then
// group 1) = w0/w1 rows [16, K] (row stride w_ld elements) x the packed token groups g0, g0 + 1
// ([K/2][width][2] each, group_elems apart). kGroups = 1 leaves columns 16-31 unwritten.
template <int kGroups>
void tile_block(const bf16* w0, const bf16* w1, int64_t w_ld, const bf16* g0, int64_t width,
                int64_t group_elems, int64_t k, float* c, PrefetchAhead* ahead) {
  const int64_t w_stride = w_ld * static_cast<int64_t>(sizeof(bf16));
  const int64_t packed = 4 * width;  // bytes per packed row: width tokens x one k pair
  constexpr int64_t kLdc = 32 * sizeof(float);
  _tile_zero(0);
  _tile_zero(2);
  if constexpr (kGroups == 2) {
    _tile_zero(1);
    _tile_zero(3);
  }
  for (int64_t s = 0; s < k; s += kTileK) {
    ahead[0].step();
    ahead[1].step();
    _tile_loadd(4, w0 + s, w_stride);
    _tile_loadd(5, w1 + s, w_stride);
    _tile_loadd(6, g0 + s * width, packed);  // pairs s/2 .. s/2 + 15
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (kGroups == 2) {
      _tile_loadd(7, g0 + group_elems + s * width, packed);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, kLdc);
  _tile_stored(2, c + 16 * 32, kLdc);
  if constexpr (kGroups == 2) {
    _tile_stored(1, c + 16, kLdc);
    _tile_stored(3, c + 16 * 32 + 16, kLdc);
  }
}

}  // namespace

#pragma GCC pop_options

namespace {

// Which weight rows a block's two tiles hold, and which outputs it writes.
struct BlockRows {
  int64_t o_begin, o_end;  // outputs written
  int64_t a0, a1;          // first weight row of tile 0 and of tile 1 (gate_up: a1 is a0's up row)
};

// Blocks of 32 outputs (gate_up: 16). A block whose outputs run past the end loads its tiles from
// the last 16 rows instead (n_out >= 16 is required): the sums of the rows it shares with the
// block before are computed twice but written once.
BlockRows block_rows(int64_t b, int64_t n_out, bool gate_up) {
  if (gate_up) {
    const int64_t o0 = b * 16, a = std::min(o0, n_out - 16);
    return {o0, std::min(o0 + 16, n_out), a, n_out + a};
  }
  const int64_t o0 = b * kBlockRows;
  return {o0, std::min(o0 + kBlockRows, n_out), std::min(o0, n_out - 16), std::min(o0 + 16, n_out - 16)};
}

// out[t][o] for the outputs of one block and tokens [t0, t0 + tb), tb <= 32, from its sums c
// (see tile_block): the same epilogue arithmetic, in the same order, as the panel paths. The sums
// are first turned token-major (ct[token][tile row]), so that each token's outputs are one
// contiguous run that vectorizes.
void write_block(const float* c, float* ct, const BlockRows& br, int64_t t0, int64_t tb, bool gate_up,
                 const bf16* bias, const bf16* residual, bf16* out, int64_t n_out) {
  transpose(c, 32, 32, tb, ct, 32);
  // Sum column of output o: o - a0 in tile 0, else 16 + o - a1 in tile 1. Gate_up blocks, and
  // plain blocks whose tiles are neighbours, hold their outputs as the run from o_begin - a0.
  const int64_t n = br.o_end - br.o_begin, first = br.o_begin - br.a0;
  const bool run = gate_up || br.a1 == br.a0 + 16;
  for (int64_t j = 0; j < tb; ++j) {
    const float* cj = ct + j * 32;
    bf16* o_row = out + (t0 + j) * n_out + br.o_begin;  // residual may alias it
    if (gate_up) {
      const float* g = cj + first;
      const float* u = cj + 16 + first;
      if (bias != nullptr) {
        const bf16* bg = bias + br.o_begin;
        const bf16* bu = bias + n_out + br.o_begin;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i)
          o_row[i] = from_float<bf16>(silu(g[i] + to_float(bg[i])) * (u[i] + to_float(bu[i])));
      } else {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) o_row[i] = from_float<bf16>(silu(g[i]) * u[i]);
      }
      continue;
    }
    float v[kBlockRows];
    if (run) {
      for (int64_t i = 0; i < n; ++i) v[i] = cj[first + i];
    } else {
      for (int64_t i = 0; i < n; ++i) {
        const int64_t o = br.o_begin + i;
        v[i] = o < br.a0 + 16 ? cj[o - br.a0] : cj[16 + o - br.a1];
      }
    }
    if (bias != nullptr) {
      const bf16* b = bias + br.o_begin;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) v[i] += to_float(b[i]);
    }
    if (residual != nullptr) {
      const bf16* r = residual + (t0 + j) * n_out + br.o_begin;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) v[i] += to_float(r[i]);
    }
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) o_row[i] = from_float<bf16>(v[i]);
  }
}

// Activation rows [T, ld] bf16 -> token groups [ceil(T/width)][K/2][width][2]: per group, a
// transpose of its rows viewed as K/2 32-bit pairs. The columns of missing tokens in the last
// group are zero.
void pack_token_groups(const bf16* rows, int64_t ld, int64_t n_tokens, int64_t k, int64_t width, bf16* packed) {
  const int64_t n_groups = (n_tokens + width - 1) / width;
  const int64_t pairs = k / 2, group_elems = k * width;
  const bool parallel = n_groups > 1 && n_tokens * k >= (int64_t{1} << 15);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t g = 0; g < n_groups; ++g) {
    const int64_t live = std::min(width, n_tokens - g * width);
    bf16* dst = packed + g * group_elems;
    if (live < width) std::memset(dst, 0, static_cast<size_t>(group_elems) * sizeof(bf16));
    // 32-bit pairs move as float bit patterns: data only moves.
    transpose(reinterpret_cast<const float*>(rows + g * width * ld), ld / 2, live, pairs,
              reinterpret_cast<float*>(dst), width);
  }
}

}  // namespace

bool amx_fits(int64_t k, int64_t n_rows, bool gate_up) {
  const int64_t n_out = gate_up ? n_rows / 2 : n_rows;
  return k > 0 && k % kTileK == 0 && n_out >= 16;
}

void stream_weights_amx(const Activations& a, const bf16* w, const bf16* bias, const bf16* residual, bf16* out,
                        int64_t n_tokens, int64_t k, int64_t n_rows, Epilogue epilogue) {
  const bool gate_up = epilogue == Epilogue::kSiluMul;
  const int64_t n_out = gate_up ? n_rows / 2 : n_rows;
  const int64_t width = std::min(n_tokens, kTileTokens);  // tokens per group
  const int64_t n_groups = (n_tokens + width - 1) / width;
  const int64_t group_elems = k * width;
  bf16* packed = thread_scratch<bf16>(4, static_cast<size_t>(n_groups * group_elems));
  pack_token_groups(static_cast<const bf16*>(a.rows), a.ld, n_tokens, k, width, packed);

  const int64_t per_block = gate_up ? 16 : kBlockRows;
  const int64_t n_blocks = (n_out + per_block - 1) / per_block;
  const int64_t block_bytes = kBlockRows * k * static_cast<int64_t>(sizeof(bf16));
  // Token tiles of an even number of groups, about 256 KiB packed.
  const int64_t tile_groups =
      std::max<int64_t>(2, ((int64_t{256} << 10) / (group_elems * static_cast<int64_t>(sizeof(bf16)))) & ~int64_t{1});
  const bool parallel = n_tokens * n_rows * k >= (int64_t{1} << 16) && n_blocks > 1;
  const int64_t threads = parallel ? omp_get_max_threads() : 1;
  // Units of about 256 KiB of weights, and at least 8 per thread so that the last ones are short.
  const int64_t by_size = std::max<int64_t>(1, (int64_t{256} << 10) / block_bytes);
  const int64_t blocks_per_unit =
      std::max<int64_t>(1, std::min(by_size, n_blocks / std::max<int64_t>(1, 8 * threads)));
  const int64_t n_units = (n_blocks + blocks_per_unit - 1) / blocks_per_unit;
  std::atomic<int64_t> next{0};
#pragma omp parallel if (parallel)
  {
    float* c = thread_scratch<float>(7, 2 * 32 * 32);  // the sums, and their token-major copy
    load_tile_config(width);
    // While a block computes, the weight rows of the one after it (the next block of the unit, or
    // the first block of the unit claimed next) stream into L2: a tile load touches 16 rows at
    // once, a pattern the hardware prefetchers do not follow (one token at a time read the
    // weights of SmolLM2-135M at 0.71x the vdpbf16ps kernel's rate without this).
    take_units_ahead(next, n_units, 2 * threads, [&](int64_t u, int64_t u_next) {
      const int64_t b0 = u * blocks_per_unit, b1 = std::min(n_blocks, b0 + blocks_per_unit);
      for (int64_t g_lo = 0; g_lo < n_groups; g_lo += tile_groups) {
        const int64_t g_hi = std::min(n_groups, g_lo + tile_groups);
        for (int64_t b = b0; b < b1; ++b) {
          const BlockRows br = block_rows(b, n_out, gate_up);
          const bf16* w0 = w + br.a0 * k;
          const bf16* w1 = w + br.a1 * k;
          PrefetchAhead ahead[2];
          const int64_t b_next = g_lo > 0 ? -1 : b + 1 < b1 ? b + 1 : u_next >= 0 ? u_next * blocks_per_unit : -1;
          if (b_next >= 0) {
            const BlockRows nr = block_rows(b_next, n_out, gate_up);
            ahead[0] = PrefetchAhead(w + nr.a0 * k, 16 * k * static_cast<int64_t>(sizeof(bf16)));
            ahead[1] = PrefetchAhead(w + nr.a1 * k, 16 * k * static_cast<int64_t>(sizeof(bf16)));
            const int64_t steps = k / kTileK;  // spread over the first group pair's k steps
            ahead[0].plan(steps);
            ahead[1].plan(steps);
          }
          for (int64_t g = g_lo; g < g_hi; g += 2) {
            const bf16* xg = packed + g * group_elems;
            if (g + 1 < g_hi) tile_block<2>(w0, w1, k, xg, width, group_elems, k, c, ahead);
            else tile_block<1>(w0, w1, k, xg, width, group_elems, k, c, ahead);
            const int64_t t0 = g * width, tb = std::min(n_tokens - t0, (g + 1 < g_hi ? 2 : 1) * width);
            write_block(c, c + 32 * 32, br, t0, tb, gate_up, bias, residual, out, n_out);
          }
        }
      }
    });
    release_tiles();
  }
}

bool cpu_has_amx_bf16() {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16") ||
      !__builtin_cpu_supports("avx512f"))
    return false;
#if defined(__linux__)
  // Linux hands out the 8 KiB tile state only to processes that ask for it.
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;  // how other systems grant the tile state is not implemented
#endif
}

}  // namespace detail
}  // namespace cpu
}  // namespace orca

#else  // not x86-64: the path does not exist

#include <stdexcept>

namespace orca {
namespace cpu {
namespace detail {
bool amx_fits(int64_t, int64_t, bool) { return false; }
void stream_weights_amx(const Activations&, const bf16*, const bf16*, const bf16*, bf16*, int64_t, int64_t, int64_t,
                        Epilogue) {
  throw std::logic_error("the amx_bf16 path exists only on x86-64");
}
bool cpu_has_amx_bf16() { return false; }
}  // namespace detail
}  // namespace cpu
}  // namespace orca

#endif
