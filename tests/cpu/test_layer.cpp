// Layer-level properties of the reference and of the public C++ API on the CPU backend.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "machmoe/machmoe.hpp"
#include "reference/parallel.hpp"
#include "test_support.hpp"

namespace machmoe::test {
namespace {

MoEProblem small_problem(Activation act = Activation::kSwiGLU, RoutingMode routing = RoutingMode::kTopK) {
  MoEProblem p;
  p.T = 24, p.d = 10, p.n = 6, p.E = 5, p.K = 2;
  p.activation = act;
  p.routing = routing;
  p.tile_m = 8;
  return p;
}

// dS = <dA', A> (+ <dO_t, b2_e>) equals the naive <dO_t, Y_g> that would need a cached Y.
TEST(LayerReference, ScoreGradientIdentityMatchesNaiveFormula) {
  for (bool bias : {false, true})
    for (Activation act : {Activation::kSwiGLU, Activation::kReLUSquared}) {
      MoEProblem p = small_problem(act);
      p.has_b1 = p.has_b2 = bias;
      LayerCase<double> c(p, 42);
      const ref::ForwardResult<double> f = ref::layer_forward(p, c.inputs());
      const ref::BackwardResult<double> g =
          ref::layer_backward(p, c.inputs(), f.saved, c.grad_out.data(), nullptr);
      const ref::RoutingMetadata& m = f.saved.meta;
      std::vector<double> naive(m.num_pairs());
      for (std::int64_t gr = 0; gr < m.num_pairs(); ++gr) {
        double s = 0;
        for (std::int64_t k = 0; k < p.d; ++k) s += c.grad_out[m.gather[gr] * p.d + k] * f.y[gr * p.d + k];
        naive[m.scatter[gr]] = s;
      }
      EXPECT_LT(rel_error(g.ds, naive), 1e-13) << "bias=" << bias << " " << activation_name(act);
    }
}

std::vector<double> to_concatenated(const std::vector<double>& interleaved, std::int64_t E, std::int64_t n,
                                    std::int64_t row_len) {
  std::vector<double> out(interleaved.size());
  for (std::int64_t e = 0; e < E; ++e)
    for (std::int64_t c = 0; c < 2 * n; ++c) {
      const std::int64_t row = (c % 2) * n + c / 2;
      std::memcpy(&out[(e * 2 * n + row) * row_len], &interleaved[(e * 2 * n + c) * row_len],
                  sizeof(double) * row_len);
    }
  return out;
}

TEST(LayerReference, BothWeightLayoutsAreBitwiseIdentical) {
  for (Activation act : {Activation::kSwiGLU, Activation::kGeGLU, Activation::kReGLU}) {
    MoEProblem p = small_problem(act);
    p.has_b1 = p.has_b2 = true;
    LayerCase<double> ci(p, 9);
    LayerCase<double> cc = ci;
    cc.problem.weight_layout = WeightLayout::kConcatenated;
    cc.w1 = to_concatenated(ci.w1, p.E, p.n, p.d);
    cc.b1 = to_concatenated(ci.b1, p.E, p.n, 1);
    const ref::ForwardResult<double> fi = ref::layer_forward(ci.problem, ci.inputs());
    const ref::ForwardResult<double> fc = ref::layer_forward(cc.problem, cc.inputs());
    EXPECT_EQ(fi.out, fc.out);
    EXPECT_EQ(fi.saved.h, fc.saved.h) << "H is interleaved in both layouts";
    const ref::BackwardResult<double> gi =
        ref::layer_backward(ci.problem, ci.inputs(), fi.saved, ci.grad_out.data(), ci.grad_logits.data());
    const ref::BackwardResult<double> gc =
        ref::layer_backward(cc.problem, cc.inputs(), fc.saved, cc.grad_out.data(), cc.grad_logits.data());
    EXPECT_EQ(gi.dx, gc.dx);
    EXPECT_EQ(to_concatenated(gi.dw1, p.E, p.n, p.d), gc.dw1);
    EXPECT_EQ(to_concatenated(gi.db1, p.E, p.n, 1), gc.db1);
    EXPECT_EQ(gi.dw2, gc.dw2);
    EXPECT_EQ(gi.drouter_weight, gc.drouter_weight);
  }
}

TEST(LayerReference, ExpertsWithNoTokensGetZeroGradients) {
  MoEProblem p = small_problem();
  p.T = 3, p.E = 8, p.K = 1;
  p.has_b1 = p.has_b2 = true;
  LayerCase<double> c(p, 5);
  const ref::ForwardResult<double> f = ref::layer_forward(p, c.inputs());
  const ref::BackwardResult<double> g = ref::layer_backward(p, c.inputs(), f.saved, c.grad_out.data(), nullptr);
  int empty = 0;
  for (std::int64_t e = 0; e < p.E; ++e) {
    if (f.expert_counts[e] != 0) continue;
    ++empty;
    for (std::int64_t i = 0; i < p.w1_rows() * p.d; ++i) { EXPECT_EQ(g.dw1[e * p.w1_rows() * p.d + i], 0.0); }
    for (std::int64_t i = 0; i < p.d * p.n; ++i) { EXPECT_EQ(g.dw2[e * p.d * p.n + i], 0.0); }
    for (std::int64_t i = 0; i < p.d; ++i) { EXPECT_EQ(g.db2[e * p.d + i], 0.0); }
  }
  EXPECT_GE(empty, 5);
}

TEST(LayerReference, TokensWithNoExpertsGiveZeroOutput) {
  MoEProblem p = small_problem(Activation::kSwiGLU, RoutingMode::kTokenRounding);
  p.rounding = RoundingRule::kDown;
  p.tile_m = 64;  // more than any expert's count: rounding down drops every pair
  LayerCase<double> c(p, 3);
  const ref::ForwardResult<double> f = ref::layer_forward(p, c.inputs());
  EXPECT_EQ(f.saved.meta.num_pairs(), 0);
  for (double v : f.out) { EXPECT_EQ(v, 0.0); }
  const ref::BackwardResult<double> g = ref::layer_backward(p, c.inputs(), f.saved, c.grad_out.data(), nullptr);
  for (double v : g.dx) { EXPECT_EQ(v, 0.0); }
}

// The reference's loops run on several threads (reference/parallel.hpp); each output element is one thread's, summed
// in the serial order, so any thread count gives bitwise the one-thread results. Sizes large enough for every loop
// to split (the aggregation, the router GEMMs, the weight gradients over experts and rows), every routing, GLU with
// the concatenated layout and biases, and a plain activation.
TEST(LayerReference, ThreadCountDoesNotChangeABit) {
  struct Restore {
    int threads = ref::cpu_threads();
    ~Restore() { ref::set_cpu_threads(threads); }
  } restore;
  for (RoutingMode r : {RoutingMode::kTopK, RoutingMode::kTokenRounding, RoutingMode::kCallerSupplied})
    for (Activation act : {Activation::kSwiGLU, Activation::kReLU}) {
      MoEProblem p;
      p.T = 2048, p.d = 64, p.n = 32, p.E = 32, p.K = 4, p.activation = act, p.routing = r, p.tile_m = 16;
      p.weight_layout = is_glu(act) ? WeightLayout::kConcatenated : WeightLayout::kInterleaved;
      p.has_b1 = p.has_b2 = true;
      const LayerCase<double> c(p, 11);
      auto run = [&](int threads) {
        ref::set_cpu_threads(threads);
        const ref::ForwardResult<double> f = ref::layer_forward(c.problem, c.inputs());
        const ref::BackwardResult<double> g = ref::layer_backward(
            c.problem, c.inputs(), f.saved, c.grad_out.data(), c.grad_logits.empty() ? nullptr : c.grad_logits.data());
        return std::make_pair(f, g);
      };
      const auto [f1, g1] = run(1);
      const auto [f7, g7] = run(7);
      const std::string what = std::string(routing_mode_name(r)) + " " + activation_name(act);
      ASSERT_GT(f1.saved.meta.num_pairs(), 1000) << what;
      const auto bitwise = [&](const char* name, const std::vector<double>& a, const std::vector<double>& b) {
        ASSERT_EQ(a.size(), b.size()) << what << " " << name;
        for (std::size_t i = 0; i < a.size(); ++i)
          if (std::memcmp(&a[i], &b[i], sizeof(double)) != 0) {
            ADD_FAILURE() << what << " " << name << "[" << i << "]: " << a[i] << " on 7 threads, " << b[i] << " on 1";
            return;
          }
      };
      bitwise("out", f7.out, f1.out);
      bitwise("router_logits", f7.router_logits, f1.router_logits);
      bitwise("h", f7.saved.h, f1.saved.h);
      bitwise("dx", g7.dx, g1.dx);
      bitwise("drouter_weight", g7.drouter_weight, g1.drouter_weight);
      bitwise("dw1", g7.dw1, g1.dw1);
      bitwise("db1", g7.db1, g1.db1);
      bitwise("dw2", g7.dw2, g1.dw2);
      bitwise("db2", g7.db2, g1.db2);
      bitwise("ds", g7.ds, g1.ds);
      bitwise("dlogits", g7.dlogits, g1.dlogits);
      bitwise("dscores", g7.dscores, g1.dscores);
    }
}

// ---- public API ------------------------------------------------------------------------------------------------

/// Runs forward + backward through the public API for real type R on a case built in double.
template <class R>
struct ApiRun {
  std::vector<R> out, logits, dx, dwr, dw1, db1, dw2, db2, dscores;
  std::vector<std::int32_t> counts;
  std::size_t saved_bytes = 0;

  /// w1_gap >= 0 (the concatenated layout of a GLU activation): W1 and its gradient as 4D (E, 2, n, d) views whose
  /// up half lies w1_gap elements past the end of the gate half, in one buffer (as torchtitan's w1 and w3, two
  /// allocations); dw1 is read back in the (E, 2n, d) order. The gap holds poison, which must stay as it is.
  ApiRun(const LayerCase<double>& c, std::int64_t row_pad = 0, std::int64_t w1_gap = -1) {
    const MoEProblem& p = c.problem;
    const DType dt = std::is_same<R, double>::value ? DType::kFP64 : DType::kFP32;
    auto cast = [](const std::vector<double>& v) { return std::vector<R>(v.begin(), v.end()); };
    // x with padded rows (stride d + row_pad) to exercise strided views.
    std::vector<R> x(static_cast<std::size_t>(p.T * (p.d + row_pad)), R(-777));
    for (std::int64_t t = 0; t < p.T; ++t)
      for (std::int64_t k = 0; k < p.d; ++k) x[t * (p.d + row_pad) + k] = static_cast<R>(c.x[t * p.d + k]);
    std::vector<R> wr = cast(c.router_weight), w1 = cast(c.w1), b1 = cast(c.b1), w2 = cast(c.w2), b2 = cast(c.b2),
                   gout = cast(c.grad_out), glog = cast(c.grad_logits), score = cast(c.pair_score);
    std::vector<std::int64_t> tok = c.pair_token, exp = c.pair_expert;
    LayerWeights w;
    if (p.routing != RoutingMode::kCallerSupplied) w.router_weight = TensorView::contiguous(wr.data(), dt, {p.E, p.d});
    w.w1 = TensorView::contiguous(w1.data(), dt, {p.E, p.w1_rows(), p.d});
    // Halves apart: the gate rows of every expert, the gap, then the up rows (copied from the concatenated w1).
    const std::int64_t half = p.E * p.n * p.d;
    std::vector<R> w1_apart, dw1_apart;
    auto apart_view = [&](std::vector<R>& buffer) {
      return TensorView::strided(buffer.data(), dt, {p.E, 2, p.n, p.d}, {p.n * p.d, half + w1_gap, p.d, 1});
    };
    if (w1_gap >= 0) {
      w1_apart.assign(static_cast<std::size_t>(2 * half + w1_gap), R(-555));
      for (std::int64_t e = 0; e < p.E; ++e)
        for (std::int64_t r = 0; r < 2 * p.n; ++r)
          for (std::int64_t k = 0; k < p.d; ++k)
            w1_apart[(r / p.n) * (half + w1_gap) + (e * p.n + r % p.n) * p.d + k] = w1[(e * 2 * p.n + r) * p.d + k];
      w.w1 = apart_view(w1_apart);
    }
    w.w2 = TensorView::contiguous(w2.data(), dt, {p.E, p.d, p.n});
    if (p.has_b1) w.b1 = TensorView::contiguous(b1.data(), dt, {p.E, p.w1_rows()});
    if (p.has_b2) w.b2 = TensorView::contiguous(b2.data(), dt, {p.E, p.d});
    RoutingTriples triples;
    const RoutingTriples* rt = nullptr;
    if (p.routing == RoutingMode::kCallerSupplied) {
      triples.token_index = TensorView::contiguous(tok.data(), DType::kInt64, {p.num_pairs});
      triples.expert_index = TensorView::contiguous(exp.data(), DType::kInt64, {p.num_pairs});
      triples.score = TensorView::contiguous(score.data(), dt, {p.num_pairs});
      rt = &triples;
    }
    const TensorView xv = TensorView::strided(x.data(), dt, {p.T, p.d}, {p.d + row_pad, 1});
    out.assign(p.T * p.d, R(0));
    counts.assign(p.E, -1);
    ForwardOutputs fo;
    fo.out = TensorView::contiguous(out.data(), dt, {p.T, p.d});
    if (p.routing != RoutingMode::kCallerSupplied) {
      logits.assign(p.T * p.E, R(0));
      fo.router_logits = TensorView::contiguous(logits.data(), dt, {p.T, p.E});
    }
    fo.expert_counts = TensorView::contiguous(counts.data(), DType::kInt32, {p.E});
    saved_bytes = saved_layout(p, dt).total_bytes;
    std::vector<unsigned char> saved(saved_bytes, 0xAB);
    forward(p, xv, w, rt, fo, ForwardBuffers{saved.data(), saved.size(), nullptr, 0});

    dx.assign(p.T * p.d, R(0));
    dwr.assign(wr.size(), R(0)), dw1.assign(w1.size(), R(0)), dw2.assign(w2.size(), R(0));
    db1.assign(b1.size(), R(0)), db2.assign(b2.size(), R(0));
    BackwardInputs bi;
    bi.grad_out = TensorView::contiguous(gout.data(), dt, {p.T, p.d});
    if (p.routing != RoutingMode::kCallerSupplied) bi.grad_router_logits = TensorView::contiguous(glog.data(), dt, {p.T, p.E});
    BackwardOutputs bo;
    bo.grad_x = TensorView::contiguous(dx.data(), dt, {p.T, p.d});
    if (p.routing != RoutingMode::kCallerSupplied)
      bo.grad_weights.router_weight = TensorView::contiguous(dwr.data(), dt, {p.E, p.d});
    bo.grad_weights.w1 = TensorView::contiguous(dw1.data(), dt, {p.E, p.w1_rows(), p.d});
    if (w1_gap >= 0) {
      dw1_apart.assign(w1_apart.size(), R(-555));
      bo.grad_weights.w1 = apart_view(dw1_apart);
    }
    bo.grad_weights.w2 = TensorView::contiguous(dw2.data(), dt, {p.E, p.d, p.n});
    if (p.has_b1) bo.grad_weights.b1 = TensorView::contiguous(db1.data(), dt, {p.E, p.w1_rows()});
    if (p.has_b2) bo.grad_weights.b2 = TensorView::contiguous(db2.data(), dt, {p.E, p.d});
    if (p.routing == RoutingMode::kCallerSupplied) {
      dscores.assign(p.num_pairs, R(0));
      bo.grad_scores = TensorView::contiguous(dscores.data(), dt, {p.num_pairs});
    }
    backward(p, xv, w, rt, bi, bo, BackwardBuffers{saved.data(), saved.size(), nullptr, 0});
    if (w1_gap >= 0) {
      for (std::int64_t e = 0; e < p.E; ++e)
        for (std::int64_t r = 0; r < 2 * p.n; ++r)
          for (std::int64_t k = 0; k < p.d; ++k)
            dw1[(e * 2 * p.n + r) * p.d + k] = dw1_apart[(r / p.n) * (half + w1_gap) + (e * p.n + r % p.n) * p.d + k];
      for (std::int64_t i = 0; i < w1_gap; ++i) gap_untouched = gap_untouched && dw1_apart[half + i] == R(-555);
    }
  }
  bool gap_untouched = true;  // the gradient's gap between its halves (w1_gap > 0)
};

std::vector<double> up(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }

// W1 and its gradient as 4D (E, 2, n, d) views whose gate and up halves lie apart (layer.hpp, LayerWeights::w1):
// bitwise the results of the contiguous (E, 2n, d) weights, every routing mode and both cache modes, with biases;
// the memory between the halves is neither read into the results nor written.
TEST(W1Views, HalvesApartGiveTheContiguousResultsBitwise) {
  for (RoutingMode r : {RoutingMode::kTopK, RoutingMode::kTokenRounding, RoutingMode::kCallerSupplied})
    for (CacheMode cache : {CacheMode::kPreActivation, CacheMode::kInputOnly}) {
      MoEProblem p = small_problem(Activation::kSwiGLU, r);
      p.cache = cache, p.weight_layout = WeightLayout::kConcatenated;
      p.has_b1 = p.has_b2 = true;
      const LayerCase<double> c(p, 91);
      const ApiRun<double> joined(c), apart(c, 0, 13), adjacent(c, 0, 0);
      const std::string what = std::string(routing_mode_name(r)) + " " + cache_mode_name(cache);
      for (const ApiRun<double>* a : {&apart, &adjacent}) {
        EXPECT_EQ(a->out, joined.out) << what;
        EXPECT_EQ(a->dx, joined.dx) << what;
        EXPECT_EQ(a->dw1, joined.dw1) << what;
        EXPECT_EQ(a->db1, joined.db1) << what;
        EXPECT_EQ(a->dw2, joined.dw2) << what;
        EXPECT_EQ(a->dwr, joined.dwr) << what;
        EXPECT_EQ(a->dscores, joined.dscores) << what;
      }
      EXPECT_TRUE(apart.gap_untouched) << what;
    }
}

class PublicApi : public testing::TestWithParam<std::tuple<RoutingMode, CacheMode>> {};

TEST_P(PublicApi, Fp64MatchesReferenceBitwiseAndFp32IsClose) {
  MoEProblem p = small_problem(Activation::kSwiGLU, std::get<0>(GetParam()));
  p.cache = std::get<1>(GetParam());
  p.has_b1 = p.has_b2 = true;
  p.score = ScoreVariant::kTopKOfSoftmax;
  LayerCase<double> c(p, 77);
  const MoEProblem& pc = c.problem;
  const ref::ForwardResult<double> f = ref::layer_forward(pc, c.inputs());
  const ref::BackwardResult<double> g = ref::layer_backward(
      pc, c.inputs(), f.saved, c.grad_out.data(), c.grad_logits.empty() ? nullptr : c.grad_logits.data());

  const ApiRun<double> a(c, /*row_pad=*/3);
  EXPECT_EQ(a.out, f.out);
  EXPECT_EQ(a.dx, g.dx);
  EXPECT_EQ(a.dw1, g.dw1);
  EXPECT_EQ(a.dw2, g.dw2);
  EXPECT_EQ(a.db1, g.db1);
  EXPECT_EQ(a.db2, g.db2);
  if (pc.routing == RoutingMode::kCallerSupplied) { EXPECT_EQ(a.dscores, g.dscores); }
  else { EXPECT_EQ(a.dwr, g.drouter_weight); }
  for (std::int64_t e = 0; e < pc.E; ++e) { EXPECT_EQ(a.counts[e], f.expert_counts[e]); }

  // fp32 through the same API: relative Frobenius error at float rounding level.
  const ApiRun<float> s(c);
  EXPECT_LT(rel_error(up(s.out), f.out), 1e-5);
  EXPECT_LT(rel_error(up(s.dx), g.dx), 1e-5);
  EXPECT_LT(rel_error(up(s.dw1), g.dw1), 1e-5);
  EXPECT_LT(rel_error(up(s.dw2), g.dw2), 1e-5);
  if (pc.routing != RoutingMode::kCallerSupplied) { EXPECT_LT(rel_error(up(s.dwr), g.drouter_weight), 1e-5); }
}

INSTANTIATE_TEST_SUITE_P(
    RoutingAndCache, PublicApi,
    testing::Combine(testing::Values(RoutingMode::kTopK, RoutingMode::kTokenRounding, RoutingMode::kCallerSupplied),
                     testing::Values(CacheMode::kPreActivation, CacheMode::kInputOnly)),
    [](const testing::TestParamInfo<std::tuple<RoutingMode, CacheMode>>& i) {
      return std::string(routing_mode_name(std::get<0>(i.param))) + "_" + cache_mode_name(std::get<1>(i.param));
    });

TEST(PublicApi, InputOnlyModeKeepsLessAndGivesIdenticalResults) {
  MoEProblem p = small_problem();
  LayerCase<double> c(p, 8);
  const ApiRun<double> pre(c);
  c.problem.cache = CacheMode::kInputOnly;
  const ApiRun<double> inp(c);
  EXPECT_LT(inp.saved_bytes, pre.saved_bytes);
  EXPECT_EQ(inp.out, pre.out);
  EXPECT_EQ(inp.dx, pre.dx);
  EXPECT_EQ(inp.dw1, pre.dw1);
  EXPECT_EQ(inp.dwr, pre.dwr);
}

TEST(PublicApi, TwoRunsAreBitwiseIdentical) {
  MoEProblem p = small_problem(Activation::kGeGLU, RoutingMode::kTokenRounding);
  LayerCase<double> c(p, 12);
  const ApiRun<float> a(c), b(c);
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.dx, b.dx);
  EXPECT_EQ(a.dw1, b.dw1);
  EXPECT_EQ(a.dwr, b.dwr);
}

TEST(PublicApi, NaNInputsPropagateAndAreNotErrors) {
  MoEProblem p = small_problem(Activation::kSwiGLU, RoutingMode::kCallerSupplied);
  LayerCase<double> c(p, 4);
  c.x[0] = std::nan("");  // token 0 always has K pairs in LayerCase
  const ApiRun<double> a(c);
  bool nan_out = false;
  for (std::int64_t k = 0; k < p.d; ++k) nan_out = nan_out || std::isnan(a.out[k]);
  EXPECT_TRUE(nan_out);
}

}  // namespace
}  // namespace machmoe::test

namespace machmoe::test {
namespace {

// backward_input() then backward_weight() give bitwise the results of backward(), through the deferred buffer.
class SplitBackward : public testing::TestWithParam<std::tuple<RoutingMode, CacheMode>> {};

TEST_P(SplitBackward, EqualsTheFullBackwardBitwise) {
  MoEProblem p = small_problem(Activation::kGeGLU, std::get<0>(GetParam()));
  p.cache = std::get<1>(GetParam());
  p.has_b1 = p.has_b2 = true;
  p.weight_layout = WeightLayout::kConcatenated;
  const LayerCase<double> c(p, 31);
  const MoEProblem& q = c.problem;
  const bool caller = q.routing == RoutingMode::kCallerSupplied;
  const DType dt = DType::kFP64;
  std::vector<double> x = c.x, wr = c.router_weight, w1 = c.w1, w2 = c.w2, b1 = c.b1, b2 = c.b2, go = c.grad_out;
  std::vector<double> sc = c.pair_score, out(q.T * q.d), logits(q.T * q.E);
  std::vector<std::int64_t> tok = c.pair_token, exp = c.pair_expert;
  std::vector<std::int32_t> counts(q.E);
  LayerWeights w;
  if (!caller) w.router_weight = TensorView::contiguous(wr.data(), dt, {q.E, q.d});
  w.w1 = TensorView::contiguous(w1.data(), dt, {q.E, q.w1_rows(), q.d});
  w.w2 = TensorView::contiguous(w2.data(), dt, {q.E, q.d, q.n});
  w.b1 = TensorView::contiguous(b1.data(), dt, {q.E, q.w1_rows()});
  w.b2 = TensorView::contiguous(b2.data(), dt, {q.E, q.d});
  RoutingTriples rt;
  if (caller) {
    rt.token_index = TensorView::contiguous(tok.data(), DType::kInt64, {q.num_pairs});
    rt.expert_index = TensorView::contiguous(exp.data(), DType::kInt64, {q.num_pairs});
    rt.score = TensorView::contiguous(sc.data(), dt, {q.num_pairs});
  }
  const TensorView xv = TensorView::contiguous(x.data(), dt, {q.T, q.d});
  ForwardOutputs fo;
  fo.out = TensorView::contiguous(out.data(), dt, {q.T, q.d});
  if (!caller) fo.router_logits = TensorView::contiguous(logits.data(), dt, {q.T, q.E});
  fo.expert_counts = TensorView::contiguous(counts.data(), DType::kInt32, {q.E});
  std::vector<unsigned char> saved(saved_layout(q, dt).total_bytes);
  forward(q, xv, w, caller ? &rt : nullptr, fo, {saved.data(), saved.size(), nullptr, 0});

  struct Grads {
    std::vector<double> dx, dwr, dw1, db1, dw2, db2, dsc;
  };
  auto make_grads = [&](Grads& g) {
    g.dx.assign(q.T * q.d, 0), g.dwr.assign(wr.size(), 0), g.dw1.assign(w1.size(), 0), g.dw2.assign(w2.size(), 0);
    g.db1.assign(b1.size(), 0), g.db2.assign(b2.size(), 0), g.dsc.assign(q.num_pairs, 0);
  };
  BackwardInputs bi;
  bi.grad_out = TensorView::contiguous(go.data(), dt, {q.T, q.d});
  Grads full, split;
  make_grads(full), make_grads(split);
  auto outputs = [&](Grads& g, bool input_half, bool weight_half) {
    BackwardOutputs bo;
    if (input_half) {
      bo.grad_x = TensorView::contiguous(g.dx.data(), dt, {q.T, q.d});
      if (!caller) bo.grad_weights.router_weight = TensorView::contiguous(g.dwr.data(), dt, {q.E, q.d});
      if (caller) bo.grad_scores = TensorView::contiguous(g.dsc.data(), dt, {q.num_pairs});
    }
    if (weight_half) {
      bo.grad_weights.w1 = TensorView::contiguous(g.dw1.data(), dt, {q.E, q.w1_rows(), q.d});
      bo.grad_weights.w2 = TensorView::contiguous(g.dw2.data(), dt, {q.E, q.d, q.n});
      bo.grad_weights.b1 = TensorView::contiguous(g.db1.data(), dt, {q.E, q.w1_rows()});
      bo.grad_weights.b2 = TensorView::contiguous(g.db2.data(), dt, {q.E, q.d});
    }
    return bo;
  };
  backward(q, xv, w, caller ? &rt : nullptr, bi, outputs(full, true, true), {saved.data(), saved.size(), nullptr, 0});
  std::vector<unsigned char> deferred(deferred_layout(q, dt).total_bytes);
  backward_input(q, xv, w, caller ? &rt : nullptr, bi, outputs(split, true, false),
                 {saved.data(), saved.size(), nullptr, 0}, {deferred.data(), deferred.size()});
  backward_weight(q, xv, w, caller ? &rt : nullptr, bi.grad_out, outputs(split, false, true), saved.data(),
                  saved.size(), {deferred.data(), deferred.size()});
  auto expect_same = [](const Grads& a, const Grads& b, const char* what) {
    EXPECT_EQ(a.dx, b.dx) << what;
    EXPECT_EQ(a.dwr, b.dwr) << what;
    EXPECT_EQ(a.dsc, b.dsc) << what;
    EXPECT_EQ(a.dw1, b.dw1) << what;
    EXPECT_EQ(a.dw2, b.dw2) << what;
    EXPECT_EQ(a.db1, b.db1) << what;
    EXPECT_EQ(a.db2, b.db2) << what;
  };
  expect_same(split, full, "split");

  // Each half refuses the other half's outputs.
  EXPECT_THROW(backward_input(q, xv, w, caller ? &rt : nullptr, bi, outputs(split, true, true),
                              {saved.data(), saved.size(), nullptr, 0}, {deferred.data(), deferred.size()}),
               Error);
  EXPECT_THROW(backward_weight(q, xv, w, caller ? &rt : nullptr, bi.grad_out, outputs(split, true, true),
                               saved.data(), saved.size(), {deferred.data(), deferred.size()}),
               Error);
  // backward_weight() reads the saved buffer after backward_input(): the input half cannot consume it.
  try {
    backward_input(q, xv, w, caller ? &rt : nullptr, bi, outputs(split, true, false),
                   {saved.data(), saved.size(), nullptr, 0, /*consume_saved=*/true}, {deferred.data(), deferred.size()});
    ADD_FAILURE() << "backward_input accepted consume_saved";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("consume_saved"), std::string::npos) << e.what();
  }
  // The CPU reference only reads the saved buffer, consumed or not: the same gradients, the buffer unchanged.
  const std::vector<unsigned char> saved_before = saved;
  Grads consumed;
  make_grads(consumed);
  backward(q, xv, w, caller ? &rt : nullptr, bi, outputs(consumed, true, true),
           {saved.data(), saved.size(), nullptr, 0, /*consume_saved=*/true});
  expect_same(consumed, full, "consumed");
  EXPECT_EQ(saved, saved_before);
  EXPECT_THROW(backward_weight(q, xv, w, caller ? &rt : nullptr, bi.grad_out, outputs(split, false, true),
                               saved.data(), saved.size(), {deferred.data(), deferred.size() - 1}),
               Error);
  // backward_weight() takes the saved buffer as plain arguments (saved, saved_bytes), and names them so: its
  // size, and its content read back (here expert offsets that do not start at 0).
  auto saved_error = [&](const std::vector<unsigned char>& buffer, std::size_t bytes) -> std::string {
    try {
      backward_weight(q, xv, w, caller ? &rt : nullptr, bi.grad_out, outputs(split, false, true), buffer.data(),
                      bytes, {deferred.data(), deferred.size()});
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  const std::string short_saved = saved_error(saved, saved.size() - 1);
  EXPECT_NE(short_saved.find("machmoe::backward_weight: argument 'saved_bytes'"), std::string::npos) << short_saved;
  std::vector<unsigned char> scrambled = saved;
  const std::int32_t not_zero = 5;
  std::memcpy(scrambled.data() + saved_layout(q, dt).expert_offsets.offset, &not_zero, sizeof not_zero);
  const std::string bad_offsets = saved_error(scrambled, scrambled.size());
  EXPECT_NE(bad_offsets.find("machmoe::backward_weight: argument 'saved': expected the buffer forward() filled"),
            std::string::npos)
      << bad_offsets;
  EXPECT_EQ(bad_offsets.find("buffers."), std::string::npos) << bad_offsets;

  // W1's gradients later (BackwardOutputs::w1_grads_later): backward() leaves dH over the consumed saved H and
  // finish_backward_w1() computes them from it, bitwise as one backward. Only a consumed buffer of the default
  // cache mode can carry dH; each call refuses the other's outputs, with the argument named.
  auto error_of = [](auto&& call) -> std::string {
    try {
      call();
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  Grads later;
  make_grads(later);
  BackwardOutputs first = outputs(later, true, true);
  first.grad_weights.w1 = first.grad_weights.b1 = TensorView();
  first.w1_grads_later = true;
  BackwardOutputs second;
  second.grad_weights.w1 = outputs(later, false, true).grad_weights.w1;
  second.grad_weights.b1 = outputs(later, false, true).grad_weights.b1;
  std::vector<unsigned char> handed_over = saved;
  const BackwardBuffers consumed_buffers{handed_over.data(), handed_over.size(), nullptr, 0, true};
  EXPECT_NE(error_of([&] {
              backward(q, xv, w, caller ? &rt : nullptr, bi, first, {saved.data(), saved.size(), nullptr, 0});
            }).find("w1_grads_later"),
            std::string::npos);
  BackwardOutputs first_with_w1 = outputs(later, true, true);
  first_with_w1.w1_grads_later = true;
  if (q.cache == CacheMode::kPreActivation) {
    EXPECT_NE(error_of([&] {
                backward(q, xv, w, caller ? &rt : nullptr, bi, first_with_w1, consumed_buffers);
              }).find("outputs.grad_weights.w1"),
              std::string::npos);
    EXPECT_NE(error_of([&] {
                finish_backward_w1(q, xv, w, caller ? &rt : nullptr, outputs(later, false, true), handed_over.data(),
                                   handed_over.size());
              }).find("outputs.grad_weights.w2"),
              std::string::npos);
    make_grads(later);
    backward(q, xv, w, caller ? &rt : nullptr, bi, first, consumed_buffers);
    EXPECT_EQ(later.dw1, std::vector<double>(w1.size(), 0.0)) << "backward() wrote W1's gradient";
    finish_backward_w1(q, xv, w, caller ? &rt : nullptr, second, handed_over.data(), handed_over.size());
    expect_same(later, full, "w1 later");
    EXPECT_NE(handed_over, saved) << "dH was expected over the saved H";
  } else {
    EXPECT_NE(error_of([&] {
                backward(q, xv, w, caller ? &rt : nullptr, bi, first, consumed_buffers);
              }).find("input-only"),
              std::string::npos);
    EXPECT_NE(error_of([&] {
                finish_backward_w1(q, xv, w, caller ? &rt : nullptr, second, handed_over.data(), handed_over.size());
              }).find("problem.cache"),
              std::string::npos);
  }
}

INSTANTIATE_TEST_SUITE_P(
    RoutingAndCache, SplitBackward,
    testing::Combine(testing::Values(RoutingMode::kTopK, RoutingMode::kTokenRounding, RoutingMode::kCallerSupplied),
                     testing::Values(CacheMode::kPreActivation, CacheMode::kInputOnly)),
    [](const testing::TestParamInfo<std::tuple<RoutingMode, CacheMode>>& i) {
      return std::string(routing_mode_name(std::get<0>(i.param))) + "_" + cache_mode_name(std::get<1>(i.param));
    });

}  // namespace
}  // namespace machmoe::test
