// CUDA / cuBLAS status checks that throw machmoe::RuntimeError with the failing call and its location.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string>

#include "machmoe/error.hpp"

namespace machmoe::gpu {

[[noreturn]] inline void throw_cuda(cudaError_t err, const char* what, const char* file, int line) {
  throw RuntimeError(std::string("machmoe: CUDA error '") + cudaGetErrorString(err) + "' in " + what + " at " + file +
                     ":" + std::to_string(line));
}
[[noreturn]] inline void throw_cublas(cublasStatus_t st, const char* what, const char* file, int line) {
  throw RuntimeError(std::string("machmoe: cuBLAS error ") + cublasGetStatusString(st) + " in " + what + " at " +
                     file + ":" + std::to_string(line));
}

}  // namespace machmoe::gpu

#define MACHMOE_CUDA_CHECK(call)                                                          \
  do {                                                                                     \
    cudaError_t machmoe_err_ = (call);                                                    \
    if (machmoe_err_ != cudaSuccess) ::machmoe::gpu::throw_cuda(machmoe_err_, #call, __FILE__, __LINE__); \
  } while (0)

/// After a kernel launch: reports launch errors (no synchronisation). cudaGetLastError also clears a non-sticky
/// error, so one stale error cannot make every later call fail.
#define MACHMOE_CUDA_CHECK_LAUNCH(name) MACHMOE_CUDA_CHECK(cudaGetLastError())

#define MACHMOE_CUBLAS_CHECK(call)                                                          \
  do {                                                                                       \
    cublasStatus_t machmoe_st_ = (call);                                                    \
    if (machmoe_st_ != CUBLAS_STATUS_SUCCESS)                                               \
      ::machmoe::gpu::throw_cublas(machmoe_st_, #call, __FILE__, __LINE__);                \
  } while (0)
