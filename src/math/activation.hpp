// The one definition of every activation's elementwise function f and its derivative f' (docs/SPEC.md §2.3, §3.3).
// For GLU activations f is the gate function (A = f(gate) * up); for the others A = f(h).
//
// Used by the CPU reference (R = double or float, exact transcendentals), the GPU reference kernels (float), the
// Hopper epilogues (float with the tanh.approx special-function unit) and the tests, so a formula changes in one
// place. The transcendental and the fused multiply-add come from a `Math` policy:
//   PreciseMath  std::tanh / std::fma (host) or tanhf / fmaf (device): the reference;
//   a device policy with tanh.approx.f32 (src/gpu/hopper/fast_math.cuh): the Hopper kernels.
// Both GELU variants are the tanh approximation; SiLU is written through tanh as well,
//   silu(x) = x sigmoid(x) = h tanh(h) + h  with h = x / 2,
// which is exact algebra and is one FMUL + MUFU.TANH + FFMA on the GPU; gpt-oss's gate x sigmoid(alpha x) likewise,
// h tanh(alpha h) + h.
//
// GLU activations combine the gate function with the up half: A = f(g') u(u'), where for gptoss_swiglu
//   g' = min(g, limit), u' = clamp(u, -limit, limit), u(u') = u' + 1
// and for the others g' = g, u(u') = u. glu_forward / glu_backward below are the one place that combination (and
// its gradient, with PyTorch's clamp backward) is written; every path calls them.
#pragma once

#include <cmath>

#include "machmoe/problem.hpp"

#if defined(__CUDACC__)
#define MACHMOE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MACHMOE_HOST_DEVICE inline
#endif

namespace machmoe::math {

/// f(x) and f'(x). At the kink of the relu-type functions f'(0) is taken as 0 (the right derivative of relu is 1,
/// but every implementation here agrees on 0, so results are comparable bitwise across paths).
template <class R>
struct ActValue {
  R value;
  R derivative;
};

/// Exact transcendentals: the CPU reference (double/float) and the GPU reference kernels (float).
struct PreciseMath {
  template <class R>
  MACHMOE_HOST_DEVICE static R tanh(R x) {
#if defined(__CUDA_ARCH__)
    return ::tanh(x);
#else
    return std::tanh(x);
#endif
  }
  template <class R>
  MACHMOE_HOST_DEVICE static R fma(R a, R b, R c) {
#if defined(__CUDA_ARCH__)
    return ::fma(a, b, c);
#else
    return std::fma(a, b, c);
#endif
  }
};

/// Run-time parameters of the parameterised activations (gptoss_swiglu: alpha, limit); the others ignore them.
/// The defaults are gpt-oss's (problem.hpp).
template <class R>
struct ActParams {
  R alpha = R(kGptOssSwiGLUAlpha);
  R limit = R(kGptOssSwiGLULimit);
};

namespace detail {
template <class R>
inline constexpr R kGeluC = R(0.7978845608028654);  // sqrt(2 / pi)
template <class R>
inline constexpr R kGeluA = R(0.044715);
}  // namespace detail

/// f(x) of activation `act` (compile-time: the Hopper epilogues unroll it into straight-line code).
template <Activation act, class Math = PreciseMath, class R>
MACHMOE_HOST_DEVICE R act_value(R x, const ActParams<R>& p = {}) {
  if constexpr (act == Activation::kSwiGLU || act == Activation::kSiLU) {
    const R h = R(0.5) * x;
    return Math::fma(h, Math::tanh(h), h);
  } else if constexpr (act == Activation::kGptOssSwiGLU) {  // the gate function x sigmoid(alpha x), unclamped
    const R h = R(0.5) * x;
    return Math::fma(h, Math::tanh(p.alpha * h), h);
  } else if constexpr (act == Activation::kGeGLU || act == Activation::kGELU) {
    const R h = R(0.5) * x;
    return Math::fma(h, Math::tanh(detail::kGeluC<R> * Math::fma(detail::kGeluA<R> * x * x, x, x)), h);
  } else if constexpr (act == Activation::kReGLU || act == Activation::kReLU) {
    return x > R(0) ? x : R(0);
  } else {
    static_assert(act == Activation::kReLUSquared, "every activation of problem.hpp has a formula here");
    return x > R(0) ? x * x : R(0);
  }
}

/// f(x) and f'(x) of activation `act`.
template <Activation act, class Math = PreciseMath, class R>
MACHMOE_HOST_DEVICE ActValue<R> act_value_and_derivative(R x, const ActParams<R>& p = {}) {
  if constexpr (act == Activation::kSwiGLU || act == Activation::kSiLU) {
    // sigmoid(x) = (1 + tanh(x / 2)) / 2; silu'(x) = s (1 + x (1 - s)).
    const R h = R(0.5) * x;
    const R t = Math::tanh(h);
    const R s = R(0.5) + R(0.5) * t;
    return {Math::fma(h, t, h), s * (R(1) + x * (R(1) - s))};
  } else if constexpr (act == Activation::kGptOssSwiGLU) {
    // f(x) = x s, s = sigmoid(alpha x) = (1 + tanh(alpha x / 2)) / 2; f'(x) = s (1 + alpha x (1 - s)).
    const R h = R(0.5) * x;
    const R t = Math::tanh(p.alpha * h);
    const R s = R(0.5) + R(0.5) * t;
    return {Math::fma(h, t, h), s * (R(1) + p.alpha * x * (R(1) - s))};
  } else if constexpr (act == Activation::kGeGLU || act == Activation::kGELU) {
    // gelu(x) = x (1 + tanh(u)) / 2, u = c (x + a x^3); gelu'(x) = (1 + t) / 2 + x (1 - t^2) u' / 2.
    const R h = R(0.5) * x;
    const R t = Math::tanh(detail::kGeluC<R> * Math::fma(detail::kGeluA<R> * x * x, x, x));
    const R du = detail::kGeluC<R> * (R(1) + R(3) * detail::kGeluA<R> * x * x);
    return {Math::fma(h, t, h), R(0.5) * (R(1) + t) + h * (R(1) - t * t) * du};
  } else if constexpr (act == Activation::kReGLU || act == Activation::kReLU) {
    return x > R(0) ? ActValue<R>{x, R(1)} : ActValue<R>{R(0), R(0)};
  } else {
    static_assert(act == Activation::kReLUSquared, "every activation of problem.hpp has a formula here");
    return x > R(0) ? ActValue<R>{x * x, R(2) * x} : ActValue<R>{R(0), R(0)};
  }
}

/// The same with the activation chosen at run time (reference paths, where a switch per element is fine).
template <class Math = PreciseMath, class R>
MACHMOE_HOST_DEVICE ActValue<R> act_value_and_derivative(Activation act, R x, const ActParams<R>& p = {}) {
  switch (act) {
    case Activation::kGptOssSwiGLU: return act_value_and_derivative<Activation::kGptOssSwiGLU, Math>(x, p);
    case Activation::kSwiGLU: return act_value_and_derivative<Activation::kSwiGLU, Math>(x);
    case Activation::kGeGLU: return act_value_and_derivative<Activation::kGeGLU, Math>(x);
    case Activation::kReGLU: return act_value_and_derivative<Activation::kReGLU, Math>(x);
    case Activation::kReLUSquared: return act_value_and_derivative<Activation::kReLUSquared, Math>(x);
    case Activation::kReLU: return act_value_and_derivative<Activation::kReLU, Math>(x);
    case Activation::kGELU: return act_value_and_derivative<Activation::kGELU, Math>(x);
    case Activation::kSiLU: return act_value_and_derivative<Activation::kSiLU, Math>(x);
  }
  return {R(0), R(0)};
}

/// Whether A = f(gate) * up (gate and up halves of W1) rather than A = f(h).
MACHMOE_HOST_DEVICE constexpr bool is_glu_activation(Activation act) {
  return act == Activation::kSwiGLU || act == Activation::kGeGLU || act == Activation::kReGLU ||
         act == Activation::kGptOssSwiGLU;
}

// ---- GLU: A = f(g') u(u') and its gradient ---------------------------------------------------------------------

/// A of a GLU activation from its (gate, up) pre-activations.
template <Activation act, class Math = PreciseMath, class R>
MACHMOE_HOST_DEVICE R glu_forward(R gate, R up, const ActParams<R>& p = {}) {
  static_assert(is_glu_activation(act), "GLU activations only");
  if constexpr (act == Activation::kGptOssSwiGLU) {
    // Comparisons written so that a NaN passes through, as torch.clamp propagates it.
    const R g = gate > p.limit ? p.limit : gate;
    const R u = (up < -p.limit ? -p.limit : up > p.limit ? p.limit : up) + R(1);
    return act_value<act, Math>(g, p) * u;
  } else {
    return act_value<act, Math>(gate) * up;
  }
}

/// A and the gradients of a GLU pair for the incoming gradient da = dL/dA.
template <class R>
struct GluGrad {
  R value;   // A
  R d_gate;  // dL/dgate
  R d_up;    // dL/dup
};

/// gptoss_swiglu: d_gate = da u f'(g') where g <= limit, d_up = da f(g') where -limit <= u <= limit, 0 elsewhere: the
/// gradient of torch.clamp, which passes it where min <= x <= max (inclusive at the limits) and is 0 outside. The
/// others: d_gate = da up f'(gate), d_up = da f(gate), in the order every path has always evaluated them (their
/// results are bitwise unchanged by the gpt-oss generalisation).
template <Activation act, class Math = PreciseMath, class R>
MACHMOE_HOST_DEVICE GluGrad<R> glu_backward(R gate, R up, R da, const ActParams<R>& p = {}) {
  static_assert(is_glu_activation(act), "GLU activations only");
  if constexpr (act == Activation::kGptOssSwiGLU) {
    const bool gate_passes = gate <= p.limit;
    const bool up_passes = up >= -p.limit && up <= p.limit;
    const R g = gate > p.limit ? p.limit : gate;
    const R u = (up < -p.limit ? -p.limit : up > p.limit ? p.limit : up) + R(1);
    const ActValue<R> f = act_value_and_derivative<act, Math>(g, p);
    // Selected rather than multiplied by a 0/1 mask: an infinite da would otherwise give NaN where torch gives 0.
    return {f.value * u, gate_passes ? da * u * f.derivative : R(0), up_passes ? da * f.value : R(0)};
  } else {
    const ActValue<R> f = act_value_and_derivative<act, Math>(gate);
    return {f.value * up, da * up * f.derivative, da * f.value};
  }
}

/// The same with the activation chosen at run time (reference paths).
template <class Math = PreciseMath, class R>
MACHMOE_HOST_DEVICE R glu_forward(Activation act, R gate, R up, const ActParams<R>& p = {}) {
  switch (act) {
    case Activation::kGeGLU: return glu_forward<Activation::kGeGLU, Math>(gate, up, p);
    case Activation::kReGLU: return glu_forward<Activation::kReGLU, Math>(gate, up, p);
    case Activation::kGptOssSwiGLU: return glu_forward<Activation::kGptOssSwiGLU, Math>(gate, up, p);
    default: return glu_forward<Activation::kSwiGLU, Math>(gate, up, p);  // callers pass GLU activations only
  }
}
template <class Math = PreciseMath, class R>
MACHMOE_HOST_DEVICE GluGrad<R> glu_backward(Activation act, R gate, R up, R da, const ActParams<R>& p = {}) {
  switch (act) {
    case Activation::kGeGLU: return glu_backward<Activation::kGeGLU, Math>(gate, up, da, p);
    case Activation::kReGLU: return glu_backward<Activation::kReGLU, Math>(gate, up, da, p);
    case Activation::kGptOssSwiGLU: return glu_backward<Activation::kGptOssSwiGLU, Math>(gate, up, da, p);
    default: return glu_backward<Activation::kSwiGLU, Math>(gate, up, da, p);
  }
}

}  // namespace machmoe::math
