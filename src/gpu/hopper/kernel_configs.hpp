// The kernel configurations that exist (one per translation unit in instantiations/) and the launcher that
// each of those units instantiates. Host code (dispatch.cpp) includes this; it holds no device code.
#pragma once

#include <cuda_runtime.h>

#include "gpu/hopper/grouped_gemm_params.hpp"

namespace sonicmoe::gpu::hopper {

template <class Config>
void launch_grouped_gemm(const GroupedGemmParams& p, int sm_count, cudaStream_t stream);

/// Up-projection: X rows gathered by cp.async, 128 x 128 tiles (64 A columns for GLU), 5 stages, activation
/// epilogue. 5 x 32 KiB ring + 2 x 17 KiB staging = 197 KiB of shared memory. One per activation.
template <Activation kAct>
using UpGatherConfig = KernelConfig<128, 5, true, EpilogueKind::kUpActivation, kAct>;
/// Down-projection: contiguous A by TMA, 128 x 128 tiles, 5 stages, bias epilogue.
using DownConfig = KernelConfig<128, 5, false, EpilogueKind::kStore>;

#define SONICMOE_UP_CONFIG(act) \
  extern template void launch_grouped_gemm<UpGatherConfig<act>>(const GroupedGemmParams&, int, cudaStream_t);
SONICMOE_UP_CONFIG(Activation::kSwiGLU)
SONICMOE_UP_CONFIG(Activation::kGeGLU)
SONICMOE_UP_CONFIG(Activation::kReGLU)
SONICMOE_UP_CONFIG(Activation::kReLUSquared)
SONICMOE_UP_CONFIG(Activation::kReLU)
SONICMOE_UP_CONFIG(Activation::kGELU)
SONICMOE_UP_CONFIG(Activation::kSiLU)
#undef SONICMOE_UP_CONFIG
extern template void launch_grouped_gemm<DownConfig>(const GroupedGemmParams&, int, cudaStream_t);

}  // namespace sonicmoe::gpu::hopper
