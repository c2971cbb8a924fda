// Microbenchmark of the CUDA slab_write: scatter T tokens' K and V rows ([Hkv*D] each) into random
// slots of the caches. Validates first against the shared reference (bench/common/reference.h):
// every written slot equals its token's row and every other slot is untouched, bit for bit;
// tokens with out-of-range slots are skipped. Then prints the median time and GB/s (bytes read +
// written) next to the measured copy ceiling.
#include <numeric>

#include "bench_util.cuh"
#include "common/reference.h"
#include "cuda/launchers.h"

namespace {

using namespace bench;
namespace kern = orca::kernels;

template <typename T, typename I>
bool run_case(int n_tokens, int n_slots, int hkv, int d, bool bad_slots, const Args& args, double copy_gbps,
              uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t row = int64_t(hkv) * d;
  std::vector<I> slots(n_slots);
  std::iota(slots.begin(), slots.end(), I(0));
  std::shuffle(slots.begin(), slots.end(), rng);
  slots.resize(n_tokens);  // distinct random slots
  if (bad_slots) {
    slots[0] = I(-1);
    if (n_tokens > 1) slots[1] = I(n_slots);  // one past the end: must be skipped
  }
  const std::vector<T> k = random_vec<T>(size_t(n_tokens) * row, rng);
  const std::vector<T> v = random_vec<T>(size_t(n_tokens) * row, rng);
  const std::vector<T> kc0 = random_vec<T>(size_t(n_slots) * row, rng);
  const std::vector<T> vc0 = random_vec<T>(size_t(n_slots) * row, rng);
  DevBuf<T> dk(k), dv(v), dkc(kc0), dvc(vc0);
  DevBuf<I> ds(slots);
  const kern::DType dt = dtype_of<T>();
  const kern::IndexType it = index_type_of<I>();
  auto launch = [&] {
    BENCH_CHECK(kern::slab_write(dt, it, dkc.ptr, dvc.ptr, dk.ptr, dv.ptr, ds.ptr, n_tokens, n_slots, row, nullptr));
  };
  launch();
  BENCH_CHECK(cudaDeviceSynchronize());
  std::vector<T> kc = kc0, vc = vc0;  // expected caches
  ref::slab_write(kc.data(), vc.data(), k.data(), v.data(), slots.data(), n_tokens, n_slots, row);
  const std::vector<T> gk = dkc.download(), gv = dvc.download();
  const bool same = std::memcmp(gk.data(), kc.data(), kc.size() * sizeof(T)) == 0 &&
                    std::memcmp(gv.data(), vc.data(), vc.size() * sizeof(T)) == 0;
  char label[160];
  std::snprintf(label, sizeof label, "slab_write T=%d S=%d Hkv=%d D=%d (%s, int%d%s)", n_tokens, n_slots, hkv, d,
                type_name<T>(), int(sizeof(I) * 8), bad_slots ? ", bad slots" : "");
  if (!same) {
    std::printf("VALIDATION FAILED %s: caches differ from the expected scatter\n", label);
    return false;
  }
  std::printf("validated %s\n", label);
  if (args.small || copy_gbps != copy_gbps) return true;
  const double ms = median_ms(launch, args.warmup, args.reps);
  const double bytes = 2.0 * 2.0 * n_tokens * double(row) * sizeof(T) + n_tokens * sizeof(I);
  const double gbps = bytes / (ms * 1e-3) / 1e9;
  std::printf("slab_write T=%-5d median %8.2f us  %7.1f GB/s (%5.1f%% of copy %.0f GB/s)\n", n_tokens, ms * 1e3, gbps,
              100.0 * gbps / copy_gbps, copy_gbps);
  Result()
      .str("bench", "slab_write")
      .str("dtype", type_name<T>())
      .num("T", n_tokens)
      .num("Hkv", hkv)
      .num("D", d)
      .num("median_us", ms * 1e3)
      .num("gbps", gbps)
      .num("copy_gbps", copy_gbps)
      .num("pct_of_copy", 100.0 * gbps / copy_gbps)
      .print();
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse_args(argc, argv);
  bool ok = true;
  ok &= run_case<__nv_bfloat16, int32_t>(37, 500, 8, 128, true, args, NAN, 1);
  ok &= run_case<__half, int64_t>(5, 64, 3, 80, false, args, NAN, 2);
  ok &= run_case<float, int32_t>(11, 99, 2, 24, true, args, NAN, 3);
  ok &= run_case<__nv_bfloat16, int64_t>(9, 40, 3, 7, false, args, NAN, 4);  // 42-byte rows: scalar path
  if (!ok) return 1;
  if (args.small) return 0;
  const double copy = copy_ceiling_gbps();
  std::printf("copy ceiling (cudaMemcpy D2D, read+write): %.1f GB/s\n", copy);
  ok &= run_case<__nv_bfloat16, int64_t>(64, 16384, 8, 128, false, args, copy, 10);
  ok &= run_case<__nv_bfloat16, int64_t>(256, 16384, 8, 128, false, args, copy, 11);
  ok &= run_case<__nv_bfloat16, int64_t>(8192, 16384, 8, 128, false, args, copy, 12);
  return ok ? 0 : 1;
}
