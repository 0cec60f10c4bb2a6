// Empty work is normal work: T = 0 (an expert-parallel rank that received no tokens, a data loader's last empty shard)
// and caller routing with no pairs run through the public API like any other call, on every routing mode, and give
// empty or zero outputs and zero weight gradients. Also the host side of index checking and grouped_expert_index.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <ostream>
#include <string>

#include "machmoe/machmoe.hpp"
#include "test_support.hpp"

namespace machmoe::test {
namespace {

MoEProblem problem_with(RoutingMode routing, std::int64_t T) {
  MoEProblem p;
  p.T = T, p.d = 8, p.n = 4, p.E = 5, p.K = 2;
  p.routing = routing;
  p.tile_m = 8;
  return p;
}

/// Forward + backward (or the split backward) through the public API, every output poisoned with NaN (counts with
/// -1) first, so that a value the layer does not write shows. Caller routing takes the case's triples.
template <class R>
struct EmptyRun {
  std::vector<R> out, logits, dx, dwr, dw1, db1, dw2, db2, dscores;
  std::vector<std::int32_t> counts;

  /// expanded: x and grad_out as autograd hands over empty tensors, (0, d) with strides (0, 0) and no data.
  EmptyRun(const LayerCase<double>& c, bool split, bool expanded = false) {
    const MoEProblem& p = c.problem;
    const DType dt = std::is_same<R, double>::value ? DType::kFP64 : DType::kFP32;
    const R nan = std::numeric_limits<R>::quiet_NaN();
    HostLayerInputs<R> in(c, dt);
    const bool caller = in.caller;
    const LayerWeights& w = in.weights;
    const RoutingTriples* rt = in.routing();
    const TensorView xv = expanded ? TensorView::strided(nullptr, dt, {p.T, p.d}, {0, 0})
                                   : TensorView::contiguous(in.x.data(), dt, {p.T, p.d});

    out.assign(static_cast<std::size_t>(p.T * p.d), nan);
    counts.assign(static_cast<std::size_t>(p.E), -1);
    ForwardOutputs fo;
    fo.out = TensorView::contiguous(out.data(), dt, {p.T, p.d});
    if (!caller) {
      logits.assign(static_cast<std::size_t>(p.T * p.E), nan);
      fo.router_logits = TensorView::contiguous(logits.data(), dt, {p.T, p.E});
    }
    fo.expert_counts = TensorView::contiguous(counts.data(), DType::kInt32, {p.E});
    std::vector<unsigned char> saved(saved_layout(p, dt).total_bytes, 0xAB);
    forward(p, xv, w, rt, fo, ForwardBuffers{saved.data(), saved.size(), nullptr, 0});

    dx.assign(static_cast<std::size_t>(p.T * p.d), nan);
    dwr.assign(in.router_weight.size(), nan), dw1.assign(in.w1.size(), nan), dw2.assign(in.w2.size(), nan);
    db1.assign(in.b1.size(), nan), db2.assign(in.b2.size(), nan);
    BackwardInputs bi;
    bi.grad_out = expanded ? TensorView::strided(nullptr, dt, {p.T, p.d}, {0, 0})
                           : TensorView::contiguous(in.grad_out.data(), dt, {p.T, p.d});
    if (!caller) bi.grad_router_logits = TensorView::contiguous(in.grad_logits.data(), dt, {p.T, p.E});
    BackwardOutputs input_half, weight_half;
    input_half.grad_x = TensorView::contiguous(dx.data(), dt, {p.T, p.d});
    if (!caller) input_half.grad_weights.router_weight = TensorView::contiguous(dwr.data(), dt, {p.E, p.d});
    if (caller) {
      dscores.assign(static_cast<std::size_t>(p.num_pairs), nan);
      input_half.grad_scores = TensorView::contiguous(dscores.data(), dt, {p.num_pairs});
    }
    LayerWeightGrads& gw = weight_half.grad_weights;
    gw.w1 = TensorView::contiguous(dw1.data(), dt, {p.E, p.w1_rows(), p.d});
    gw.w2 = TensorView::contiguous(dw2.data(), dt, {p.E, p.d, p.n});
    if (p.has_b1) gw.b1 = TensorView::contiguous(db1.data(), dt, {p.E, p.w1_rows()});
    if (p.has_b2) gw.b2 = TensorView::contiguous(db2.data(), dt, {p.E, p.d});
    const BackwardBuffers bb{saved.data(), saved.size(), nullptr, 0};
    if (split) {
      std::vector<unsigned char> deferred(deferred_layout(p, dt).total_bytes);
      const DeferredBuffer db{deferred.data(), deferred.size()};
      backward_input(p, xv, w, rt, bi, input_half, bb, db);
      backward_weight(p, xv, w, rt, bi.grad_out, weight_half, saved.data(), saved.size(), db);
    } else {
      BackwardOutputs all = input_half;
      all.grad_weights.w1 = gw.w1, all.grad_weights.b1 = gw.b1, all.grad_weights.w2 = gw.w2;
      all.grad_weights.b2 = gw.b2;
      backward(p, xv, w, rt, bi, all, bb);
    }
  }
};

template <class R>
void expect_all_zero(const std::vector<R>& v, const std::string& what) {
  for (std::size_t i = 0; i < v.size(); ++i) ASSERT_EQ(v[i], R(0)) << what << "[" << i << "]";
}

template <class R>
void expect_empty_work_results(const EmptyRun<R>& r, const MoEProblem& p, const std::string& label) {
  EXPECT_EQ(r.out.size(), static_cast<std::size_t>(p.T * p.d)) << label;
  expect_all_zero(r.out, label + " out");
  for (std::int64_t e = 0; e < p.E; ++e) EXPECT_EQ(r.counts[e], 0) << label << " expert_counts[" << e << "]";
  expect_all_zero(r.dx, label + " grad_x");
  expect_all_zero(r.dw1, label + " grad w1");
  expect_all_zero(r.dw2, label + " grad w2");
  expect_all_zero(r.db1, label + " grad b1");
  expect_all_zero(r.db2, label + " grad b2");
  if (p.routing != RoutingMode::kCallerSupplied) expect_all_zero(r.dwr, label + " grad router_weight");
  EXPECT_TRUE(r.dscores.empty()) << label;
}

struct EmptyCase {
  RoutingMode routing;
  RoundingRule rounding;
  CacheMode cache;
  const char* name;
};

void PrintTo(const EmptyCase& c, std::ostream* os) { *os << c.name; }

class ZeroTokens : public testing::TestWithParam<EmptyCase> {};

TEST_P(ZeroTokens, EmptyOutputsAndZeroGradientsFullAndSplitBackward) {
  const EmptyCase& ec = GetParam();
  for (bool bias : {false, true})
    for (Activation act : {Activation::kSwiGLU, Activation::kReLU})
      for (ScoreVariant score : {ScoreVariant::kSoftmaxOverTopK, ScoreVariant::kTopKOfSoftmax}) {
        MoEProblem p = problem_with(ec.routing, 0);
        p.rounding = ec.rounding, p.cache = ec.cache, p.activation = act, p.score = score;
        p.has_b1 = p.has_b2 = bias;
        const LayerCase<double> c(p, 5);
        ASSERT_EQ(c.problem.num_pairs, 0);
        const std::string label = std::string(ec.name) + " bias=" + std::to_string(bias) + " " +
                                  activation_name(act) + " " + score_variant_name(score);
        for (bool split : {false, true}) {
          const std::string l = label + (split ? " split" : " full");
          EmptyRun<double> r64(c, split);
          expect_empty_work_results(r64, c.problem, l + " fp64");
          EmptyRun<float> r32(c, split);
          expect_empty_work_results(r32, c.problem, l + " fp32");
        }
      }
}

INSTANTIATE_TEST_SUITE_P(
    EveryRouting, ZeroTokens,
    testing::Values(EmptyCase{RoutingMode::kTopK, RoundingRule::kNearest, CacheMode::kPreActivation, "topk"},
                    EmptyCase{RoutingMode::kTopK, RoundingRule::kNearest, CacheMode::kInputOnly, "topk_input_only"},
                    EmptyCase{RoutingMode::kTokenRounding, RoundingRule::kNearest, CacheMode::kPreActivation, "tr_nearest"},
                    EmptyCase{RoutingMode::kTokenRounding, RoundingRule::kUp, CacheMode::kInputOnly, "tr_up"},
                    EmptyCase{RoutingMode::kTokenRounding, RoundingRule::kDown, CacheMode::kPreActivation, "tr_down"},
                    EmptyCase{RoutingMode::kCallerSupplied, RoundingRule::kNearest, CacheMode::kPreActivation, "caller"},
                    EmptyCase{RoutingMode::kCallerSupplied, RoundingRule::kNearest, CacheMode::kInputOnly,
                              "caller_input_only"}),
    [](const testing::TestParamInfo<EmptyCase>& i) { return std::string(i.param.name); });

// A view with no elements addresses no memory: autograd hands the backward of an empty output a (0, d) gradient
// expanded from a scalar, strides (0, 0), which must not be rejected as overlapping rows.
TEST(EmptyWork, ZeroElementViewsMayHaveAnyStridesAndNoData) {
  for (RoutingMode routing : {RoutingMode::kTopK, RoutingMode::kTokenRounding, RoutingMode::kCallerSupplied}) {
    const LayerCase<double> c(problem_with(routing, 0), 2);
    for (bool split : {false, true}) {
      EmptyRun<double> r(c, split, /*expanded=*/true);
      expect_empty_work_results(r, c.problem, std::string(routing_mode_name(routing)) + " expanded");
    }
  }
  // Views with elements keep every check.
  std::vector<double> x(8);
  const MoEProblem p = problem_with(RoutingMode::kTopK, 1);
  std::vector<double> w1(5 * 8 * 8), w2(5 * 8 * 4), wr(5 * 8), out(8), logits(5);
  std::vector<std::int32_t> counts(5);
  std::vector<unsigned char> saved(saved_layout(p, DType::kFP64).total_bytes);
  LayerWeights w;
  w.router_weight = TensorView::contiguous(wr.data(), DType::kFP64, {5, 8});
  w.w1 = TensorView::contiguous(w1.data(), DType::kFP64, {5, 8, 8});
  w.w2 = TensorView::contiguous(w2.data(), DType::kFP64, {5, 8, 4});
  ForwardOutputs fo;
  fo.out = TensorView::contiguous(out.data(), DType::kFP64, {1, 8});
  fo.router_logits = TensorView::contiguous(logits.data(), DType::kFP64, {1, 5});
  fo.expert_counts = TensorView::contiguous(counts.data(), DType::kInt32, {5});
  try {
    forward(p, TensorView::strided(x.data(), DType::kFP64, {1, 8}, {0, 0}), w, nullptr, fo,
            {saved.data(), saved.size(), nullptr, 0});
    ADD_FAILURE() << "inner stride 0 accepted on a view with elements";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'x.stride'"), std::string::npos) << e.what();
  }
  try {
    forward(p, TensorView::contiguous(nullptr, DType::kFP64, {1, 8}), w, nullptr, fo,
            {saved.data(), saved.size(), nullptr, 0});
    ADD_FAILURE() << "null data accepted on a view with elements";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("non-null"), std::string::npos) << e.what();
  }
}

// Caller routing with tokens but no pairs (a rank whose tokens all went to other ranks' experts): experts contribute
// nothing, so the output and the input gradient are zero, and so are the weight gradients.
TEST(EmptyWork, CallerRoutingWithNoPairsGivesZeroOutputAndGradients) {
  for (CacheMode cache : {CacheMode::kPreActivation, CacheMode::kInputOnly})
    for (bool split : {false, true}) {
      MoEProblem p = problem_with(RoutingMode::kCallerSupplied, 7);
      p.cache = cache;
      p.has_b1 = p.has_b2 = true;  // biases live inside the experts: a token routed nowhere gets none of them
      LayerCase<double> c(p, 8);
      c.pair_token.clear(), c.pair_expert.clear(), c.pair_score.clear();
      c.problem.num_pairs = 0;
      const std::string label = std::string(cache_mode_name(cache)) + (split ? " split" : " full");
      EmptyRun<double> r(c, split);
      expect_empty_work_results(r, c.problem, label);
      EXPECT_EQ(r.out.size(), 7u * 8u);
    }
}

// The reference itself, below the public API: T = 0 gives empty results without reading any input.
TEST(EmptyWork, ReferenceLayerWithZeroTokens) {
  for (RoutingMode routing : {RoutingMode::kTopK, RoutingMode::kTokenRounding, RoutingMode::kCallerSupplied}) {
    MoEProblem p = problem_with(routing, 0);
    p.has_b1 = p.has_b2 = true;
    const LayerCase<double> c(p, 1);
    const ref::ForwardResult<double> f = ref::layer_forward(c.problem, c.inputs());
    EXPECT_TRUE(f.out.empty());
    EXPECT_EQ(f.saved.meta.num_pairs(), 0);
    EXPECT_EQ(f.expert_counts, std::vector<std::int64_t>(5, 0));
    const ref::BackwardResult<double> g = ref::layer_backward(c.problem, c.inputs(), f.saved, c.grad_out.data(),
                                                              c.grad_logits.empty() ? nullptr : c.grad_logits.data());
    EXPECT_TRUE(g.dx.empty());
    expect_all_zero(g.dw1, "dw1");
    expect_all_zero(g.dw2, "dw2");
    expect_all_zero(g.db1, "db1");
    expect_all_zero(g.db2, "db2");
    expect_all_zero(g.drouter_weight, "drouter_weight");
  }
}

// Layouts of empty problems: nothing sized by the pairs, only the per-expert (and per-token) offsets.
TEST(EmptyWork, LayoutsOfZeroTokenProblems) {
  for (RoutingMode routing : {RoutingMode::kTopK, RoutingMode::kTokenRounding, RoutingMode::kCallerSupplied}) {
    MoEProblem p = problem_with(routing, 0);
    EXPECT_EQ(p.max_pairs(), 0);
    EXPECT_NO_THROW(validate_problem(p));
    const SavedLayout s = saved_layout(p, DType::kBF16);
    EXPECT_FALSE(s.h.present());
    EXPECT_FALSE(s.scores.present());
    EXPECT_FALSE(s.scatter.present());
    EXPECT_FALSE(s.router_logits.present());
    EXPECT_TRUE(s.expert_offsets.present());
    EXPECT_EQ(s.token_offsets.present(), routing != RoutingMode::kTopK);
    EXPECT_LE(s.total_bytes, 2 * kRegionAlignment);
    EXPECT_EQ(deferred_layout(p, DType::kBF16).total_bytes, 0u);
    EXPECT_EQ(activation_memory(p, DType::kBF16).x_bytes, 0u);
    const ForwardWorkspaceLayout fw = forward_workspace_layout(p, DType::kBF16);
    EXPECT_FALSE(fw.a.present());
    EXPECT_FALSE(fw.y.present());
    EXPECT_FALSE(fw.tile_hist.present());
    const BackwardWorkspaceLayout bw = backward_workspace_layout(p, DType::kBF16);
    EXPECT_FALSE(bw.dh.present());
    EXPECT_FALSE(bw.dx_expanded.present());
  }
}

TEST(EmptyWork, NegativeTokenCountsAreStillRejected) {
  MoEProblem p = problem_with(RoutingMode::kTopK, -1);
  try {
    validate_problem(p, "forward");
    ADD_FAILURE() << "T = -1 accepted";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'problem.T'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[0, "), std::string::npos) << msg;
    EXPECT_NE(msg.find("got -1"), std::string::npos) << msg;
  }
}

// Token rounding on a batch smaller than one tile: no expert reaches a tile, so rounding down keeps no pair and the
// output is zero (what the Python layer warns about, docs/ROUTING.md "Small batches"); rounding to nearest keeps an
// expert only when more than half of the tokens chose it (its rounded-up count is capped at T).
TEST(EmptyWork, TokenRoundingOnABatchSmallerThanATile) {
  MoEProblem p = problem_with(RoutingMode::kTokenRounding, 16);
  p.tile_m = 128;
  p.rounding = RoundingRule::kDown;
  const LayerCase<double> c(p, 12);
  const EmptyRun<double> down(c, false);
  expect_all_zero(down.out, "out (rounding down)");
  for (std::int32_t v : down.counts) EXPECT_EQ(v, 0);
  LayerCase<double> n = c;
  n.problem.rounding = RoundingRule::kNearest;
  const ref::ForwardResult<double> f = ref::layer_forward(n.problem, n.inputs());
  std::vector<std::int64_t> chose(5, 0);
  const std::vector<std::int64_t> topk = ref::topk_experts(f.router_logits.data(), 16, 5, 2);
  for (std::int64_t e : topk) ++chose[e];
  for (std::int64_t e = 0; e < 5; ++e)
    EXPECT_EQ(f.expert_counts[e], chose[e] > 8 ? 16 : 0) << "expert " << e << " chosen by " << chose[e];
}

// ---- index checking and grouped_expert_index on the host --------------------------------------------------------

TEST(IndexChecking, SwitchRoundTripsAndCpuHasNothingToRaise) {
  const bool initial = index_checking_enabled();
  set_index_checking(true);
  EXPECT_TRUE(index_checking_enabled());
  EXPECT_NO_THROW(check_device_errors(Device::cpu()));
  set_index_checking(false);
  EXPECT_FALSE(index_checking_enabled());
  set_index_checking(initial);
}

TEST(GroupedExpertIndex, ExpandsCountsOnTheHost) {
  std::vector<std::int64_t> counts = {3, 0, 2, 0, 1};
  std::vector<std::int32_t> index(6, -7);
  grouped_expert_index(TensorView::contiguous(counts.data(), DType::kInt64, {5}),
                       TensorView::contiguous(index.data(), DType::kInt32, {6}));
  EXPECT_EQ(index, (std::vector<std::int32_t>{0, 0, 0, 2, 2, 4}));
  std::vector<std::int32_t> counts32 = {0, 2};
  std::vector<std::int64_t> index64(2, -7);
  grouped_expert_index(TensorView::contiguous(counts32.data(), DType::kInt32, {2}),
                       TensorView::contiguous(index64.data(), DType::kInt64, {2}));
  EXPECT_EQ(index64, (std::vector<std::int64_t>{1, 1}));
  // No rows: all-zero counts are valid, and the (null) output is not touched.
  std::vector<std::int32_t> zeros = {0, 0, 0};
  EXPECT_NO_THROW(grouped_expert_index(TensorView::contiguous(zeros.data(), DType::kInt32, {3}),
                                       TensorView::contiguous(nullptr, DType::kInt32, {0})));
}

TEST(GroupedExpertIndex, RejectsBadCountsWithoutWriting) {
  std::vector<std::int32_t> index(4, -7);
  const TensorView iv = TensorView::contiguous(index.data(), DType::kInt32, {4});
  std::vector<std::int64_t> negative = {3, -1, 2};
  expect_error([&] { grouped_expert_index(TensorView::contiguous(negative.data(), DType::kInt64, {3}), iv); },
               {"grouped_expert_index", "'expert_counts[1]'", "a count >= 0", "got -1"});
  std::vector<std::int64_t> short_sum = {1, 2, 0};
  expect_error([&] { grouped_expert_index(TensorView::contiguous(short_sum.data(), DType::kInt64, {3}), iv); },
               {"'expert_counts'", "summing to the 4 grouped rows", "got a sum of 3"});
  std::vector<std::int64_t> long_sum = {3, 2, 0};
  expect_error([&] { grouped_expert_index(TensorView::contiguous(long_sum.data(), DType::kInt64, {3}), iv); },
               {"'expert_counts'", "summing to the 4 grouped rows", "got a sum above 4"});
  std::vector<double> wrong_dtype = {1, 3};
  expect_error([&] { grouped_expert_index(TensorView::contiguous(wrong_dtype.data(), DType::kFP64, {2}), iv); },
               {"'expert_counts'", "int32 or int64", "got fp64"});
  EXPECT_EQ(index, std::vector<std::int32_t>(4, -7)) << "a rejected call wrote its output";
}

TEST(GroupedExpertIndex, RejectsCountsWhoseSumWrapsWithoutWriting) {
  // 2 + M + M + 4 is 4 modulo 2^64: summed first and compared after, these passed as 4 rows and the fill wrote
  // about 2^63 entries into a vector of 4.
  const std::int64_t M = std::numeric_limits<std::int64_t>::max();
  std::vector<std::int64_t> index(4, -7);
  const TensorView iv = TensorView::contiguous(index.data(), DType::kInt64, {4});
  std::vector<std::int64_t> wrapping = {2, M, M, 4};
  expect_error([&] { grouped_expert_index(TensorView::contiguous(wrapping.data(), DType::kInt64, {4}), iv); },
               {"grouped_expert_index", "'expert_counts'", "summing to the 4 grouped rows", "got a sum above 4",
                "expert_counts[1] = 9223372036854775807"});
  // One huge count after a full sum, and the largest count alone.
  std::vector<std::int64_t> late = {4, 0, M};
  expect_error([&] { grouped_expert_index(TensorView::contiguous(late.data(), DType::kInt64, {3}), iv); },
               {"'expert_counts'", "got a sum above 4", "expert_counts[2]"});
  std::vector<std::int64_t> alone = {M};
  expect_error([&] { grouped_expert_index(TensorView::contiguous(alone.data(), DType::kInt64, {1}), iv); },
               {"'expert_counts'", "got a sum above 4", "expert_counts[0]"});
  EXPECT_EQ(index, std::vector<std::int64_t>(4, -7)) << "a rejected call wrote its output";
}

}  // namespace
}  // namespace machmoe::test
