// Shared helpers of the CPU tests: random problems with realistic magnitudes, a scalar loss over the layer's
// outputs, relative (Frobenius) error, and the check that a call fails with a given message.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "reference/layer.hpp"
#include "reference/router.hpp"
#include "machmoe/error.hpp"
#include "machmoe/layer.hpp"
#include "machmoe/tensor.hpp"
#include "machmoe/problem.hpp"

namespace machmoe {
// gtest prints test parameters in its listing and its failure messages; without these it prints enums as bytes.
// They live in machmoe's namespace so that gtest finds them next to the enums.
inline void PrintTo(Activation v, std::ostream* os) { *os << activation_name(v); }
inline void PrintTo(WeightLayout v, std::ostream* os) { *os << weight_layout_name(v); }
inline void PrintTo(ScoreVariant v, std::ostream* os) { *os << score_variant_name(v); }
inline void PrintTo(RoutingMode v, std::ostream* os) { *os << routing_mode_name(v); }
inline void PrintTo(RoundingRule v, std::ostream* os) { *os << rounding_rule_name(v); }
inline void PrintTo(CacheMode v, std::ostream* os) { *os << cache_mode_name(v); }
}  // namespace machmoe

namespace machmoe::test {

/// Expects `f` to throw machmoe::Error whose message contains every fragment.
inline void expect_error(const std::function<void()>& f, std::initializer_list<const char*> fragments) {
  try {
    f();
    ADD_FAILURE() << "no error thrown; expected one mentioning '" << *fragments.begin() << "'";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const char* frag : fragments) EXPECT_NE(msg.find(frag), std::string::npos) << "message: " << msg;
  }
}

inline double rel_error(const std::vector<double>& a, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - ref[i]) * (a[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  if (den == 0) return std::sqrt(num);
  return std::sqrt(num / den);
}

template <class R>
std::vector<R> normal(std::mt19937_64& rng, std::size_t count, double stddev) {
  std::normal_distribution<double> dist(0.0, stddev);
  std::vector<R> v(count);
  for (R& x : v) x = static_cast<R>(dist(rng));
  return v;
}

/// All inputs of one layer call, owned. Caller-supplied routing draws K' <= K distinct random experts per token
/// (some tokens get none) and positive scores.
template <class R>
struct LayerCase {
  MoEProblem problem;
  std::vector<R> x, router_weight, w1, b1, w2, b2;
  std::vector<std::int64_t> pair_token, pair_expert;
  std::vector<R> pair_score;
  std::vector<R> grad_out, grad_logits;  // weights of the scalar test loss

  LayerCase(const MoEProblem& p, std::uint64_t seed) : problem(p) {
    std::mt19937_64 rng(seed);
    const auto sz = [](std::int64_t v) { return static_cast<std::size_t>(v); };
    x = normal<R>(rng, sz(p.T * p.d), 1.0);
    router_weight = normal<R>(rng, sz(p.E * p.d), 1.0 / std::sqrt(double(p.d)));
    w1 = normal<R>(rng, sz(p.E * p.w1_rows() * p.d), 1.0 / std::sqrt(double(p.d)));
    w2 = normal<R>(rng, sz(p.E * p.d * p.n), 1.0 / std::sqrt(double(p.n)));
    if (p.has_b1) b1 = normal<R>(rng, sz(p.E * p.w1_rows()), 0.5);
    if (p.has_b2) b2 = normal<R>(rng, sz(p.E * p.d), 0.5);
    if (p.routing == RoutingMode::kCallerSupplied) {
      std::uniform_int_distribution<std::int64_t> count(0, p.K);
      std::uniform_real_distribution<double> score(0.05, 1.0);
      std::vector<std::int64_t> experts(sz(p.E));
      for (std::int64_t t = 0; t < p.T; ++t) {
        for (std::int64_t e = 0; e < p.E; ++e) experts[e] = e;
        std::shuffle(experts.begin(), experts.end(), rng);
        const std::int64_t k = t == 0 ? p.K : count(rng);  // token 0 always full, so K is reached
        for (std::int64_t i = 0; i < k; ++i) {
          pair_token.push_back(t);
          pair_expert.push_back(experts[i]);
          pair_score.push_back(static_cast<R>(score(rng)));
        }
      }
      problem.num_pairs = static_cast<std::int64_t>(pair_token.size());
    }
    grad_out = normal<R>(rng, sz(p.T * p.d), 1.0);
    if (p.routing != RoutingMode::kCallerSupplied) grad_logits = normal<R>(rng, sz(p.T * p.E), 0.1);
  }

  ref::LayerInputs<R> inputs() const {
    ref::LayerInputs<R> in;
    in.x = x.data();
    in.router_weight = router_weight.data();
    in.experts.w1 = w1.data();
    in.experts.b1 = b1.empty() ? nullptr : b1.data();
    in.experts.w2 = w2.data();
    in.experts.b2 = b2.empty() ? nullptr : b2.data();
    if (problem.routing == RoutingMode::kCallerSupplied) {
      in.pair_token = pair_token.data();
      in.pair_expert = pair_expert.data();
      in.pair_score = pair_score.data();
    }
    return in;
  }

  /// L = <out, grad_out> + <logits, grad_logits>: its gradient is what backward(grad_out, grad_logits) returns.
  double loss() const {
    const ref::ForwardResult<R> f = ref::layer_forward(problem, inputs());
    double l = 0;
    for (std::size_t i = 0; i < f.out.size(); ++i) l += double(f.out[i]) * double(grad_out[i]);
    for (std::size_t i = 0; i < f.router_logits.size(); ++i) l += double(f.router_logits[i]) * double(grad_logits[i]);
    return l;
  }
};

/// Central finite differences of case.loss() w.r.t. every element of `param` (a member of `c`).
inline std::vector<double> finite_difference(LayerCase<double>& c, std::vector<double>& param, double h = 1e-6) {
  std::vector<double> g(param.size());
  for (std::size_t i = 0; i < param.size(); ++i) {
    const double keep = param[i];
    param[i] = keep + h;
    const double up = c.loss();
    param[i] = keep - h;
    const double down = c.loss();
    param[i] = keep;
    g[i] = (up - down) / (2 * h);
  }
  return g;
}


/// A case's inputs as host arrays of type R (dtype `dt`) with the public API's views over them: the weights and,
/// for caller routing, the triples (empty index and score views when there are no pairs: their data pointers are
/// those of empty vectors, typically null). Not copyable: the views point into the arrays.
template <class R>
struct HostLayerInputs {
  std::vector<R> x, router_weight, w1, b1, w2, b2, grad_out, grad_logits, score;
  std::vector<std::int64_t> token, expert;
  bool caller;
  LayerWeights weights;
  RoutingTriples triples;

  HostLayerInputs(const LayerCase<double>& c, DType dt)
      : x(cast(c.x)), router_weight(cast(c.router_weight)), w1(cast(c.w1)), b1(cast(c.b1)), w2(cast(c.w2)),
        b2(cast(c.b2)), grad_out(cast(c.grad_out)), grad_logits(cast(c.grad_logits)), score(cast(c.pair_score)),
        token(c.pair_token), expert(c.pair_expert),
        caller(c.problem.routing == RoutingMode::kCallerSupplied) {
    const MoEProblem& p = c.problem;
    if (!caller) weights.router_weight = TensorView::contiguous(router_weight.data(), dt, {p.E, p.d});
    weights.w1 = TensorView::contiguous(w1.data(), dt, {p.E, p.w1_rows(), p.d});
    weights.w2 = TensorView::contiguous(w2.data(), dt, {p.E, p.d, p.n});
    if (p.has_b1) weights.b1 = TensorView::contiguous(b1.data(), dt, {p.E, p.w1_rows()});
    if (p.has_b2) weights.b2 = TensorView::contiguous(b2.data(), dt, {p.E, p.d});
    if (caller) {
      triples.token_index = TensorView::contiguous(token.data(), DType::kInt64, {p.num_pairs});
      triples.expert_index = TensorView::contiguous(expert.data(), DType::kInt64, {p.num_pairs});
      triples.score = TensorView::contiguous(score.data(), dt, {p.num_pairs});
    }
  }
  HostLayerInputs(const HostLayerInputs&) = delete;
  HostLayerInputs& operator=(const HostLayerInputs&) = delete;

  const RoutingTriples* routing() const { return caller ? &triples : nullptr; }

 private:
  static std::vector<R> cast(const std::vector<double>& v) { return std::vector<R>(v.begin(), v.end()); }
};

}  // namespace machmoe::test
