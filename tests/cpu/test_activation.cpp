// The one definition of the activations (src/math/activation.hpp): values against their textbook formulas and
// derivatives against central differences, in float64, for every activation of the API.
#include <gtest/gtest.h>

#include <cmath>

#include "math/activation.hpp"

namespace machmoe::test {
namespace {

const Activation kAll[] = {Activation::kSwiGLU, Activation::kGeGLU, Activation::kReGLU, Activation::kReLUSquared,
                           Activation::kReLU,   Activation::kGELU,  Activation::kSiLU};

double textbook(Activation a, double x) {
  switch (a) {
    case Activation::kSwiGLU:
    case Activation::kSiLU: return x / (1.0 + std::exp(-x));
    case Activation::kGeGLU:
    case Activation::kGELU: return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
    case Activation::kReGLU:
    case Activation::kReLU: return x > 0 ? x : 0.0;
    case Activation::kReLUSquared: return x > 0 ? x * x : 0.0;
  }
  return NAN;
}

TEST(Activation, ValuesMatchTheirFormulas) {
  for (Activation a : kAll) {
    for (double x = -8.0; x <= 8.0; x += 0.0625) {
      const double v = math::act_value_and_derivative(a, x).value;
      EXPECT_NEAR(v, textbook(a, x), 1e-14 * (1.0 + std::fabs(x * x))) << activation_name(a) << " x=" << x;
    }
  }
}

TEST(Activation, DerivativesMatchCentralDifferences) {
  const double h = 1e-6;
  for (Activation a : kAll) {
    for (double x = -6.0; x <= 6.0; x += 0.0625 + 1e-3) {  // offset: never on the kink at 0
      const double fd = (math::act_value_and_derivative(a, x + h).value -
                         math::act_value_and_derivative(a, x - h).value) / (2 * h);
      EXPECT_NEAR(math::act_value_and_derivative(a, x).derivative, fd, 1e-7 * (1.0 + std::fabs(fd)))
          << activation_name(a) << " x=" << x;
    }
  }
}

TEST(Activation, CompileTimeAndRunTimeFormsAgreeBitwise) {
  for (double x = -5.0; x <= 5.0; x += 0.25) {
    EXPECT_EQ(math::act_value<Activation::kSwiGLU>(x), math::act_value_and_derivative(Activation::kSwiGLU, x).value);
    EXPECT_EQ(math::act_value<Activation::kGELU>(x), math::act_value_and_derivative(Activation::kGELU, x).value);
    EXPECT_EQ(math::act_value<Activation::kReLUSquared>(float(x)),
              math::act_value_and_derivative(Activation::kReLUSquared, float(x)).value);
  }
}

TEST(Activation, GluClassification) {
  for (Activation a : kAll) EXPECT_EQ(math::is_glu_activation(a), is_glu(a)) << activation_name(a);
}

}  // namespace
}  // namespace machmoe::test
