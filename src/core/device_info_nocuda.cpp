// Device discovery for builds without nvcc: no CUDA devices.
#include "sonicmoe/device.hpp"

namespace sonicmoe {

bool built_with_cuda() { return false; }
int cuda_device_count() { return 0; }
std::string cuda_device_description(int) { return {}; }

}  // namespace sonicmoe

#include "sonicmoe/profiling.hpp"

namespace sonicmoe {
void enable_stage_timing(bool) {}
std::vector<StageTime> collect_stage_timings() { return {}; }
}  // namespace sonicmoe
