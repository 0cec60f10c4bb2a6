// The whole forward of the layer against an independent float64 oracle: a deliberately naive, token-by-token
// transcription of docs/SPEC.md §1–§2 and §5 and docs/ROUTING.md that shares no code with the library. The router,
// the top-K selection with its tie rule, the three score variants, token rounding (counts, ranking and scores), the
// activations (written out again here, not taken from src/math/activation.hpp), both W1 layouts, the biases and
// the score-weighted sum are all recomputed from their definitions.
//
// Why: every other check of the forward is relative. The public API's CPU path calls ref::layer_forward itself, so
// comparing the two (test_layer.cpp) tests plumbing; finite differences (test_gradients.cpp) test the backward
// against the forward; test_activation.cpp and the GPU tests compare against activation.hpp or the reference. Only
// test_gptoss.cpp had an independent transcription, for one activation. A formula that is wrong in the one shared
// definition would pass all of them.
//
// Each parameter (activation x weight layout x routing mode) runs every combination of edge shape (T = 1, K = 1,
// K = E, E = 1, experts with no token, tied logits), bias (none, b1, b2, both), score variant and, for token
// rounding, rounding rule, through ref::layer_forward and through the public machmoe::forward in float64; output
// and router logits must agree with the oracle to a relative Frobenius error of 1e-12 (float64 rounding of
// differently ordered sums and different but equivalent formulas gives ~1e-16) and the expert counts exactly.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "machmoe/machmoe.hpp"
#include "test_support.hpp"

namespace machmoe::test {
namespace {

// ---- the oracle ------------------------------------------------------------------------------------------------

double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

/// GELU, tanh approximation (docs/SPEC.md §2.3: both gelu and geglu use it).
double gelu_tanh(double v) {
  const double pi = std::acos(-1.0);
  return 0.5 * v * (1.0 + std::tanh(std::sqrt(2.0 / pi) * (v + 0.044715 * v * v * v)));
}

/// A_j of a GLU activation from its gate and up pre-activations. gpt-oss (HF GptOssExperts): gate clamped above at
/// the limit, up clamped to [-limit, limit] and shifted by one, gate sigmoid(alpha gate).
double glu(const MoEProblem& p, double gate, double up, std::int64_t& clamped) {
  switch (p.activation) {
    case Activation::kSwiGLU: return gate * sigmoid(gate) * up;
    case Activation::kGeGLU: return gelu_tanh(gate) * up;
    case Activation::kReGLU: return std::max(gate, 0.0) * up;
    case Activation::kGptOssSwiGLU: {
      const double limit = p.swiglu_limit;
      clamped += (gate > limit) + (up > limit || up < -limit);
      const double g = std::min(gate, limit);
      const double u = std::max(-limit, std::min(up, limit));
      return g * sigmoid(p.swiglu_alpha * g) * (u + 1.0);
    }
    default: break;
  }
  ADD_FAILURE() << "not a GLU activation: " << activation_name(p.activation);
  return 0;
}

/// A_j of an elementwise activation.
double elementwise(Activation act, double h) {
  switch (act) {
    case Activation::kReLUSquared: return h > 0 ? h * h : 0.0;
    case Activation::kReLU: return h > 0 ? h : 0.0;
    case Activation::kGELU: return gelu_tanh(h);
    case Activation::kSiLU: return h * sigmoid(h);
    default: break;
  }
  ADD_FAILURE() << "not an elementwise activation: " << activation_name(act);
  return 0;
}

/// The K largest of z, largest first; equal values rank the lower index first (docs/ROUTING.md). Written as K
/// passes of "first strict maximum among the unpicked", so the tie rule is the scan order, not a sort comparator.
std::vector<std::int64_t> top_k(const std::vector<double>& z, std::int64_t K) {
  std::vector<bool> picked(z.size(), false);
  std::vector<std::int64_t> sel;
  for (std::int64_t k = 0; k < K; ++k) {
    std::int64_t best = -1;
    for (std::size_t e = 0; e < z.size(); ++e)
      if (!picked[e] && (best < 0 || z[e] > z[static_cast<std::size_t>(best)])) best = static_cast<std::int64_t>(e);
    picked[static_cast<std::size_t>(best)] = true;
    sel.push_back(best);
  }
  return sel;
}

struct Pair {
  std::int64_t token, expert;
  double score;
};

struct Oracle {
  std::vector<double> out;           // (T, d)
  std::vector<double> logits;        // (T, E); empty for caller-supplied routing
  std::vector<std::int64_t> counts;  // (E)
  std::int64_t clamped = 0;          // gptoss_swiglu: gate and up values the clamps changed
};

/// The routed pairs of the router (top-K, or token rounding built on it) from the logits, by definition.
std::vector<Pair> route(const MoEProblem& p, const std::vector<double>& logits) {
  const std::int64_t T = p.T, E = p.E, K = p.K;
  std::vector<std::vector<std::int64_t>> sel(static_cast<std::size_t>(T));  // token choice
  std::vector<std::vector<double>> prob(static_cast<std::size_t>(T));       // softmax over all E
  std::vector<std::vector<double>> tc(static_cast<std::size_t>(T));         // token-choice score of sel[t][k]
  for (std::int64_t t = 0; t < T; ++t) {
    const std::vector<double> z(logits.begin() + t * E, logits.begin() + (t + 1) * E);
    sel[t] = top_k(z, K);
    // Plain exp without the max subtracted: the logits of these cases are O(1), and it is the definition.
    double all = 0, chosen = 0;
    for (std::int64_t e = 0; e < E; ++e) all += std::exp(z[e]);
    for (std::int64_t e = 0; e < E; ++e) prob[t].push_back(std::exp(z[e]) / all);
    for (std::int64_t e : sel[t]) chosen += std::exp(z[e]);
    double chosen_prob = 0;
    for (std::int64_t e : sel[t]) chosen_prob += prob[t][e];
    for (std::int64_t e : sel[t]) {
      switch (p.score) {
        case ScoreVariant::kSoftmaxOverTopK: tc[t].push_back(std::exp(z[e]) / chosen); break;
        case ScoreVariant::kTopKOfSoftmax: tc[t].push_back(prob[t][e]); break;
        // Through the full softmax, as the variant is defined (the library computes it as softmax_topk).
        case ScoreVariant::kTopKOfSoftmaxRenorm: tc[t].push_back(prob[t][e] / chosen_prob); break;
      }
    }
  }
  std::vector<Pair> pairs;
  if (p.routing == RoutingMode::kTopK) {
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t k = 0; k < K; ++k) pairs.push_back({t, sel[t][k], tc[t][k]});
    return pairs;
  }
  // Token rounding (docs/SPEC.md §5, docs/ROUTING.md): f_e token choices, r_e by the rule with the upper count
  // capped at T; per expert the tokens ranked by S' = TC score if chosen, softmax - 1 otherwise (ties: lower token),
  // the first r_e kept; chosen pairs keep the TC score, padded ones carry the raw softmax probability.
  const std::int64_t M = p.tile_m;
  std::vector<std::vector<bool>> keep(static_cast<std::size_t>(T), std::vector<bool>(static_cast<std::size_t>(E)));
  for (std::int64_t e = 0; e < E; ++e) {
    std::vector<double> key(static_cast<std::size_t>(T));
    std::int64_t f = 0;
    for (std::int64_t t = 0; t < T; ++t) {
      key[t] = prob[t][e] - 1.0;
      for (std::int64_t k = 0; k < K; ++k)
        if (sel[t][k] == e) key[t] = tc[t][k], ++f;
    }
    const std::int64_t down = f / M * M, up = std::min((f + M - 1) / M * M, T);
    const std::int64_t r = p.rounding == RoundingRule::kDown ? down
                           : p.rounding == RoundingRule::kUp ? up
                                                             : (up - f < f - down ? up : down);
    for (std::int64_t t : top_k(key, r)) keep[t][e] = true;
  }
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t e = 0; e < E; ++e) {
      if (!keep[t][e]) continue;
      double s = prob[t][e];
      for (std::int64_t k = 0; k < K; ++k)
        if (sel[t][k] == e) s = tc[t][k];
      pairs.push_back({t, e, s});
    }
  return pairs;
}

/// The forward, token by token and pair by pair: O_t = sum over t's pairs of s (act(W1_e x_t + b1_e) W2_e^T + b2_e).
Oracle transcribe(const MoEProblem& p, const LayerCase<double>& c) {
  const std::int64_t T = p.T, d = p.d, n = p.n, E = p.E;
  const bool gated = p.activation == Activation::kSwiGLU || p.activation == Activation::kGeGLU ||
                     p.activation == Activation::kReGLU || p.activation == Activation::kGptOssSwiGLU;
  const std::int64_t rows = gated ? 2 * n : n;
  Oracle r;
  std::vector<Pair> pairs;
  if (p.routing == RoutingMode::kCallerSupplied) {
    for (std::size_t i = 0; i < c.pair_token.size(); ++i)
      pairs.push_back({c.pair_token[i], c.pair_expert[i], c.pair_score[i]});
  } else {
    r.logits.assign(static_cast<std::size_t>(T * E), 0.0);
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t e = 0; e < E; ++e)
        for (std::int64_t k = 0; k < d; ++k) r.logits[t * E + e] += c.x[t * d + k] * c.router_weight[e * d + k];
    pairs = route(p, r.logits);
  }

  r.out.assign(static_cast<std::size_t>(T * d), 0.0);
  r.counts.assign(static_cast<std::size_t>(E), 0);
  // W1 row of gate_j and up_j: interleaved 2j, 2j + 1; concatenated j, n + j. Non-GLU: row j is h_j.
  const auto gate_row = [&](std::int64_t j) { return p.weight_layout == WeightLayout::kInterleaved ? 2 * j : j; };
  const auto up_row = [&](std::int64_t j) {
    return p.weight_layout == WeightLayout::kInterleaved ? 2 * j + 1 : n + j;
  };
  const auto pre_activation = [&](std::int64_t t, std::int64_t e, std::int64_t row) {
    double h = c.b1.empty() ? 0.0 : c.b1[e * rows + row];
    for (std::int64_t k = 0; k < d; ++k) h += c.w1[(e * rows + row) * d + k] * c.x[t * d + k];
    return h;
  };
  for (const Pair& pr : pairs) {
    const std::int64_t t = pr.token, e = pr.expert;
    ++r.counts[e];
    std::vector<double> a(static_cast<std::size_t>(n));
    for (std::int64_t j = 0; j < n; ++j)
      a[j] = gated ? glu(p, pre_activation(t, e, gate_row(j)), pre_activation(t, e, up_row(j)), r.clamped)
                   : elementwise(p.activation, pre_activation(t, e, j));
    for (std::int64_t m = 0; m < d; ++m) {
      double y = c.b2.empty() ? 0.0 : c.b2[e * d + m];
      for (std::int64_t j = 0; j < n; ++j) y += c.w2[(e * d + m) * n + j] * a[j];
      r.out[t * d + m] += pr.score * y;
    }
  }
  return r;
}

// ---- the cases -------------------------------------------------------------------------------------------------

enum class Router {
  kRandom,
  kTiedPairs,  // router rows 2i and 2i + 1 equal: every token's logits come in bitwise-equal pairs
  kZero,       // router weight zero: all logits 0, every token picks experts 0..K-1 by the tie rule alone
};

struct Shape {
  const char* name;
  std::int64_t T, d, n, E, K;
  Router router = Router::kRandom;
};

// T = 13 and odd d, n: no size is a multiple of a tile, a block or another size.
const Shape kShapes[] = {
    {"general", 13, 9, 5, 6, 2},
    {"one_token", 1, 8, 6, 4, 2},
    {"K_is_1", 13, 7, 5, 5, 1},
    {"K_is_E", 13, 7, 5, 4, 4},
    {"one_expert", 13, 7, 5, 1, 1},
    {"idle_experts", 5, 7, 5, 16, 2},  // 10 pairs over 16 experts: at least 6 receive no token
    // K = 3 odd: each token's K-th choice splits a tied pair, so the lower index must win it.
    {"tied_logit_pairs", 13, 7, 5, 6, 3, Router::kTiedPairs},
    {"all_logits_zero", 13, 7, 5, 6, 3, Router::kZero},
};

struct Bias {
  const char* name;
  bool b1, b2;
};
const Bias kBiases[] = {{"none", false, false}, {"b1", true, false}, {"b2", false, true}, {"b1+b2", true, true}};

/// gptoss_swiglu's (alpha, limit): gpt-oss's; a limit that clamps a large share of the O(1) pre-activations with
/// another alpha; no clamp at all (+inf).
struct GptOssParams {
  double alpha, limit;
};
const GptOssParams kGptOssParams[] = {
    {kGptOssSwiGLUAlpha, kGptOssSwiGLULimit}, {1.0, 0.75}, {kGptOssSwiGLUAlpha, std::numeric_limits<double>::infinity()}};

struct ApiForward {
  std::vector<double> out, logits;
  std::vector<std::int32_t> counts;
};

/// machmoe::forward on CPU float64 tensors.
ApiForward api_forward(const LayerCase<double>& c) {
  const MoEProblem& p = c.problem;
  HostLayerInputs<double> in(c, DType::kFP64);
  ApiForward r;
  r.out.assign(static_cast<std::size_t>(p.T * p.d), -1.0);
  r.counts.assign(static_cast<std::size_t>(p.E), -1);
  ForwardOutputs fo;
  fo.out = TensorView::contiguous(r.out.data(), DType::kFP64, {p.T, p.d});
  if (p.routing != RoutingMode::kCallerSupplied) {
    r.logits.assign(static_cast<std::size_t>(p.T * p.E), -1.0);
    fo.router_logits = TensorView::contiguous(r.logits.data(), DType::kFP64, {p.T, p.E});
  }
  fo.expert_counts = TensorView::contiguous(r.counts.data(), DType::kInt32, {p.E});
  std::vector<unsigned char> saved(saved_layout(p, DType::kFP64).total_bytes);
  forward(p, TensorView::contiguous(in.x.data(), DType::kFP64, {p.T, p.d}), in.weights, in.routing(), fo,
          ForwardBuffers{saved.data(), saved.size(), nullptr, 0});
  return r;
}

struct OracleParam {
  Activation activation;
  WeightLayout layout;
  RoutingMode routing;
};

// Failure messages name the parameter rather than printing its bytes.
void PrintTo(const OracleParam& p, std::ostream* os) {
  *os << activation_name(p.activation) << " " << weight_layout_name(p.layout) << " " << routing_mode_name(p.routing);
}

std::vector<OracleParam> every_activation_layout_and_routing() {
  std::vector<OracleParam> v;
  for (Activation act : {Activation::kSwiGLU, Activation::kGeGLU, Activation::kReGLU, Activation::kReLUSquared,
                         Activation::kReLU, Activation::kGELU, Activation::kSiLU, Activation::kGptOssSwiGLU})
    for (WeightLayout layout : {WeightLayout::kInterleaved, WeightLayout::kConcatenated}) {
      if (!is_glu(act) && layout != WeightLayout::kInterleaved) continue;  // a gate/up layout needs a GLU
      for (RoutingMode routing : {RoutingMode::kTopK, RoutingMode::kTokenRounding, RoutingMode::kCallerSupplied})
        v.push_back({act, layout, routing});
    }
  return v;
}

class ForwardOracle : public testing::TestWithParam<OracleParam> {
 protected:
  // Over the whole suite: the sub-cases run and the worst relative error of each compared output, printed once.
  static inline std::int64_t cases_ = 0;
  static inline double worst_out_ = 0, worst_logits_ = 0;
  static void TearDownTestSuite() {
    std::printf("[ ForwardOracle ] %lld sub-cases; worst relative Frobenius error: output %.3g, router logits %.3g\n",
                static_cast<long long>(cases_), worst_out_, worst_logits_);
  }
};

TEST_P(ForwardOracle, ReferenceAndPublicApiMatchANaiveFloat64TranscriptionOfTheSpec) {
  constexpr double kTol = 1e-12;
  const OracleParam param = GetParam();
  std::int64_t clamped = 0;
  for (std::size_t si = 0; si < std::size(kShapes); ++si) {
    const Shape& sh = kShapes[si];
    for (std::size_t bi = 0; bi < std::size(kBiases); ++bi)
      for (const GptOssParams& gp : kGptOssParams) {
        MoEProblem p;
        p.T = sh.T, p.d = sh.d, p.n = sh.n, p.E = sh.E, p.K = sh.K;
        p.activation = param.activation, p.weight_layout = param.layout, p.routing = param.routing;
        p.has_b1 = kBiases[bi].b1, p.has_b2 = kBiases[bi].b2;
        p.tile_m = 8;  // token rounding only; T = 13 then has one full tile and a partial one
        if (param.activation == Activation::kGptOssSwiGLU) {
          p.swiglu_alpha = gp.alpha, p.swiglu_limit = gp.limit;
        } else if (&gp != &kGptOssParams[0]) {
          continue;  // the parameters belong to gptoss_swiglu; the others run once
        }
        LayerCase<double> c(p, 1000 + 10 * si + bi);
        if (sh.router == Router::kTiedPairs)
          for (std::int64_t e = 1; e < p.E; e += 2)
            std::copy_n(&c.router_weight[(e - 1) * p.d], p.d, &c.router_weight[e * p.d]);
        if (sh.router == Router::kZero) std::fill(c.router_weight.begin(), c.router_weight.end(), 0.0);

        // Caller routing carries its own scores: the score variant and rounding rule do not apply.
        const bool routed = p.routing != RoutingMode::kCallerSupplied;
        const bool rounding = p.routing == RoutingMode::kTokenRounding;
        for (ScoreVariant score : {ScoreVariant::kSoftmaxOverTopK, ScoreVariant::kTopKOfSoftmax,
                                   ScoreVariant::kTopKOfSoftmaxRenorm}) {
          if (!routed && score != ScoreVariant::kSoftmaxOverTopK) continue;
          for (RoundingRule rule : {RoundingRule::kNearest, RoundingRule::kUp, RoundingRule::kDown}) {
            if (!rounding && rule != RoundingRule::kNearest) continue;
            c.problem.score = score;
            c.problem.rounding = rule;
            const MoEProblem& pc = c.problem;
            SCOPED_TRACE(std::string("shape ") + sh.name + ", bias " + kBiases[bi].name + ": " + pc.to_string());
            const Oracle want = transcribe(pc, c);
            clamped += want.clamped;
            ++cases_;

            // The edges must be what their names say, in the oracle's own routing.
            if (std::string(sh.name) == "idle_experts") {
              EXPECT_NE(std::count(want.counts.begin(), want.counts.end(), 0), 0) << "no expert without a token";
            }
            if (sh.router == Router::kZero && p.routing == RoutingMode::kTopK) {
              for (std::int64_t e = 0; e < p.E; ++e) {
                EXPECT_EQ(want.counts[e], e < p.K ? p.T : 0) << "all-tied logits pick experts 0..K-1, expert " << e;
              }
            }

            const ref::ForwardResult<double> f = ref::layer_forward(pc, c.inputs());
            const double out_err = rel_error(f.out, want.out);
            EXPECT_LT(out_err, kTol) << "ref::layer_forward output";
            EXPECT_EQ(f.expert_counts, want.counts) << "ref::layer_forward expert counts";
            worst_out_ = std::max(worst_out_, out_err);
            if (routed) {
              const double logit_err = rel_error(f.router_logits, want.logits);
              EXPECT_LT(logit_err, kTol) << "ref::layer_forward router logits";
              worst_logits_ = std::max(worst_logits_, logit_err);
            } else {
              EXPECT_TRUE(f.router_logits.empty()) << "caller routing has no router";
            }

            const ApiForward a = api_forward(c);
            const double api_err = rel_error(a.out, want.out);
            EXPECT_LT(api_err, kTol) << "machmoe::forward output";
            worst_out_ = std::max(worst_out_, api_err);
            if (routed) {
              const double logit_err = rel_error(a.logits, want.logits);
              EXPECT_LT(logit_err, kTol) << "machmoe::forward router logits";
              worst_logits_ = std::max(worst_logits_, logit_err);
            }
            EXPECT_EQ(std::vector<std::int64_t>(a.counts.begin(), a.counts.end()), want.counts)
                << "machmoe::forward expert counts";
          }
        }
      }
  }
  // The limit 0.75 must have clamped something, or the clamps went untested here.
  if (param.activation == Activation::kGptOssSwiGLU) { EXPECT_GT(clamped, 0); }
}

INSTANTIATE_TEST_SUITE_P(EveryActivationLayoutAndRouting, ForwardOracle,
                         testing::ValuesIn(every_activation_layout_and_routing()),
                         [](const testing::TestParamInfo<OracleParam>& i) {
                           return std::string(activation_name(i.param.activation)) + "_" +
                                  weight_layout_name(i.param.layout) + "_" + routing_mode_name(i.param.routing);
                         });

}  // namespace
}  // namespace machmoe::test
