// What this build and this machine can run.
#pragma once

#include <string>

namespace machmoe {

/// True when the library was compiled with its CUDA sources (nvcc was found at configure time).
bool built_with_cuda();
/// Number of usable CUDA devices; 0 when the build has no CUDA or no driver/GPU is present. Never throws.
int cuda_device_count();
/// "NVIDIA H100 80GB HBM3 (sm_90, 132 SMs)"; empty when the ordinal is not a usable device.
std::string cuda_device_description(int ordinal);

}  // namespace machmoe
