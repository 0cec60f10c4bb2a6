// Dispatch of the expert GEMMs to the Hopper kernels, with the GPU reference GEMM as the fallback for
// what they do not take. Host code only.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "gpu/kernels.hpp"

namespace machmoe::gpu {

/// Why the Hopper kernels cannot run `a` ("" when they can). Limits (docs/ARCHITECTURE.md): bf16; an sm_90 device;
/// K and N positive multiples of 8 (a GLU up-projection: n = N / 2 too; edge tiles and a partial last k-block are
/// predicated inside the kernels); K-major weights (stride 1 along K) with 16-byte-aligned rows and base; rows of A, H/Y and A-out 16-byte aligned;
/// the store or up-projection epilogue.
std::string hopper_unsupported_reason(const VarlenMArgs& a);

/// Runs a varlen-M expert GEMM (forward up- or down-projection, backward dX~ and dH) on the Hopper kernel when it
/// takes the shape, else on the GPU reference GEMM, warning once per (stage, reason) on stderr with the shape and
/// why, or throwing machmoe::Error under FallbackPolicy::kError (machmoe/fallback.hpp). Same results either way up
/// to rounding (fp32 accumulation in a different order).
void launch_expert_gemm(const VarlenMArgs& a, const char* stage, cudaStream_t stream);
/// Under FallbackPolicy::kError, throws what launch_expert_gemm(a, stage) would throw, without launching anything;
/// otherwise does nothing. The layer calls it for every GEMM of a call before its first launch, so that a refused
/// GEMM raises with nothing written (docs/VALIDATION.md).
void refuse_expert_gemm_fallback(const VarlenMArgs& a, const char* stage);

/// Why the Hopper weight-gradient kernels cannot run `a` ("" when they can). Limits: bf16 inputs, output bf16 or
/// fp32; an sm_90 device; the backward's Hopper kernels switched on; M and N positive multiples of 8; operand rows and
/// the output 16-byte aligned (row strides multiples of 8 elements); exactly one operand gathered (dW2: A, dW1: B);
/// a concatenated row map only with M = 2n. The N tile follows set_hopper_tile_n / MACHMOE_HOPPER_TILE_N too.
std::string hopper_wgrad_unsupported_reason(const VarlenKArgs& a);

/// Runs a weight-gradient GEMM (backward dW1, dW2) on the Hopper varlen-K kernel when it takes the shape, else on
/// the GPU reference GEMM, reported as launch_expert_gemm does. Same results either way up to rounding
/// (fp32 accumulation in a different order); experts without rows get exact zeros (accumulating: untouched).
void launch_weight_gemm(const VarlenKArgs& a, const char* stage, cudaStream_t stream);
/// refuse_expert_gemm_fallback for a weight-gradient GEMM (launch_weight_gemm).
void refuse_weight_gemm_fallback(const VarlenKArgs& a, const char* stage);

/// Process-wide switch (default on; off when the environment sets MACHMOE_DISABLE_HOPPER_KERNELS=1). Tests use
/// it to run the same layer through both paths.
void set_hopper_kernels_enabled(bool enabled);
/// Forces the N tile (128 or 256, where N allows it) instead of the heuristic; 0 restores the heuristic. Also
/// set from the environment by MACHMOE_HOPPER_TILE_N.
void set_hopper_tile_n(int tile_n);
/// Forces the tile scheduler's rasterisation group (M-tiles per group; 1 runs along N); 0 restores the heuristic.
/// Also set from the environment by MACHMOE_HOPPER_RASTER_M. The results are bitwise the same for every value.
void set_hopper_raster_m(int raster_m);
/// Forces dX~'s CTA clusters along M (1 or 2: pairs sharing the weight tile by multicast); 0 restores the heuristic.
/// Also set from the environment by MACHMOE_HOPPER_CLUSTER_M. The results are bitwise the same for every value.
void set_hopper_cluster_m(int cluster_m);
/// Forces the weight gradients' groups of m-tiles (m-tiles of one expert and n-tile that one CTA takes back to back,
/// up to the largest divisor of the m-tile count; 1: none); 0 restores the heuristic. Also set from the environment
/// by MACHMOE_HOPPER_WGRAD_M_GROUP. The results are bitwise the same for every value.
void set_hopper_wgrad_m_group(int m_group);
bool hopper_kernels_enabled();
/// The backward's Hopper kernels (dX~, dW1, dW2): on by default; off with MACHMOE_HOPPER_BACKWARD=0 or this switch
/// (tests compare both paths).
void set_hopper_backward_enabled(bool enabled);
bool hopper_backward_enabled();

}  // namespace machmoe::gpu
