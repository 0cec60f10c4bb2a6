// Stage boundaries for machmoe/profiling.hpp: mark_stage(name) starts a stage (ending the previous one);
// mark_stage(nullptr) ends the current one.
#pragma once

#include <cuda_runtime.h>

namespace machmoe::gpu {

void mark_stage(const char* name, cudaStream_t stream);

}  // namespace machmoe::gpu
