// CUDA / cuBLAS status checks that throw sonicmoe::RuntimeError with the failing call and its location.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string>

#include "sonicmoe/error.hpp"

namespace sonicmoe::gpu {

[[noreturn]] inline void throw_cuda(cudaError_t err, const char* what, const char* file, int line) {
  throw RuntimeError(std::string("sonicmoe: CUDA error '") + cudaGetErrorString(err) + "' in " + what + " at " + file +
                     ":" + std::to_string(line));
}
[[noreturn]] inline void throw_cublas(cublasStatus_t st, const char* what, const char* file, int line) {
  throw RuntimeError(std::string("sonicmoe: cuBLAS error ") + cublasGetStatusString(st) + " in " + what + " at " +
                     file + ":" + std::to_string(line));
}

}  // namespace sonicmoe::gpu

#define SONICMOE_CUDA_CHECK(call)                                                          \
  do {                                                                                     \
    cudaError_t sonicmoe_err_ = (call);                                                    \
    if (sonicmoe_err_ != cudaSuccess) ::sonicmoe::gpu::throw_cuda(sonicmoe_err_, #call, __FILE__, __LINE__); \
  } while (0)

/// After a kernel launch: reports launch errors (no synchronisation). cudaGetLastError also clears a non-sticky
/// error, so one stale error cannot make every later call fail.
#define SONICMOE_CUDA_CHECK_LAUNCH(name) SONICMOE_CUDA_CHECK(cudaGetLastError())

#define SONICMOE_CUBLAS_CHECK(call)                                                          \
  do {                                                                                       \
    cublasStatus_t sonicmoe_st_ = (call);                                                    \
    if (sonicmoe_st_ != CUBLAS_STATUS_SUCCESS)                                               \
      ::sonicmoe::gpu::throw_cublas(sonicmoe_st_, #call, __FILE__, __LINE__);                \
  } while (0)
