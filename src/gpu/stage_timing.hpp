// Stage boundaries for sonicmoe/profiling.hpp: mark_stage(name) starts a stage (ending the previous one);
// mark_stage(nullptr) ends the current one.
#pragma once

#include <cuda_runtime.h>

namespace sonicmoe::gpu {

void mark_stage(const char* name, cudaStream_t stream);

}  // namespace sonicmoe::gpu
