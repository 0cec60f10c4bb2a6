// Scalar activation functions and their exact derivatives, for the CPU reference. GELU is the tanh
// approximation, which is what the GPU epilogues compute (docs/SPEC.md §2.3).
#pragma once

#include <cmath>

#include "machmoe/problem.hpp"

namespace machmoe::ref {

template <class R>
R sigmoid(R x) {
  return R(1) / (R(1) + std::exp(-x));
}

template <class R>
struct ScalarAct {
  R value;       // f(x)
  R derivative;  // f'(x); at the kinks of relu-type functions the right derivative at 0 is taken as 0
};

/// Elementwise function f of an activation: for GLU activations f is applied to the gate, for the others to
/// the whole pre-activation.
template <class R>
ScalarAct<R> act_scalar(Activation act, R x) {
  switch (act) {
    case Activation::kSwiGLU:
    case Activation::kSiLU: {
      const R s = sigmoid(x);
      return {x * s, s * (R(1) + x * (R(1) - s))};
    }
    case Activation::kGeGLU:
    case Activation::kGELU: {
      const R c = R(0.7978845608028654);  // sqrt(2/pi)
      const R a = R(0.044715);
      const R u = c * (x + a * x * x * x);
      const R t = std::tanh(u);
      const R du = c * (R(1) + R(3) * a * x * x);
      return {R(0.5) * x * (R(1) + t), R(0.5) * (R(1) + t) + R(0.5) * x * (R(1) - t * t) * du};
    }
    case Activation::kReGLU:
    case Activation::kReLU:
      return x > R(0) ? ScalarAct<R>{x, R(1)} : ScalarAct<R>{R(0), R(0)};
    case Activation::kReLUSquared:
      return x > R(0) ? ScalarAct<R>{x * x, R(2) * x} : ScalarAct<R>{R(0), R(0)};
  }
  return {R(0), R(0)};
}

}  // namespace machmoe::ref
