// Programmatic dependent launch (sm_90): chains of short kernels on one stream without the launch gap between them.
// A kernel started by launch_dependent() may be scheduled while the kernel before it on the stream is still running:
// once every CTA of that kernel has called allow_dependent_launch() or exited. It must call wait_for_prior_grid()
// before it reads or writes anything the kernel before it touches; the wait returns when that kernel has completed
// and its writes are visible. Launched the ordinary way, wait_for_prior_grid() returns at once, so a kernel that calls
// it works under either launch. Stream capture records the launch as a programmatic edge of the CUDA graph.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "gpu/cuda_check.hpp"

namespace machmoe::gpu {

/// Blocks until the grid this one depends on has completed and flushed its memory (a no-op without a dependency).
__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/// This CTA no longer holds back the launch of the kernel queued after it (which still waits for this grid's
/// completion before touching its results): called where what is left of a CTA's work is short.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/// The launch attribute that lets a kernel start before the previous one on its stream completes.
inline cudaLaunchAttribute dependent_launch_attribute() {
  cudaLaunchAttribute a{};
  a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a.val.programmaticStreamSerializationAllowed = 1;
  return a;
}

/// kernel<<<grid, block, smem, stream>>>(args...) as a programmatic dependent launch (see above).
template <class... Params, class... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream,
                      Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid, cfg.blockDim = block, cfg.dynamicSmemBytes = smem, cfg.stream = stream;
  cudaLaunchAttribute attr[1] = {dependent_launch_attribute()};
  cfg.attrs = attr, cfg.numAttrs = 1;
  MACHMOE_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

}  // namespace machmoe::gpu
