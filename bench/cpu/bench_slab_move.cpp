// Microbenchmark of the CPU slab_move kernel (slab compaction: move rows inside every KV pool).
// 1. Validates against the shared reference (bench/common/reference.h) bit for bit: random move
//    lists with disjoint and overlapping ranges in both directions, moves that depend on earlier
//    ones, odd row sizes, one pool and many.
//    Exits 1 on any mismatch.
// 2. Times a compaction of SmolLM2-135M's pools (30 layers x K and V = 60 pools, Hkv=3, D=64):
//    32 slabs of 256 cached rows each, every one slid down past a freed gap. GB/s counts the
//    bytes read plus written, to compare with the memcpy ceiling (read + write).
#include <cstdio>
#include <cstring>
#include <vector>

#include "bench_util.h"
#include "common/reference.h"
#include "cpu/cpu_kernels.h"

namespace {

bool check_case(int64_t n_pools, int64_t n_slots, int64_t row_bytes, int n_moves, uint64_t seed) {
  bench::Rng rng(seed);
  std::vector<unsigned char> pools(static_cast<size_t>(n_pools * n_slots * row_bytes));
  for (auto& b : pools) b = static_cast<unsigned char>(rng.next());
  std::vector<unsigned char> want = pools;
  std::vector<int64_t> moves;
  for (int m = 0; m < n_moves; ++m) {
    const int64_t n = rng.randint(0, n_slots / 2);
    const int64_t src = rng.randint(0, n_slots - n);
    // Half the moves shift by less than their length: overlapping source and destination.
    const int64_t dst = m % 2 ? std::max<int64_t>(0, std::min(n_slots - n, src + rng.randint(-n, n)))
                              : rng.randint(0, n_slots - n);
    moves.insert(moves.end(), {src, dst, n});
  }
  orca::cpu::slab_move(pools.data(), n_pools, n_slots, row_bytes, moves.data(), n_moves);
  bench::ref::slab_move(want.data(), n_pools, n_slots, row_bytes, moves.data(), n_moves);
  char name[160];
  std::snprintf(name, sizeof name, "slab_move P=%lld S=%lld row=%lldB moves=%d", static_cast<long long>(n_pools),
                static_cast<long long>(n_slots), static_cast<long long>(row_bytes), n_moves);
  if (std::memcmp(pools.data(), want.data(), pools.size()) != 0) {
    std::printf("FAIL %s: pools differ from the reference\n", name);
    return false;
  }
  std::printf("ok   %s\n", name);
  return true;
}

bool validate_all() {
  bool ok = true;
  uint64_t seed = 1;
  const int64_t rows[] = {1, 26, 3 * 64 * 4, 2 * 80 * 2};
  for (int64_t r : rows) {
    ok &= check_case(1, 50, r, 7, ++seed);
    ok &= check_case(60, 333, r, 12, ++seed);
  }
  ok &= check_case(4, 1, 8, 3, ++seed);  // a single slot: only empty and self moves
  return ok;
}

void perf(const bench::Ceilings& c) {
  const int64_t n_pools = 60, row_bytes = 3 * 64 * 4, slab = 256, gap = 64, n_slabs = 32;
  const int64_t n_slots = n_slabs * (slab + gap);
  std::vector<unsigned char> pools(static_cast<size_t>(n_pools * n_slots * row_bytes), 1);
  std::vector<int64_t> moves;  // slab i at i*(slab+gap)+gap slides down to i*slab
  for (int64_t i = 0; i < n_slabs; ++i) moves.insert(moves.end(), {i * (slab + gap) + gap, i * slab, slab});
  const bench::Timing t = bench::time_calls(
      [&] { orca::cpu::slab_move(pools.data(), n_pools, n_slots, row_bytes, moves.data(), n_slabs); }, 11, 2);
  const double bytes = 2.0 * static_cast<double>(n_pools * n_slabs * slab * row_bytes);
  char label[96];
  std::snprintf(label, sizeof label, "slab_move f32 compaction %lld slabs x %lld rows", static_cast<long long>(n_slabs),
                static_cast<long long>(slab));
  bench::report(label, t, 0.0, bytes, c);
}

}  // namespace

int main(int argc, char** argv) {
  return bench::finish_main(argc, argv, validate_all(), [](const bench::Ceilings& c) { perf(c); });
}
