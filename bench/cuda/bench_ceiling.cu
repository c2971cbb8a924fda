// Device memory ceiling: cudaMemcpy device-to-device bandwidth (bytes read + written) at a few
// sizes, plus a plain 16-byte grid-stride copy kernel, so the kernel benchmarks have a measured
// roof to compare against. The bf16 GEMM ceiling needs cuBLAS and comes from bench/gpu_reference.py.
#include "bench_util.cuh"

namespace {

__global__ void copy_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

}  // namespace

int main(int argc, char** argv) {
  const bench::Args args = bench::parse_args(argc, argv);
  cudaDeviceProp prop{};
  BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);

  const size_t sizes[] = {size_t(64) << 20, size_t(256) << 20, size_t(1) << 30};
  double best = 0.0;
  for (size_t bytes : sizes) {
    if (args.small && bytes > (size_t(64) << 20)) break;
    const double gbps = bench::copy_ceiling_gbps(bytes, args.reps);
    best = std::max(best, gbps);
    std::printf("cudaMemcpy D2D %6zu MiB: %8.1f GB/s (read+write)\n", bytes >> 20, gbps);
    bench::Result().str("bench", "copy_memcpy").num("mib", double(bytes >> 20)).num("gbps", gbps).print();
  }

  // Validate then time the copy kernel on 1 GiB (64 MiB with --small).
  const size_t bytes = args.small ? size_t(64) << 20 : size_t(1) << 30;
  const size_t n = bytes / sizeof(uint4);
  std::mt19937_64 rng(7);
  std::vector<uint32_t> host(bytes / 4);
  for (auto& x : host) x = static_cast<uint32_t>(rng());
  bench::DevBuf<uint32_t> src(host), dst(host.size());
  const int blocks = prop.multiProcessorCount * 8;
  copy_kernel<<<blocks, 256>>>(reinterpret_cast<const uint4*>(src.ptr), reinterpret_cast<uint4*>(dst.ptr), n);
  BENCH_CHECK(cudaDeviceSynchronize());
  if (dst.download() != host) {
    std::printf("VALIDATION FAILED copy_kernel: destination differs from source\n");
    return 1;
  }
  std::printf("validated copy_kernel: %zu bytes\n", bytes);
  const double ms = bench::event_median_ms(
      [&] {
        copy_kernel<<<blocks, 256>>>(reinterpret_cast<const uint4*>(src.ptr), reinterpret_cast<uint4*>(dst.ptr), n);
      },
      args.warmup, args.reps);
  const double kernel_gbps = 2.0 * double(bytes) / (ms * 1e-3) / 1e9;
  std::printf("copy kernel %zu MiB: %.1f GB/s (%.3f ms)\n", bytes >> 20, kernel_gbps, ms);
  bench::Result().str("bench", "copy_kernel").num("mib", double(bytes >> 20)).num("gbps", kernel_gbps).print();
  bench::Result().str("bench", "copy_ceiling").num("gbps", std::max(best, kernel_gbps)).str("device", prop.name).print();
  return 0;
}
