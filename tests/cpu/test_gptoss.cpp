// Activation gptoss_swiglu (gpt-oss's expert MLP) in the CPU reference: the layer against an independent per-token
// transcription of HF transformers' GptOssTopKRouter + GptOssExperts (float64), both weight layouts, with and without
// biases, both cache modes; the parameters' validation. Inputs are scaled so that a good share of the gate and up
// pre-activations lie beyond the limit, and the test says how many did, so the clamps are exercised rather than
// assumed. Gradients against finite differences: test_gradients.cpp (cases gptoss_swiglu_*).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "machmoe/machmoe.hpp"
#include "test_support.hpp"

namespace machmoe::test {
namespace {

struct Transcription {
  std::vector<double> out;
  std::int64_t gate_clamped = 0, up_clamped = 0, values = 0;
};

/// gpt-oss as HF writes it, token by token: logits = x Wr^T, the top K, softmax over those K; per selected expert
/// gate_up = x W1^T + b1 with gate = columns ::2, up = 1::2 (our interleaved W1 rows are HF's gate_up_proj columns),
/// gate.clamp(max=limit), up.clamp(-limit, limit), glu = gate sigmoid(alpha gate), (up + 1) glu W2^T + b2, times
/// the score, summed. Written with exp and std::min/max, not through activation.hpp.
Transcription transcribe(const MoEProblem& p, const LayerCase<double>& c) {
  const std::int64_t T = p.T, d = p.d, n = p.n, E = p.E, K = p.K;
  const double alpha = p.swiglu_alpha, limit = p.swiglu_limit;
  Transcription r;
  r.out.assign(static_cast<std::size_t>(T * d), 0.0);
  for (std::int64_t t = 0; t < T; ++t) {
    const double* x = &c.x[t * d];
    std::vector<double> logits(E);
    for (std::int64_t e = 0; e < E; ++e) {
      double z = 0;
      for (std::int64_t k = 0; k < d; ++k) z += x[k] * c.router_weight[e * d + k];
      logits[e] = z;
    }
    std::vector<std::int64_t> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) { return logits[a] > logits[b]; });
    double zmax = logits[order[0]], zsum = 0;
    for (std::int64_t k = 0; k < K; ++k) zsum += std::exp(logits[order[k]] - zmax);
    for (std::int64_t k = 0; k < K; ++k) {
      const std::int64_t e = order[k];
      const double score = std::exp(logits[e] - zmax) / zsum;
      std::vector<double> act(n);
      for (std::int64_t j = 0; j < n; ++j) {
        // Interleaved W1: row 2j is gate_j, row 2j + 1 is up_j (the concatenated case is converted by the caller).
        double gate = 0, up = 0;
        for (std::int64_t k2 = 0; k2 < d; ++k2) {
          gate += x[k2] * c.w1[(e * 2 * n + 2 * j) * d + k2];
          up += x[k2] * c.w1[(e * 2 * n + 2 * j + 1) * d + k2];
        }
        if (!c.b1.empty()) gate += c.b1[e * 2 * n + 2 * j], up += c.b1[e * 2 * n + 2 * j + 1];
        r.gate_clamped += gate > limit, r.up_clamped += std::fabs(up) > limit, ++r.values;
        gate = std::min(gate, limit);
        up = std::max(-limit, std::min(up, limit));
        const double glu = gate / (1.0 + std::exp(-gate * alpha));
        act[j] = (up + 1.0) * glu;
      }
      for (std::int64_t m = 0; m < d; ++m) {
        double y = 0;
        for (std::int64_t j = 0; j < n; ++j) y += act[j] * c.w2[(e * d + m) * n + j];
        if (!c.b2.empty()) y += c.b2[e * d + m];
        r.out[t * d + m] += score * y;
      }
    }
  }
  return r;
}

MoEProblem gptoss_problem(bool bias, double limit) {
  MoEProblem p;
  p.T = 40, p.d = 24, p.n = 16, p.E = 8, p.K = 4;
  p.activation = Activation::kGptOssSwiGLU;
  p.swiglu_limit = limit;
  p.has_b1 = p.has_b2 = bias;
  return p;
}

/// W1 scaled so the pre-activations have a standard deviation near `scale` (x ~ N(0, 1), W1 ~ N(0, scale^2 / d)).
void scale_w1(LayerCase<double>& c, double scale) {
  for (double& w : c.w1) w *= scale;
  for (double& b : c.b1) b *= scale;
}

std::vector<double> interleaved_to_concatenated(const std::vector<double>& v, std::int64_t E, std::int64_t n,
                                                std::int64_t row_len) {
  std::vector<double> out(v.size());
  for (std::int64_t e = 0; e < E; ++e)
    for (std::int64_t c = 0; c < 2 * n; ++c)
      std::copy_n(&v[(e * 2 * n + c) * row_len], row_len, &out[(e * 2 * n + (c % 2) * n + c / 2) * row_len]);
  return out;
}

TEST(GptOssReference, LayerMatchesAnIndependentTranscriptionWithTheClampsActive) {
  for (double limit : {kGptOssSwiGLULimit, 1.5})
    for (bool bias : {false, true}) {
      MoEProblem p = gptoss_problem(bias, limit);
      LayerCase<double> c(p, 77 + static_cast<std::uint64_t>(bias));
      scale_w1(c, limit == kGptOssSwiGLULimit ? 7.0 : 1.5);  // pre-activations of the limit's size: ~30% clamped
      const Transcription want = transcribe(p, c);
      // The clamps must be doing something in this test: a fifth or more of each half beyond the limit.
      EXPECT_GT(want.gate_clamped * 5, want.values / 2) << "gate values above the limit: " << want.gate_clamped;
      EXPECT_GT(want.up_clamped * 5, want.values) << "up values beyond +-limit: " << want.up_clamped;

      const ref::ForwardResult<double> f = ref::layer_forward(p, c.inputs());
      EXPECT_LT(rel_error(f.out, want.out), 1e-13) << "limit=" << limit << " bias=" << bias;

      // The concatenated layout (HF-style [gate; up] rows) gives bitwise the same layer.
      MoEProblem pc = p;
      pc.weight_layout = WeightLayout::kConcatenated;
      LayerCase<double> cc = c;
      cc.problem = pc;
      cc.w1 = interleaved_to_concatenated(c.w1, p.E, p.n, p.d);
      if (bias) cc.b1 = interleaved_to_concatenated(c.b1, p.E, p.n, 1);
      const ref::ForwardResult<double> fc = ref::layer_forward(pc, cc.inputs());
      EXPECT_EQ(fc.out, f.out);
      const ref::BackwardResult<double> g = ref::layer_backward(p, c.inputs(), f.saved, c.grad_out.data(), nullptr);
      const ref::BackwardResult<double> gc = ref::layer_backward(pc, cc.inputs(), fc.saved, c.grad_out.data(), nullptr);
      EXPECT_EQ(gc.dx, g.dx);
      EXPECT_EQ(gc.dw2, g.dw2);
      EXPECT_EQ(gc.dw1, interleaved_to_concatenated(g.dw1, p.E, p.n, p.d));

      // Input-only cache mode recomputes H with the same arithmetic: bitwise the same gradients.
      MoEProblem pi = p;
      pi.cache = CacheMode::kInputOnly;
      const ref::ForwardResult<double> fi = ref::layer_forward(pi, c.inputs());
      const ref::BackwardResult<double> gi = ref::layer_backward(pi, c.inputs(), fi.saved, c.grad_out.data(), nullptr);
      EXPECT_EQ(fi.out, f.out);
      EXPECT_EQ(gi.dx, g.dx);
      EXPECT_EQ(gi.dw1, g.dw1);
      EXPECT_EQ(gi.db1, g.db1);
    }
}

// The parameters reach the reference: a different alpha or limit changes the output, by the transcription's amount.
TEST(GptOssReference, AlphaAndLimitAreUsed) {
  MoEProblem p = gptoss_problem(true, 2.0);
  p.swiglu_alpha = 0.75;
  LayerCase<double> c(p, 5);
  scale_w1(c, 3.0);
  const ref::ForwardResult<double> f = ref::layer_forward(p, c.inputs());
  EXPECT_LT(rel_error(f.out, transcribe(p, c).out), 1e-13);
  MoEProblem q = p;
  q.swiglu_alpha = kGptOssSwiGLUAlpha, q.swiglu_limit = kGptOssSwiGLULimit;
  EXPECT_GT(rel_error(ref::layer_forward(q, c.inputs()).out, f.out), 1e-2);
}

// The public API on the CPU backend (float64) gives the reference's output for this activation.
TEST(GptOssReference, PublicApiFp64MatchesTheTranscription) {
  MoEProblem p = gptoss_problem(true, kGptOssSwiGLULimit);
  LayerCase<double> c(p, 11);
  scale_w1(c, 7.0);
  HostLayerInputs<double> h(c, DType::kFP64);
  std::vector<double> out(static_cast<std::size_t>(p.T * p.d)), logits(static_cast<std::size_t>(p.T * p.E));
  std::vector<std::int32_t> counts(static_cast<std::size_t>(p.E));
  std::vector<unsigned char> saved(saved_layout(p, DType::kFP64).total_bytes);
  ForwardOutputs fo;
  fo.out = TensorView::contiguous(out.data(), DType::kFP64, {p.T, p.d});
  fo.router_logits = TensorView::contiguous(logits.data(), DType::kFP64, {p.T, p.E});
  fo.expert_counts = TensorView::contiguous(counts.data(), DType::kInt32, {p.E});
  forward(p, TensorView::contiguous(h.x.data(), DType::kFP64, {p.T, p.d}), h.weights, nullptr, fo,
          ForwardBuffers{saved.data(), saved.size(), nullptr, 0});
  EXPECT_LT(rel_error(out, transcribe(p, c).out), 1e-13);
}

TEST(GptOssValidation, ParametersAreCheckedAndBelongToGptOssOnly) {
  auto message = [](const MoEProblem& p) -> std::string {
    try {
      validate_problem(p, "test");
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  MoEProblem p = gptoss_problem(false, kGptOssSwiGLULimit);
  EXPECT_EQ(message(p), "");
  p.swiglu_limit = std::numeric_limits<double>::infinity();  // no clamping
  EXPECT_EQ(message(p), "");
  // (1e-50 and 1e39: finite doubles that the float the kernels compute with cannot hold)
  for (double bad : {0.0, -1.0, std::numeric_limits<double>::quiet_NaN(), 1e-50, 1e39}) {
    p.swiglu_limit = bad;
    EXPECT_NE(message(p).find("problem.swiglu_limit"), std::string::npos) << bad;
  }
  p.swiglu_limit = static_cast<double>(std::numeric_limits<float>::min());  // the smallest normal float: taken
  EXPECT_EQ(message(p), "");
  p.swiglu_limit = 7.0;
  p.swiglu_alpha = -static_cast<double>(std::numeric_limits<float>::max());
  EXPECT_EQ(message(p), "");
  for (double bad : {std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN(), 1e39, -1e39}) {
    p.swiglu_alpha = bad;
    EXPECT_NE(message(p).find("problem.swiglu_alpha"), std::string::npos) << bad;
  }
  // Set with another activation: refused, naming the activation they belong to.
  MoEProblem q = gptoss_problem(false, kGptOssSwiGLULimit);
  q.activation = Activation::kSwiGLU;
  EXPECT_EQ(message(q), "");
  q.swiglu_limit = 10.0;
  const std::string m = message(q);
  EXPECT_NE(m.find("problem.swiglu_limit"), std::string::npos) << m;
  EXPECT_NE(m.find("gptoss_swiglu"), std::string::npos) << m;
  q.swiglu_limit = kGptOssSwiGLULimit, q.swiglu_alpha = 1.0;
  EXPECT_NE(message(q).find("problem.swiglu_alpha"), std::string::npos);
}

TEST(GptOssValidation, NameAndCode) {
  EXPECT_EQ(parse_activation("gptoss_swiglu"), Activation::kGptOssSwiGLU);
  EXPECT_STREQ(activation_name(Activation::kGptOssSwiGLU), "gptoss_swiglu");
  EXPECT_EQ(activation_from_code(7, "test", "activation"), Activation::kGptOssSwiGLU);
  EXPECT_TRUE(is_glu(Activation::kGptOssSwiGLU));
  MoEProblem p = gptoss_problem(false, 7.0);
  EXPECT_EQ(p.w1_rows(), 2 * p.n);
  EXPECT_NE(p.to_string().find("gptoss_swiglu(alpha=1.702,limit=7)"), std::string::npos) << p.to_string();
}

}  // namespace
}  // namespace machmoe::test
