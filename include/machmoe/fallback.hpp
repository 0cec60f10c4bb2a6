// What happens when a GPU expert GEMM cannot run on the fast Hopper kernels and falls back to the slow GPU
// reference GEMM (docs/ARCHITECTURE.md, "What takes the fast path"). The Hopper kernels take d and n that are any
// multiple of 8; what they refuse breaks 16-byte alignment (d or n not a multiple of 8, unaligned pointers or row
// strides), is not bf16, or is not on a compute-capability-9.0 device. Such a call still computes the right result,
// but several times slower, so it is never silent.
#pragma once

#include <string>

namespace machmoe {

enum class FallbackPolicy : int {
  kWarn,   // run the reference GEMM; print one warning per (stage, reason) per process to stderr (default)
  kError,  // throw machmoe::Error with the same message instead of running the reference GEMM
};

/// Sets the process-wide policy. The initial one comes from the environment, read once at the first call of these
/// functions or of a GPU layer entry point: MACHMOE_FALLBACK=error gives kError; unset, empty or "warn" gives kWarn
/// (another value is reported on stderr once and read as kWarn). The reference path chosen on purpose
/// (MACHMOE_DISABLE_HOPPER_KERNELS=1, MACHMOE_HOPPER_BACKWARD=0 or their test switches) is logged, never an error.
/// With kError the error is raised before the call launches anything (every expert GEMM of a forward or backward is
/// checked first), so its outputs and the caller's gradient buffers are left as they were; finish_backward_w1 checks
/// its own GEMM when it is called, after the backward before it.
void set_fallback_policy(FallbackPolicy policy);
FallbackPolicy fallback_policy();

/// "warn" or "error".
const char* fallback_policy_name(FallbackPolicy policy);

}  // namespace machmoe
