// CUDA device discovery. Compiled only when nvcc is available; never throws, so a machine without a driver or a
// GPU (CI) simply reports zero devices.
#include <cuda_runtime.h>

#include <atomic>
#include <string>

#include "machmoe/device.hpp"

namespace machmoe {

bool built_with_cuda() { return true; }

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no driver" / "no device" error
    return 0;
  }
  return count;
}

std::string cuda_device_description(int ordinal) {
  cudaDeviceProp prop{};
  if (ordinal < 0 || ordinal >= cuda_device_count() || cudaGetDeviceProperties(&prop, ordinal) != cudaSuccess) {
    (void)cudaGetLastError();
    return {};
  }
  return std::string(prop.name) + " (sm_" + std::to_string(prop.major) + std::to_string(prop.minor) + ", " +
         std::to_string(prop.multiProcessorCount) + " SMs, " +
         std::to_string(prop.totalGlobalMem / (1024ull * 1024ull * 1024ull)) + " GiB, " +
         std::to_string(cuda_memory_bandwidth_gbps(ordinal)) + " GB/s)";
}

long long cuda_memory_bandwidth_gbps(int ordinal) {
  int clock_khz = 0, bus_bits = 0;
  if (ordinal < 0 || ordinal >= cuda_device_count() ||
      cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, ordinal) != cudaSuccess ||
      cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, ordinal) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  // Two transfers a clock of bus_bits / 8 bytes: 2 x clock_khz x 1e3 x bus_bits / 8 bytes a second, / 1e9 for GB/s.
  return 2LL * clock_khz * bus_bits / 8 / 1000000;
}

namespace {

/// query(ordinal), remembered per ordinal once it is nonzero (a device's properties do not change while a process
/// runs); 0 for a negative ordinal or a failed query. Each caller passes its own Cache (one per property).
constexpr int kCachedOrdinals = 64;
using Cache = std::atomic<int>[kCachedOrdinals];

template <class Query>
int cached_per_ordinal(Cache& cache, int ordinal, Query&& query) {
  if (ordinal < 0) return 0;
  if (ordinal < kCachedOrdinals) {
    const int v = cache[ordinal].load(std::memory_order_relaxed);
    if (v != 0) return v;
  }
  const int v = query();
  if (v != 0 && ordinal < kCachedOrdinals) cache[ordinal].store(v, std::memory_order_relaxed);
  return v;
}

}  // namespace

int cuda_compute_capability(int ordinal) {
  // Cached: every argument check of a CUDA view asks (ArgChecker::device), a dozen times a layer call.
  static Cache cache;
  return cached_per_ordinal(cache, ordinal, [ordinal] {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ordinal) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, ordinal) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return 10 * major + minor;
  });
}

int cuda_sm_count(int ordinal) {
  // Cached: every GPU layer call under an SM margin asks (core/layer.cpp, the margin's check).
  static Cache cache;
  return cached_per_ordinal(cache, ordinal, [ordinal] {
    int count = 0;
    if (ordinal >= cuda_device_count() ||
        cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, ordinal) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return count;
  });
}

}  // namespace machmoe
