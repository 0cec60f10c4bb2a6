// The kernel families built from the pieces (kernel_families.cuh assembles them) and the launcher of each, for
// host code (dispatch.cpp); no device code here. The configurations that exist are listed, one per translation
// unit, in instantiations/kernel_list.inc, generated from the table in generate_instantiations.py.
#pragma once

#include <cuda_runtime.h>

#include "gpu/hopper/params.hpp"
#include "gpu/hopper/tile_config.hpp"
#include "machmoe/problem.hpp"

namespace machmoe::gpu::hopper {

/// Up-projection (forward): X rows gathered by cp.async, W1 by TMA, activation epilogue (H and A).
using UpProjectionParams = KernelParams<MainloopVarlenMParams, EpilogueActivationParams>;
template <class Tile, Activation kAct>
void launch_up_projection(const UpProjectionParams& p, int usable_sms, cudaStream_t stream);

/// Down-projection (forward): contiguous A by TMA, W2 by TMA, store epilogue (Y).
using DownProjectionParams = KernelParams<MainloopVarlenMParams, EpilogueStoreParams>;
template <class Tile>
void launch_down_projection(const DownProjectionParams& p, int usable_sms, cudaStream_t stream);

/// dX~ = dH W1_e (backward): contiguous dH by TMA, W1 read in place as an MN-major B (both layouts), store
/// epilogue. Shares DownProjectionParams' shape (mainloop + store epilogue).
template <class Tile>
void launch_dx_expanded(const DownProjectionParams& p, int usable_sms, cudaStream_t stream);

/// dH kernel (backward): dA' = gather(dO) W2_e^T with dO rows gathered by cp.async and W2 read in place as an
/// MN-major B; activation-gradient epilogue (dH, A', dS partials).
using DhKernelParams = KernelParams<MainloopVarlenMParams, EpilogueActivationGradParams>;
template <class Tile, Activation kAct>
void launch_dh_kernel(const DhKernelParams& p, int usable_sms, cudaStream_t stream);

/// Weight gradients (varlen-K over each expert's grouped rows, both operands MN-major, cp.async with the rows past
/// the segment zero-filled), weight-gradient epilogue (bf16 or fp32, overwrite or accumulate, concatenated row map).
/// dW2: A = dO gathered by the routing index, B = A' contiguous. dW1: A = dH contiguous, B = X gathered.
using WeightGradParams = KernelParams<MainloopVarlenKParams, EpilogueWgradParams, VarlenKSchedulerParams>;
template <class Tile>
void launch_weight_grad_dw2(const WeightGradParams& p, int usable_sms, cudaStream_t stream);
template <class Tile>
void launch_weight_grad_dw1(const WeightGradParams& p, int usable_sms, cudaStream_t stream);

}  // namespace machmoe::gpu::hopper

#include "gpu/hopper/instantiations/kernel_list.inc"
