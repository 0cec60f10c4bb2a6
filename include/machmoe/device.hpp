// What this build and this machine can run.
#pragma once

#include <string>

namespace machmoe {

/// True when the library was compiled with its CUDA sources (nvcc was found at configure time).
bool built_with_cuda();
/// Number of usable CUDA devices; 0 when the build has no CUDA or no driver/GPU is present. Never throws.
int cuda_device_count();
/// "NVIDIA H100 80GB HBM3 (sm_90, 132 SMs, 79 GiB, 3352 GB/s)"; empty when the ordinal is not a usable device.
std::string cuda_device_description(int ordinal);
/// A usable device's peak memory bandwidth in GB/s, from the driver's memory clock and bus width (two transfers a
/// clock: 3352 on an H100 SXM, about 4900 on an H200); 0 when the ordinal is not a usable device or the driver does not
/// report it. Never throws. Some tile choices differ between an H100 and an H200 by it.
long long cuda_memory_bandwidth_gbps(int ordinal);
/// Compute capability of a usable device as 10 major + minor (90 for an H100 or H200); 0 when the ordinal is not a
/// usable device or the build has no CUDA. Never throws. The CUDA build carries kernels for sm_90a only, so the layer
/// on a CUDA device takes compute capability 90 and refuses others with an error that says so.
int cuda_compute_capability(int ordinal);
/// A usable device's streaming multiprocessors (132 on an H100 SXM or H200); 0 when the ordinal is not a usable device
/// or the build has no CUDA. Never throws. The expert GEMMs' persistent grids take this many SMs, less the SM margin
/// (sm_margin.hpp).
int cuda_sm_count(int ordinal);
/// The one compute capability the CUDA build's kernels run on (sm_90a: H100, H200).
inline constexpr int kCudaComputeCapability = 90;

}  // namespace machmoe
