// Microbenchmark of the CUDA slab_write: scatter T tokens' K and V rows ([Hkv*D] each) into random
// slots of the caches. Validates first against the shared reference (bench/common/reference.h):
// every written slot equals its token's row and every other slot is untouched, bit for bit;
// tokens with out-of-range slots are skipped. Then prints the time per call and GB/s (bytes read +
// written) next to the measured copy ceiling. Timing: CUDA graph replays (bench_util.cuh),
// rotating over copies of the caches and of the new rows, so that calls do not hit in L2.
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
  BENCH_CHECK(kern::slab_write(dt, it, dkc.ptr, dvc.ptr, dk.ptr, dv.ptr, ds.ptr, n_tokens, n_slots, row, nullptr));
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
  const double bytes = 2.0 * 2.0 * n_tokens * double(row) * sizeof(T) + n_tokens * sizeof(I);
  // Rotation sized by the caches (the scattered rows land anywhere in them), at most 4 copies.
  const int copies = std::min(4, rotation_copies(2.0 * n_slots * double(row) * sizeof(T)));
  std::vector<std::unique_ptr<DevBuf<T>>> kcs, vcs, ks, vs;
  for (int c = 0; c < copies; ++c) {
    kcs.push_back(std::make_unique<DevBuf<T>>(kc0));
    vcs.push_back(std::make_unique<DevBuf<T>>(vc0));
    ks.push_back(std::make_unique<DevBuf<T>>(k));
    vs.push_back(std::make_unique<DevBuf<T>>(v));
  }
  const KernelTime kt = kernel_time(
      [&](cudaStream_t stream, int i) {
        const int c = i % copies;
        return kern::slab_write(dt, it, kcs[c]->ptr, vcs[c]->ptr, ks[c]->ptr, vs[c]->ptr, ds.ptr, n_tokens, n_slots,
                                row, stream);
      },
      args);
  const double us = kt.us();
  const double gbps = bytes / (us * 1e-6) / 1e9;
  std::printf("slab_write T=%-5d %8.2f us (%s; back-to-back %.2f us)  %7.1f GB/s (%5.1f%% of copy %.0f GB/s)\n",
              n_tokens, us, kt.method(), kt.b2b_us, gbps, 100.0 * gbps / copy_gbps, copy_gbps);
  Result r;
  r.str("bench", "slab_write").str("dtype", type_name<T>()).num("T", n_tokens).num("Hkv", hkv).num("D", d);
  add_timing(r, kt);
  r.num("gbps", gbps).num("copy_gbps", copy_gbps).num("pct_of_copy", 100.0 * gbps / copy_gbps)
      .num("rotated_copies", copies).print();
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
