// Gradient accumulation (LayerWeightGrads::accumulate): the weight gradients are added into the caller's buffers,
// fp32 or of the data dtype, by backward() and by the split backward; zero-token experts and empty calls leave
// them unchanged; wrong buffers are refused with the argument named.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <type_traits>

#include "machmoe/machmoe.hpp"
#include "test_support.hpp"

namespace machmoe::test {
namespace {

/// The five weight gradients of one layer, as host vectors of the gradient type G (empty where the layer has no
/// such weight).
template <class G>
struct GradBuffers {
  std::vector<G> wr, w1, b1, w2, b2;
};

/// The five buffers in one order, for checks that treat them alike, and their names in that order.
constexpr const char* kGradNames[5] = {"router_weight", "w1", "b1", "w2", "b2"};
template <class G>
std::array<std::vector<G>*, 5> fields(GradBuffers<G>& g) {
  return {&g.wr, &g.w1, &g.b1, &g.w2, &g.b2};
}
template <class G>
std::array<const std::vector<G>*, 5> fields(const GradBuffers<G>& g) {
  return {&g.wr, &g.w1, &g.b1, &g.w2, &g.b2};
}

/// Each buffer of `got` equal to the same buffer of `want`, element for element (gtest names the buffer).
template <class G>
void expect_equal_buffers(const GradBuffers<G>& got, const GradBuffers<G>& want, const std::string& what = "") {
  for (int i = 0; i < 5; ++i) EXPECT_EQ(*fields(got)[i], *fields(want)[i]) << kGradNames[i] << what;
}

template <class T>
constexpr DType dtype_of() {
  return std::is_same<T, double>::value ? DType::kFP64 : DType::kFP32;
}

/// Initial contents of the accumulation buffers: random, nonzero (so a skipped write and a write of zero differ).
template <class G>
GradBuffers<G> initial_grads(const MoEProblem& p, bool has_router, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const auto sz = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  GradBuffers<G> g;
  if (has_router) g.wr = normal<G>(rng, sz(p.E * p.d), 0.5);
  g.w1 = normal<G>(rng, sz(p.E * p.w1_rows() * p.d), 0.5);
  g.w2 = normal<G>(rng, sz(p.E * p.d * p.n), 0.5);
  if (p.has_b1) g.b1 = normal<G>(rng, sz(p.E * p.w1_rows()), 0.5);
  if (p.has_b2) g.b2 = normal<G>(rng, sz(p.E * p.d), 0.5);
  return g;
}

/// One forward + backward through the public API on the CPU, data of type R, weight gradients of type G written
/// into (accumulate: added to) `grads`. split: backward_input() then backward_weight().
template <class R, class G>
void run_backward(const LayerCase<double>& c, GradBuffers<G>& grads, bool accumulate, bool split) {
  const MoEProblem& p = c.problem;
  const bool caller = p.routing == RoutingMode::kCallerSupplied;
  const DType dt = dtype_of<R>(), gt = dtype_of<G>();
  HostLayerInputs<R> in(c, dt);
  const LayerWeights& w = in.weights;
  const RoutingTriples* routing = in.routing();
  const TensorView xv = TensorView::contiguous(in.x.data(), dt, {p.T, p.d});
  std::vector<R> out(p.T * p.d), logits(p.T * p.E), dx(p.T * p.d), dsc(p.num_pairs);
  std::vector<std::int32_t> counts(p.E);
  ForwardOutputs fo;
  fo.out = TensorView::contiguous(out.data(), dt, {p.T, p.d});
  if (!caller) fo.router_logits = TensorView::contiguous(logits.data(), dt, {p.T, p.E});
  fo.expert_counts = TensorView::contiguous(counts.data(), DType::kInt32, {p.E});
  std::vector<unsigned char> saved(saved_layout(p, dt).total_bytes);
  forward(p, xv, w, routing, fo, {saved.data(), saved.size(), nullptr, 0});

  BackwardInputs bi;
  bi.grad_out = TensorView::contiguous(in.grad_out.data(), dt, {p.T, p.d});
  if (!caller) bi.grad_router_logits = TensorView::contiguous(in.grad_logits.data(), dt, {p.T, p.E});
  BackwardOutputs bo;
  bo.grad_x = TensorView::contiguous(dx.data(), dt, {p.T, p.d});
  if (caller) bo.grad_scores = TensorView::contiguous(dsc.data(), dt, {p.num_pairs});
  LayerWeightGrads& gw = bo.grad_weights;
  if (!grads.wr.empty()) gw.router_weight = TensorView::contiguous(grads.wr.data(), gt, {p.E, p.d});
  gw.w1 = TensorView::contiguous(grads.w1.data(), gt, {p.E, p.w1_rows(), p.d});
  gw.w2 = TensorView::contiguous(grads.w2.data(), gt, {p.E, p.d, p.n});
  if (p.has_b1) gw.b1 = TensorView::contiguous(grads.b1.data(), gt, {p.E, p.w1_rows()});
  if (p.has_b2) gw.b2 = TensorView::contiguous(grads.b2.data(), gt, {p.E, p.d});
  gw.accumulate = accumulate;
  if (!split) {
    backward(p, xv, w, routing, bi, bo, {saved.data(), saved.size(), nullptr, 0});
    return;
  }
  BackwardOutputs in_half = bo, weight_half;
  in_half.grad_weights.w1 = in_half.grad_weights.b1 = in_half.grad_weights.w2 = in_half.grad_weights.b2 = TensorView();
  weight_half.grad_weights = bo.grad_weights;
  weight_half.grad_weights.router_weight = TensorView();
  std::vector<unsigned char> deferred(deferred_layout(p, dt).total_bytes);
  backward_input(p, xv, w, routing, bi, in_half, {saved.data(), saved.size(), nullptr, 0},
                 {deferred.data(), deferred.size()});
  backward_weight(p, xv, w, routing, bi.grad_out, weight_half, saved.data(), saved.size(),
                  {deferred.data(), deferred.size()});
}

/// The float64 reference's weight gradients of one case (the router's is zero for caller-supplied routing).
GradBuffers<double> reference_grads(const LayerCase<double>& c) {
  const MoEProblem& p = c.problem;
  const ref::ForwardResult<double> f = ref::layer_forward(p, c.inputs());
  const ref::BackwardResult<double> g = ref::layer_backward(
      p, c.inputs(), f.saved, c.grad_out.data(), c.grad_logits.empty() ? nullptr : c.grad_logits.data());
  GradBuffers<double> r;
  r.wr = p.routing == RoutingMode::kCallerSupplied ? std::vector<double>(p.E * p.d, 0.0) : g.drouter_weight;
  r.w1 = g.dw1, r.b1 = g.db1, r.w2 = g.dw2, r.b2 = g.db2;
  return r;
}

MoEProblem accumulation_problem(RoutingMode routing) {
  MoEProblem p;
  p.T = 24, p.d = 10, p.n = 6, p.E = 5, p.K = 2;
  p.activation = Activation::kGeGLU, p.weight_layout = WeightLayout::kConcatenated;
  p.has_b1 = p.has_b2 = true;
  p.routing = routing, p.tile_m = 8;
  return p;
}

/// Three tokens with one expert each, of eight: at least five experts receive no pair.
MoEProblem few_pairs_problem() {
  MoEProblem p;
  p.T = 3, p.d = 10, p.n = 6, p.E = 8, p.K = 1, p.has_b1 = p.has_b2 = true;
  return p;
}

/// Two micro-batches: the same weights, different tokens, upstream gradients (and caller triples).
std::pair<LayerCase<double>, LayerCase<double>> two_micro_batches(const MoEProblem& p) {
  const LayerCase<double> a(p, 101);
  LayerCase<double> b(p, 202);
  b.router_weight = a.router_weight, b.w1 = a.w1, b.b1 = a.b1, b.w2 = a.w2, b.b2 = a.b2;
  return {a, b};
}

std::vector<double> up(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }

class Accumulate : public testing::TestWithParam<std::tuple<RoutingMode, bool>> {};

// fp64 data, fp64 buffers: G0 + dW(batch a) + dW(batch b), added in that order, is bitwise what accumulating twice
// gives, for the full and the split backward.
TEST_P(Accumulate, TwiceEqualsTheSumOfTwoBackwardPassesBitwise) {
  const auto [routing, split] = GetParam();
  const MoEProblem p = accumulation_problem(routing);
  const auto [a, b] = two_micro_batches(p);
  const bool router = routing != RoutingMode::kCallerSupplied;
  GradBuffers<double> acc = initial_grads<double>(a.problem, true, 7);
  GradBuffers<double> expect = acc;
  run_backward<double, double>(a, acc, true, split);
  run_backward<double, double>(b, acc, true, split);
  GradBuffers<double> ga = reference_grads(a), gb = reference_grads(b);
  auto add = [](std::vector<double>& dst, const std::vector<double>& v) {
    for (std::size_t i = 0; i < dst.size(); ++i) dst[i] += v[i];
  };
  for (const GradBuffers<double>* g : {&ga, &gb})
    for (int i = 0; i < 5; ++i) add(*fields(expect)[i], *fields(*g)[i]);
  expect_equal_buffers(acc, expect,
                       router ? " (router gradient accumulated)" : " (caller routing: router buffer unchanged)");
}

// fp32 buffers: fp64 data (the CPU's stand-in for bf16 data with fp32 main grads: the buffer narrower than the
// arithmetic) rounds each sum once to fp32; fp32 data accumulates in fp32. Both against the float64 sum.
TEST_P(Accumulate, Fp32BuffersMatchTheFloat64Sum) {
  const auto [routing, split] = GetParam();
  const MoEProblem p = accumulation_problem(routing);
  const auto [a, b] = two_micro_batches(p);
  GradBuffers<float> init = initial_grads<float>(a.problem, true, 9);
  GradBuffers<double> ga = reference_grads(a), gb = reference_grads(b);
  GradBuffers<double> exact;  // in float64 from the same fp32 start
  for (int i = 0; i < 5; ++i) *fields(exact)[i] = up(*fields(init)[i]);
  GradBuffers<float> rounded = init;  // what fp64 data into fp32 buffers must give bitwise: one rounding per sum
  auto step = [](std::vector<double>& ex, std::vector<float>& ro, const std::vector<double>& g) {
    for (std::size_t i = 0; i < ex.size(); ++i) {
      ex[i] += g[i];
      ro[i] = static_cast<float>(static_cast<double>(ro[i]) + g[i]);
    }
  };
  for (const GradBuffers<double>* g : {&ga, &gb})
    for (int i = 0; i < 5; ++i) step(*fields(exact)[i], *fields(rounded)[i], *fields(*g)[i]);

  GradBuffers<float> from64 = init, from32 = init;
  run_backward<double, float>(a, from64, true, split);
  run_backward<double, float>(b, from64, true, split);
  run_backward<float, float>(a, from32, true, split);
  run_backward<float, float>(b, from32, true, split);
  expect_equal_buffers(from64, rounded);
  for (int i = 0; i < 5; ++i) {
    const std::vector<double>& want = *fields(exact)[i];
    EXPECT_LT(rel_error(up(*fields(from32)[i]), want), 1e-5) << kGradNames[i] << ": fp32 data into fp32 buffers";
    EXPECT_LT(rel_error(up(*fields(from64)[i]), want), 2e-7) << kGradNames[i] << ": fp64 data into fp32 buffers";
  }
}

// Without accumulate, fp32 gradients of fp64 data are the reference's, rounded once (the buffer's old contents are
// ignored).
TEST_P(Accumulate, Fp32GradientsOfFp64DataOverwrite) {
  const auto [routing, split] = GetParam();
  const auto [a, b] = two_micro_batches(accumulation_problem(routing));
  (void)b;
  GradBuffers<float> g = initial_grads<float>(a.problem, true, 3);
  run_backward<double, float>(a, g, false, split);
  GradBuffers<double> r = reference_grads(a);
  GradBuffers<float> rounded;
  for (int i = 0; i < 5; ++i) *fields(rounded)[i] = std::vector<float>(fields(r)[i]->begin(), fields(r)[i]->end());
  expect_equal_buffers(g, rounded);
}

INSTANTIATE_TEST_SUITE_P(
    RoutingAndSplit, Accumulate,
    testing::Combine(testing::Values(RoutingMode::kTopK, RoutingMode::kTokenRounding, RoutingMode::kCallerSupplied),
                     testing::Bool()),
    [](const testing::TestParamInfo<std::tuple<RoutingMode, bool>>& i) {
      return std::string(routing_mode_name(std::get<0>(i.param))) + (std::get<1>(i.param) ? "_split" : "_full");
    });

// Experts that receive no pair keep their rows of every buffer bitwise; a call with no tokens keeps everything.
TEST(AccumulateEdges, ZeroTokenExpertsAndEmptyCallsLeaveTheBufferUnchanged) {
  for (bool split : {false, true}) {
    const MoEProblem p = few_pairs_problem();
    const LayerCase<double> c(p, 5);
    const ref::ForwardResult<double> f = ref::layer_forward(p, c.inputs());
    const GradBuffers<double> init = initial_grads<double>(p, true, 11);
    GradBuffers<double> g = init;
    run_backward<double, double>(c, g, true, split);
    int empty = 0;
    for (std::int64_t e = 0; e < p.E; ++e) {
      const bool none = f.expert_counts[e] == 0;
      empty += none;
      auto rows_equal = [&](const std::vector<double>& now, const std::vector<double>& was, std::int64_t per) {
        return std::equal(now.begin() + e * per, now.begin() + (e + 1) * per, was.begin() + e * per);
      };
      EXPECT_EQ(rows_equal(g.w1, init.w1, p.w1_rows() * p.d), none) << "expert " << e << (split ? " split" : "");
      EXPECT_EQ(rows_equal(g.w2, init.w2, p.d * p.n), none) << "expert " << e;
      EXPECT_EQ(rows_equal(g.b1, init.b1, p.w1_rows()), none) << "expert " << e;
      EXPECT_EQ(rows_equal(g.b2, init.b2, p.d), none) << "expert " << e;
    }
    EXPECT_GE(empty, 5);

    MoEProblem q = p;
    q.T = 0;
    const LayerCase<double> none(q, 6);
    GradBuffers<double> kept = init;
    run_backward<double, double>(none, kept, true, split);
    expect_equal_buffers(kept, init, split ? " (split, no tokens)" : " (no tokens)");
  }
}

/// Every weight gradient's buffer filled with -0.0, which adding a zero gradient turns into +0.0.
template <class G>
GradBuffers<G> negative_zero_grads(const MoEProblem& p) {
  GradBuffers<G> g;
  g.wr.assign(p.E * p.d, G(-0.0)), g.w1.assign(p.E * p.w1_rows() * p.d, G(-0.0));
  g.b1.assign(p.E * p.w1_rows(), G(-0.0)), g.w2.assign(p.E * p.d * p.n, G(-0.0)), g.b2.assign(p.E * p.d, G(-0.0));
  return g;
}

/// v[from, to) all zeros of the given sign.
template <class G>
bool all_zero_signed(const std::vector<G>& v, std::size_t from, std::size_t to, bool negative) {
  return std::all_of(v.begin() + from, v.begin() + to, [&](G x) { return x == 0 && std::signbit(x) == negative; });
}

// The same with buffers holding -0.0, which adding a zero gradient turns into +0.0: experts without a pair and calls
// without pairs must leave them bitwise as they were (the GPU writes nothing there), for the router too, in fp64 and
// fp32 buffers.
template <class G>
void expect_negative_zeros_kept() {
  for (bool split : {false, true}) {
    SCOPED_TRACE(std::string(sizeof(G) == 8 ? "fp64" : "fp32") + " buffers" + (split ? ", split" : ""));
    const MoEProblem p = few_pairs_problem();
    const auto negative_zeros = [&] { return negative_zero_grads<G>(p); };
    const auto all_negative_zero = [](const std::vector<G>& v, std::size_t from, std::size_t to) {
      return all_zero_signed(v, from, to, true);
    };
    const LayerCase<double> c(p, 5);
    const ref::ForwardResult<double> f = ref::layer_forward(p, c.inputs());
    GradBuffers<G> g = negative_zeros();
    run_backward<double, G>(c, g, true, split);
    int empty = 0;
    for (std::int64_t e = 0; e < p.E; ++e) {
      if (f.expert_counts[e] != 0) continue;
      ++empty;
      const auto rows = [&](const std::vector<G>& v, std::int64_t per) {
        return all_negative_zero(v, e * per, (e + 1) * per);
      };
      EXPECT_TRUE(rows(g.w1, p.w1_rows() * p.d)) << "expert " << e;
      EXPECT_TRUE(rows(g.b1, p.w1_rows())) << "expert " << e;
      EXPECT_TRUE(rows(g.w2, p.d * p.n)) << "expert " << e;
      EXPECT_TRUE(rows(g.b2, p.d)) << "expert " << e;
    }
    EXPECT_GE(empty, 5);
    EXPECT_FALSE(all_negative_zero(g.w2, 0, g.w2.size())) << "no gradient was added at all";

    MoEProblem q = p;
    q.T = 0;
    GradBuffers<G> kept = negative_zeros();
    run_backward<double, G>(LayerCase<double>(q, 6), kept, true, split);
    for (int i = 0; i < 5; ++i)
      EXPECT_TRUE(all_negative_zero(*fields(kept)[i], 0, fields(kept)[i]->size())) << kGradNames[i];

    // Caller-supplied routing: the router's gradient is zero and leaves its buffer as it is.
    MoEProblem r = p;
    r.routing = RoutingMode::kCallerSupplied, r.num_pairs = 3;
    LayerCase<double> cr(r, 7);
    cr.pair_token = {0, 1, 2}, cr.pair_expert = {0, 0, 2}, cr.pair_score = {1.0, 0.5, 0.25};
    cr.problem.num_pairs = 3;
    GradBuffers<G> gr = negative_zeros();
    run_backward<double, G>(cr, gr, true, split);
    EXPECT_TRUE(all_negative_zero(gr.wr, 0, gr.wr.size()));
    for (std::int64_t e : {1, 3, 4, 5, 6, 7})
      EXPECT_TRUE(all_negative_zero(gr.w1, e * r.w1_rows() * r.d, (e + 1) * r.w1_rows() * r.d)) << "expert " << e;
  }
}

TEST(AccumulateEdges, NegativeZerosOfExpertsWithoutPairsAndEmptyCallsStayNegative) {
  expect_negative_zeros_kept<double>();
  expect_negative_zeros_kept<float>();
}

// Which experts are left as they are is decided by their pairs, not by their values: an expert with pairs whose whole
// gradient is exactly zero (zero upstream gradients) is added into, so its -0.0 becomes +0.0 as the GPU's sums make
// it, while the experts without pairs keep theirs; the router's gradient, which every token reaches, is added into
// every row. fp64 and fp32 buffers, full and split backward.
template <class G>
void expect_zero_gradients_of_experts_with_pairs_added() {
  for (bool split : {false, true}) {
    SCOPED_TRACE(std::string(sizeof(G) == 8 ? "fp64" : "fp32") + " buffers" + (split ? ", split" : ""));
    const MoEProblem p = few_pairs_problem();
    LayerCase<double> c(p, 5);
    std::fill(c.grad_out.begin(), c.grad_out.end(), 0.0);
    std::fill(c.grad_logits.begin(), c.grad_logits.end(), 0.0);
    const ref::ForwardResult<double> f = ref::layer_forward(p, c.inputs());
    GradBuffers<G> g = negative_zero_grads<G>(p);
    run_backward<double, G>(c, g, true, split);
    int with_pairs = 0;
    for (std::int64_t e = 0; e < p.E; ++e) {
      const bool none = f.expert_counts[e] == 0;
      with_pairs += !none;
      const auto slice = [&](const std::vector<G>& v, std::int64_t per) {
        return all_zero_signed(v, e * per, (e + 1) * per, /*negative=*/none);
      };
      EXPECT_TRUE(slice(g.w1, p.w1_rows() * p.d)) << "expert " << e << (none ? " (no pairs)" : "");
      EXPECT_TRUE(slice(g.b1, p.w1_rows())) << "expert " << e << (none ? " (no pairs)" : "");
      EXPECT_TRUE(slice(g.w2, p.d * p.n)) << "expert " << e << (none ? " (no pairs)" : "");
      EXPECT_TRUE(slice(g.b2, p.d)) << "expert " << e << (none ? " (no pairs)" : "");
    }
    EXPECT_GE(with_pairs, 1);
    EXPECT_LE(with_pairs, 3);
    EXPECT_TRUE(all_zero_signed(g.wr, 0, g.wr.size(), /*negative=*/false));
  }
}

TEST(AccumulateEdges, ExpertsWithPairsAddTheirZeroGradientsAsTheGpuDoes) {
  expect_zero_gradients_of_experts_with_pairs_added<double>();
  expect_zero_gradients_of_experts_with_pairs_added<float>();
}

// ---- validation ------------------------------------------------------------------------------------------------

TEST(AccumulateValidation, BuffersOfAnotherDtypeOrShapeAreRefusedByName) {
  MoEProblem p;
  p.T = 6, p.d = 8, p.n = 3, p.E = 4, p.K = 2, p.has_b1 = true;
  const LayerCase<double> c(p, 1);
  const std::vector<double> x = c.x, wr = c.router_weight, w1 = c.w1, b1 = c.b1, w2 = c.w2, go = c.grad_out;
  std::vector<double> out(48), logits(24), dx(48), dwr(32), dw1(w1.size()), dw2(w2.size()), db1(b1.size());
  std::vector<std::int32_t> counts(4);
  std::vector<std::uint16_t> half(w1.size());
  std::vector<float> dw1_f(w1.size()), dx_f(48);
  const DType dt = DType::kFP64;
  LayerWeights w;
  w.router_weight = TensorView::contiguous(const_cast<double*>(wr.data()), dt, {4, 8});
  w.w1 = TensorView::contiguous(const_cast<double*>(w1.data()), dt, {4, 6, 8});
  w.w2 = TensorView::contiguous(const_cast<double*>(w2.data()), dt, {4, 8, 3});
  w.b1 = TensorView::contiguous(const_cast<double*>(b1.data()), dt, {4, 6});
  const TensorView xv = TensorView::contiguous(const_cast<double*>(x.data()), dt, {6, 8});
  ForwardOutputs fo{TensorView::contiguous(out.data(), dt, {6, 8}), TensorView::contiguous(logits.data(), dt, {6, 4}),
                    TensorView::contiguous(counts.data(), DType::kInt32, {4})};
  std::vector<unsigned char> saved(saved_layout(p, dt).total_bytes);
  forward(p, xv, w, nullptr, fo, {saved.data(), saved.size(), nullptr, 0});
  BackwardInputs bi;
  bi.grad_out = TensorView::contiguous(const_cast<double*>(go.data()), dt, {6, 8});
  auto outputs = [&] {
    BackwardOutputs bo;
    bo.grad_x = TensorView::contiguous(dx.data(), dt, {6, 8});
    bo.grad_weights.router_weight = TensorView::contiguous(dwr.data(), dt, {4, 8});
    bo.grad_weights.w1 = TensorView::contiguous(dw1.data(), dt, {4, 6, 8});
    bo.grad_weights.w2 = TensorView::contiguous(dw2.data(), dt, {4, 8, 3});
    bo.grad_weights.b1 = TensorView::contiguous(db1.data(), dt, {4, 6});
    bo.grad_weights.accumulate = true;
    return bo;
  };
  const BackwardBuffers bb{saved.data(), saved.size(), nullptr, 0};
  EXPECT_NO_THROW(backward(p, xv, w, nullptr, bi, outputs(), bb));
  {  // fp32 buffers of fp64 data are fine
    BackwardOutputs bo = outputs();
    bo.grad_weights.w1 = TensorView::contiguous(dw1_f.data(), DType::kFP32, {4, 6, 8});
    EXPECT_NO_THROW(backward(p, xv, w, nullptr, bi, bo, bb));
  }
  {  // neither the data dtype nor fp32
    BackwardOutputs bo = outputs();
    bo.grad_weights.w1 = TensorView::contiguous(half.data(), DType::kBF16, {4, 6, 8});
    expect_error([&] { backward(p, xv, w, nullptr, bi, bo, bb); },
                 {"machmoe::backward", "'outputs.grad_weights.w1'", "dtype fp64 (the data dtype of x) or fp32",
                  "got bf16"});
  }
  {  // the router's buffer too
    BackwardOutputs bo = outputs();
    bo.grad_weights.router_weight = TensorView::contiguous(half.data(), DType::kFP16, {4, 8});
    expect_error([&] { backward(p, xv, w, nullptr, bi, bo, bb); },
                 {"'outputs.grad_weights.router_weight'", "or fp32", "got fp16"});
  }
  {  // wrong shape
    BackwardOutputs bo = outputs();
    bo.grad_weights.b1 = TensorView::contiguous(db1.data(), dt, {6, 4});
    expect_error([&] { backward(p, xv, w, nullptr, bi, bo, bb); },
                 {"'outputs.grad_weights.b1'", "expected shape (4, 6)", "got (6, 4)"});
  }
  {  // grad_x stays in the data dtype
    BackwardOutputs bo = outputs();
    bo.grad_x = TensorView::contiguous(dx_f.data(), DType::kFP32, {6, 8});
    expect_error([&] { backward(p, xv, w, nullptr, bi, bo, bb); }, {"'outputs.grad_x'", "dtype fp64", "got fp32"});
  }
  {  // backward_weight names its arguments the same way
    BackwardOutputs bo = outputs();
    bo.grad_x = bo.grad_weights.router_weight = TensorView();
    bo.grad_weights.w2 = TensorView::contiguous(half.data(), DType::kBF16, {4, 8, 3});
    std::vector<unsigned char> deferred(deferred_layout(p, dt).total_bytes);
    expect_error([&] {
      backward_weight(p, xv, w, nullptr, bi.grad_out, bo, saved.data(), saved.size(),
                      {deferred.data(), deferred.size()});
    }, {"machmoe::backward_weight", "'outputs.grad_weights.w2'", "or fp32", "got bf16"});
  }
  {  // fp32 data: the only gradient dtype is fp32, and the message says so
    MoEProblem q = p;
    std::vector<float> xf(x.begin(), x.end()), wrf(wr.begin(), wr.end()), w1f(w1.begin(), w1.end()),
        b1f(b1.begin(), b1.end()), w2f(w2.begin(), w2.end()), gof(go.begin(), go.end()), of(48), lf(24), dxf(48),
        dwrf(32), dw2f(w2.size()), db1f(b1.size());
    const DType ft = DType::kFP32;
    LayerWeights wf;
    wf.router_weight = TensorView::contiguous(wrf.data(), ft, {4, 8});
    wf.w1 = TensorView::contiguous(w1f.data(), ft, {4, 6, 8});
    wf.w2 = TensorView::contiguous(w2f.data(), ft, {4, 8, 3});
    wf.b1 = TensorView::contiguous(b1f.data(), ft, {4, 6});
    const TensorView xfv = TensorView::contiguous(xf.data(), ft, {6, 8});
    std::vector<unsigned char> sf(saved_layout(q, ft).total_bytes);
    forward(q, xfv, wf, nullptr,
            {TensorView::contiguous(of.data(), ft, {6, 8}), TensorView::contiguous(lf.data(), ft, {6, 4}),
             TensorView::contiguous(counts.data(), DType::kInt32, {4})},
            {sf.data(), sf.size(), nullptr, 0});
    BackwardInputs bif;
    bif.grad_out = TensorView::contiguous(gof.data(), ft, {6, 8});
    BackwardOutputs bo;
    bo.grad_x = TensorView::contiguous(dxf.data(), ft, {6, 8});
    bo.grad_weights.router_weight = TensorView::contiguous(dwrf.data(), ft, {4, 8});
    bo.grad_weights.w1 = TensorView::contiguous(dw1.data(), dt, {4, 6, 8});  // fp64 gradient of fp32 data
    bo.grad_weights.w2 = TensorView::contiguous(dw2f.data(), ft, {4, 8, 3});
    bo.grad_weights.b1 = TensorView::contiguous(db1f.data(), ft, {4, 6});
    bo.grad_weights.accumulate = true;
    try {
      backward(q, xfv, wf, nullptr, bif, bo, {sf.data(), sf.size(), nullptr, 0});
      ADD_FAILURE() << "an fp64 gradient of fp32 data was accepted";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("'outputs.grad_weights.w1': expected dtype fp32 (the data dtype of x), got fp64"),
                std::string::npos)
          << msg;
    }
  }
}

}  // namespace
}  // namespace machmoe::test
