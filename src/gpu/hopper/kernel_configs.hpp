// The kernel configurations that exist (one per translation unit in instantiations/) and the launcher that
// each of those units instantiates. Host code (dispatch.cpp) includes this; it holds no device code.
#pragma once

#include <cuda_runtime.h>

#include "gpu/hopper/grouped_gemm_params.hpp"

namespace machmoe::gpu::hopper {

template <class Config>
void launch_grouped_gemm(const GroupedGemmParams& p, int sm_count, cudaStream_t stream);

// Up-projection: X rows gathered by cp.async, activation epilogue, one configuration per activation.
/// 128 x 128 tiles (64 A columns for GLU), ping-pong, 5 stages: 5 x 32 KiB ring + 2 x 16 KiB staging.
template <Activation kAct>
using UpPingPongConfig = KernelConfig<128, 5, true, EpilogueKind::kUpActivation, Schedule::kPingPong, kAct>;
/// 128 x 256 tiles, cooperative, 4 stages: 4 x 48 KiB ring + 2 x 16 KiB staging (N a multiple of 256). Clusters of
/// 2 CTAs along M: each loads half of the W1 tile and multicasts it to both (half the weight traffic from L2;
/// measured equal on 1.4B/7B and 4 % faster on 120B (2048,64,4) than the cluster-free kernel, BENCHMARKS.md).
template <Activation kAct>
using UpCooperativeConfig = KernelConfig<256, 4, true, EpilogueKind::kUpActivation, Schedule::kCooperative, kAct, 2>;
// Down-projection: contiguous A by TMA, bias epilogue. No clusters: multicasting W2 across 2-CTA clusters measured
// equal or up to 2.5 % slower on six configurations (BENCHMARKS.md), so it was not kept.
using DownPingPongConfig = KernelConfig<128, 5, false, EpilogueKind::kStore, Schedule::kPingPong>;
using DownCooperativeConfig = KernelConfig<256, 4, false, EpilogueKind::kStore, Schedule::kCooperative>;

#define MACHMOE_UP_CONFIGS(act)                                                                               \
  extern template void launch_grouped_gemm<UpPingPongConfig<act>>(const GroupedGemmParams&, int, cudaStream_t); \
  extern template void launch_grouped_gemm<UpCooperativeConfig<act>>(const GroupedGemmParams&, int, cudaStream_t);
MACHMOE_UP_CONFIGS(Activation::kSwiGLU)
MACHMOE_UP_CONFIGS(Activation::kGeGLU)
MACHMOE_UP_CONFIGS(Activation::kReGLU)
MACHMOE_UP_CONFIGS(Activation::kReLUSquared)
MACHMOE_UP_CONFIGS(Activation::kReLU)
MACHMOE_UP_CONFIGS(Activation::kGELU)
MACHMOE_UP_CONFIGS(Activation::kSiLU)
#undef MACHMOE_UP_CONFIGS
extern template void launch_grouped_gemm<DownPingPongConfig>(const GroupedGemmParams&, int, cudaStream_t);
extern template void launch_grouped_gemm<DownCooperativeConfig>(const GroupedGemmParams&, int, cudaStream_t);

}  // namespace machmoe::gpu::hopper
