// Per-device facts the launchers need on the host (cached: cudaDeviceGetAttribute is cheap but
// the launchers run once per layer per iteration).
#include <atomic>

#include "cuda/common.cuh"

namespace orca::kernels::detail {
namespace {

constexpr int kMaxDevices = 64;

// `attr` of the current device, cached per device in `cache` (0 = not queried yet); 0 on error.
int cached_attribute(std::atomic<int> (&cache)[kMaxDevices], cudaDeviceAttr attr) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  if (dev >= 0 && dev < kMaxDevices) {
    const int cached = cache[dev].load(std::memory_order_relaxed);
    if (cached > 0) return cached;
  }
  int value = 0;
  if (cudaDeviceGetAttribute(&value, attr, dev) != cudaSuccess) return 0;
  if (dev >= 0 && dev < kMaxDevices) cache[dev].store(value, std::memory_order_relaxed);
  return value;
}

}  // namespace

int current_device_sm_count() {
  static std::atomic<int> cache[kMaxDevices];
  return cached_attribute(cache, cudaDevAttrMultiProcessorCount);
}

size_t current_device_max_pitch() {
  static std::atomic<int> cache[kMaxDevices];
  const int pitch = cached_attribute(cache, cudaDevAttrMaxPitch);
  return pitch > 0 ? static_cast<size_t>(pitch) : 0;
}

}  // namespace orca::kernels::detail
