// One kernel configuration per translation unit (compile time and memory: docs/BUILD.md).
#include "gpu/hopper/grouped_gemm_kernel.cuh"
#include "gpu/hopper/kernel_configs.hpp"

namespace machmoe::gpu::hopper {
template void launch_grouped_gemm<UpCooperativeConfig<Activation::kSiLU>>(const GroupedGemmParams&, int, cudaStream_t);
}
