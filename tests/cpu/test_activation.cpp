// The one definition of the activations (src/math/activation.hpp): values against their textbook formulas and
// derivatives against central differences, in float64, for every activation of the API; the GLU combination
// (glu_forward / glu_backward) against its formula, gpt-oss's clamps at and around their limits included.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "math/activation.hpp"

namespace machmoe::test {
namespace {

const Activation kAll[] = {Activation::kSwiGLU, Activation::kGeGLU, Activation::kReGLU, Activation::kReLUSquared,
                           Activation::kReLU,   Activation::kGELU,  Activation::kSiLU,
                           Activation::kGptOssSwiGLU};

double textbook(Activation a, double x) {
  switch (a) {
    case Activation::kSwiGLU:
    case Activation::kSiLU: return x / (1.0 + std::exp(-x));
    case Activation::kGeGLU:
    case Activation::kGELU: return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
    case Activation::kReGLU:
    case Activation::kReLU: return x > 0 ? x : 0.0;
    case Activation::kReLUSquared: return x > 0 ? x * x : 0.0;
    case Activation::kGptOssSwiGLU: return x / (1.0 + std::exp(-kGptOssSwiGLUAlpha * x));  // the gate function
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

// ---- GLU combination ----------------------------------------------------------------------------------------------

// gpt-oss's expert MLP as HF transformers writes it (GptOssExperts.forward), transcribed independently of
// activation.hpp: exp rather than tanh, clamps as torch.clamp.
double gptoss_textbook(double gate, double up, double alpha, double limit) {
  const double g = std::min(gate, limit);
  const double u = std::max(-limit, std::min(up, limit));
  return (u + 1.0) * (g / (1.0 + std::exp(-alpha * g)));
}

TEST(GluActivation, GptOssValuesMatchTheHfFormula) {
  for (double alpha : {kGptOssSwiGLUAlpha, 1.0, -0.5})
    for (double limit : {kGptOssSwiGLULimit, 1.5})
      for (double gate = -12.0; gate <= 12.0; gate += 0.375)
        for (double up = -12.0; up <= 12.0; up += 0.375) {
          const math::ActParams<double> p{alpha, limit};
          const double want = gptoss_textbook(gate, up, alpha, limit);
          const double got = math::glu_forward<Activation::kGptOssSwiGLU>(gate, up, p);
          EXPECT_NEAR(got, want, 1e-14 * (1.0 + std::fabs(want))) << gate << " " << up << " " << alpha << " " << limit;
          // The run-time form and the backward's value agree bitwise with it.
          EXPECT_EQ(math::glu_forward(Activation::kGptOssSwiGLU, gate, up, p), got);
          EXPECT_EQ(math::glu_backward<Activation::kGptOssSwiGLU>(gate, up, 1.0, p).value, got);
        }
}

TEST(GluActivation, GptOssGradientsMatchCentralDifferencesAwayFromTheLimits) {
  const double h = 1e-6;
  for (double limit : {kGptOssSwiGLULimit, 1.5}) {
    const math::ActParams<double> p{kGptOssSwiGLUAlpha, limit};
    auto A = [&](double g, double u) { return math::glu_forward<Activation::kGptOssSwiGLU>(g, u, p); };
    // The offset keeps every point more than h away from the kinks at g = limit and u = +-limit.
    for (double gate = -10.0; gate <= 10.0; gate += 0.25 + 1e-3)
      for (double up = -10.0; up <= 10.0; up += 0.25 + 1e-3) {
        const double da = 0.75;
        const math::GluGrad<double> gr = math::glu_backward<Activation::kGptOssSwiGLU>(gate, up, da, p);
        const double fd_gate = da * (A(gate + h, up) - A(gate - h, up)) / (2 * h);
        const double fd_up = da * (A(gate, up + h) - A(gate, up - h)) / (2 * h);
        EXPECT_NEAR(gr.d_gate, fd_gate, 1e-7 * (1.0 + std::fabs(fd_gate))) << gate << " " << up;
        EXPECT_NEAR(gr.d_up, fd_up, 1e-7 * (1.0 + std::fabs(fd_up))) << gate << " " << up;
        // Clamped inputs get exactly zero gradient.
        if (gate > limit) {
          EXPECT_EQ(gr.d_gate, 0.0);
        }
        if (std::fabs(up) > limit) {
          EXPECT_EQ(gr.d_up, 0.0);
        }
      }
  }
}

// torch.clamp's backward passes the gradient where min <= x <= max, inclusive: at exactly +-limit the gradient is
// the one-sided derivative from inside, and one ulp outside it is 0.
TEST(GluActivation, GptOssClampBoundariesFollowTorch) {
  const double limit = 7.0, alpha = kGptOssSwiGLUAlpha, da = 1.25;
  const math::ActParams<double> p{alpha, limit};
  const double above = std::nextafter(limit, 1e9), below = std::nextafter(limit, -1e9);
  const double s = 1.0 / (1.0 + std::exp(-alpha * limit));
  const double f = limit * s, df = s * (1.0 + alpha * limit * (1.0 - s));
  const double up = 0.5;
  // Gate at the limit: passes (d_gate = da (up + 1) f'(limit)); above: 0; below: the ordinary derivative.
  EXPECT_NEAR(math::glu_backward<Activation::kGptOssSwiGLU>(limit, up, da, p).d_gate, da * (up + 1) * df, 1e-14 * 20);
  EXPECT_EQ(math::glu_backward<Activation::kGptOssSwiGLU>(above, up, da, p).d_gate, 0.0);
  EXPECT_NE(math::glu_backward<Activation::kGptOssSwiGLU>(below, up, da, p).d_gate, 0.0);
  // The gate has no lower clamp: a negative gate far below -limit still has its (small, nonzero) gradient. Far in
  // the tail sigmoid through tanh rounds to exactly 0 (tanh(-25.5) == -1 in double) where exp would give ~1e-22:
  // an absolute difference below 1e-20, as for silu, and never a NaN.
  const math::GluGrad<double> neg = math::glu_backward<Activation::kGptOssSwiGLU>(-8.0, up, da, p);
  const double s8 = 1.0 / (1.0 + std::exp(alpha * 8.0));
  EXPECT_NEAR(neg.d_gate, da * (up + 1) * s8 * (1.0 - alpha * 8.0 * (1.0 - s8)), 1e-15);
  EXPECT_NE(neg.d_gate, 0.0);
  const math::GluGrad<double> far = math::glu_backward<Activation::kGptOssSwiGLU>(-30.0, up, da, p);
  EXPECT_TRUE(std::isfinite(far.d_gate) && std::isfinite(far.value));
  EXPECT_LT(std::fabs(far.d_gate) + std::fabs(far.value), 1e-20);
  // Up at +-limit: passes (d_up = da f(gate)); beyond: 0; the value uses the clamped up.
  const double gate = 0.8, fg = gate / (1.0 + std::exp(-alpha * gate));
  for (double u : {limit, -limit}) {
    const math::GluGrad<double> at = math::glu_backward<Activation::kGptOssSwiGLU>(gate, u, da, p);
    EXPECT_NEAR(at.d_up, da * fg, 1e-15);
  }
  for (double u : {above, -above, 100.0, -100.0}) {
    const math::GluGrad<double> out = math::glu_backward<Activation::kGptOssSwiGLU>(gate, u, da, p);
    EXPECT_EQ(out.d_up, 0.0) << u;
    EXPECT_NEAR(out.value, fg * ((u > 0 ? limit : -limit) + 1.0), 1e-14) << u;
  }
  // Clamped values: A does not move beyond the limits.
  EXPECT_EQ(math::glu_forward<Activation::kGptOssSwiGLU>(above, up, p), math::glu_forward<Activation::kGptOssSwiGLU>(limit, up, p));
  EXPECT_NEAR(math::glu_forward<Activation::kGptOssSwiGLU>(50.0, 50.0, p), f * (limit + 1.0), 1e-13);
  // A NaN pre-activation propagates into A (torch.clamp propagates NaN); its gradients are 0 (torch's mask is false).
  const double nan = std::numeric_limits<double>::quiet_NaN();
  EXPECT_TRUE(std::isnan(math::glu_forward<Activation::kGptOssSwiGLU>(nan, up, p)));
  EXPECT_TRUE(std::isnan(math::glu_forward<Activation::kGptOssSwiGLU>(gate, nan, p)));
  EXPECT_EQ(math::glu_backward<Activation::kGptOssSwiGLU>(nan, up, da, p).d_gate, 0.0);
  EXPECT_EQ(math::glu_backward<Activation::kGptOssSwiGLU>(gate, nan, da, p).d_up, 0.0);
  // An infinite limit turns the clamps off: the plain gate function times (up + 1).
  const math::ActParams<double> off{alpha, std::numeric_limits<double>::infinity()};
  EXPECT_NEAR(math::glu_forward<Activation::kGptOssSwiGLU>(20.0, 30.0, off), 31.0 * 20.0 / (1.0 + std::exp(-alpha * 20.0)), 1e-12);
}

// The generalised GLU form computes the other GLUs exactly as before: A = f(g) up, d gate = da up f'(g),
// d up = da f(g), bitwise, in double and float.
template <class R>
void expect_plain_glu_unchanged(Activation a) {
  for (double gx = -6.0; gx <= 6.0; gx += 0.3125)
    for (double ux = -3.0; ux <= 3.0; ux += 0.4375) {
      const R g = R(gx), u = R(ux), da = R(0.7);
      const math::ActValue<R> f = math::act_value_and_derivative(a, g);
      const math::GluGrad<R> gr = math::glu_backward(a, g, u, da);
      EXPECT_EQ(math::glu_forward(a, g, u), f.value * u);
      EXPECT_EQ(gr.value, f.value * u);
      EXPECT_EQ(gr.d_gate, da * u * f.derivative);
      EXPECT_EQ(gr.d_up, da * f.value);
    }
}

TEST(GluActivation, OtherGlusAreBitwiseTheFormerFormula) {
  for (Activation a : {Activation::kSwiGLU, Activation::kGeGLU, Activation::kReGLU}) {
    expect_plain_glu_unchanged<double>(a);
    expect_plain_glu_unchanged<float>(a);
  }
}

}  // namespace
}  // namespace machmoe::test
