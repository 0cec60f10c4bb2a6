// The math policy of the Hopper epilogues for src/math/activation.hpp: tanh on the special-function unit
// (tanh.approx.f32, docs/SPEC.md §2.3; its error is far below the bf16 rounding of the result) and fmaf.
#pragma once

#include "math/activation.hpp"

namespace machmoe::gpu::hopper {

struct FastMath {
  __device__ __forceinline__ static float tanh(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
  }
  __device__ __forceinline__ static float fma(float a, float b, float c) { return fmaf(a, b, c); }
};

/// f(x) of activation `act` as the Hopper epilogues compute it.
template <Activation act>
__device__ __forceinline__ float fast_activation(float x) {
  return math::act_value<act, FastMath>(x);
}

/// A = f(gate') u(up') of a GLU activation as the Hopper epilogues compute it (math::glu_forward).
template <Activation act>
__device__ __forceinline__ float fast_glu(float gate, float up, const math::ActParams<float>& p) {
  return math::glu_forward<act, FastMath>(gate, up, p);
}

}  // namespace machmoe::gpu::hopper
