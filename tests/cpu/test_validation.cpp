// Every validation error of the public API: the message names the argument, what was expected and what was
// given; no output is written when a call is rejected.
#include <gtest/gtest.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>

#include "machmoe/machmoe.hpp"
#include "test_support.hpp"

namespace machmoe {
namespace {

using test::expect_error;

/// A valid fp64 call (T=6, d=8, n=3 so w1 is (E, 6, 8), E=4, K=2) that each test breaks in one place.
struct Call {
  MoEProblem p;
  std::vector<double> x, wr, w1, w2, b1, b2, out, logits, gout, dx, dwr, dw1, dw2, db1, db2, scores, dscores;
  std::vector<std::int32_t> counts;
  std::vector<std::int64_t> tok, exp;
  std::vector<unsigned char> saved;
  LayerWeights w;
  TensorView xv;
  ForwardOutputs fo;
  ForwardBuffers fb;
  RoutingTriples rt;
  BackwardInputs bi;
  BackwardOutputs bo;
  BackwardBuffers bb;

  explicit Call(RoutingMode routing = RoutingMode::kTopK) {
    p.T = 6, p.d = 8, p.n = 3, p.E = 4, p.K = 2, p.routing = routing;
    p.has_b1 = true;
    if (routing == RoutingMode::kCallerSupplied) {
      tok = {0, 0, 1, 3, 3, 5};
      exp = {1, 2, 0, 3, 1, 2};
      scores = {0.5, 0.5, 1.0, 0.3, 0.7, 1.0};
      p.num_pairs = 6;
    }
    const DType dt = DType::kFP64;
    auto fill = [](std::vector<double>& v, std::size_t n, double base) {
      v.resize(n);
      for (std::size_t i = 0; i < n; ++i) v[i] = base + 0.01 * double(i % 17) - 0.05;
    };
    fill(x, 48, 0.3), fill(wr, 32, 0.1), fill(w1, 4 * 6 * 8, -0.1), fill(w2, 4 * 8 * 3, 0.2), fill(b1, 24, 0.0);
    fill(gout, 48, 1.0);
    out.assign(48, 0), logits.assign(24, 0), counts.assign(4, 0), dx.assign(48, 0), dwr.assign(32, 0);
    dw1.assign(w1.size(), 0), dw2.assign(w2.size(), 0), db1.assign(24, 0), dscores.assign(6, 0);
    xv = TensorView::contiguous(x.data(), dt, {6, 8});
    if (routing != RoutingMode::kCallerSupplied) w.router_weight = TensorView::contiguous(wr.data(), dt, {4, 8});
    w.w1 = TensorView::contiguous(w1.data(), dt, {4, 6, 8});
    w.w2 = TensorView::contiguous(w2.data(), dt, {4, 8, 3});
    w.b1 = TensorView::contiguous(b1.data(), dt, {4, 6});
    fo.out = TensorView::contiguous(out.data(), dt, {6, 8});
    if (routing != RoutingMode::kCallerSupplied) fo.router_logits = TensorView::contiguous(logits.data(), dt, {6, 4});
    fo.expert_counts = TensorView::contiguous(counts.data(), DType::kInt32, {4});
    saved.assign(saved_layout(p, dt).total_bytes, 0);
    fb = {saved.data(), saved.size(), nullptr, 0};
    bb = {saved.data(), saved.size(), nullptr, 0};
    if (routing == RoutingMode::kCallerSupplied) {
      rt.token_index = TensorView::contiguous(tok.data(), DType::kInt64, {6});
      rt.expert_index = TensorView::contiguous(exp.data(), DType::kInt64, {6});
      rt.score = TensorView::contiguous(scores.data(), dt, {6});
      bo.grad_scores = TensorView::contiguous(dscores.data(), dt, {6});
    }
    bi.grad_out = TensorView::contiguous(gout.data(), dt, {6, 8});
    bo.grad_x = TensorView::contiguous(dx.data(), dt, {6, 8});
    if (routing != RoutingMode::kCallerSupplied)
      bo.grad_weights.router_weight = TensorView::contiguous(dwr.data(), dt, {4, 8});
    bo.grad_weights.w1 = TensorView::contiguous(dw1.data(), dt, {4, 6, 8});
    bo.grad_weights.w2 = TensorView::contiguous(dw2.data(), dt, {4, 8, 3});
    bo.grad_weights.b1 = TensorView::contiguous(db1.data(), dt, {4, 6});
  }
  const RoutingTriples* routing() const { return p.routing == RoutingMode::kCallerSupplied ? &rt : nullptr; }
  void forward_call() { forward(p, xv, w, routing(), fo, fb); }
  void backward_call() { backward(p, xv, w, routing(), bi, bo, bb); }

  /// Fills every output, buffer and gradient with values no call writes (a count of -5, 0xAB bytes, 7.0, 123.0),
  /// so that a rejected call that wrote anything shows; expect_untouched() checks them, the saved buffer against
  /// `saved_now` (a valid forward's state, or all 0xAB).
  void poison() {
    for (std::vector<double>* v : {&out, &logits}) v->assign(v->size(), 123.0);
    for (std::vector<double>* v : {&dx, &dwr, &dw1, &dw2, &db1, &dscores}) v->assign(v->size(), 7.0);
    counts.assign(counts.size(), -5);
    saved.assign(saved.size(), 0xAB);
  }
  void expect_untouched(const std::vector<unsigned char>& saved_now) const {
    for (const std::vector<double>* v : {&out, &logits})
      EXPECT_EQ(*v, std::vector<double>(v->size(), 123.0)) << "out or router_logits written";
    for (const std::vector<double>* v : {&dx, &dwr, &dw1, &dw2, &db1, &dscores})
      EXPECT_EQ(*v, std::vector<double>(v->size(), 7.0)) << "a gradient written";
    EXPECT_EQ(counts, std::vector<std::int32_t>(counts.size(), -5)) << "expert_counts written";
    EXPECT_TRUE(saved == saved_now) << "the saved buffer written";
  }
  void expect_untouched() const { expect_untouched(std::vector<unsigned char>(saved.size(), 0xAB)); }
};


TEST(Validation, ValidCallsPass) {
  for (RoutingMode r : {RoutingMode::kTopK, RoutingMode::kTokenRounding, RoutingMode::kCallerSupplied}) {
    Call c(r);
    EXPECT_NO_THROW(c.forward_call());
    EXPECT_NO_THROW(c.backward_call());
  }
}

TEST(Validation, ProblemFields) {
  auto with = [](const std::function<void(MoEProblem&)>& f) {
    return [f] {
      Call c;
      f(c.p);
      c.forward_call();
    };
  };
  expect_error(with([](MoEProblem& p) { p.T = -1; }), {"'problem.T'", "[0, ", "got -1"});  // T = 0 is valid
  expect_error(with([](MoEProblem& p) { p.K = 0; }), {"'problem.K'", "1 <= K <= E", "got 0"});
  expect_error(with([](MoEProblem& p) { p.K = 5; }), {"'problem.K'", "[1, 4]", "got 5"});
  expect_error(with([](MoEProblem& p) { p.E = 70000; }), {"'problem.E'", "65536", "got 70000"});
  expect_error(with([](MoEProblem& p) { p.d = -3; }), {"'problem.d'", "got -3"});
  expect_error(with([](MoEProblem& p) { p.routing = RoutingMode::kTokenRounding, p.tile_m = 12; }),
               {"'problem.tile_m'", "multiple of 8", "got 12"});
  expect_error(with([](MoEProblem& p) { p.routing = RoutingMode::kTokenRounding, p.tile_m = 0; }),
               {"'problem.tile_m'", "got 0"});
  expect_error(with([](MoEProblem& p) { p.num_pairs = 3; }), {"'problem.num_pairs'", "0 unless routing is 'caller'"});
  expect_error(with([](MoEProblem& p) { p.activation = Activation::kReLU, p.weight_layout = WeightLayout::kConcatenated; }),
               {"'problem.weight_layout'", "'interleaved'", "'concatenated'"});
  expect_error(with([](MoEProblem& p) { p.T = 1 << 30, p.K = 4; }), {"'problem.T*K'", "int32"});
}

// Option fields hold enum values; a MoEProblem filled from an unchecked integer (as the PyTorch binding did) can
// hold any int. Every public entry point must reject it by name, listing the valid names and values.
template <class Enum>
Enum bad_enum(int v) {
  return static_cast<Enum>(v);  // well defined: the enums have the fixed underlying type int
}

const int kBadCodes[] = {-1, 8, 77, 99, 1 << 16, INT_MAX, INT_MIN};

TEST(Validation, EveryOptionFieldOutOfRangeIsNamed) {
  struct Field {
    const char* name;
    int first_invalid;  // the enum's count: codes [0, count) are valid
    const char* listing;
    std::function<void(MoEProblem&, int)> set;
  };
  const Field fields[] = {
      {"problem.activation", 8,
       "one of {swiglu = 0, geglu = 1, reglu = 2, relu_squared = 3, relu = 4, gelu = 5, silu = 6, "
       "gptoss_swiglu = 7}",
       [](MoEProblem& p, int v) { p.activation = bad_enum<Activation>(v); }},
      {"problem.weight_layout", 2, "one of {interleaved = 0, concatenated = 1}",
       [](MoEProblem& p, int v) { p.weight_layout = bad_enum<WeightLayout>(v); }},
      {"problem.score", 3, "one of {softmax_topk = 0, topk_softmax = 1, topk_softmax_renorm = 2}",
       [](MoEProblem& p, int v) { p.score = bad_enum<ScoreVariant>(v); }},
      {"problem.routing", 3, "one of {topk = 0, token_rounding = 1, caller = 2}",
       [](MoEProblem& p, int v) { p.routing = bad_enum<RoutingMode>(v); }},
      {"problem.rounding", 3, "one of {nearest = 0, up = 1, down = 2}",
       [](MoEProblem& p, int v) { p.rounding = bad_enum<RoundingRule>(v); }},
      {"problem.cache", 2, "one of {preact = 0, input_only = 1}",
       [](MoEProblem& p, int v) { p.cache = bad_enum<CacheMode>(v); }},
  };
  for (const Field& f : fields) {
    std::vector<int> codes(std::begin(kBadCodes), std::end(kBadCodes));
    codes.push_back(f.first_invalid);
    for (int v : codes) {
      if (v >= 0 && v < f.first_invalid) continue;
      SCOPED_TRACE(std::string(f.name) + " = " + std::to_string(v));
      const std::string got = "got " + std::to_string(v);
      MoEProblem p = Call().p;
      f.set(p, v);
      expect_error([&] { validate_problem(p); }, {f.name, f.listing, got.c_str()});
      // Every entry point, before it reads a tensor; and the rejected call writes nothing.
      Call c;
      f.set(c.p, v);
      c.poison();
      expect_error([&] { c.forward_call(); }, {"machmoe::forward: argument '", f.name, got.c_str()});
      expect_error([&] { c.backward_call(); }, {"machmoe::backward: argument '", f.name, got.c_str()});
      c.expect_untouched();
    }
  }
}

TEST(Validation, AnInvalidActivationIsNotReportedAsAShape) {
  // With code 99 the activation is not GLU, so W1 would be checked against (E, n, d): before the option check that
  // was the error reported. It must name the activation instead.
  Call c;
  c.p.activation = bad_enum<Activation>(99);
  try {
    c.forward_call();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'problem.activation'"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("shape"), std::string::npos) << msg;
  }
  // Nor as the layout rule it would trip (a concatenated layout needs a GLU activation, which 99 is not).
  c = Call();
  c.p.activation = bad_enum<Activation>(99);
  c.p.weight_layout = WeightLayout::kConcatenated;
  expect_error([&] { c.forward_call(); }, {"'problem.activation'", "got 99"});
}

TEST(Validation, OptionCodesConvertOnlyTheirValues) {
  EXPECT_EQ(activation_from_code(5, "op", "activation"), Activation::kGELU);
  EXPECT_EQ(weight_layout_from_code(1, "op", "weight_layout"), WeightLayout::kConcatenated);
  EXPECT_EQ(score_variant_from_code(2, "op", "score"), ScoreVariant::kTopKOfSoftmaxRenorm);
  EXPECT_EQ(routing_mode_from_code(2, "op", "routing"), RoutingMode::kCallerSupplied);
  EXPECT_EQ(rounding_rule_from_code(0, "op", "rounding"), RoundingRule::kNearest);
  EXPECT_EQ(cache_mode_from_code(1, "op", "cache"), CacheMode::kInputOnly);
  // 2^32 + c narrowed to int is c, a valid code: the 64-bit value itself must be rejected.
  const std::int64_t wide[] = {-1, 8, std::int64_t{1} << 32, (std::int64_t{1} << 32) + 1, (std::int64_t{1} << 32) + 2,
                               std::int64_t{INT_MAX} + 1, INT64_MAX, INT64_MIN};
  for (std::int64_t v : wide) {
    const std::string got = "got " + std::to_string(v);
    expect_error([&] { activation_from_code(v, "layer_forward", "activation"); },
                 {"machmoe::layer_forward: argument 'activation'", "swiglu = 0", got.c_str()});
    if (v >= 0 && v < 2) continue;
    expect_error([&] { cache_mode_from_code(v, "op", "cache"); }, {"'cache'", "input_only = 1", got.c_str()});
    expect_error([&] { weight_layout_from_code(v, "op", "weight_layout"); }, {"'weight_layout'", got.c_str()});
    if (v >= 0 && v < 3) continue;
    expect_error([&] { routing_mode_from_code(v, "op", "routing"); }, {"'routing'", "caller = 2", got.c_str()});
    expect_error([&] { score_variant_from_code(v, "op", "score"); }, {"'score'", got.c_str()});
    expect_error([&] { rounding_rule_from_code(v, "op", "rounding"); }, {"'rounding'", got.c_str()});
  }
}

TEST(Validation, TensorShapesDtypesStridesPointersDevices) {
  {
    Call c;  // W1 given transposed: (E, d, 2n) instead of (E, 2n, d)
    c.w.w1 = TensorView::contiguous(c.w1.data(), DType::kFP64, {4, 8, 6});
    expect_error([&] { c.forward_call(); }, {"'weights.w1'", "shape (4, 6, 8)", "got (4, 8, 6)"});
  }
  {
    Call c;
    c.w.w2.dtype = DType::kFP32;
    expect_error([&] { c.forward_call(); }, {"'weights.w2'", "dtype fp64", "got fp32"});
  }
  {
    Call c;  // inner stride 2
    c.xv = TensorView::strided(c.x.data(), DType::kFP64, {6, 4}, {8, 2});
    c.p.d = 4;
    c.w.w1 = TensorView::contiguous(c.w1.data(), DType::kFP64, {4, 6, 4});
    expect_error([&] { c.forward_call(); }, {"'x.stride'", "unit inner stride", "got (8, 2)"});
  }
  {
    Call c;  // overlapping rows
    c.xv = TensorView::strided(c.x.data(), DType::kFP64, {6, 8}, {4, 1});
    expect_error([&] { c.forward_call(); }, {"'x.stride'", ">= 8", "got (4, 1)"});
  }
  {
    Call c;
    c.w.w1.data = nullptr;
    expect_error([&] { c.forward_call(); }, {"'weights.w1'", "non-null", "nullptr"});
  }
  {
    Call c;
    c.w.w2.device = Device::cuda(0);
    expect_error([&] { c.forward_call(); }, {"'weights.w2'", "on cpu", "cuda:0"});
  }
  {
    Call c;
    c.xv.dtype = DType::kInt32;
    expect_error([&] { c.forward_call(); }, {"'x'", "floating dtype", "int32"});
  }
  {
    Call c;  // bf16 on the CPU has no backend
    c.xv.dtype = c.w.router_weight.dtype = c.w.w1.dtype = c.w.w2.dtype = c.w.b1.dtype = DType::kBF16;
    c.fo.out.dtype = c.fo.router_logits.dtype = DType::kBF16;
    expect_error([&] { c.forward_call(); }, {"'x'", "fp32 or fp64 on cpu", "bf16"});
  }
  {
    Call c;  // fp64 has no GPU path (with CUDA) or CUDA has no path at all (without)
    c.xv.device = c.w.router_weight.device = c.w.w1.device = c.w.w2.device = c.w.b1.device = Device::cuda(0);
    if (built_with_cuda())
      expect_error([&] { c.forward_call(); }, {"'x'", "bf16, fp16 or fp32 on cuda", "fp64"});
    else
      expect_error([&] { c.forward_call(); }, {"'x'", "tensors on cpu", "cuda:0"});
  }
  {
    Call c;
    c.fo.expert_counts.dtype = DType::kInt64;
    expect_error([&] { c.forward_call(); }, {"'outputs.expert_counts'", "int32", "int64"});
  }
  {
    Call c;
    c.fo.out = TensorView::contiguous(c.out.data(), DType::kFP64, {8, 6});
    expect_error([&] { c.forward_call(); }, {"'outputs.out'", "shape (6, 8)", "got (8, 6)"});
  }
}

TEST(Validation, BiasesMustMatchTheProblem) {
  {
    Call c;
    c.w.b1 = TensorView();
    expect_error([&] { c.forward_call(); }, {"'weights.b1'", "(4, 6)", "empty view"});
  }
  {
    Call c;
    c.b2.assign(32, 0.0);
    c.w.b2 = TensorView::contiguous(c.b2.data(), DType::kFP64, {4, 8});
    expect_error([&] { c.forward_call(); }, {"'weights.b2'", "problem.has_b2 is false", "(4, 8)"});
  }
}

TEST(Validation, CallerSuppliedRouting) {
  {
    Call c(RoutingMode::kCallerSupplied);
    c.exp[3] = 4;
    expect_error([&] { c.forward_call(); }, {"'routing.expert_index[3]'", "[0, 4)", "got 4"});
  }
  {
    Call c(RoutingMode::kCallerSupplied);
    c.exp[0] = -1;
    expect_error([&] { c.forward_call(); }, {"'routing.expert_index[0]'", "got -1"});
  }
  {
    Call c(RoutingMode::kCallerSupplied);
    c.tok[5] = 6;
    expect_error([&] { c.forward_call(); }, {"'routing.token_index[5]'", "[0, 6)", "got 6"});
  }
  {
    Call c(RoutingMode::kCallerSupplied);
    c.tok = {0, 0, 3, 1, 3, 5};
    expect_error([&] { c.forward_call(); }, {"'routing.token_index[3]'", "ascending order", "got 1"});
  }
  {
    Call c(RoutingMode::kCallerSupplied);
    c.tok = {0, 0, 0, 3, 3, 5};
    expect_error([&] { c.forward_call(); }, {"'routing.token_index[2]'", "at most K = 2", "3 pairs for token 0"});
  }
  {
    Call c(RoutingMode::kCallerSupplied);
    expect_error([&] { forward(c.p, c.xv, c.w, nullptr, c.fo, c.fb); }, {"'routing'", "triples", "nullptr"});
  }
  {
    Call c;
    RoutingTriples r;
    expect_error([&] { forward(c.p, c.xv, c.w, &r, c.fo, c.fb); }, {"'routing'", "nullptr (routing 'topk'"});
  }
  {
    Call c(RoutingMode::kCallerSupplied);
    c.rt.score.dtype = DType::kFP32;
    expect_error([&] { c.forward_call(); }, {"'routing.score'", "dtype fp64", "fp32"});
  }
  {
    Call c(RoutingMode::kCallerSupplied);
    c.rt.token_index.dtype = DType::kFP64;
    expect_error([&] { c.forward_call(); }, {"'routing.token_index'", "int32 or int64", "fp64"});
  }
}

TEST(Validation, BuffersAndStream) {
  {
    Call c;
    c.fb.saved_bytes -= 1;
    expect_error([&] { c.forward_call(); }, {"'buffers.saved_bytes'", "at least", std::to_string(c.saved.size()).c_str()});
  }
  {
    Call c;
    c.fb.saved = nullptr;
    expect_error([&] { c.forward_call(); }, {"'buffers.saved'", "non-null"});
  }
  {
    Call c;
    int fake_stream = 0;
    expect_error([&] { forward(c.p, c.xv, c.w, nullptr, c.fo, c.fb, &fake_stream); }, {"'stream'", "nullptr for cpu"});
  }
  {
    Call c;  // a saved buffer forward() never filled
    std::memset(c.saved.data(), 0xFF, c.saved.size());
    expect_error([&] { c.backward_call(); }, {"'buffers.saved'", "forward() filled"});
  }
  {
    // Buffers must start at a multiple of kBufferAlignment (the GPU kernels' 16-byte accesses), forward and backward;
    // 8 bytes past an aligned start is rejected, with the offset named.
    Call c;
    static_assert(kBufferAlignment == 16, "the message below names 16");
    std::vector<unsigned char> slack(c.saved.size() + 2 * kBufferAlignment);
    const auto base = reinterpret_cast<std::uintptr_t>(slack.data());
    unsigned char* aligned = slack.data() + (kBufferAlignment - base % kBufferAlignment) % kBufferAlignment;
    c.fb.saved = aligned + 8;
    expect_error([&] { c.forward_call(); }, {"'buffers.saved'", "aligned to kBufferAlignment = 16 bytes",
                                             "8 bytes past a multiple"});
    c.fb.saved = aligned;
    c.forward_call();  // the aligned start of the same memory passes
    c.bb.saved = aligned + 8;  // rejected before anything reads it
    expect_error([&] { c.backward_call(); }, {"'buffers.saved'", "aligned to kBufferAlignment"});
  }
}

TEST(Validation, BackwardArguments) {
  {
    Call c;
    c.forward_call();
    c.bo.grad_weights.b1 = TensorView();
    expect_error([&] { c.backward_call(); }, {"'outputs.grad_weights.b1'", "(4, 6)"});
  }
  {
    Call c;
    c.forward_call();
    c.bi.grad_out = TensorView::contiguous(c.gout.data(), DType::kFP64, {8, 6});
    expect_error([&] { c.backward_call(); }, {"'inputs.grad_out'", "(6, 8)"});
  }
  {
    Call c(RoutingMode::kCallerSupplied);
    c.forward_call();
    c.bo.grad_scores = TensorView();
    expect_error([&] { c.backward_call(); }, {"'outputs.grad_scores'", "(6,)"});
  }
  {
    Call c;
    c.forward_call();
    c.bo.grad_scores = TensorView::contiguous(c.dscores.data(), DType::kFP64, {6});
    expect_error([&] { c.backward_call(); }, {"'outputs.grad_scores'", "only routing 'caller'"});
  }
}

// docs/VALIDATION.md, "Caller memory is untouched on error": no output, buffer or gradient of a rejected call is
// written, including rejections that come only after every tensor checked out (routing values, buffer sizes).
// An output that shares memory with another argument of the call is refused before anything is written: the GPU
// reads x after writing grad_x (for the weight gradients), so an alias would give other results there than here.
// Views laid one after another in one allocation (a flat gradient buffer's) pass.
TEST(Validation, OutputsThatShareMemoryWithAnotherArgumentAreRefused) {
  const DType dt = DType::kFP64;
  {
    Call c;
    c.forward_call();
    const std::vector<unsigned char> saved_now = c.saved;
    c.bo.grad_x = c.xv;  // grad_x written over x
    const std::vector<double> x_before = c.x;
    c.poison();
    c.saved = saved_now;
    expect_error([&] { c.backward_call(); },
                 {"machmoe::backward: argument 'outputs.grad_x'", "memory of its own", "overlapping x at"});
    c.expect_untouched(saved_now);
    EXPECT_EQ(c.x, x_before) << "x written";
  }
  {
    Call c;
    c.fo.out = TensorView::contiguous(c.saved.data(), dt, {6, 8});  // the output inside the saved buffer
    expect_error([&] { c.forward_call(); },
                 {"machmoe::forward: argument 'outputs.out'", "overlapping buffers.saved at"});
  }
  {
    Call c;
    c.forward_call();
    c.bo.grad_weights.w2 = TensorView::contiguous(c.dw1.data() + 8, dt, {4, 8, 3});  // two gradients overlapping
    expect_error([&] { c.backward_call(); },
                 {"argument 'outputs.grad_weights.w1'", "overlapping outputs.grad_weights.w2 at"});
  }
  {
    Call c;
    c.forward_call();
    c.bi.grad_out = c.xv;  // read twice: allowed (a loss of <out, x> gives x as grad_out)
    EXPECT_NO_THROW(c.backward_call());
    std::vector<double> flat(c.dw1.size() + c.dw2.size() + c.db1.size(), 0.0);  // one after another: allowed
    c.bo.grad_weights.w1 = TensorView::contiguous(flat.data(), dt, {4, 6, 8});
    c.bo.grad_weights.w2 = TensorView::contiguous(flat.data() + c.dw1.size(), dt, {4, 8, 3});
    c.bo.grad_weights.b1 = TensorView::contiguous(flat.data() + c.dw1.size() + c.dw2.size(), dt, {4, 6});
    EXPECT_NO_THROW(c.backward_call());
  }
  {
    Call c;  // the split halves: backward_weight's gradient over the deferred buffer it reads
    c.forward_call();
    std::vector<unsigned char> deferred(deferred_layout(c.p, dt).total_bytes);
    BackwardOutputs input_half, weight_half = c.bo;
    input_half.grad_x = c.bo.grad_x, input_half.grad_weights.router_weight = c.bo.grad_weights.router_weight;
    weight_half.grad_x = weight_half.grad_weights.router_weight = TensorView();
    backward_input(c.p, c.xv, c.w, nullptr, c.bi, input_half, c.bb, {deferred.data(), deferred.size()});
    weight_half.grad_weights.b1 = TensorView::contiguous(reinterpret_cast<double*>(deferred.data()), dt, {4, 6});
    expect_error(
        [&] {
          backward_weight(c.p, c.xv, c.w, nullptr, c.bi.grad_out, weight_half, c.saved.data(), c.saved.size(),
                          {deferred.data(), deferred.size()});
        },
        {"machmoe::backward_weight: argument 'outputs.grad_weights.b1'", "overlapping deferred.data at"});
  }
}

// W1 (and its gradient) as a 4D (E, 2, n, d) view of the concatenated layout whose halves may lie apart
// (layer.hpp, LayerWeights::w1).
TEST(Validation, W1ViewsWithHalvesApart) {
  const DType dt = DType::kFP64;
  const std::int64_t half = 4 * 3 * 8, gap = 50;
  // Gate rows, a gap, up rows; the same for the gradient. grad_x lies in the weights' gap: written there, it
  // shares no byte with either half, so it is not an alias.
  auto apart = [&](std::vector<double>& buffer, const std::vector<double>& joined) {
    buffer.assign(static_cast<std::size_t>(2 * half + gap), 0.0);
    for (std::int64_t e = 0; e < 4; ++e)
      for (std::int64_t r = 0; r < 6; ++r)
        for (std::int64_t k = 0; k < 8; ++k) buffer[(r / 3) * (half + gap) + (e * 3 + r % 3) * 8 + k] = joined[(e * 6 + r) * 8 + k];
    return TensorView::strided(buffer.data(), dt, {4, 2, 3, 8}, {24, half + gap, 8, 1});
  };
  {
    Call c;
    c.p.weight_layout = WeightLayout::kConcatenated;
    std::vector<double> w1_apart, dw1_apart;
    c.w.w1 = apart(w1_apart, c.w1);
    c.bo.grad_weights.w1 = apart(dw1_apart, c.dw1);
    c.bo.grad_x = TensorView::contiguous(w1_apart.data() + half + 1, dt, {6, 8});
    EXPECT_NO_THROW(c.forward_call());
    EXPECT_NO_THROW(c.backward_call());
    // The gradient's halves against another gradient: its up half over grad_weights.w2.
    c.bo.grad_weights.w2 = TensorView::contiguous(dw1_apart.data() + half + gap + 10, dt, {4, 8, 3});
    expect_error([&] { c.backward_call(); }, {"'outputs.grad_weights.w1'", "overlapping outputs.grad_weights.w2 at"});
  }
  {
    Call c;  // the interleaved layout has no halves
    std::vector<double> w1_apart;
    c.w.w1 = apart(w1_apart, c.w1);
    expect_error([&] { c.forward_call(); },
                 {"'weights.w1'", "shape (4, 6, 8)", "only for the concatenated layout", "got (4, 2, 3, 8)"});
  }
  {
    Call c;
    c.p.weight_layout = WeightLayout::kConcatenated;
    std::vector<double> w1_apart;
    TensorView v = apart(w1_apart, c.w1);
    v.shape[2] = 2;
    c.w.w1 = v;
    expect_error([&] { c.forward_call(); }, {"'weights.w1'", "shape (4, 6, 8) or (4, 2, 3, 8)", "got (4, 2, 2, 8)"});
    v = apart(w1_apart, c.w1);
    v.data = w1_apart.data() + half + gap, v.stride[1] = -(half + gap);  // the up half before the gate half
    c.w.w1 = v;
    expect_error([&] { c.forward_call(); }, {"'weights.w1.stride'", "positive stride along dimension 1"});
    v = apart(w1_apart, c.w1);
    v.stride[1] = 8;  // up row j is gate row j + 1: the halves share memory
    c.w.w1 = v;
    expect_error([&] { c.forward_call(); }, {"'weights.w1.stride'", "row-major", "dimension 1 needs stride >= 24"});
    v = apart(w1_apart, c.w1);
    v.stride[3] = 2;  // a half that is not row-major
    c.w.w1 = v;
    expect_error([&] { c.forward_call(); }, {"'weights.w1 (its gate half, [:, 0]).stride'", "unit inner stride"});
    // The joined weights viewed so: (E, 2, n, d) of a contiguous (E, 2n, d) tensor.
    c.w.w1 = TensorView::strided(c.w1.data(), dt, {4, 2, 3, 8}, {48, 24, 8, 1});
    EXPECT_NO_THROW(c.forward_call());
  }
}

TEST(Validation, RejectedCallsWriteNothing) {
  {
    Call c(RoutingMode::kCallerSupplied);
    c.poison();
    c.exp[5] = 99;  // detected only after every tensor checked out
    expect_error([&] { c.forward_call(); }, {"machmoe::forward", "expert_index[5]", "99"});
    expect_error([&] { c.backward_call(); }, {"machmoe::backward", "expert_index[5]", "99"});
    c.expect_untouched();
  }
  {
    // The backward of a valid forward, then the same routing with a bad value: neither the gradients nor the state
    // the forward saved change.
    Call c(RoutingMode::kCallerSupplied);
    c.forward_call();
    const std::vector<unsigned char> state = c.saved;
    const std::vector<double> out = c.out;
    const std::vector<std::int32_t> counts = c.counts;
    for (std::vector<double>* v : {&c.dx, &c.dw1, &c.dw2, &c.db1, &c.dscores}) v->assign(v->size(), 7.0);
    c.tok[4] = 6;  // a token outside [0, T)
    expect_error([&] { c.backward_call(); }, {"machmoe::backward", "token_index[4]", "6"});
    c.tok[4] = 3, c.exp[2] = -1;
    expect_error([&] { c.backward_call(); }, {"machmoe::backward", "expert_index[2]", "-1"});
    for (std::vector<double>* v : {&c.dx, &c.dw1, &c.dw2, &c.db1, &c.dscores})
      EXPECT_EQ(*v, std::vector<double>(v->size(), 7.0)) << "a gradient written";
    EXPECT_TRUE(c.saved == state) << "the saved buffer written";
    EXPECT_EQ(c.out, out);
    EXPECT_EQ(c.counts, counts);
  }
  {
    // Top-K routing (router_logits present): a saved buffer one byte short is refused after the tensors.
    Call c;
    c.poison();
    c.fb.saved_bytes = c.bb.saved_bytes = c.saved.size() - 1;
    expect_error([&] { c.forward_call(); }, {"machmoe::forward", "saved"});
    expect_error([&] { c.backward_call(); }, {"machmoe::backward", "saved"});
    c.expect_untouched();
  }
}

/// An fp64 top-K call of T tokens and K choices (E = 4, d = 8, n = 3, SwiGLU: w1 is (4, 6, 8)) over a saved buffer
/// of its own, for the saved-buffer checks below (or token rounding to tiles of 8 rows).
struct TopKCall {
  MoEProblem p;
  std::vector<double> x, wr, w1, w2, out, logits, gout, dx, dwr, dw1, dw2;
  std::vector<std::int32_t> counts;
  std::vector<unsigned char> saved;

  TopKCall(std::int64_t T, std::int64_t K, RoutingMode routing = RoutingMode::kTopK) {
    p.T = T, p.d = 8, p.n = 3, p.E = 4, p.K = K, p.routing = routing;
    p.tile_m = 8;  // token rounding: tiles of 8 rows
    auto fill = [](std::vector<double>& v, std::size_t n, double base) {
      v.resize(n);
      for (std::size_t i = 0; i < n; ++i) v[i] = base + 0.01 * double(i % 17) - 0.05 + 0.003 * double(i % 29);
    };
    const std::size_t td = static_cast<std::size_t>(T * 8);
    fill(x, td, 0.3), fill(wr, 32, 0.1), fill(w1, 4 * 6 * 8, -0.1), fill(w2, 4 * 8 * 3, 0.2), fill(gout, td, 1.0);
    out.assign(td, 0), logits.assign(static_cast<std::size_t>(T * 4), 0), counts.assign(4, 0);
    dx.assign(td, 0), dwr.assign(32, 0), dw1.assign(w1.size(), 0), dw2.assign(w2.size(), 0);
    saved.assign(saved_layout(p, DType::kFP64).total_bytes, 0);
  }
  TensorView view(std::vector<double>& v, std::initializer_list<std::int64_t> shape) {
    return TensorView::contiguous(v.data(), DType::kFP64, shape);
  }
  LayerWeights weights() {
    LayerWeights w;
    w.router_weight = view(wr, {4, 8}), w.w1 = view(w1, {4, 6, 8}), w.w2 = view(w2, {4, 8, 3});
    return w;
  }
  void forward_call() {
    ForwardOutputs fo;
    fo.out = view(out, {p.T, 8}), fo.router_logits = view(logits, {p.T, 4});
    fo.expert_counts = TensorView::contiguous(counts.data(), DType::kInt32, {4});
    forward(p, view(x, {p.T, 8}), weights(), nullptr, fo, {saved.data(), saved.size(), nullptr, 0});
  }
  void backward_call() {
    BackwardInputs bi;
    bi.grad_out = view(gout, {p.T, 8});
    BackwardOutputs bo;
    bo.grad_x = view(dx, {p.T, 8});
    bo.grad_weights.router_weight = view(dwr, {4, 8});
    bo.grad_weights.w1 = view(dw1, {4, 6, 8});
    bo.grad_weights.w2 = view(dw2, {4, 8, 3});
    backward(p, view(x, {p.T, 8}), weights(), nullptr, bi, bo, {saved.data(), saved.size(), nullptr, 0});
  }
  std::vector<std::vector<double>*> grads() { return {&dx, &dwr, &dw1, &dw2}; }
};

// docs/VALIDATION.md, "Saved buffer (CPU backward only)": a saved buffer of another problem with the same layout
// (top-K with T*K unchanged: T = 100, K = 1 against T = 50, K = 2) passes the offset checks; its index arrays are
// range-checked before anything is read through them or written, so the backward refuses it instead of indexing x
// and the gradients out of bounds.
TEST(Validation, SavedBufferOfAnotherProblemIsRefused) {
  TopKCall wide(100, 1), narrow(50, 2);
  ASSERT_EQ(wide.p.max_pairs(), narrow.p.max_pairs());
  ASSERT_EQ(wide.saved.size(), narrow.saved.size()) << "the same saved layout size";
  const SavedLayout lw = saved_layout(wide.p, DType::kFP64), ln = saved_layout(narrow.p, DType::kFP64);
  using Regions = std::initializer_list<std::pair<BufferRegion, BufferRegion>>;
  for (const auto& [a, b] : Regions{{lw.scatter, ln.scatter}, {lw.inverse, ln.inverse}, {lw.gather, ln.gather},
                                    {lw.expert_offsets, ln.expert_offsets}, {lw.scores, ln.scores}, {lw.h, ln.h}}) {
    EXPECT_EQ(a.offset, b.offset) << "the same saved layout";
    EXPECT_EQ(a.bytes, b.bytes) << "the same saved layout";
  }
  wide.forward_call();
  narrow.forward_call();
  EXPECT_NO_THROW(narrow.backward_call()) << "its own saved buffer";

  for (std::vector<double>* v : narrow.grads()) v->assign(v->size(), 7.0);
  narrow.saved = wide.saved;  // tokens up to 99 in a problem of 50
  const std::vector<unsigned char> state = narrow.saved;
  expect_error([&] { narrow.backward_call(); },
               {"machmoe::backward", "'buffers.saved'", "does not belong to this problem", "gather", "[0, 50)"});
  for (std::vector<double>* v : narrow.grads())
    EXPECT_EQ(*v, std::vector<double>(v->size(), 7.0)) << "a gradient written";
  EXPECT_TRUE(narrow.saved == state) << "the saved buffer written";

  // Each index array on its own: a pair index past P in scatter or inverse, a negative token.
  const auto corrupt = [&](const BufferRegion& r, std::size_t i, std::int32_t v) {
    TopKCall c(50, 2);
    c.forward_call();
    std::memcpy(c.saved.data() + r.offset + i * sizeof(std::int32_t), &v, sizeof v);
    for (std::vector<double>* g : c.grads()) g->assign(g->size(), 7.0);
    return c;
  };
  {
    TopKCall c = corrupt(ln.scatter, 17, 100);
    expect_error([&] { c.backward_call(); }, {"'buffers.saved'", "scatter[17]", "[0, 100)", "100"});
    for (std::vector<double>* v : c.grads()) EXPECT_EQ(*v, std::vector<double>(v->size(), 7.0));
  }
  {
    TopKCall c = corrupt(ln.inverse, 99, -1);
    expect_error([&] { c.backward_call(); }, {"'buffers.saved'", "inverse[99]", "[0, 100)", "-1"});
    for (std::vector<double>* v : c.grads()) EXPECT_EQ(*v, std::vector<double>(v->size(), 7.0));
  }
  {
    TopKCall c = corrupt(ln.gather, 0, -3);
    expect_error([&] { c.backward_call(); }, {"'buffers.saved'", "gather[0]", "[0, 50)", "-3"});
    for (std::vector<double>* v : c.grads()) EXPECT_EQ(*v, std::vector<double>(v->size(), 7.0));
  }
}

// The other way round, every index falls in range (tokens below 50 in a problem of 100): the arrays' consistency with
// this problem's routing refuses it, where it used to give wrong gradients; so are arrays that are each in range but
// not inverse permutations, a caller-routed buffer fed with other pairs, and (integrity only: the reference rebuilds
// them) token rounding's saved per-token offsets that disagree with its pairs.
TEST(Validation, SavedBufferInRangeButNotThisProblemsIsRefused) {
  TopKCall wide(100, 1), narrow(50, 2);
  const SavedLayout lw = saved_layout(wide.p, DType::kFP64);
  narrow.forward_call();
  wide.forward_call();
  EXPECT_NO_THROW(wide.backward_call()) << "its own saved buffer";
  for (std::vector<double>* v : wide.grads()) v->assign(v->size(), 7.0);
  wide.saved = narrow.saved;  // pair p of token p / 2, in a problem whose pair p is token p's
  expect_error([&] { wide.backward_call(); },
               {"machmoe::backward", "'buffers.saved'", "p / K = p / 1 (top-K)", "pair 1 of token 0",
                "does not belong to this problem"});
  for (std::vector<double>* v : wide.grads()) EXPECT_EQ(*v, std::vector<double>(v->size(), 7.0));

  // Two entries of inverse swapped: each in range, the two arrays no longer inverse permutations.
  {
    TopKCall c(100, 1);
    c.forward_call();
    std::int32_t a = 0, b = 0;
    std::memcpy(&a, c.saved.data() + lw.inverse.offset + 3 * sizeof a, sizeof a);
    std::memcpy(&b, c.saved.data() + lw.inverse.offset + 4 * sizeof b, sizeof b);
    std::memcpy(c.saved.data() + lw.inverse.offset + 3 * sizeof b, &b, sizeof b);
    std::memcpy(c.saved.data() + lw.inverse.offset + 4 * sizeof a, &a, sizeof a);
    for (std::vector<double>* g : c.grads()) g->assign(g->size(), 7.0);
    expect_error([&] { c.backward_call(); }, {"'buffers.saved'", "inverse permutations", "scatter[inverse[3]] = 4"});
    for (std::vector<double>* v : c.grads()) EXPECT_EQ(*v, std::vector<double>(v->size(), 7.0));
  }

  // Caller-supplied routing: the same T, E and pair count, other pairs in the backward than in the forward.
  for (const bool other_expert : {false, true}) {
    Call c(RoutingMode::kCallerSupplied);
    c.forward_call();
    EXPECT_NO_THROW(c.backward_call()) << "its own pairs";
    if (other_expert)
      c.exp[4] = 0;  // pair 4: token 3, expert 1 in the forward
    else
      c.tok = {0, 1, 1, 3, 3, 5};  // pair 1: token 0 in the forward
    for (std::vector<double>* v : {&c.dx, &c.dw1, &c.dw2, &c.db1, &c.dscores}) v->assign(v->size(), 7.0);
    expect_error([&] { c.backward_call(); },
                 {"'buffers.saved'", "these routing triples",
                  other_expert ? "pair 4 is token 3, expert 0" : "pair 1 is token 1, expert 2",
                  other_expert ? "token 3, expert 1 in the saved buffer" : "token 0, expert 2 in the saved buffer"});
    for (std::vector<double>* v : {&c.dx, &c.dw1, &c.dw2, &c.db1, &c.dscores})
      EXPECT_EQ(*v, std::vector<double>(v->size(), 7.0)) << "a gradient written";
  }

  // Token rounding: its own buffer passes; one of the saved per-token offsets moved does not.
  TopKCall tr(40, 2, RoutingMode::kTokenRounding);
  const SavedLayout lt = saved_layout(tr.p, DType::kFP64);
  ASSERT_TRUE(lt.token_offsets.present());
  tr.forward_call();
  EXPECT_NO_THROW(tr.backward_call()) << "its own saved buffer";
  std::int32_t off = 0;
  std::memcpy(&off, tr.saved.data() + lt.token_offsets.offset + 7 * sizeof off, sizeof off);
  ++off;
  std::memcpy(tr.saved.data() + lt.token_offsets.offset + 7 * sizeof off, &off, sizeof off);
  for (std::vector<double>* g : tr.grads()) g->assign(g->size(), 7.0);
  const std::string moved = "token_offsets[7] = " + std::to_string(off);
  expect_error([&] { tr.backward_call(); },
               {"'buffers.saved'", "token_offsets[t] is the number of pairs of the tokens before t", moved.c_str()});
  for (std::vector<double>* v : tr.grads()) EXPECT_EQ(*v, std::vector<double>(v->size(), 7.0));
}

TEST(Validation, NameParsersListTheAcceptedNames) {
  expect_error([] { parse_activation("swish"); }, {"'activation'", "swiglu", "'swish'"});
  expect_error([] { parse_score_variant("softmax"); }, {"'score'", "topk_softmax_renorm"});
  expect_error([] { parse_rounding_rule("half"); }, {"'rounding'", "nearest"});
  EXPECT_EQ(parse_weight_layout("concatenated"), WeightLayout::kConcatenated);
  EXPECT_EQ(parse_cache_mode("input_only"), CacheMode::kInputOnly);
  EXPECT_EQ(parse_routing_mode("token_rounding"), RoutingMode::kTokenRounding);
}

TEST(Validation, Losses) {
  // loss and grad hold values no call writes: the rejected calls below must leave them so.
  std::vector<double> z(12, 0.0), g(12, 7.0), loss(1, -3.0);
  std::vector<std::int32_t> counts = {1, 2, -1, 0};
  const TensorView zv = TensorView::contiguous(z.data(), DType::kFP64, {3, 4});
  const TensorView lv = TensorView::contiguous(loss.data(), DType::kFP64, {1});
  const TensorView gv = TensorView::contiguous(g.data(), DType::kFP64, {3, 4});
  expect_error([&] { load_balancing_loss(zv, TensorView::contiguous(counts.data(), DType::kInt32, {4}), lv, gv); },
               {"'expert_counts[2]'", ">= 0", "-1"});
  expect_error([&] { load_balancing_loss(zv, TensorView::contiguous(counts.data(), DType::kInt32, {4}), lv, gv,
                                         1.0, /*accumulate=*/true); },
               {"'expert_counts[2]'", ">= 0", "-1"});
  expect_error([&] { load_balancing_loss(zv, TensorView::contiguous(counts.data(), DType::kInt32, {3}), lv, gv); },
               {"'expert_counts'", "(4,)", "(3,)"});
  expect_error([&] { router_z_loss(zv, TensorView::contiguous(loss.data(), DType::kFP32, {1}), gv); },
               {"'loss'", "fp64"});
  EXPECT_EQ(loss[0], -3.0) << "a rejected call wrote the loss";
  EXPECT_EQ(g, std::vector<double>(12, 7.0)) << "a rejected call wrote the gradient";
  g.assign(12, 0.0);
  counts[2] = 3;
  load_balancing_loss(zv, TensorView::contiguous(counts.data(), DType::kInt32, {4}), lv, gv);
  EXPECT_NEAR(loss[0], 1.0, 1e-15);
  router_z_loss(zv, lv, gv, 0.5, /*accumulate=*/true);
  EXPECT_NEAR(loss[0], std::log(4.0) * std::log(4.0), 1e-14);
  // Uniform probabilities, counts {1, 2, 3, 0}: the aux gradient at [0][0] is p (dP_0 - sum p dP) = 0.25 * (-1/9);
  // the z-loss gradient 2 lse p / T, scaled by 0.5, is added onto it.
  EXPECT_NEAR(g[0], -1.0 / 36 + 0.5 * 2 * std::log(4.0) * 0.25 / 3, 1e-15);
}

}  // namespace
}  // namespace machmoe
