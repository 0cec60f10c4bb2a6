// Device discovery for builds without nvcc: no CUDA devices.
#include "machmoe/device.hpp"

namespace machmoe {

bool built_with_cuda() { return false; }
int cuda_device_count() { return 0; }
std::string cuda_device_description(int) { return {}; }
int cuda_compute_capability(int) { return 0; }
int cuda_sm_count(int) { return 0; }
long long cuda_memory_bandwidth_gbps(int) { return 0; }

}  // namespace machmoe

#include "machmoe/profiling.hpp"

namespace machmoe {
void enable_stage_timing(bool) {}
std::vector<StageTime> collect_stage_timings() { return {}; }
}  // namespace machmoe
