// SMs that the layer's expert GEMMs leave free for kernels on other streams (docs/ARCHITECTURE.md, "The SM margin").
//
// The expert GEMMs (forward and backward) run persistent grids: one CTA on every SM, or one cluster on every pair of
// SMs, each holding its SM's shared memory and registers until the GEMM ends. A kernel launched meanwhile on
// another stream, such as the all-to-all of an expert-parallel schedule that overlaps communication with the
// experts (NCCL's kernels), finds no SM it can run on until then, so the overlap serialises. With a margin of m
// those grids take sm_count - m SMs (whole clusters), and m SMs stay free for the other stream. The layer's other
// kernels are grids sized by their work, whose CTAs the hardware schedules around the other stream's. cuBLAS's
// router GEMMs (microseconds) are left as they are: the SM count cuBLAS targets may change its choice of kernel, and
// with it the logits' rounding and the routing.
//
// Results do not depend on the margin: every output element of an expert GEMM is computed by one CTA in a fixed order
// whatever the grid, so a call is bitwise the same with any margin (the GPU tests check it). Time does: the GEMMs run
// on fewer SMs.
#pragma once

namespace machmoe {

/// Sets the process-wide margin. Each expert GEMM reads it when it is launched (forward and backward alike, on any
/// thread: autograd runs the backward on its own), so a change made while a call runs on another thread reaches that
/// call's later GEMMs, which changes their time, never their results. A CUDA graph keeps the grids of its capture:
/// its replays take the margin that was set when it was captured. `sms` must be >= 0; 0 (the default) gives the
/// GEMMs every SM. The initial value comes from the environment, read once at the first call of these functions or of
/// a GPU layer entry point: MACHMOE_SM_MARGIN=m (another value than a non-negative integer is reported on stderr once
/// and read as 0). Every GPU layer entry point refuses a margin that leaves its device fewer than two SMs (the expert
/// GEMMs need one cluster of two), as an argument error, before it launches anything. CPU calls ignore it.
void set_sm_margin(int sms);
int sm_margin();

}  // namespace machmoe
