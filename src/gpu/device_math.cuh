// Device helpers shared by the GPU runtime's kernels: element conversions, activations (the same functions as
// src/reference/activation.hpp, in fp32), the concatenated-GLU row map, and dtype dispatch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "sonicmoe/error.hpp"
#include "sonicmoe/problem.hpp"
#include "sonicmoe/tensor.hpp"

namespace sonicmoe::gpu {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <class T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

struct ActValue {
  float value, derivative;
};

/// f and f' of the elementwise part of an activation (the gate function for GLU activations).
__device__ __forceinline__ ActValue act_eval(Activation act, float x) {
  switch (act) {
    case Activation::kSwiGLU:
    case Activation::kSiLU: {
      const float s = 1.0f / (1.0f + expf(-x));
      return {x * s, s * (1.0f + x * (1.0f - s))};
    }
    case Activation::kGeGLU:
    case Activation::kGELU: {
      const float c = 0.7978845608028654f, a = 0.044715f;
      const float t = tanhf(c * (x + a * x * x * x));
      const float du = c * (1.0f + 3.0f * a * x * x);
      return {0.5f * x * (1.0f + t), 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du};
    }
    case Activation::kReGLU:
    case Activation::kReLU:
      return x > 0.0f ? ActValue{x, 1.0f} : ActValue{0.0f, 0.0f};
    case Activation::kReLUSquared:
      return x > 0.0f ? ActValue{x * x, 2.0f * x} : ActValue{0.0f, 0.0f};
  }
  return {0.0f, 0.0f};
}

__host__ __device__ __forceinline__ bool act_is_glu(Activation a) {
  return a == Activation::kSwiGLU || a == Activation::kGeGLU || a == Activation::kReGLU;
}

/// Concatenated GLU layout: interleaved column c lives in row (c % 2) * n + c / 2.
__device__ __forceinline__ std::int64_t glu_concat_row(std::int64_t c, std::int64_t n) {
  return (c & 1) * n + (c >> 1);
}

/// Total order of top-K candidates (value, index): larger value first, NaN last, lower index first on ties.
__device__ __forceinline__ bool ranks_before(float av, int ai, float bv, int bi) {
  const bool an = isnan(av), bn = isnan(bv);
  if (an != bn) return bn;
  if (!an && av != bv) return av > bv;
  return ai < bi;
}

/// Expert owning grouped row g: the last e with offsets[e] <= g.
__device__ __forceinline__ int expert_of_row(const std::int32_t* offsets, int E, std::int64_t g) {
  int lo = 0, hi = E;  // invariant: offsets[lo] <= g < offsets[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (offsets[mid] <= g) lo = mid;
    else hi = mid;
  }
  return lo;
}

/// Calls f(T{}) with the element type of a data dtype (bf16, fp16, fp32).
template <class F>
void dispatch_data_type(DType dt, F&& f) {
  switch (dt) {
    case DType::kBF16: f(__nv_bfloat16{}); return;
    case DType::kFP16: f(__half{}); return;
    case DType::kFP32: f(float{}); return;
    default: throw Error(std::string("sonicmoe: GPU kernels take bf16, fp16 or fp32 data, got ") + dtype_name(dt));
  }
}

inline unsigned int ceil_div(std::int64_t a, std::int64_t b) { return static_cast<unsigned int>((a + b - 1) / b); }

}  // namespace sonicmoe::gpu
