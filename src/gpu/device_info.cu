// CUDA device discovery. Compiled only when nvcc is available; never throws, so a machine without a driver or a
// GPU (CI) simply reports zero devices.
#include <cuda_runtime.h>

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
         std::to_string(prop.totalGlobalMem / (1024ull * 1024ull * 1024ull)) + " GiB)";
}

}  // namespace machmoe
