// Each kernel family as a combination of pieces (kernel.cuh): mainloop + epilogue + scheduler. A new kernel (the
// backward's dH and dX~) is a new line here, not a fork. Included only by instantiations/*.cu.
#pragma once

#include "gpu/hopper/epilogue_activation.cuh"
#include "gpu/hopper/epilogue_activation_grad.cuh"
#include "gpu/hopper/epilogue_store.cuh"
#include "gpu/hopper/epilogue_wgrad.cuh"
#include "gpu/hopper/kernel.cuh"
#include "gpu/hopper/kernel_families.hpp"
#include "gpu/hopper/mainloop_varlen_k.cuh"
#include "gpu/hopper/mainloop_varlen_m.cuh"
#include "gpu/hopper/tile_scheduler.cuh"
#include "gpu/hopper/tile_scheduler_varlen_k.cuh"

namespace machmoe::gpu::hopper {

template <class Tile, Activation kAct>
using UpProjectionKernel = PersistentKernel<Tile, MainloopVarlenM<Tile, OperandA::kGathered>,
                                            EpilogueActivation<Tile, kAct>, ClusterTiles<Tile>>;

template <class Tile>
using DownProjectionKernel =
    PersistentKernel<Tile, MainloopVarlenM<Tile, OperandA::kContiguous>, EpilogueStore<Tile>, ClusterTiles<Tile>>;

template <class Tile>
using DxExpandedKernel = PersistentKernel<Tile, MainloopVarlenM<Tile, OperandA::kContiguous, Major::kMN>,
                                          EpilogueStore<Tile>, ClusterTiles<Tile>>;

/// Weight gradients (varlen-K): dW2 = dO^T A' (A = dO gathered, B = A' contiguous), dW1 = dH^T X (A = dH
/// contiguous, B = X gathered).
template <class Tile, OperandK kA, OperandK kB>
using WeightGradKernel =
    PersistentKernel<Tile, MainloopVarlenK<Tile, kA, kB>, EpilogueWgrad<Tile>, VarlenKTiles<Tile>>;

template <class Tile, Activation kAct>
using DhKernel = PersistentKernel<Tile, MainloopVarlenM<Tile, OperandA::kGathered, Major::kMN>,
                                  EpilogueActivationGrad<Tile, kAct>, ClusterTiles<Tile>>;

template <class Tile, Activation kAct>
void launch_up_projection(const UpProjectionParams& p, int usable_sms, cudaStream_t stream) {
  launch_kernel<UpProjectionKernel<Tile, kAct>>(p, usable_sms, stream);
}

template <class Tile>
void launch_down_projection(const DownProjectionParams& p, int usable_sms, cudaStream_t stream) {
  launch_kernel<DownProjectionKernel<Tile>>(p, usable_sms, stream);
}

template <class Tile>
void launch_dx_expanded(const DownProjectionParams& p, int usable_sms, cudaStream_t stream) {
  launch_kernel<DxExpandedKernel<Tile>>(p, usable_sms, stream);
}

template <class Tile, Activation kAct>
void launch_dh_kernel(const DhKernelParams& p, int usable_sms, cudaStream_t stream) {
  launch_kernel<DhKernel<Tile, kAct>>(p, usable_sms, stream);
}

template <class Tile>
void launch_weight_grad_dw2(const WeightGradParams& p, int usable_sms, cudaStream_t stream) {
  launch_kernel<WeightGradKernel<Tile, OperandK::kGathered, OperandK::kContiguous>>(p, usable_sms, stream);
}

template <class Tile>
void launch_weight_grad_dw1(const WeightGradParams& p, int usable_sms, cudaStream_t stream) {
  launch_kernel<WeightGradKernel<Tile, OperandK::kContiguous, OperandK::kGathered>>(p, usable_sms, stream);
}

}  // namespace machmoe::gpu::hopper
