// Small building blocks shared by the CPU kernels: element conversion to and from float32,
// a vectorizable exp2 and per-thread scratch buffers. Everything here is written as plain
// loops that GCC/Clang auto-vectorize at -O3 (no intrinsics), so the same source builds for
// any x86-64 level or for aarch64.
#pragma once
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "cpu_kernels.h"

namespace orca {
namespace cpu {
namespace detail {

// dst[n] = float(src[n]). For bf16 this is a zero-extend and shift, which vectorizes.
template <typename T>
inline void load_row(const T* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// dst[n] = T(src[n]) with round-to-nearest-even for bf16 (the header's from_float, which
// if-converts and vectorizes).
template <typename T>
inline void store_row(const float* __restrict src, T* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<T>(src[i]);
}

// a * b + c with one rounding wherever the CPU has FMA. Spelled out because GCC's implicit
// contraction of a*b + c depends on how a loop was vectorized (an SLP-vectorized, fully unrolled
// loop may keep separate multiplies and adds), and code paths that must round identically -- the
// two CPU attention paths of the batch-invariant mode -- cannot leave that to the optimiser.
inline float fmadd(float a, float b, float c) {
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// 2^x for x <= 0 (softmax exponents after subtracting the running max). Arguments below -126
// are clamped, giving ~1e-38 instead of a denormal or 0: far below float32 resolution of
// any softmax sum that contains the max element (which contributes 1). Max relative error
// ~7e-8 on [-126, 0]. Plain arithmetic so that a loop over it vectorizes (libm exp2f does not
// without -ffast-math).
inline float exp2_nonpos(float x) {
  x = x < -126.0f ? -126.0f : x;
  const float n = std::nearbyint(x);
  const float f = x - n;  // in [-0.5, 0.5]
  // Taylor series of 2^f = e^(f ln2) to degree 7: truncation error < 1e-8 on |f| <= 0.5.
  float p = 1.5252733804059840e-5f;
  p = fmadd(p, f, 1.5403530393381609e-4f);
  p = fmadd(p, f, 1.3333558146428443e-3f);
  p = fmadd(p, f, 9.6181291076284772e-3f);
  p = fmadd(p, f, 5.5504108664821580e-2f);
  p = fmadd(p, f, 2.4022650695910071e-1f);
  p = fmadd(p, f, 6.9314718055994531e-1f);
  p = fmadd(p, f, 1.0f);
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Leading dimension for float32 scratch rows: a multiple of 16 floats keeps every row
// 64-byte aligned. Vector loads that straddle cache lines measured ~1.6x slower in the
// micro-kernels, so all scratch operands use padded rows and aligned buffers.
inline int64_t padded_ld(int64_t n) { return (n + 15) & ~int64_t{15}; }

// x if keep, else +0.0f, with integer bit masking. The obvious `keep ? x : 0.0f` (or
// `x * (keep ? 1.f : 0.f)`) makes GCC move floating-point work into the branches, where under
// the default -ftrapping-math it "could trap", so the loop is not if-converted or vectorized.
inline float keep_if(float x, bool keep) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  u &= 0u - static_cast<uint32_t>(keep);
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// Runs f(u) once for each unit u in [0, n_units), on whichever of the threads sharing `next`
// (zero at the start) takes it: each thread takes the next unit when it is done with one, so a
// thread that runs slower takes fewer instead of holding up the others at the barrier.
template <typename F>
inline void take_units(std::atomic<int64_t>& next, int64_t n_units, F&& f) {
  for (int64_t u = next.fetch_add(1, std::memory_order_relaxed); u < n_units;
       u = next.fetch_add(1, std::memory_order_relaxed))
    f(u);
}

// take_units, where each thread claims the unit it computes next before it computes this one,
// so that f(u, ahead) can bring unit ahead's data into its cache while u computes (ahead is -1
// when there is none). While fewer than `keep_free` units are left, no unit is claimed ahead:
// a claimed unit cannot go to a thread that falls idle, so the last units stay free to take.
template <typename F>
inline void take_units_ahead(std::atomic<int64_t>& next, int64_t n_units, int64_t keep_free, F&& f) {
  int64_t u = next.fetch_add(1, std::memory_order_relaxed);
  while (u < n_units) {
    int64_t ahead = -1;
    if (n_units - u > keep_free) {
      ahead = next.fetch_add(1, std::memory_order_relaxed);
      if (ahead >= n_units) ahead = -1;
    }
    f(u, ahead);
    u = ahead >= 0 ? ahead : next.fetch_add(1, std::memory_order_relaxed);
  }
}

// The positions [front, back) of one thread's share of the work that nobody has taken yet: its
// owner takes them from the front, and a thread that has finished its own share takes them from
// the back. Both ends live in one word (32 bits each), so a taker moves its end with one
// compare-and-swap and the two can never take the same position.
class alignas(64) WorkClaims {
 public:
  // Positions [0, n_positions), n_positions < 2^32.
  void reset(int64_t n_positions) { ends_.store(static_cast<uint64_t>(n_positions) << 32, std::memory_order_relaxed); }
  // Half of the positions left (at least min_take of them) from the front (owner) or the back
  // (helper) into [*i0, *i1); false when none are left. Halving keeps the claims few: a
  // compare-and-swap is a locked instruction, which waits for the loads in flight, and claims of
  // 32 KiB of weights at a time made a T = 1 forward of SmolLM2-135M 7% slower than fixed halves
  // did (skinny_gemm.cpp).
  bool take(int64_t min_take, bool from_front, int64_t* i0, int64_t* i1) {
    uint64_t v = ends_.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t f = static_cast<int64_t>(v & 0xffffffffu), b = static_cast<int64_t>(v >> 32);
      if (f >= b) return false;
      const int64_t n = std::max(min_take, (b - f) / 2);
      const int64_t lo = from_front ? f : std::max(f, b - n), hi = from_front ? std::min(b, f + n) : b;
      const uint64_t next = from_front ? (v & ~uint64_t{0xffffffffu}) | static_cast<uint64_t>(hi)
                                       : (static_cast<uint64_t>(lo) << 32) | (v & 0xffffffffu);
      if (ends_.compare_exchange_weak(v, next, std::memory_order_relaxed)) {
        *i0 = lo;
        *i1 = hi;
        return true;
      }
    }
  }

 private:
  std::atomic<uint64_t> ends_{0};
};

// One WorkClaims per share of n items split evenly (share r: items [n * r / shares,
// n * (r + 1) / shares)), each counting the positions of per_position items its share covers.
inline std::vector<WorkClaims> even_share_claims(int64_t n, int64_t shares, int64_t per_position) {
  std::vector<WorkClaims> claims(static_cast<size_t>(shares));
  for (int64_t r = 0; r < shares; ++r) {
    const int64_t items = n * (r + 1) / shares - n * r / shares;
    claims[static_cast<size_t>(r)].reset((items + per_position - 1) / per_position);
  }
  return claims;
}

// The calling thread's part of work split into `shares` shares of positions, each with its
// WorkClaims: thread `tid` takes its own share from the front, then what is left of every other
// share from the back, and runs f(share, i0, i1) on each claim. Every position of every share is
// run exactly once, by some thread, once every thread of the team has returned.
template <typename F>
inline void take_shares(WorkClaims* claims, int64_t shares, int64_t min_take, int64_t tid, F&& f) {
  int64_t i0 = 0, i1 = 0;
  if (tid < shares)
    while (claims[tid].take(min_take, true, &i0, &i1)) f(tid, i0, i1);
  for (int64_t k = 1; k <= shares; ++k) {  // the others' shares, from the next one on
    const int64_t r = (tid + k) % shares;
    while (claims[r].take(min_take, false, &i0, &i1)) f(r, i0, i1);
  }
}

// Bytes [begin, begin + bytes) streamed into L2 a few cache lines per step() over `steps`
// steps: the data of a thread's next unit of work, fetched while the current one computes
// instead of in one serial burst when the next one starts. Default-constructed, it does nothing.
class PrefetchAhead {
 public:
  PrefetchAhead() = default;
  PrefetchAhead(const void* begin, int64_t bytes)
      : p_(static_cast<const char*>(begin)), end_(static_cast<const char*>(begin) + std::max<int64_t>(bytes, 0)) {}
  // Spread what is left over `steps` calls of step().
  void plan(int64_t steps) {
    const int64_t lines = (end_ - p_ + 63) / 64;
    lines_per_step_ = steps > 0 ? (lines + steps - 1) / steps : lines;
  }
  void step() {
    for (int64_t i = 0; i < lines_per_step_ && p_ < end_; ++i, p_ += 64) __builtin_prefetch(p_, 0, 2);  // L2
  }

 private:
  const char* p_ = nullptr;
  const char* end_ = nullptr;
  int64_t lines_per_step_ = 0;
};

// A growable 64-byte-aligned buffer of E private to the calling thread (OpenMP workers each
// get their own). `slot` separates buffers that are alive at the same time. Reusing them
// avoids a malloc, page faults and zeroing on every call of a kernel that runs once per layer
// per iteration. Contents are unspecified on return.
template <typename E = float>
inline E* thread_scratch(int slot, size_t n) {
  struct Buffer {
    E* data = nullptr;
    size_t size = 0;
    ~Buffer() { std::free(data); }
  };
  constexpr int kSlots = 8;
  thread_local Buffer bufs[kSlots];
  Buffer& b = bufs[slot];
  if (b.size < n) {
    std::free(b.data);
    b.data = nullptr;
    b.size = 0;
    const size_t bytes = ((n * sizeof(E)) + 63) & ~size_t{63};
    b.data = static_cast<E*>(std::aligned_alloc(64, bytes));
    if (b.data == nullptr) throw std::bad_alloc();
    b.size = n;
  }
  return b.data;
}

}  // namespace detail
}  // namespace cpu
}  // namespace orca
