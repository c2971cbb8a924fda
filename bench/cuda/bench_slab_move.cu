// Microbenchmark of the CUDA slab_move (slab compaction: move rows inside every KV pool with
// 2-D device copies). Validates first against the shared reference (bench/common/reference.h),
// bit for bit: random move lists with disjoint and overlapping ranges in both directions, with a
// scratch buffer (staged copies) and without one (shift-sized pieces). Then times a compaction of
// Llama-3-8B-shaped pools (32 layers x K and V = 64 pools, Hkv=8, D=128, bf16) and prints GB/s
// (bytes read + written) next to the measured copy ceiling.
#include <algorithm>
#include <cstring>
#include <random>

#include "bench_util.cuh"
#include "common/reference.h"
#include "cuda/launchers.h"

namespace {

using namespace bench;
namespace kern = orca::kernels;

bool run_case(int64_t n_pools, int64_t n_slots, int64_t row_bytes, int n_moves, size_t scratch_rows, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<unsigned char> host(size_t(n_pools * n_slots * row_bytes));
  for (auto& b : host) b = static_cast<unsigned char>(rng());
  std::vector<int64_t> moves;
  for (int m = 0; m < n_moves; ++m) {
    const int64_t n = int64_t(rng() % uint64_t(n_slots / 2 + 1));
    const int64_t src = int64_t(rng() % uint64_t(n_slots - n + 1));
    const int64_t shift = int64_t(rng() % uint64_t(2 * n + 1)) - n;  // often overlapping
    const int64_t dst = std::max<int64_t>(0, std::min(n_slots - n, src + shift));
    moves.insert(moves.end(), {src, dst, n});
  }
  DevBuf<unsigned char> pools(host);
  const size_t scratch_bytes = scratch_rows * size_t(n_pools * row_bytes);
  DevBuf<unsigned char> scratch(scratch_bytes);
  BENCH_CHECK(kern::slab_move(pools.ptr, n_pools, n_slots, row_bytes, moves.data(), n_moves,
                              scratch_rows ? scratch.ptr : nullptr, scratch_bytes, nullptr));
  BENCH_CHECK(cudaDeviceSynchronize());
  ref::slab_move(host.data(), n_pools, n_slots, row_bytes, moves.data(), n_moves);
  const std::vector<unsigned char> got = pools.download();
  char label[160];
  std::snprintf(label, sizeof label, "slab_move P=%lld S=%lld row=%lldB moves=%d scratch=%zu rows",
                (long long)n_pools, (long long)n_slots, (long long)row_bytes, n_moves, scratch_rows);
  if (std::memcmp(got.data(), host.data(), host.size()) != 0) {
    std::printf("VALIDATION FAILED %s: pools differ from the reference\n", label);
    return false;
  }
  std::printf("validated %s\n", label);
  return true;
}

void perf(const Args& args, double copy_gbps) {
  const int64_t n_pools = 64, row_bytes = 8 * 128 * 2, slab = 1024, gap = 256, n_slabs = 16;
  const int64_t n_slots = n_slabs * (slab + gap);
  DevBuf<unsigned char> pools(std::vector<unsigned char>(size_t(n_pools * n_slots * row_bytes), 1));
  std::vector<int64_t> moves;  // slab i at i*(slab+gap)+gap slides down to i*slab
  for (int64_t i = 0; i < n_slabs; ++i) moves.insert(moves.end(), {i * (slab + gap) + gap, i * slab, slab});
  const size_t scratch_bytes = size_t(64) << 20;
  DevBuf<unsigned char> scratch(scratch_bytes);
  // The same moves every call (after the first the rows are already in place, but the same bytes
  // are copied): the 2-D copies are graph-capturable, so kernel_time replays them in a graph.
  const KernelTime kt = kernel_time(
      [&](cudaStream_t stream, int) {
        return kern::slab_move(pools.ptr, n_pools, n_slots, row_bytes, moves.data(), n_slabs, scratch.ptr,
                               scratch_bytes, stream);
      },
      args);
  const double us = kt.us();
  const double bytes = 2.0 * double(n_pools * n_slabs * slab * row_bytes);
  const double gbps = bytes / (us * 1e-6) / 1e9;
  std::printf("slab_move compaction %lld slabs x %lld rows  %8.2f us (%s; b2b %.2f)  %7.1f GB/s (%5.1f%% of copy %.0f GB/s)\n",
              (long long)n_slabs, (long long)slab, us, kt.method(), kt.b2b_us, gbps, 100.0 * gbps / copy_gbps,
              copy_gbps);
  Result r;
  r.str("bench", "slab_move").num("pools", double(n_pools)).num("rows_moved", double(n_slabs * slab));
  add_timing(r, kt);
  r.num("gbps", gbps).num("copy_gbps", copy_gbps).num("pct_of_copy", 100.0 * gbps / copy_gbps).print();
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse_args(argc, argv);
  bool ok = true;
  ok &= run_case(1, 50, 6, 9, 0, 1);
  ok &= run_case(60, 333, 768, 12, 0, 2);
  ok &= run_case(60, 333, 768, 12, 40, 3);
  ok &= run_case(3, 97, 26, 20, 7, 4);
  if (!ok) return 1;
  if (args.small) return 0;
  perf(args, copy_ceiling_gbps());
  return 0;
}
