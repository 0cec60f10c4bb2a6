// The GPU runtime against the float64 CPU reference (docs/TARGETS.md T10: relative Frobenius error <= 1e-2 in bf16 on
// inputs ~N(0,1) and weights ~N(0, 1/sqrt(fan_in))), for every option, edge shapes, determinism, buffer bounds,
// kernel-level exactness of routing and metadata, sentinel pairs, and cases whose offsets pass 2^31 elements.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <tuple>

#include "gpu/hopper/dispatch.hpp"
#include "gpu/hopper/heuristics.hpp"
#include "gpu_support.hpp"
#include "reference/router.hpp"

namespace machmoe::test {
namespace {

// bf16 keeps 8 significant bits, fp16 11: fp16's bound is four times tighter, still several times its rounding
// (inputs, H, A and the outputs each rounded once).
double tolerance(DType dt) { return dt == DType::kFP32 ? 2e-5 : dt == DType::kFP16 ? 4e-3 : 1e-2; }

/// Worst relative error seen per (quantity, tolerance class), printed when the suite ends.
std::map<std::string, double>& worst_errors() {
  static std::map<std::string, double> m;
  return m;
}

class ErrorReport : public testing::Environment {
 public:
  void TearDown() override {
    std::printf("worst relative Frobenius errors against float64 (tolerance in brackets):\n");
    for (const auto& [k, v] : worst_errors()) std::printf("  %-28s %.3e\n", k.c_str(), v);
  }
};
const auto* const kErrorReport = testing::AddGlobalTestEnvironment(new ErrorReport);

void expect_close(const char* what, const std::vector<double>& gpu, const std::vector<double>& ref, double tol) {
  ASSERT_EQ(gpu.size(), ref.size()) << what;
  for (double v : gpu) ASSERT_FALSE(std::isnan(v)) << what << " has NaN: an element was not written";
  const double err = rel_error(gpu, ref);
  EXPECT_LT(err, tol) << what;
  char key[64];
  std::snprintf(key, sizeof key, "%s [%.0e]", what, tol);
  double& w = worst_errors()[key];
  w = std::max(w, err);
}

void compare_all(const GpuRun& g, const ReferenceRun& r, DType dt) {
  const MoEProblem& p = g.problem;
  const double tol = tolerance(dt);
  EXPECT_TRUE(g.canaries_intact) << "a kernel wrote past the end of a caller buffer";
  expect_close("out", g.out, r.f.out, tol);
  for (std::int64_t e = 0; e < p.E; ++e) EXPECT_EQ(g.counts[e], r.f.expert_counts[e]) << "expert_counts[" << e << "]";
  expect_close("dx", g.dx, r.g.dx, tol);
  expect_close("dW1", g.dw1, r.g.dw1, tol);
  expect_close("dW2", g.dw2, r.g.dw2, tol);
  if (p.has_b1) expect_close("db1", g.db1, r.g.db1, tol);
  if (p.has_b2) expect_close("db2", g.db2, r.g.db2, tol);
  if (p.routing == RoutingMode::kCallerSupplied) {
    expect_close("dscores", g.dscores, r.g.dscores, tol);
  } else {
    expect_close("dW_router", g.dwr, r.g.drouter_weight, tol);
  }
}

struct GpuCase {
  DType dt;
  Activation activation;
  WeightLayout layout;
  bool bias;
  RoutingMode routing;
  ScoreVariant score;
  CacheMode cache;
  RoundingRule rounding = RoundingRule::kNearest;
};

std::string gpu_case_name(const testing::TestParamInfo<GpuCase>& i) {
  const GpuCase& c = i.param;
  std::string s = std::string(dtype_name(c.dt)) + "_" + activation_name(c.activation) + "_" +
                  weight_layout_name(c.layout) + (c.bias ? "_bias_" : "_nobias_") + routing_mode_name(c.routing);
  if (c.routing != RoutingMode::kCallerSupplied) s += std::string("_") + score_variant_name(c.score);
  if (c.routing == RoutingMode::kTokenRounding) s += std::string("_") + rounding_rule_name(c.rounding);
  return s + "_" + cache_mode_name(c.cache);
}

class GpuLayer : public testing::TestWithParam<GpuCase> {
 protected:
  void SetUp() override { REQUIRE_GPU(); }
};

TEST_P(GpuLayer, MatchesFloat64Reference) {
  const GpuCase& gc = GetParam();
  MoEProblem p;
  // Not multiples of any tile: T=200 tokens, d=96, n=40, E=8 experts, K=2.
  p.T = 200, p.d = 96, p.n = 40, p.E = 8, p.K = 2;
  p.activation = gc.activation, p.weight_layout = gc.layout, p.has_b1 = p.has_b2 = gc.bias;
  p.routing = gc.routing, p.score = gc.score, p.cache = gc.cache;
  p.rounding = gc.rounding, p.tile_m = 16;  // ~50 tokens per expert: rounding moves every count
  p.dx_chunks = gc.bias ? 3 : 0;  // half the cases with dX~ in chunks of tokens (the heuristic: one pass here)
  LayerCase<double> c(p, 2024);
  // Input-only mode's cases without an upstream gradient of the logits: with top-K and a renormalised score the
  // router's term of dX is then summed from the pairs inside the gather-sum (the other cases: dlogits W_r).
  if (gc.cache == CacheMode::kInputOnly) c.grad_logits.clear();
  const GpuRun g = run_on_gpu(c, gc.dt);
  const LayerCase<double> q = quantized_case(c, gc.dt);
  if (p.routing != RoutingMode::kCallerSupplied) {
    // The logits themselves, against x W_r^T in float64.
    const std::vector<double> z = ref::router_logits(q.x.data(), q.router_weight.data(), p.T, p.d, p.E);
    expect_close("router_logits", g.logits, z, tolerance(gc.dt));
  }
  compare_all(g, reference_for(q, g.logits), gc.dt);
}

std::vector<GpuCase> gpu_cases() {
  std::vector<GpuCase> out;
  const Activation acts[] = {Activation::kSwiGLU, Activation::kGeGLU, Activation::kReGLU, Activation::kReLUSquared,
                             Activation::kReLU,   Activation::kGELU,  Activation::kSiLU,  Activation::kGptOssSwiGLU};
  for (DType dt : {DType::kBF16, DType::kFP32})
    for (Activation a : acts)
      for (WeightLayout l : {WeightLayout::kInterleaved, WeightLayout::kConcatenated}) {
        if (!is_glu(a) && l == WeightLayout::kConcatenated) continue;
        for (bool bias : {false, true})
          for (CacheMode cm : {CacheMode::kPreActivation, CacheMode::kInputOnly}) {
            for (ScoreVariant s : {ScoreVariant::kSoftmaxOverTopK, ScoreVariant::kTopKOfSoftmax,
                                   ScoreVariant::kTopKOfSoftmaxRenorm})
              out.push_back({dt, a, l, bias, RoutingMode::kTopK, s, cm});
            out.push_back({dt, a, l, bias, RoutingMode::kCallerSupplied, ScoreVariant::kSoftmaxOverTopK, cm});
          }
      }
  for (Activation a : {Activation::kSwiGLU, Activation::kGELU})
    out.push_back({DType::kFP16, a, WeightLayout::kInterleaved, true, RoutingMode::kTopK,
                   ScoreVariant::kSoftmaxOverTopK, CacheMode::kPreActivation});
  // Token rounding: every rule and score variant, both cache modes.
  for (DType dt : {DType::kBF16, DType::kFP32})
    for (RoundingRule r : {RoundingRule::kNearest, RoundingRule::kUp, RoundingRule::kDown})
      for (ScoreVariant s : {ScoreVariant::kSoftmaxOverTopK, ScoreVariant::kTopKOfSoftmax,
                             ScoreVariant::kTopKOfSoftmaxRenorm}) {
        out.push_back({dt, Activation::kSwiGLU, WeightLayout::kConcatenated, true, RoutingMode::kTokenRounding, s,
                       CacheMode::kPreActivation, r});
        out.push_back({dt, Activation::kReLU, WeightLayout::kInterleaved, false, RoutingMode::kTokenRounding, s,
                       CacheMode::kInputOnly, r});
      }
  return out;
}

// The same options at a shape the Hopper kernels take in bf16 (d a multiple of 64 and of 128 for dX~, n a multiple
// of 128 for the dH kernel; T and the segments are not tile multiples), so the whole layer runs on them: in bf16 the
// fallback policy is "error", so that a GEMM sent to the reference path fails the test. (fp16 and fp32 run on the
// reference GEMMs by design.)
TEST_P(GpuLayer, HopperShapesMatchFloat64Reference) {
  const GpuCase& gc = GetParam();
  const ScopedFallbackPolicy policy(gc.dt == DType::kBF16 ? FallbackPolicy::kError : fallback_policy());
  MoEProblem p;
  p.T = 333, p.d = 256, p.n = 128, p.E = 8, p.K = 2;
  p.activation = gc.activation, p.weight_layout = gc.layout, p.has_b1 = p.has_b2 = gc.bias;
  p.routing = gc.routing, p.score = gc.score, p.cache = gc.cache;
  p.rounding = gc.rounding, p.tile_m = 16;
  const LayerCase<double> c(p, 4048);
  const GpuRun g = run_on_gpu(c, gc.dt);
  compare_all(g, reference_for(quantized_case(c, gc.dt), g.logits), gc.dt);
}

INSTANTIATE_TEST_SUITE_P(AllOptions, GpuLayer, testing::ValuesIn(gpu_cases()), gpu_case_name);

// gptoss_swiglu with its clamps active: limit 1.0 on pre-activations of size ~1 (x ~ N(0, 1), W1 ~ N(0, 1/d), b1 ~
// N(0, 0.25)), so about a fifth of the gate values and two fifths of the up values are clamped (and a bf16 H value
// can sit exactly on the limit). alpha 1.3 rather than gpt-oss's 1.702, so that a kernel ignoring the parameter
// fails. Both shapes: the GPU reference GEMMs' (not tile multiples) and the Hopper kernels' (whole layer on them in
// bf16); every layout, bias on/off, both cache modes, top-K and caller routing, bf16 and fp32.
//
// The reference's backward reads H rounded to the data dtype, as the GPU's backward reads the H its up-projection
// stored (or recomputed) in that dtype. torch.clamp's gradient is discontinuous at the limits, so a pre-activation
// that rounding moves onto or across a limit gets the other side's gradient: against a reference on the exact H, dH
// (and dX, dW1, db1) differ by 4-6% relative Frobenius in bf16 at this clamping rate (measured in float64, H rounded
// or not). That is what caching H in bf16 does to this activation, not a kernel error; the forward, continuous, is
// compared against the plain reference too.
ReferenceRun reference_with_cached_h(const LayerCase<double>& q, const std::vector<double>& gpu_logits, DType dt) {
  ReferenceRun r;
  MoEProblem p = q.problem;
  p.cache = CacheMode::kPreActivation;  // the GPU's input-only mode recomputes the same rounded H
  ref::LayerInputs<double> in = q.inputs();
  if (p.routing != RoutingMode::kCallerSupplied) in.router_logits = gpu_logits.data();
  r.f = ref::layer_forward(p, in);
  ref::ForwardSaved<double> saved = r.f.saved;
  saved.h = quantize(saved.h, dt);
  r.g = ref::layer_backward(p, in, saved, q.grad_out.data(), q.grad_logits.empty() ? nullptr : q.grad_logits.data());
  return r;
}

class GpuLayerGptOss : public testing::TestWithParam<GpuCase> {
 protected:
  void SetUp() override { REQUIRE_GPU(); }
};

TEST_P(GpuLayerGptOss, ClampedMatchesFloat64Reference) {
  const GpuCase& gc = GetParam();
  for (bool hopper_shape : {false, true}) {
    SCOPED_TRACE(hopper_shape ? "Hopper shape" : "reference-GEMM shape");
    MoEProblem p;
    // At the Hopper shape in bf16 a GEMM that fell back would fail the test ("error" policy).
    const ScopedFallbackPolicy policy(hopper_shape && gc.dt == DType::kBF16 ? FallbackPolicy::kError
                                                                            : fallback_policy());
    if (hopper_shape)
      p.T = 333, p.d = 256, p.n = 128, p.E = 8, p.K = 2;
    else
      p.T = 200, p.d = 96, p.n = 40, p.E = 8, p.K = 2;
    p.activation = Activation::kGptOssSwiGLU, p.swiglu_alpha = 1.3, p.swiglu_limit = 1.0;
    p.weight_layout = gc.layout, p.has_b1 = p.has_b2 = gc.bias;
    p.routing = gc.routing, p.score = gc.score, p.cache = gc.cache;
    const LayerCase<double> c(p, 4242);
    const GpuRun g = run_on_gpu(c, gc.dt);
    const LayerCase<double> q = quantized_case(c, gc.dt);
    compare_all(g, reference_with_cached_h(q, g.logits, gc.dt), gc.dt);
    expect_close("out (exact-H reference)", g.out, reference_for(q, g.logits).f.out, tolerance(gc.dt));
  }
}

std::vector<GpuCase> gptoss_cases() {
  std::vector<GpuCase> out;
  for (DType dt : {DType::kBF16, DType::kFP32})
    for (WeightLayout l : {WeightLayout::kInterleaved, WeightLayout::kConcatenated})
      for (bool bias : {false, true})
        for (CacheMode cm : {CacheMode::kPreActivation, CacheMode::kInputOnly})
          for (RoutingMode r : {RoutingMode::kTopK, RoutingMode::kCallerSupplied})
            out.push_back({dt, Activation::kGptOssSwiGLU, l, bias, r, ScoreVariant::kSoftmaxOverTopK, cm});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Clamped, GpuLayerGptOss, testing::ValuesIn(gptoss_cases()), gpu_case_name);

// The layer on the Hopper kernels against the same layer on the GPU reference GEMMs, at a 7B-like shape (scaled
// down in T) too large for the float64 CPU reference; and the input-only cache mode (H recomputed in the
// backward by the same kernel) bitwise equal to the default mode.
TEST(GpuLayerProperties, HopperKernelsAgreeWithTheReferenceGemmPath) {
  REQUIRE_GPU();
  MoEProblem p;
  p.T = 4096, p.d = 1536, p.n = 256, p.E = 32, p.K = 4, p.has_b1 = p.has_b2 = true;
  p.weight_layout = WeightLayout::kConcatenated;
  const LayerCase<double> c(p, 17);
  GpuRun fast;
  {
    // The fast run must really be on the Hopper kernels: a GEMM that fell back would make this test compare the
    // reference path with itself, so the fallback policy is "error" for it.
    const ScopedFallbackPolicy policy(FallbackPolicy::kError);
    fast = run_on_gpu(c, DType::kBF16);
  }
  gpu::set_hopper_kernels_enabled(false);
  const GpuRun ref = run_on_gpu(c, DType::kBF16);
  gpu::set_hopper_kernels_enabled(true);
  EXPECT_TRUE(fast.canaries_intact);
  EXPECT_LT(rel_error(fast.out, ref.out), 5e-3);
  EXPECT_LT(rel_error(fast.dx, ref.dx), 1e-2);
  EXPECT_LT(rel_error(fast.dw1, ref.dw1), 1e-2);
  EXPECT_LT(rel_error(fast.dw2, ref.dw2), 1e-2);
  EXPECT_LT(rel_error(fast.dwr, ref.dwr), 1e-2);
  LayerCase<double> ci = c;
  ci.problem.cache = CacheMode::kInputOnly;
  const GpuRun input_only = run_on_gpu(ci, DType::kBF16);
  EXPECT_EQ(input_only.raw_out, fast.raw_out);
  EXPECT_EQ(input_only.raw_dx, fast.raw_dx);
  EXPECT_EQ(input_only.raw_dw1, fast.raw_dw1);
  EXPECT_EQ(input_only.raw_dw2, fast.raw_dw2);
}

// The device check of every CUDA argument (ArgChecker::device) takes a Hopper and only that: the GPU machine's device
// reports compute capability 9.0, the one the build's sm_90a kernels run on, and a layer call on it passes the check.
// Its memory bandwidth (a tile choice depends on it) is a Hopper's: 2 TB/s (H100 PCIe) to 4.9 TB/s (H200), and the
// description names it.
TEST(GpuDevice, ComputeCapabilityIsTheOneTheBuildTargets) {
  REQUIRE_GPU();
  for (int ordinal = 0; ordinal < cuda_device_count(); ++ordinal) {
    EXPECT_EQ(cuda_compute_capability(ordinal), kCudaComputeCapability) << cuda_device_description(ordinal);
    const long long gbps = cuda_memory_bandwidth_gbps(ordinal);
    EXPECT_GE(gbps, 1900) << cuda_device_description(ordinal);
    EXPECT_LE(gbps, 6000) << cuda_device_description(ordinal);
    EXPECT_NE(cuda_device_description(ordinal).find(std::to_string(gbps) + " GB/s"), std::string::npos)
        << cuda_device_description(ordinal);
  }
  EXPECT_EQ(cuda_compute_capability(cuda_device_count()), 0);
}

// Stage timing (machmoe/profiling.hpp, the benchmark's stage table): a forward and a backward with it on report
// their stages in launch order, each time finite and not negative, the forward's routing and GEMM stages among them,
// the results unchanged; a second collect returns nothing (the marks were consumed), and with timing off nothing is
// recorded.
TEST(GpuStageTiming, ForwardAndBackwardReportTheirStages) {
  REQUIRE_GPU();
  MoEProblem p;
  p.T = 333, p.d = 256, p.n = 128, p.E = 8, p.K = 2;
  const LayerCase<double> c(p, 71);
  const GpuRun plain = run_on_gpu(c, DType::kBF16);
  struct TimingGuard {
    ~TimingGuard() { enable_stage_timing(false), collect_stage_timings(); }
  } guard;
  enable_stage_timing(true);
  const GpuRun timed = run_on_gpu(c, DType::kBF16);
  const std::vector<StageTime> stages = collect_stage_timings();
  ASSERT_FALSE(stages.empty());
  bool forward_seen = false, backward_seen = false, up_seen = false;
  for (const StageTime& st : stages) {
    SCOPED_TRACE(st.stage);
    EXPECT_TRUE(std::isfinite(st.ms) && st.ms >= 0.0f);
    const bool is_forward = st.stage.rfind("forward/", 0) == 0, is_backward = st.stage.rfind("backward/", 0) == 0;
    EXPECT_TRUE(is_forward || is_backward);
    EXPECT_FALSE(is_forward && backward_seen) << "a forward stage after a backward one: not in launch order";
    forward_seen |= is_forward, backward_seen |= is_backward;
    up_seen |= st.stage == "forward/up_projection";
  }
  EXPECT_TRUE(forward_seen && backward_seen && up_seen);
  EXPECT_TRUE(collect_stage_timings().empty());
  EXPECT_EQ(timed.out, plain.out);  // timing marks change nothing the layer computes
  EXPECT_EQ(timed.dx, plain.dx);
  enable_stage_timing(false);
  (void)run_on_gpu(c, DType::kBF16);
  EXPECT_TRUE(collect_stage_timings().empty());
}

// d and n any multiple of 8 (issue #14, T13: edge tiles along N, partial last k-blocks, edge tiles of the weight
// gradients): the whole layer, forward and backward, on the Hopper kernels against float64. The fallback policy is
// "error" meanwhile, so a GEMM that fell back to the reference kernel would throw instead of passing quietly.
TEST(GpuLayerOddShapes, EveryGemmOnTheHopperKernelsMatchesFloat64) {
  REQUIRE_GPU();
  const ScopedFallbackPolicy policy(FallbackPolicy::kError);
  gpu::set_hopper_kernels_enabled(true);
  gpu::set_hopper_backward_enabled(true);
  struct Shape {
    std::int64_t T, d, n, E, K;
    const char* name;
  };
  const Shape shapes[] = {{333, 200, 72, 8, 2, "d200_n72"},
                          {257, 136, 264, 6, 3, "d136_n264"},
                          {64, 8, 8, 4, 2, "d8_n8"},
                          {5, 200, 72, 16, 1, "zero_token_experts"}};
  for (const Shape& sh : shapes)
    for (Activation act : {Activation::kSwiGLU, Activation::kGeGLU, Activation::kReGLU, Activation::kReLUSquared,
                           Activation::kReLU, Activation::kGELU, Activation::kSiLU})
      for (WeightLayout layout : {WeightLayout::kInterleaved, WeightLayout::kConcatenated}) {
        if (!is_glu(act) && layout == WeightLayout::kConcatenated) continue;
        for (bool bias : {false, true}) {
          SCOPED_TRACE(std::string(sh.name) + " " + activation_name(act) + " " + weight_layout_name(layout) +
                       (bias ? " bias" : ""));
          MoEProblem p;
          p.T = sh.T, p.d = sh.d, p.n = sh.n, p.E = sh.E, p.K = sh.K;
          p.activation = act, p.weight_layout = layout, p.has_b1 = p.has_b2 = bias;
          p.cache = bias ? CacheMode::kPreActivation : CacheMode::kInputOnly;  // both modes over the loop
          const LayerCase<double> c(p, 4049);
          GpuRun g;
          ASSERT_NO_THROW(g = run_on_gpu(c, DType::kBF16)) << "a GEMM fell back to the reference kernel";
          EXPECT_TRUE(g.canaries_intact);
          compare_all(g, reference_for(quantized_case(c, DType::kBF16), g.logits), DType::kBF16);
        }
      }
}

// Under the fallback policy "error", a GEMM the Hopper kernels refuse raises before the call launches anything, so
// that nothing the call writes has been written (docs/VALIDATION.md): a forward whose W2 view has rows of n + 1
// elements (130 bytes, not 16-byte aligned: refused by the down-projection, which runs after the router GEMM, top-K,
// the metadata and the up-projection), and a full backward and a split backward_weight whose W1 gradient view has
// rows of d + 1 elements (refused by dW1, their last GEMM). Every output keeps its poison (0xFF bytes) and the saved
// buffer its contents; the same calls with aligned views then run.
TEST(GpuFallbackPolicy, ARefusedGemmRaisesBeforeTheCallWritesAnything) {
  REQUIRE_GPU();
  gpu::set_hopper_kernels_enabled(true);
  gpu::set_hopper_backward_enabled(true);
  const ScopedFallbackPolicy policy(FallbackPolicy::kError);
  MoEProblem p;
  p.T = 96, p.d = 64, p.n = 64, p.E = 4, p.K = 2;
  const LayerCase<double> c(p, 4051);
  const DType dt = DType::kBF16;
  const Device dev = Device::cuda(0);
  const std::size_t el = dtype_size(dt);
  const std::int64_t rows = p.w1_rows();
  std::vector<double> w2_padded(static_cast<std::size_t>(p.E * p.d * (p.n + 1)), 0.0);
  for (std::int64_t r = 0; r < p.E * p.d; ++r)
    for (std::int64_t k = 0; k < p.n; ++k) w2_padded[r * (p.n + 1) + k] = c.w2[r * p.n + k];
  DeviceBuffer x(encode(c.x, dt)), wr(encode(c.router_weight, dt)), w1(encode(c.w1, dt)), w2(encode(c.w2, dt));
  DeviceBuffer w2p(encode(w2_padded, dt)), gout(encode(c.grad_out, dt));
  LayerWeights w;
  w.router_weight = TensorView::contiguous(wr.get(), dt, {p.E, p.d}, dev);
  w.w1 = TensorView::contiguous(w1.get(), dt, {p.E, rows, p.d}, dev);
  w.w2 = TensorView::contiguous(w2.get(), dt, {p.E, p.d, p.n}, dev);
  LayerWeights misaligned = w;
  misaligned.w2 = TensorView::strided(w2p.get(), dt, {p.E, p.d, p.n}, {p.d * (p.n + 1), p.n + 1, 1}, dev);
  const TensorView xv = TensorView::contiguous(x.get(), dt, {p.T, p.d}, dev);
  DeviceBuffer out(p.T * p.d * el), logits(p.T * p.E * el), counts(p.E * 4);
  DeviceBuffer saved(saved_layout(p, dt).total_bytes), fws(forward_workspace_bytes(p, dt, dev));
  ForwardOutputs fo;
  fo.out = TensorView::contiguous(out.get(), dt, {p.T, p.d}, dev);
  fo.router_logits = TensorView::contiguous(logits.get(), dt, {p.T, p.E}, dev);
  fo.expert_counts = TensorView::contiguous(counts.get(), DType::kInt32, {p.E}, dev);
  struct Stream {
    cudaStream_t s = nullptr;
    Stream() { cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); }
    ~Stream() { cudaStreamDestroy(s); }
  } stream;
  const auto poisoned = [](const DeviceBuffer& b) {
    const std::vector<unsigned char> h = b.download();
    return std::all_of(h.begin(), h.end(), [](unsigned char v) { return v == 0xFF; });
  };
  // Runs `call`, which must raise machmoe::Error naming `stage` and `reason`.
  const auto expect_refused = [&](const std::function<void()>& call, const char* stage, const char* reason) {
    try {
      call();
      ADD_FAILURE() << stage << ": no error raised";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(stage), std::string::npos) << what;
      EXPECT_NE(what.find(reason), std::string::npos) << what;
    }
    GPU_CHECK(cudaStreamSynchronize(stream.s));
  };

  expect_refused([&] { forward(p, xv, misaligned, nullptr, fo, {saved.get(), saved.bytes(), fws.get(), fws.bytes()},
                               stream.s); },
                 "forward/down_projection", "weight rows not 16-byte aligned");
  for (const DeviceBuffer* b : {&out, &logits, &counts, &saved}) EXPECT_TRUE(poisoned(*b));
  forward(p, xv, w, nullptr, fo, {saved.get(), saved.bytes(), fws.get(), fws.bytes()}, stream.s);
  GPU_CHECK(cudaStreamSynchronize(stream.s));
  EXPECT_FALSE(poisoned(out));
  const std::vector<unsigned char> saved_after_forward = saved.download();

  DeviceBuffer dx(p.T * p.d * el), dwr(p.E * p.d * el), dw2(p.E * p.d * p.n * el), dw1(p.E * rows * p.d * el);
  DeviceBuffer dw1p(p.E * rows * (p.d + 1) * el);
  DeviceBuffer bws(backward_workspace_bytes(p, dt, dev, false)), ibws(backward_input_workspace_bytes(p, dt, dev));
  DeviceBuffer deferred(deferred_layout(p, dt).total_bytes);
  BackwardInputs bi;
  bi.grad_out = TensorView::contiguous(gout.get(), dt, {p.T, p.d}, dev);
  BackwardOutputs bo;
  bo.grad_x = TensorView::contiguous(dx.get(), dt, {p.T, p.d}, dev);
  bo.grad_weights.router_weight = TensorView::contiguous(dwr.get(), dt, {p.E, p.d}, dev);
  bo.grad_weights.w2 = TensorView::contiguous(dw2.get(), dt, {p.E, p.d, p.n}, dev);
  bo.grad_weights.w1 = TensorView::strided(dw1p.get(), dt, {p.E, rows, p.d}, {rows * (p.d + 1), p.d + 1, 1}, dev);
  expect_refused([&] { backward(p, xv, w, nullptr, bi, bo, {saved.get(), saved.bytes(), bws.get(), bws.bytes()},
                                stream.s); },
                 "backward/dw1", "output rows not 16-byte aligned");
  for (const DeviceBuffer* b : {&dx, &dwr, &dw2, &dw1p}) EXPECT_TRUE(poisoned(*b));
  EXPECT_EQ(saved.download(), saved_after_forward);

  // The split backward: its input half, then the weight half refused before dW2 (its first GEMM) is written.
  BackwardOutputs input_half = bo, weight_half;
  input_half.grad_weights.w1 = input_half.grad_weights.w2 = TensorView();
  weight_half.grad_weights.w1 = bo.grad_weights.w1, weight_half.grad_weights.w2 = bo.grad_weights.w2;
  backward_input(p, xv, w, nullptr, bi, input_half, {saved.get(), saved.bytes(), ibws.get(), ibws.bytes()},
                 {deferred.get(), deferred.bytes()}, stream.s);
  GPU_CHECK(cudaStreamSynchronize(stream.s));
  EXPECT_FALSE(poisoned(dx));
  expect_refused([&] { backward_weight(p, xv, w, nullptr, bi.grad_out, weight_half, saved.get(), saved.bytes(),
                                       {deferred.get(), deferred.bytes()}, stream.s); },
                 "backward/dw1", "output rows not 16-byte aligned");
  for (const DeviceBuffer* b : {&dw2, &dw1p}) EXPECT_TRUE(poisoned(*b));

  // With W1's gradient aligned, the same backward runs, every GEMM on the Hopper kernels.
  bo.grad_weights.w1 = TensorView::contiguous(dw1.get(), dt, {p.E, rows, p.d}, dev);
  backward(p, xv, w, nullptr, bi, bo, {saved.get(), saved.bytes(), bws.get(), bws.bytes()}, stream.s);
  GPU_CHECK(cudaStreamSynchronize(stream.s));
  for (const DeviceBuffer* b : {&dw2, &dw1}) EXPECT_FALSE(poisoned(*b));
}

// The dH kernel's wide tile (the cooperative 128 x 256 one with H staged by TMA, which the heuristic takes only where
// d >= 4096 and the experts average 1024 rows or more) inside the whole layer: the backward writes dH over the saved H (and in input-only mode over
// the recomputed H), so this is where its in-place path runs. Every family forced to its wide tile, small shapes with
// a partial M-tile per expert and an n that is one wide tile, GLU and not, both layouts, bias on and off, both cache
// modes, against the float64 reference.
TEST(GpuLayerProperties, WideDhTileInTheLayerMatchesFloat64) {
  REQUIRE_GPU();
  struct TileGuard {
    ~TileGuard() { gpu::set_hopper_tile_n(0); }
  } tile_guard;
  const ScopedFallbackPolicy policy(FallbackPolicy::kError);
  gpu::set_hopper_tile_n(256);
  for (Activation act : {Activation::kSwiGLU, Activation::kReLU, Activation::kGptOssSwiGLU})
    for (WeightLayout layout : {WeightLayout::kInterleaved, WeightLayout::kConcatenated}) {
      if (!is_glu(act) && layout == WeightLayout::kConcatenated) continue;
      for (CacheMode cache : {CacheMode::kPreActivation, CacheMode::kInputOnly})
        for (bool bias : {false, true}) {
          SCOPED_TRACE(std::string(activation_name(act)) + " " + weight_layout_name(layout) + " " +
                       cache_mode_name(cache) + (bias ? " bias" : ""));
          MoEProblem p;
          p.T = 333, p.d = 256, p.n = 256, p.E = 6, p.K = 2;
          p.activation = act, p.weight_layout = layout, p.has_b1 = p.has_b2 = bias, p.cache = cache;
          const LayerCase<double> c(p, 4050);
          GpuRun g;
          ASSERT_NO_THROW(g = run_on_gpu(c, DType::kBF16)) << "a GEMM fell back to the reference kernel";
          const LayerCase<double> q = quantized_case(c, DType::kBF16);
          // gptoss_swiglu's clamps: the reference reads H rounded as the GPU's backward does (see above).
          compare_all(g, act == Activation::kGptOssSwiGLU ? reference_with_cached_h(q, g.logits, DType::kBF16)
                                                          : reference_for(q, g.logits),
                      DType::kBF16);
        }
    }
}

// Many experts: E = 512 and 1024 (the token-rounding sweep's E = 512, and past it), K = 8, against the float64
// reference, top-K and token rounding, forward and every gradient. Most experts get a handful of rows, many none.
TEST(GpuLayerProperties, ManyExpertsMatchFloat64) {
  REQUIRE_GPU();
  for (std::int64_t E : {512, 1024})
    for (RoutingMode routing : {RoutingMode::kTopK, RoutingMode::kTokenRounding}) {
      SCOPED_TRACE("E = " + std::to_string(E) + " " + routing_mode_name(routing));
      MoEProblem p;
      p.T = 700, p.d = 128, p.n = 64, p.E = E, p.K = 8, p.routing = routing, p.tile_m = 16;
      p.has_b1 = p.has_b2 = true;
      const LayerCase<double> c(p, 512 + E);
      const GpuRun g = run_on_gpu(c, DType::kBF16);
      compare_all(g, reference_for(quantized_case(c, DType::kBF16), g.logits), DType::kBF16);
    }
}

// The router's backward with more selections per token than a warp has lanes (33: a lane takes two) and than the
// 64 its earlier version handled in one chunk (80), for every score variant, with and without an upstream gradient
// of the logits (without it, the renormalised scores' term of dX is summed from the pairs).
TEST(GpuLayerProperties, ManySelectionsPerTokenMatchFloat64) {
  REQUIRE_GPU();
  for (std::int64_t K : {33, 80})
    for (ScoreVariant s :
         {ScoreVariant::kSoftmaxOverTopK, ScoreVariant::kTopKOfSoftmax, ScoreVariant::kTopKOfSoftmaxRenorm})
      for (bool upstream : {true, false})
        for (DType dt : {DType::kBF16, DType::kFP32}) {
          SCOPED_TRACE("K = " + std::to_string(K) + " " + score_variant_name(s) +
                       (upstream ? " with" : " without") + " grad_logits " + dtype_name(dt));
          MoEProblem p;
          p.T = 90, p.d = 64, p.n = 32, p.E = 100, p.K = K, p.score = s, p.tile_m = 16;
          LayerCase<double> c(p, 700 + K);
          if (!upstream) c.grad_logits.clear();
          const GpuRun g = run_on_gpu(c, dt);
          compare_all(g, reference_for(quantized_case(c, dt), g.logits), dt);
        }
}

// ---- edge shapes -----------------------------------------------------------------------------------------------

struct EdgeShape {
  std::int64_t T, d, n, E, K, row_pad;
  const char* name;
};

class GpuEdgeShapes : public testing::TestWithParam<std::tuple<EdgeShape, RoutingMode, DType>> {
 protected:
  void SetUp() override { REQUIRE_GPU(); }
};

TEST_P(GpuEdgeShapes, MatchFloat64Reference) {
  const EdgeShape s = std::get<0>(GetParam());
  MoEProblem p;
  p.T = s.T, p.d = s.d, p.n = s.n, p.E = s.E, p.K = s.K;
  p.has_b1 = p.has_b2 = true;
  p.routing = std::get<1>(GetParam());
  p.score = ScoreVariant::kTopKOfSoftmax;
  p.tile_m = 8;
  const DType dt = std::get<2>(GetParam());
  const LayerCase<double> c(p, 77);
  const GpuRun g = run_on_gpu(c, dt, s.row_pad);
  compare_all(g, reference_for(quantized_case(c, dt), g.logits), dt);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GpuEdgeShapes,
    testing::Combine(testing::Values(EdgeShape{1, 64, 32, 4, 2, 0, "T1"}, EdgeShape{37, 64, 32, 6, 6, 0, "KeqE"},
                                     EdgeShape{50, 64, 32, 1, 1, 0, "E1"},
                                     EdgeShape{5, 64, 32, 16, 1, 0, "empty_experts"},
                                     EdgeShape{131, 33, 17, 5, 3, 0, "odd_dims_scalar_path"},
                                     EdgeShape{300, 128, 64, 7, 3, 24, "padded_rows"},
                                     EdgeShape{70, 96, 48, 40, 1, 0, "K1_many_experts"}),
                     testing::Values(RoutingMode::kTopK, RoutingMode::kCallerSupplied, RoutingMode::kTokenRounding),
                     testing::Values(DType::kBF16, DType::kFP16, DType::kFP32)),
    [](const testing::TestParamInfo<std::tuple<EdgeShape, RoutingMode, DType>>& i) {
      return std::string(std::get<0>(i.param).name) + "_" + routing_mode_name(std::get<1>(i.param)) + "_" +
             dtype_name(std::get<2>(i.param));
    });

// ---- determinism, buffer bounds ----------------------------------------------------------------------------------

TEST(GpuLayerProperties, TwoRunsAreBitwiseIdentical) {
  REQUIRE_GPU();
  MoEProblem p;
  p.T = 1000, p.d = 256, p.n = 128, p.E = 16, p.K = 4, p.has_b1 = p.has_b2 = true;
  LayerCase<double> c(p, 5);
  for (bool upstream_logit_grad : {true, false}) {  // dX's router term from dlogits W_r, or summed from the pairs
    if (!upstream_logit_grad) c.grad_logits.clear();
    const GpuRun a = run_on_gpu(c, DType::kBF16), b = run_on_gpu(c, DType::kBF16);
    EXPECT_EQ(a.raw_out, b.raw_out);
    EXPECT_EQ(a.raw_dx, b.raw_dx) << upstream_logit_grad;
    EXPECT_EQ(a.raw_dw1, b.raw_dw1);
    EXPECT_EQ(a.raw_dw2, b.raw_dw2);
    EXPECT_EQ(a.dwr, b.dwr) << upstream_logit_grad;
    EXPECT_EQ(a.saved, b.saved);
  }
}

// The raw buffers need only start at a multiple of kBufferAlignment (16 bytes): the library places its regions at
// 256-byte offsets from there and hands cuBLAS the first 256-byte aligned address of its region. The same call with
// every buffer (saved, both workspaces, deferred) 16, 48, 144 or 240 bytes into a 256-byte aligned allocation
// computes the same bytes and writes nothing in front of or behind any buffer: top-K (the router GEMM through
// cuBLAS), token rounding, caller routing; the full and the split backward.
TEST(GpuLayerProperties, BuffersAtAnySixteenByteBoundaryGiveTheSameResults) {
  REQUIRE_GPU();
  for (RoutingMode r : {RoutingMode::kTopK, RoutingMode::kTokenRounding, RoutingMode::kCallerSupplied})
    for (bool split : {false, true}) {
      MoEProblem p;
      p.T = 1500, p.d = 192, p.n = 96, p.E = 12, p.K = 3, p.routing = r, p.tile_m = 64;
      p.has_b1 = p.has_b2 = true;
      const LayerCase<double> c(p, 16);
      GpuRunOptions o;
      o.split = split;
      const GpuRun aligned = run_on_gpu(c, DType::kBF16, o);
      EXPECT_TRUE(aligned.canaries_intact);
      for (std::size_t lead : {16, 48, 144, 240}) {
        o.buffer_lead = lead;
        const GpuRun shifted = run_on_gpu(c, DType::kBF16, o);
        const std::string what = std::string(routing_mode_name(r)) + (split ? " split" : "") + ", buffers " +
                                 std::to_string(lead) + " bytes past 256-byte alignment";
        EXPECT_TRUE(shifted.canaries_intact) << what;
        EXPECT_EQ(shifted.raw_out, aligned.raw_out) << what;
        EXPECT_EQ(shifted.saved, aligned.saved) << what;
        expect_same_backward(shifted, aligned, what);
      }
    }
}

// With one expert the weights' expert dimension never moves, and a view may carry any stride there (PyTorch leaves a
// size-1 dimension's stride arbitrary: an expand gives 0, a slice of a larger tensor an odd value). Weights, biases
// and weight gradients with expert strides 0 and 7 give the bytes of contiguous ones, on the Hopper kernels (the
// fallback policy is "error": a GEMM that fell back would throw), with both W1 layouts, top-K (K = 1) and caller
// routing; the contiguous run matches float64.
TEST(GpuLayerProperties, OneExpertWithAnyExpertStrideGivesTheSameResults) {
  REQUIRE_GPU();
  const ScopedFallbackPolicy strict(FallbackPolicy::kError);
  for (RoutingMode r : {RoutingMode::kTopK, RoutingMode::kCallerSupplied})
    for (WeightLayout layout : {WeightLayout::kInterleaved, WeightLayout::kConcatenated}) {
      MoEProblem p;
      p.T = 700, p.d = 256, p.n = 128, p.E = 1, p.K = 1, p.routing = r, p.weight_layout = layout;
      p.has_b1 = p.has_b2 = true;
      const LayerCase<double> c(p, 17);
      GpuRunOptions o;
      const GpuRun contiguous = run_on_gpu(c, DType::kBF16, o);
      compare_all(contiguous, reference_for(quantized_case(c, DType::kBF16), contiguous.logits), DType::kBF16);
      for (std::int64_t stride : {0, 7}) {
        o.one_expert_stride = stride;
        GpuRun strided;
        const std::string what = std::string(routing_mode_name(r)) + " " + weight_layout_name(layout) +
                                 ", expert stride " + std::to_string(stride);
        ASSERT_NO_THROW(strided = run_on_gpu(c, DType::kBF16, o)) << what;
        EXPECT_TRUE(strided.canaries_intact) << what;
        EXPECT_EQ(strided.raw_out, contiguous.raw_out) << what;
        expect_same_backward(strided, contiguous, what);
      }
    }
}

// W1 and its gradient as 4D (E, 2, n, d) views whose gate and up halves lie apart (torchtitan's w1 and w3, two
// allocations; layer.hpp, LayerWeights::w1) give the bytes of the joined (E, 2n, d) weights: a gap of 40 elements
// (16-byte aligned) on the Hopper kernels (fallback policy "error": the up-projection's and dX~'s 4D weight maps,
// dW1's 4D store map, and its register stores with fp32 gradients accumulated); a gap of 3 elements (the up half
// not 16-byte aligned, which the Hopper kernels refuse) on the reference GEMMs, against the joined weights there
// too (the two paths round differently); edge tiles (n = 40) and the wide, clustered tiles
// (n = 128); top-K and caller routing (W1's addressing does not depend on the routing), both cache modes (the
// input-only mode's backward runs the up-projection again). The gap's poison is never written.
TEST(GpuLayerProperties, W1HalvesApartGiveTheJoinedResultsBitwise) {
  REQUIRE_GPU();
  struct Shape {
    std::int64_t T, d, n, E, K;
  };
  for (const Shape& sh : {Shape{200, 96, 40, 8, 2}, Shape{1024, 256, 128, 4, 2}})
    for (RoutingMode r : {RoutingMode::kTopK, RoutingMode::kCallerSupplied})
      for (CacheMode cm : {CacheMode::kPreActivation, CacheMode::kInputOnly}) {
        MoEProblem p;
        p.T = sh.T, p.d = sh.d, p.n = sh.n, p.E = sh.E, p.K = sh.K, p.routing = r, p.cache = cm, p.tile_m = 16;
        p.weight_layout = WeightLayout::kConcatenated, p.has_b1 = p.has_b2 = sh.n == 40;
        const LayerCase<double> c(p, 23);
        const std::string shape = "n = " + std::to_string(sh.n) + " " + routing_mode_name(r) + " " + cache_mode_name(cm);
        GpuRunOptions o;
        GpuRun joined;
        {
          const ScopedFallbackPolicy strict(FallbackPolicy::kError);
          joined = run_on_gpu(c, DType::kBF16, o);
        }
        if (cm == CacheMode::kPreActivation)
          compare_all(joined, reference_for(quantized_case(c, DType::kBF16), joined.logits), DType::kBF16);
        for (std::int64_t gap : {40, 3}) {
          const std::string what = shape + ", gap " + std::to_string(gap);
          GpuRun apart, baseline = joined;
          if (gap % 8 == 0) {
            const ScopedFallbackPolicy strict(FallbackPolicy::kError);
            o.w1_gap = gap;
            ASSERT_NO_THROW(apart = run_on_gpu(c, DType::kBF16, o)) << what;
          } else {
            gpu::set_hopper_kernels_enabled(false);
            o.w1_gap = -1;
            baseline = run_on_gpu(c, DType::kBF16, o);
            o.w1_gap = gap;
            apart = run_on_gpu(c, DType::kBF16, o);
            gpu::set_hopper_kernels_enabled(true);
          }
          EXPECT_TRUE(apart.canaries_intact) << what;
          EXPECT_TRUE(apart.w1_gap_intact) << what;
          EXPECT_EQ(apart.raw_out, baseline.raw_out) << what;
          expect_same_backward(apart, baseline, what);
        }
        // fp32 gradients accumulated into (the register stores of dW1's epilogue) over halves apart.
        WeightGradMode acc;
        acc.accumulate = true, acc.dtype = DType::kFP32;
        std::mt19937_64 rng(5);
        acc.w1 = normal<double>(rng, c.w1.size(), 1.0), acc.w2 = normal<double>(rng, c.w2.size(), 1.0);
        acc.b1 = normal<double>(rng, c.b1.size(), 1.0), acc.b2 = normal<double>(rng, c.b2.size(), 1.0);
        if (r != RoutingMode::kCallerSupplied) acc.wr = normal<double>(rng, static_cast<std::size_t>(p.E * p.d), 1.0);
        o.grads = &acc, o.w1_gap = -1;
        GpuRun acc_joined, acc_apart;
        {
          const ScopedFallbackPolicy strict(FallbackPolicy::kError);
          acc_joined = run_on_gpu(c, DType::kBF16, o);
          o.w1_gap = 40;
          ASSERT_NO_THROW(acc_apart = run_on_gpu(c, DType::kBF16, o)) << shape << ", accumulated";
        }
        EXPECT_TRUE(acc_apart.w1_gap_intact) << shape << ", accumulated";
        EXPECT_TRUE(acc_apart.canaries_intact) << shape << ", accumulated";
        expect_same_backward(acc_apart, acc_joined, shape + ", accumulated");
      }
}

// No allocation and no host synchronisation inside forward/backward: both run under CUDA-graph capture in global
// mode (which rejects cudaMalloc and synchronising calls), and the replayed graph gives bitwise the same results.
// A first call on the thread creates its cuBLAS handle (cuBLAS's one-time allocation), so it runs uncaptured.
TEST(GpuLayerProperties, CapturesIntoACudaGraphAndReplaysBitwiseEqual) {
  REQUIRE_GPU();
  for (RoutingMode r : {RoutingMode::kTopK, RoutingMode::kTokenRounding, RoutingMode::kCallerSupplied})
    for (CacheMode cm : {CacheMode::kPreActivation, CacheMode::kInputOnly}) {
      MoEProblem p;
      p.T = 2048, p.d = 256, p.n = 128, p.E = 16, p.K = 4, p.routing = r, p.cache = cm, p.tile_m = 64;
      p.has_b1 = p.has_b2 = true;
      const LayerCase<double> c(p, 12);
      const GpuRun direct = run_on_gpu(c, DType::kBF16);
      GpuRun replayed;
      ASSERT_NO_THROW(replayed = run_on_gpu(c, DType::kBF16, 0, /*graph=*/true))
          << routing_mode_name(r) << " " << cache_mode_name(cm);
      EXPECT_EQ(direct.raw_out, replayed.raw_out);
      EXPECT_EQ(direct.raw_dx, replayed.raw_dx);
      EXPECT_EQ(direct.raw_dw1, replayed.raw_dw1);
      EXPECT_EQ(direct.raw_dw2, replayed.raw_dw2);
      EXPECT_EQ(direct.saved, replayed.saved);
    }
}

// backward_input() then backward_weight() (the split backward) give bitwise the full backward's results.
TEST(GpuLayerProperties, SplitBackwardEqualsFullBackwardBitwise) {
  REQUIRE_GPU();
  for (RoutingMode r : {RoutingMode::kTopK, RoutingMode::kTokenRounding, RoutingMode::kCallerSupplied})
    for (CacheMode cm : {CacheMode::kPreActivation, CacheMode::kInputOnly}) {
      MoEProblem p;
      p.T = 1500, p.d = 192, p.n = 96, p.E = 12, p.K = 3, p.routing = r, p.cache = cm, p.tile_m = 64;
      p.has_b1 = p.has_b2 = true, p.weight_layout = WeightLayout::kConcatenated;
      LayerCase<double> c(p, 14);
      if (cm == CacheMode::kInputOnly) c.grad_logits.clear();  // top-K: dX's router term summed from the pairs
      const GpuRun full = run_on_gpu(c, DType::kBF16);
      const GpuRun split = run_on_gpu(c, DType::kBF16, 0, false, /*split=*/true);
      EXPECT_TRUE(split.canaries_intact);
      expect_same_backward(split, full, std::string(routing_mode_name(r)) + " " + cache_mode_name(cm));
    }
}

// A backward that takes the saved buffer over (dH written over the saved H, a workspace smaller by P x w1_rows
// elements) gives bitwise the results of one that only reads it, also under CUDA-graph capture (each replay's
// forward writes H again before its backward consumes it); the canaries around every buffer stay intact.
TEST(GpuLayerProperties, ConsumingTheSavedBufferChangesNoResultBitwise) {
  REQUIRE_GPU();
  for (RoutingMode r : {RoutingMode::kTopK, RoutingMode::kTokenRounding, RoutingMode::kCallerSupplied})
    for (CacheMode cm : {CacheMode::kPreActivation, CacheMode::kInputOnly})
      for (bool graph : {false, true}) {
        MoEProblem p;
        p.T = 1500, p.d = 192, p.n = 96, p.E = 12, p.K = 3, p.routing = r, p.cache = cm, p.tile_m = 64;
        p.has_b1 = p.has_b2 = true, p.weight_layout = WeightLayout::kConcatenated;
        const LayerCase<double> c(p, 15);
        const GpuRun kept = run_on_gpu(c, DType::kBF16, 0, graph);
        const GpuRun consumed = run_on_gpu(c, DType::kBF16, 0, graph, false, nullptr, /*consume_saved=*/true);
        const std::string what = std::string(routing_mode_name(r)) + " " + cache_mode_name(cm) +
                                 (graph ? " graph" : "");
        EXPECT_TRUE(consumed.canaries_intact) << what;
        EXPECT_EQ(consumed.raw_out, kept.raw_out) << what;
        expect_same_backward(consumed, kept, what);
        const std::size_t smaller = backward_workspace_bytes(p, DType::kBF16, Device::cuda(0)) -
                                    backward_workspace_bytes(p, DType::kBF16, Device::cuda(0), true);
        if (cm == CacheMode::kPreActivation) {
          EXPECT_GE(smaller, static_cast<std::size_t>(p.max_pairs() * p.w1_rows() * 2)) << what;
          EXPECT_NE(consumed.saved, kept.saved) << what << ": dH was expected over the saved H";
          // W1's gradients later, from the dH left over the saved H (BackwardOutputs::w1_grads_later), also with
          // accumulation into fp32 gradients: bitwise the one-call backward's.
          const GpuRun later = run_on_gpu(c, DType::kBF16, 0, graph, false, nullptr, true, /*w1_later=*/true);
          EXPECT_TRUE(later.canaries_intact) << what;
          expect_same_backward(later, kept, what + " w1 later");
          EXPECT_EQ(later.saved, consumed.saved) << what;
          if (!graph) {
            WeightGradMode acc;  // fp32 gradient buffers holding earlier micro-batches' sums
            acc.dtype = DType::kFP32, acc.accumulate = true;
            std::mt19937_64 rng(7);
            const auto start = [&](std::size_t count) { return normal<double>(rng, count, 0.05); };
            if (r != RoutingMode::kCallerSupplied) acc.wr = start(c.router_weight.size());
            acc.w1 = start(c.w1.size()), acc.b1 = start(c.b1.size()), acc.w2 = start(c.w2.size());
            acc.b2 = start(c.b2.size());
            const GpuRun acc_kept = run_on_gpu(c, DType::kBF16, 0, false, false, &acc);
            const GpuRun acc_later = run_on_gpu(c, DType::kBF16, 0, false, false, &acc, true, true);
            expect_same_backward(acc_later, acc_kept, what + " w1 later, accumulating");
          }
        } else {
          EXPECT_EQ(smaller, 0u) << what << ": input-only mode keeps no H to write over";
          EXPECT_EQ(consumed.saved, kept.saved) << what;
        }
      }
}

// dX~ and Y in chunks of tokens (MoEProblem::dx_chunks, y_chunks) give bitwise the one-pass results: each token's
// sum is finished in its chunk, over the same rows in the same order. Every routing mode (token rounding's and caller
// routing's variable pair counts), both cache modes, the Hopper and the reference backward GEMMs, chunk counts that leave
// chunks without tokens (T = 1, more chunks than tokens), experts without tokens, and a graph capture.
TEST(GpuLayerProperties, DxInChunksOfTokensIsBitwiseOnePass) {
  REQUIRE_GPU();
  struct BackwardGuard {
    ~BackwardGuard() {
      gpu::set_hopper_backward_enabled(true);
      gpu::set_hopper_cluster_m(0);
    }
  } guard;
  struct Shape {
    std::int64_t T, d, n, E, K;
  };
  // (E = 300: the chunk plan scans the experts 256 at a time with a carry.) The Hopper dX~ also runs in 2-CTA
  // clusters (the heuristic's choice where K = 2n >= 4096, forced here), whose pairs read each chunk's rows of dH
  // through the per-expert row shift.
  for (const Shape& sh : {Shape{1500, 192, 96, 12, 3}, Shape{1, 64, 32, 8, 2}, Shape{5, 64, 32, 40, 2},
                          Shape{60, 64, 32, 300, 8}})
    for (RoutingMode r : {RoutingMode::kTopK, RoutingMode::kTokenRounding, RoutingMode::kCallerSupplied})
      for (CacheMode cm : {CacheMode::kPreActivation, CacheMode::kInputOnly})
        for (bool hopper_backward : {true, false}) {
          if (sh.T < 100 && (cm == CacheMode::kInputOnly || !hopper_backward)) continue;  // (the large shape has them)
          gpu::set_hopper_backward_enabled(hopper_backward);
          MoEProblem p;
          p.T = sh.T, p.d = sh.d, p.n = sh.n, p.E = sh.E, p.K = sh.K, p.routing = r, p.cache = cm, p.tile_m = 64;
          p.has_b1 = p.has_b2 = true;
          p.dx_chunks = 1, p.y_chunks = 1;
          LayerCase<double> c(p, 16);
          if (cm == CacheMode::kInputOnly) c.grad_logits.clear();  // top-K: dX's router term summed from the pairs
          const GpuRun one = run_on_gpu(c, DType::kBF16);
          for (std::int64_t chunks : {2, 3, 7}) {
            c.problem.dx_chunks = chunks, c.problem.y_chunks = chunks;
            const bool graph = chunks == 3 && sh.T > 100;
            const GpuRun many = run_on_gpu(c, DType::kBF16, 0, graph, false, nullptr, /*consume_saved=*/chunks == 7);
            const std::string what = "T=" + std::to_string(sh.T) + " " + routing_mode_name(r) + " " +
                                     cache_mode_name(cm) + (hopper_backward ? " hopper" : " reference") +
                                     " chunks=" + std::to_string(chunks);
            EXPECT_TRUE(many.canaries_intact) << what;
            EXPECT_EQ(many.raw_out, one.raw_out) << what;
            expect_same_backward(many, one, what);
            if (hopper_backward) {
              gpu::set_hopper_cluster_m(2);
              const GpuRun pairs = run_on_gpu(c, DType::kBF16, 0, false, false, nullptr, chunks == 7);
              gpu::set_hopper_cluster_m(0);
              EXPECT_TRUE(pairs.canaries_intact) << what << " clusters";
              EXPECT_EQ(pairs.raw_out, one.raw_out) << what << " clusters";
              expect_same_backward(pairs, one, what + " clusters");
            }
          }
        }
}

// The heuristic chunks dX~ where an expert keeps enough rows per chunk, and the layer still matches float64 there.
TEST(GpuLayerProperties, HeuristicTokenChunksMatchFloat64) {
  REQUIRE_GPU();
  MoEProblem p;
  p.T = 6144, p.d = 512, p.n = 128, p.E = 4, p.K = 2, p.has_b1 = true;
  ASSERT_EQ(backward_dx_chunks(p), 2) << "min(ceil(d / n) = 4, P / (E 768) = 4, 2)";
  ASSERT_EQ(forward_y_chunks(p), 2) << "A + Y + output (11.0 M elements) > dX~ chunk + dX + dO + dW2 (9.7 M)";
  const LayerCase<double> c(p, 18);
  const GpuRun chunked = run_on_gpu(c, DType::kBF16);
  const LayerCase<double> q = quantized_case(c, DType::kBF16);
  compare_all(chunked, reference_for(q, chunked.logits), DType::kBF16);
  LayerCase<double> one = c;
  one.problem.dx_chunks = 1, one.problem.y_chunks = 1;
  const GpuRun single = run_on_gpu(one, DType::kBF16);
  EXPECT_EQ(single.raw_dx, chunked.raw_dx);
  EXPECT_EQ(single.raw_out, chunked.raw_out);
}

TEST(GpuLayerProperties, BothWeightLayoutsGiveBitwiseIdenticalOutputs) {
  REQUIRE_GPU();
  MoEProblem p;
  p.T = 300, p.d = 128, p.n = 64, p.E = 8, p.K = 2, p.has_b1 = true;
  LayerCase<double> ci(p, 6);
  LayerCase<double> cc = ci;
  cc.problem.weight_layout = WeightLayout::kConcatenated;
  for (std::int64_t e = 0; e < p.E; ++e)
    for (std::int64_t c = 0; c < 2 * p.n; ++c) {
      const std::int64_t row = (c % 2) * p.n + c / 2;
      for (std::int64_t k = 0; k < p.d; ++k) cc.w1[(e * 2 * p.n + row) * p.d + k] = ci.w1[(e * 2 * p.n + c) * p.d + k];
      cc.b1[e * 2 * p.n + row] = ci.b1[e * 2 * p.n + c];
    }
  const GpuRun a = run_on_gpu(ci, DType::kBF16), b = run_on_gpu(cc, DType::kBF16);
  EXPECT_EQ(a.raw_out, b.raw_out);
  EXPECT_EQ(a.raw_dx, b.raw_dx);
  EXPECT_EQ(a.raw_dw2, b.raw_dw2);
}

TEST(GpuLayerProperties, SavedMetadataEqualsTheReferenceBuild) {
  REQUIRE_GPU();
  // E = 600: the expert scans take the experts a block at a time (256 or 512) with a carry.
  for (std::int64_t E : {24, 600})
  for (RoutingMode r : {RoutingMode::kTopK, RoutingMode::kCallerSupplied, RoutingMode::kTokenRounding}) {
    MoEProblem p;
    p.T = 3000, p.d = 64, p.n = 32, p.E = E, p.K = 3, p.routing = r;  // 9000 pairs: several metadata tiles
    p.tile_m = 64;
    const LayerCase<double> c(p, 8);
    const GpuRun g = run_on_gpu(c, DType::kFP32);
    const ReferenceRun ref = reference_for(quantized_case(c, DType::kFP32), g.logits);
    const ref::RoutingMetadata& m = ref.f.saved.meta;
    const SavedLayout l = saved_layout(c.problem, DType::kFP32);
    auto ints = [&](const BufferRegion& reg, std::size_t n) {
      std::vector<std::int64_t> v(n);
      for (std::size_t i = 0; i < n; ++i) {
        std::int32_t x;
        std::memcpy(&x, &g.saved[reg.offset + 4 * i], 4);
        v[i] = x;
      }
      return v;
    };
    const std::size_t P = static_cast<std::size_t>(m.num_pairs());
    EXPECT_EQ(ints(l.expert_offsets, c.problem.E + 1), m.expert_offsets);
    EXPECT_EQ(ints(l.scatter, P), m.scatter);
    EXPECT_EQ(ints(l.inverse, P), m.inverse);
    EXPECT_EQ(ints(l.gather, P), m.gather);
    if (l.token_offsets.present()) {
      EXPECT_EQ(ints(l.token_offsets, c.problem.T + 1), m.token_offsets);
    }
  }
}

// Every top-K kernel variant: a lane per token (bf16 rows of at most 128 experts, K <= 8, a score over the selection:
// K 8, 4 and 2), rows held in registers (E <= 512: 1, 2, 4, 8 or 16 per lane, E not a multiple of 32, K = E, K > 32
// which keeps raw logits in memory between the rounds) and rows read from memory (E > 512); each score variant. The selection, the grouped order and the scores must be those of the reference on the GPU's logits.
TEST(GpuLayerProperties, TopKOnTheGpuLogitsIsExactForEveryKernelVariant) {
  REQUIRE_GPU();
  struct Shape {
    std::int64_t E, K;
    ScoreVariant score;
  };
  const Shape shapes[] = {{1, 1, ScoreVariant::kSoftmaxOverTopK},       {20, 20, ScoreVariant::kTopKOfSoftmax},
                          {64, 64, ScoreVariant::kTopKOfSoftmax},       {128, 8, ScoreVariant::kSoftmaxOverTopK},
                          {200, 7, ScoreVariant::kTopKOfSoftmaxRenorm}, {256, 16, ScoreVariant::kTopKOfSoftmax},
                          {512, 40, ScoreVariant::kSoftmaxOverTopK},    {4096, 16, ScoreVariant::kTopKOfSoftmax},
                          {5000, 20, ScoreVariant::kSoftmaxOverTopK},   {64, 4, ScoreVariant::kTopKOfSoftmaxRenorm},
                          {32, 2, ScoreVariant::kSoftmaxOverTopK}};
  for (const Shape& sh : shapes) {
    MoEProblem p;
    p.T = 64, p.d = 32, p.n = 8, p.E = sh.E, p.K = sh.K, p.score = sh.score;
    const LayerCase<double> c(p, 9);
    const GpuRun g = run_on_gpu(c, DType::kBF16);
    // Ties are common among bf16 logits: the order must still be exactly (value desc, index asc).
    const ReferenceRun r = reference_for(quantized_case(c, DType::kBF16), g.logits);
    const std::string where = "E=" + std::to_string(sh.E) + " K=" + std::to_string(sh.K);
    for (std::int64_t e = 0; e < sh.E; ++e) ASSERT_EQ(g.counts[e], r.f.expert_counts[e]) << where;
    const SavedLayout l = saved_layout(g.problem, DType::kBF16);
    const ref::RoutingMetadata& m = r.f.saved.meta;
    const std::size_t P = static_cast<std::size_t>(m.num_pairs());
    double worst = 0.0;
    for (std::size_t i = 0; i < P; ++i) {
      std::int32_t inv;
      float score;
      std::memcpy(&inv, &g.saved[l.inverse.offset + 4 * i], 4);
      std::memcpy(&score, &g.saved[l.scores.offset + 4 * i], 4);
      ASSERT_EQ(inv, m.inverse[i]) << where << " pair " << i;
      worst = std::max(worst, std::abs(score - r.f.saved.scores[i]));
    }
    EXPECT_LT(worst, 1e-5) << where << ": fp32 scores against the float64 scores of the same logits";
    EXPECT_LT(rel_error(g.out, r.f.out), 1e-2) << where;
  }
}

TEST(GpuLayerProperties, OutOfRangeCallerPairsAreSkipped) {
  REQUIRE_GPU();
  MoEProblem p;
  p.T = 40, p.d = 64, p.n = 32, p.E = 6, p.K = 2, p.routing = RoutingMode::kCallerSupplied;
  LayerCase<double> c(p, 10);
  LayerCase<double> kept = c;  // the same triples without the sentinels
  kept.pair_token.clear(), kept.pair_expert.clear(), kept.pair_score.clear();
  for (std::size_t i = 0; i < c.pair_token.size(); ++i) {
    if (i % 5 == 2) {
      c.pair_expert[i] = (i % 2) ? p.E + 3 : -1;  // expert-parallel style sentinels
      continue;
    }
    kept.pair_token.push_back(c.pair_token[i]);
    kept.pair_expert.push_back(c.pair_expert[i]);
    kept.pair_score.push_back(c.pair_score[i]);
  }
  kept.problem.num_pairs = static_cast<std::int64_t>(kept.pair_token.size());
  const GpuRun g = run_on_gpu(c, DType::kFP32);
  const ReferenceRun r = reference_for(quantized_case(kept, DType::kFP32), {});
  expect_close("out", g.out, r.f.out, 2e-5);
  expect_close("dx", g.dx, r.g.dx, 2e-5);
  expect_close("dw1", g.dw1, r.g.dw1, 2e-5);  // a sentinel pair must not reach the weight gradients either
  expect_close("dw2", g.dw2, r.g.dw2, 2e-5);
  for (std::size_t i = 0, j = 0; i < c.pair_token.size(); ++i) {
    if (i % 5 == 2) {
      EXPECT_EQ(g.dscores[i], 0.0) << "a skipped pair gets no score gradient";
    } else {
      EXPECT_NEAR(g.dscores[i], r.g.dscores[j++], 1e-4);
    }
  }
}

// Caller pairs that break the rules the GPU does not check by default (tokens ascending, at most K pairs a token,
// tokens in range) are skipped without moving any other pair: the layer equals the reference on the pairs that keep
// them, with the forward's Y and the backward's dX~ in chunks of tokens (whose row bound assumes at most K pairs a
// token). Each bad pair comes right after the last pair of some token: a token out of range, a token below the one
// before it, or many more pairs of the same token (a chunk would overrun its rows if they were routed).
TEST(GpuLayerProperties, MalformedCallerPairsAreSkippedWithoutMovingOthers) {
  REQUIRE_GPU();
  MoEProblem p;
  p.T = 300, p.d = 64, p.n = 32, p.E = 6, p.K = 3, p.routing = RoutingMode::kCallerSupplied;
  p.dx_chunks = 3, p.y_chunks = 3;
  const LayerCase<double> valid(p, 12);  // at most K pairs a token, K / 2 on average: room for the bad ones
  LayerCase<double> c = valid, kept = valid;  // c: with the bad pairs; kept: the pairs the GPU must route
  for (LayerCase<double>* lc : {&c, &kept}) lc->pair_token.clear(), lc->pair_expert.clear(), lc->pair_score.clear();
  std::vector<bool> bad;
  auto push = [&](std::int64_t t, std::int64_t e, double s, bool is_bad) {
    c.pair_token.push_back(t), c.pair_expert.push_back(e), c.pair_score.push_back(s), bad.push_back(is_bad);
    if (!is_bad) kept.pair_token.push_back(t), kept.pair_expert.push_back(e), kept.pair_score.push_back(s);
  };
  const std::size_t P0 = valid.pair_token.size();
  const std::int64_t budget = p.T * p.K - static_cast<std::int64_t>(P0);  // num_pairs <= T K
  std::int64_t added = 0, of_token = 0;
  bool many_done = false;
  for (std::size_t i = 0; i < P0; ++i) {
    const std::int64_t t = valid.pair_token[i];
    of_token = i > 0 && valid.pair_token[i - 1] == t ? of_token + 1 : 1;
    push(t, valid.pair_expert[i], valid.pair_score[i], false);
    if (i + 1 < P0 && valid.pair_token[i + 1] == t) continue;  // not the token's last pair
    const std::int64_t e = (t + 1) % p.E;
    if (!many_done && t >= p.T / 2 && added + 40 <= budget) {
      // 40 more pairs of this token: those past its K-th are skipped (the first may still fit under K).
      for (std::int64_t j = 0; j < 40; ++j) push(t, (e + j) % p.E, 0.25, of_token + j >= p.K);
      added += 40, many_done = true;
    } else if (t % 7 == 1 && added < budget) {
      push(t % 2 ? p.T + 5 : -1, e, 0.5, true), ++added;  // a token out of range
    } else if (t % 7 == 3 && t >= 2 && added < budget) {
      push(t - 2, e, 0.5, true), ++added;  // below the token before it
    }
  }
  ASSERT_TRUE(many_done);
  ASSERT_GT(added, 60) << "the case must hold every kind of bad pair, many times";
  c.problem.num_pairs = static_cast<std::int64_t>(c.pair_token.size());
  kept.problem.num_pairs = static_cast<std::int64_t>(kept.pair_token.size());
  const GpuRun g = run_on_gpu(c, DType::kFP32);
  EXPECT_TRUE(g.canaries_intact);
  const ReferenceRun r = reference_for(quantized_case(kept, DType::kFP32), {});
  expect_close("out", g.out, r.f.out, 2e-5);
  expect_close("dx", g.dx, r.g.dx, 2e-5);
  expect_close("dw1", g.dw1, r.g.dw1, 2e-5);
  expect_close("dw2", g.dw2, r.g.dw2, 2e-5);
  for (std::size_t i = 0, j = 0; i < bad.size(); ++i) {
    if (bad[i]) {
      EXPECT_EQ(g.dscores[i], 0.0) << "pair " << i << ": a skipped pair gets no score gradient";
    } else {
      EXPECT_NEAR(g.dscores[i], r.g.dscores[j++], 1e-4) << "pair " << i;
    }
  }
  for (std::int64_t e = 0; e < p.E; ++e) EXPECT_EQ(g.counts[e], r.f.expert_counts[e]) << "expert " << e;
}

// ---- gradient accumulation (LayerWeightGrads::accumulate) ----------------------------------------------------------

/// Initial accumulation buffers: random, each tensor at the scale of the reference's gradient (so an error in the
/// added gradient is not hidden under a large buffer), rounded to the buffer dtype.
WeightGradMode accumulation_buffers(const ReferenceRun& r, const MoEProblem& p, DType gt, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto like = [&](const std::vector<double>& g) {
    double ss = 0;
    for (double v : g) ss += v * v;
    const double rms = g.empty() ? 1.0 : std::sqrt(ss / static_cast<double>(g.size())) + 1e-3;
    return quantize(normal<double>(rng, g.size(), rms), gt);
  };
  WeightGradMode m;
  m.dtype = gt, m.accumulate = true;
  if (p.routing != RoutingMode::kCallerSupplied) m.wr = like(r.g.drouter_weight);
  m.w1 = like(r.g.dw1), m.w2 = like(r.g.dw2), m.b1 = like(r.g.db1), m.b2 = like(r.g.db2);
  return m;
}

std::vector<double> plus(std::vector<double> a, const std::vector<double>& b, double scale = 1.0) {
  for (std::size_t i = 0; i < a.size(); ++i) a[i] += scale * b[i];
  return a;
}

class GpuAccumulate : public testing::TestWithParam<std::tuple<DType, RoutingMode, bool>> {
 protected:
  void SetUp() override { REQUIRE_GPU(); }
};

// bf16 data, fp32 or bf16 buffers: accumulating two micro-batches (same weights, other tokens) gives the float64 sum
// buffer + dW(a) + dW(b), for the full and the split backward, at a shape the Hopper kernels take (the fallback
// policy "error": a GEMM sent to the reference path fails the test).
TEST_P(GpuAccumulate, TwoMicroBatchesMatchTheFloat64Sum) {
  const auto [gt, routing, split] = GetParam();
  const ScopedFallbackPolicy policy(FallbackPolicy::kError);
  MoEProblem p;
  p.T = 333, p.d = 192, p.n = 64, p.E = 8, p.K = 2, p.has_b1 = p.has_b2 = true;
  p.weight_layout = WeightLayout::kConcatenated, p.routing = routing, p.tile_m = 16;
  const LayerCase<double> a(p, 31);
  LayerCase<double> b(p, 32);
  b.router_weight = a.router_weight, b.w1 = a.w1, b.b1 = a.b1, b.w2 = a.w2, b.b2 = a.b2;
  const DType dt = DType::kBF16;
  // Plain runs first: their logits pin the reference's routing.
  const GpuRun plain_a = run_on_gpu(a, dt), plain_b = run_on_gpu(b, dt);
  const ReferenceRun ra = reference_for(quantized_case(a, dt), plain_a.logits);
  const ReferenceRun rb = reference_for(quantized_case(b, dt), plain_b.logits);
  const WeightGradMode init = accumulation_buffers(ra, a.problem, gt, 5);
  const GpuRun first = run_on_gpu(a, dt, 0, false, split, &init);
  WeightGradMode after_first = init;
  after_first.wr = first.dwr, after_first.w1 = first.dw1, after_first.b1 = first.db1, after_first.w2 = first.dw2;
  after_first.b2 = first.db2;
  const GpuRun second = run_on_gpu(b, dt, 0, false, split, &after_first);
  EXPECT_TRUE(first.canaries_intact && second.canaries_intact);
  const double tol = tolerance(dt);
  expect_close("accumulated dW1", second.dw1, plus(plus(init.w1, ra.g.dw1), rb.g.dw1), tol);
  expect_close("accumulated dW2", second.dw2, plus(plus(init.w2, ra.g.dw2), rb.g.dw2), tol);
  expect_close("accumulated db1", second.db1, plus(plus(init.b1, ra.g.db1), rb.g.db1), tol);
  expect_close("accumulated db2", second.db2, plus(plus(init.b2, ra.g.db2), rb.g.db2), tol);
  if (routing != RoutingMode::kCallerSupplied)
    expect_close("accumulated dW_router", second.dwr,
                 plus(plus(init.wr, ra.g.drouter_weight), rb.g.drouter_weight), tol);
  // The input gradient is never accumulated.
  expect_close("dx (accumulating run)", second.dx, rb.g.dx, tol);
}

INSTANTIATE_TEST_SUITE_P(
    BufferDtypes, GpuAccumulate,
    testing::Combine(testing::Values(DType::kFP32, DType::kBF16),
                     testing::Values(RoutingMode::kTopK, RoutingMode::kTokenRounding, RoutingMode::kCallerSupplied),
                     testing::Bool()),
    [](const testing::TestParamInfo<std::tuple<DType, RoutingMode, bool>>& i) {
      return std::string(dtype_name(std::get<0>(i.param))) + "_" + routing_mode_name(std::get<1>(i.param)) +
             (std::get<2>(i.param) ? "_split" : "_full");
    });

// Experts that receive no token keep their part of every buffer bitwise, as does a call with no tokens; fp32 and
// bf16 buffers, full and split backward.
TEST(GpuAccumulateEdges, ZeroTokenExpertsAndEmptyCallsLeaveTheBufferUnchanged) {
  REQUIRE_GPU();
  for (DType gt : {DType::kFP32, DType::kBF16})
    for (bool split : {false, true}) {
      MoEProblem p;
      p.T = 5, p.d = 128, p.n = 64, p.E = 16, p.K = 1, p.has_b1 = p.has_b2 = true;
      const LayerCase<double> c(p, 77);
      const GpuRun plain = run_on_gpu(c, DType::kBF16);
      const ReferenceRun r = reference_for(quantized_case(c, DType::kBF16), plain.logits);
      const WeightGradMode init = accumulation_buffers(r, p, gt, 8);
      const GpuRun g = run_on_gpu(c, DType::kBF16, 0, false, split, &init);
      const std::string where = std::string(dtype_name(gt)) + (split ? " split" : " full");
      int empty = 0;
      for (std::int64_t e = 0; e < p.E; ++e) {
        const bool none = g.counts[e] == 0;
        empty += none;
        auto same = [&](const std::vector<double>& now, const std::vector<double>& was, std::int64_t per) {
          return std::equal(now.begin() + e * per, now.begin() + (e + 1) * per, was.begin() + e * per);
        };
        EXPECT_EQ(same(g.dw1, init.w1, p.w1_rows() * p.d), none) << where << " expert " << e;
        EXPECT_EQ(same(g.dw2, init.w2, p.d * p.n), none) << where << " expert " << e;
        EXPECT_EQ(same(g.db1, init.b1, p.w1_rows()), none) << where << " expert " << e;
        EXPECT_EQ(same(g.db2, init.b2, p.d), none) << where << " expert " << e;
      }
      EXPECT_GE(empty, 11) << where;
      expect_close("dW1 with empty experts", g.dw1, plus(init.w1, r.g.dw1), tolerance(DType::kBF16));

      MoEProblem q = p;
      q.T = 0;
      const LayerCase<double> nothing(q, 78);
      const GpuRun z = run_on_gpu(nothing, DType::kBF16, 0, false, split, &init);
      EXPECT_EQ(z.dwr, init.wr) << where;
      EXPECT_EQ(z.dw1, init.w1) << where;
      EXPECT_EQ(z.dw2, init.w2) << where;
      EXPECT_EQ(z.db1, init.b1) << where;
      EXPECT_EQ(z.db2, init.b2) << where;
    }
}

// Accumulation needs no host synchronisation: captured into a CUDA graph and replayed twice, the buffers hold
// buffer + 2 dW.
TEST(GpuAccumulateEdges, CapturedIntoACudaGraphEachReplayAddsOnce) {
  REQUIRE_GPU();
  MoEProblem p;
  p.T = 1024, p.d = 256, p.n = 128, p.E = 16, p.K = 4, p.has_b1 = p.has_b2 = true;
  const LayerCase<double> c(p, 12);
  const GpuRun plain = run_on_gpu(c, DType::kBF16);
  const ReferenceRun r = reference_for(quantized_case(c, DType::kBF16), plain.logits);
  const WeightGradMode init = accumulation_buffers(r, p, DType::kFP32, 9);
  GpuRun replayed;
  ASSERT_NO_THROW(replayed = run_on_gpu(c, DType::kBF16, 0, /*graph=*/true, false, &init));
  const double tol = tolerance(DType::kBF16);
  expect_close("dW1 after two replays", replayed.dw1, plus(init.w1, r.g.dw1, 2.0), tol);
  expect_close("dW2 after two replays", replayed.dw2, plus(init.w2, r.g.dw2, 2.0), tol);
  expect_close("db1 after two replays", replayed.db1, plus(init.b1, r.g.db1, 2.0), tol);
  expect_close("db2 after two replays", replayed.db2, plus(init.b2, r.g.db2, 2.0), tol);
  expect_close("dW_router after two replays", replayed.dwr, plus(init.wr, r.g.drouter_weight, 2.0), tol);
}

// ---- 64-bit offsets ----------------------------------------------------------------------------------------------

// P * d = 524288 * 4224 > 2^31 elements in Y and dX~: row offsets must be 64-bit. Checked on sampled tokens,
// including the last ones (the highest grouped rows), against the reference restricted to each token (a token's
// output and input gradient depend only on its own row).
TEST(GpuLayerLarge, OffsetsPast2To31Elements) {
  REQUIRE_GPU();
  MoEProblem p;
  // d = 4224 = 33 * 128: the Hopper kernels take it (Y on the down-projection kernel).
  p.T = 65536, p.d = 4224, p.n = 64, p.E = 8, p.K = 8;  // K = E: every token in every expert
  p.has_b1 = p.has_b2 = true;
  const LayerCase<double> c(p, 11);
  const GpuRun g = run_on_gpu(c, DType::kBF16);
  const LayerCase<double> q = quantized_case(c, DType::kBF16);
  for (std::int64_t t : {std::int64_t{0}, std::int64_t{1}, p.T / 2, p.T - 2, p.T - 1}) {
    LayerCase<double> one = q;
    one.problem.T = 1;
    one.x.assign(q.x.begin() + t * p.d, q.x.begin() + (t + 1) * p.d);
    one.grad_out.assign(q.grad_out.begin() + t * p.d, q.grad_out.begin() + (t + 1) * p.d);
    one.grad_logits.assign(q.grad_logits.begin() + t * p.E, q.grad_logits.begin() + (t + 1) * p.E);
    const std::vector<double> z(g.logits.begin() + t * p.E, g.logits.begin() + (t + 1) * p.E);
    const ReferenceRun r = reference_for(one, z);
    const std::vector<double> out_t(g.out.begin() + t * p.d, g.out.begin() + (t + 1) * p.d);
    const std::vector<double> dx_t(g.dx.begin() + t * p.d, g.dx.begin() + (t + 1) * p.d);
    EXPECT_LT(rel_error(out_t, r.f.out), 1e-2) << "token " << t;
    EXPECT_LT(rel_error(dx_t, r.g.dx), 1e-2) << "token " << t;
  }
  EXPECT_TRUE(g.canaries_intact);
}


// T * d and P * 2n past 2^31 elements too (x, out, dX by token row; H, dH and A' by grouped row; Y and dX~ by pair),
// on every row, and the weight gradients. x, dO are R-periodic in the token (base rows tiled on the device, R prime,
// so a wrapped or truncated 32-bit offset, a multiple of a power of two, cannot land on a row with the same data);
// the router's logits are then R-periodic too (asserted), and so is the routing. Every row of out and dX is
// compared with its base row's float64 reference (a row's own relative error, so one wrong row among two million is
// seen); the weight gradients are q copies of the base's plus the first m base tokens' (T = q R + m).
TEST(GpuLayerLarge, TokenAndHiddenOffsetsPast2To31ElementsOnEveryRow) {
  REQUIRE_GPU();
  constexpr std::int64_t R = 509;
  MoEProblem p;
  p.T = (std::int64_t{1} << 21) + 4099, p.d = 1152, p.n = 512, p.E = 8, p.K = 2;
  p.has_b1 = p.has_b2 = true;
  ASSERT_GT(p.T * p.d, std::int64_t{1} << 31);
  ASSERT_GT(p.T * p.K * p.w1_rows(), std::int64_t{1} << 31);
  const std::int64_t q = p.T / R, m = p.T % R;
  const DType dt = DType::kBF16;
  const std::size_t el = dtype_size(dt);
  const Device dev = Device::cuda(0);

  MoEProblem pb = p;
  pb.T = R;
  LayerCase<double> base = quantized_case(LayerCase<double>(pb, 23), dt);
  base.grad_logits.clear();  // the router's term of dX from the pairs, inside the gather-sum (the default path)

  // A (rows, cols) tensor whose rows repeat `block` (R rows): the block uploaded once, then doubled on the device.
  auto tiled = [&](const std::vector<double>& block, std::int64_t cols) {
    const std::vector<unsigned char> b = encode(block, dt);
    auto buf = std::make_unique<DeviceBuffer>(static_cast<std::size_t>(p.T * cols) * el);
    char* dst = static_cast<char*>(buf->get());
    cudaMemcpy(dst, b.data(), b.size(), cudaMemcpyHostToDevice);
    for (std::size_t have = b.size(); have < buf->bytes(); have *= 2)
      cudaMemcpy(dst + have, dst, std::min(have, buf->bytes() - have), cudaMemcpyDeviceToDevice);
    return buf;
  };
  const auto x = tiled(base.x, p.d), gout = tiled(base.grad_out, p.d);
  DeviceBuffer wr(encode(base.router_weight, dt)), w1(encode(base.w1, dt)), w2(encode(base.w2, dt));
  DeviceBuffer b1(encode(base.b1, dt)), b2(encode(base.b2, dt));
  LayerWeights w;
  w.router_weight = TensorView::contiguous(wr.get(), dt, {p.E, p.d}, dev);
  w.w1 = TensorView::contiguous(w1.get(), dt, {p.E, p.w1_rows(), p.d}, dev);
  w.w2 = TensorView::contiguous(w2.get(), dt, {p.E, p.d, p.n}, dev);
  w.b1 = TensorView::contiguous(b1.get(), dt, {p.E, p.w1_rows()}, dev);
  w.b2 = TensorView::contiguous(b2.get(), dt, {p.E, p.d}, dev);
  const TensorView xv = TensorView::contiguous(x->get(), dt, {p.T, p.d}, dev);

  DeviceBuffer out(p.T * p.d * el), logits(p.T * p.E * el), counts(p.E * 4), dx(p.T * p.d * el);
  DeviceBuffer saved(saved_layout(p, dt).total_bytes), fws(forward_workspace_bytes(p, dt, dev));
  DeviceBuffer bws(backward_workspace_bytes(p, dt, dev, false));
  DeviceBuffer dwr(base.router_weight.size() * el), dw1(base.w1.size() * el), dw2(base.w2.size() * el);
  DeviceBuffer db1(base.b1.size() * el), db2(base.b2.size() * el);
  ForwardOutputs fo;
  fo.out = TensorView::contiguous(out.get(), dt, {p.T, p.d}, dev);
  fo.router_logits = TensorView::contiguous(logits.get(), dt, {p.T, p.E}, dev);
  fo.expert_counts = TensorView::contiguous(counts.get(), DType::kInt32, {p.E}, dev);
  BackwardInputs bi;
  bi.grad_out = TensorView::contiguous(gout->get(), dt, {p.T, p.d}, dev);
  BackwardOutputs bo;
  bo.grad_x = TensorView::contiguous(dx.get(), dt, {p.T, p.d}, dev);
  bo.grad_weights.router_weight = TensorView::contiguous(dwr.get(), dt, {p.E, p.d}, dev);
  bo.grad_weights.w1 = TensorView::contiguous(dw1.get(), dt, {p.E, p.w1_rows(), p.d}, dev);
  bo.grad_weights.w2 = TensorView::contiguous(dw2.get(), dt, {p.E, p.d, p.n}, dev);
  bo.grad_weights.b1 = TensorView::contiguous(db1.get(), dt, {p.E, p.w1_rows()}, dev);
  bo.grad_weights.b2 = TensorView::contiguous(db2.get(), dt, {p.E, p.d}, dev);
  progress("large layer: forward + backward");
  forward(p, xv, w, nullptr, fo, {saved.get(), saved.bytes(), fws.get(), fws.bytes()}, nullptr);
  backward(p, xv, w, nullptr, bi, bo, {saved.get(), saved.bytes(), bws.get(), bws.bytes(), false}, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (const DeviceBuffer* b : {&out, &logits, &counts, &dx, &saved, &fws, &bws, &dwr, &dw1, &dw2, &db1, &db2})
    EXPECT_TRUE(b->canary_intact()) << "a kernel wrote past the end of a buffer";

  // The routing repeats with the rows: the logits of token t are bitwise those of token t mod R.
  const std::vector<unsigned char> lraw = logits.download();
  const std::size_t lrow = static_cast<std::size_t>(p.E) * el;
  std::int64_t aperiodic = 0;
  for (std::int64_t t = R; t < p.T; ++t)
    aperiodic += std::memcmp(&lraw[t * lrow], &lraw[(t % R) * lrow], lrow) != 0;
  ASSERT_EQ(aperiodic, 0) << "the router GEMM gave identical rows different logits: the periodic check cannot hold";

  // References: the base's R tokens and its first m, routed by the GPU's logits.
  const std::vector<double> zb = decode(lraw.data(), static_cast<std::size_t>(R * p.E), dt);
  progress("large layer: float64 references");
  const ReferenceRun rb = reference_for(base, zb);
  LayerCase<double> head = base;
  head.problem.T = m;
  head.x.resize(m * p.d), head.grad_out.resize(m * p.d);
  const ReferenceRun rm = reference_for(head, std::vector<double>(zb.begin(), zb.begin() + m * p.E));

  // Every row of out and dX against its base row: its own relative error, and the Frobenius error of the whole.
  progress("large layer: every row of out and dX");
  for (const auto& [name, buf, ref] : {std::tuple{"out", &out, &rb.f.out}, std::tuple{"dx", &dx, &rb.g.dx}}) {
    constexpr std::int64_t kRowsPerCopy = 16384;
    std::vector<unsigned char> h(static_cast<std::size_t>(kRowsPerCopy * p.d) * el);
    double err2 = 0, ref2 = 0, worst_row = 0;
    std::int64_t worst_t = -1;
    for (std::int64_t t0 = 0; t0 < p.T; t0 += kRowsPerCopy) {
      const std::int64_t rows = std::min(kRowsPerCopy, p.T - t0);
      cudaMemcpy(h.data(), static_cast<const char*>(buf->get()) + t0 * p.d * el, rows * p.d * el,
                 cudaMemcpyDeviceToHost);
      const std::vector<double> g = decode(h.data(), static_cast<std::size_t>(rows * p.d), dt);
      for (std::int64_t i = 0; i < rows; ++i) {
        const double* r = ref->data() + ((t0 + i) % R) * p.d;
        double e2 = 0, r2 = 0;
        for (std::int64_t k = 0; k < p.d; ++k) {
          const double v = g[i * p.d + k];
          e2 += std::isnan(v) ? 1e300 : (v - r[k]) * (v - r[k]);
          r2 += r[k] * r[k];
        }
        err2 += e2, ref2 += r2;
        const double row = std::sqrt(e2 / std::max(r2, 1e-300));
        if (row > worst_row) worst_row = row, worst_t = t0 + i;
      }
    }
    EXPECT_LT(std::sqrt(err2 / ref2), 1e-2) << name;
    EXPECT_LT(worst_row, 3e-2) << name << ": row " << worst_t << " (its first element at offset "
                               << worst_t * p.d << ") is off";
  }

  // Counts and weight gradients: q copies of the base's plus the head's.
  const std::vector<unsigned char> hc = counts.download();
  for (std::int64_t e = 0; e < p.E; ++e) {
    std::int32_t c;
    std::memcpy(&c, &hc[4 * e], 4);
    EXPECT_EQ(c, q * rb.f.expert_counts[e] + rm.f.expert_counts[e]) << "expert_counts[" << e << "]";
  }
  auto combined = [&](const std::vector<double>& all, const std::vector<double>& first) {
    std::vector<double> v(all.size());
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = double(q) * all[i] + first[i];
    return v;
  };
  const auto dec = [&](const DeviceBuffer& b) { return decode(b.download().data(), b.bytes() / el, dt); };
  expect_close("large dW1", dec(dw1), combined(rb.g.dw1, rm.g.dw1), 1e-2);
  expect_close("large dW2", dec(dw2), combined(rb.g.dw2, rm.g.dw2), 1e-2);
  expect_close("large db1", dec(db1), combined(rb.g.db1, rm.g.db1), 1e-2);
  expect_close("large db2", dec(db2), combined(rb.g.db2, rm.g.db2), 1e-2);
  expect_close("large dW_router", dec(dwr), combined(rb.g.drouter_weight, rm.g.drouter_weight), 1e-2);
}

/// set_sm_margin for a scope, the margin before it restored after.
struct ScopedSmMargin {
  explicit ScopedSmMargin(int sms) : previous(sm_margin()) { set_sm_margin(sms); }
  ~ScopedSmMargin() { set_sm_margin(previous); }
  ScopedSmMargin(const ScopedSmMargin&) = delete;
  ScopedSmMargin& operator=(const ScopedSmMargin&) = delete;
  int previous;
};

// The expert GEMMs' persistent grids on fewer SMs (set_sm_margin) give bitwise the whole device's results: the
// forward, the full and the split backward, in both cache modes, dX~ in clusters of two and alone, bf16 and fp32
// weight gradients (overwritten and accumulated into). The margins reach down to one cluster (sms - 2), and at
// sms - 32 the weight-gradient heuristic, which counts its wide tiles against the usable SMs, takes the wide tile for
// dW1 and dW2 where the whole device takes the square one (checked here on the heuristic itself), so two tile shapes
// of those GEMMs are compared too. That the grids are cut is tests/python/test_sm_margin.py's to check (it reads
// each launch's grid from torch.profiler); here an ignored margin would pass.
TEST(GpuSmMargin, FewerSmsGiveBitwiseTheWholeDevicesResults) {
  REQUIRE_GPU();
  struct ClusterGuard {
    ~ClusterGuard() { gpu::set_hopper_cluster_m(0); }
  } guard;
  const int sms = cuda_sm_count(0);
  ASSERT_GE(sms, 34) << "a Hopper GPU has 114 SMs or more";
  MoEProblem p;
  p.T = 2048, p.d = 512, p.n = 256, p.E = 8, p.K = 2, p.tile_m = 64, p.has_b1 = p.has_b2 = true;
  for (const bool narrow : {false, true}) {  // dW1 (M = 2n, N = d), dW2 (M = d, N = n): 64 and 32 wide tiles
    gpu::hopper::WgradShape shape;
    shape.E = p.E, shape.M = narrow ? p.d : 2 * p.n, shape.N = narrow ? p.n : p.d;
    shape.sm_count = sms;
    EXPECT_EQ(gpu::hopper::choose_wgrad_tiles(shape, {}).tile_n, 128) << (narrow ? "dW2" : "dW1");
    shape.sm_count = 32;
    EXPECT_EQ(gpu::hopper::choose_wgrad_tiles(shape, {}).tile_n, 256) << (narrow ? "dW2" : "dW1");
  }
  for (RoutingMode r : {RoutingMode::kTopK, RoutingMode::kTokenRounding})
    for (CacheMode cm : {CacheMode::kPreActivation, CacheMode::kInputOnly})
      for (int cluster_m : {1, 2}) {
        gpu::set_hopper_cluster_m(cluster_m);
        p.routing = r, p.cache = cm;
        LayerCase<double> c(p, 37);
        if (cm == CacheMode::kInputOnly) c.grad_logits.clear();
        GpuRun whole;
        {
          const ScopedSmMargin none(0);
          whole = run_on_gpu(c, DType::kBF16);
        }
        for (int margin : {1, 16, sms - 32, sms - 2}) {
          const ScopedSmMargin fewer(margin);
          const std::string what = std::string(routing_mode_name(r)) + " " + cache_mode_name(cm) + " dX~ cluster " +
                                   std::to_string(cluster_m) + ", margin " + std::to_string(margin);
          const bool split = margin == 16;
          const GpuRun run = run_on_gpu(c, DType::kBF16, 0, /*graph=*/margin == 1, split);
          EXPECT_TRUE(run.canaries_intact) << what;
          EXPECT_EQ(run.raw_out, whole.raw_out) << what;
          EXPECT_EQ(run.counts, whole.counts) << what;
          EXPECT_EQ(run.saved, whole.saved) << what;
          expect_same_backward(run, whole, what);
        }
      }
  // fp32 weight gradients, overwritten and accumulated into (fp32 buffers holding earlier micro-batches' sums): the
  // weight-gradient kernels' fp32 epilogues, on the wide tile at sms - 32 and the square one on the whole device.
  gpu::set_hopper_cluster_m(0);
  p.routing = RoutingMode::kTopK, p.cache = CacheMode::kPreActivation;
  const LayerCase<double> c(p, 38);
  for (const bool accumulate : {false, true}) {
    WeightGradMode grads;
    grads.dtype = DType::kFP32, grads.accumulate = accumulate;
    if (accumulate) {
      std::mt19937_64 rng(8);
      const auto start = [&](std::size_t count) { return normal<double>(rng, count, 0.05); };
      grads.wr = start(c.router_weight.size()), grads.w1 = start(c.w1.size()), grads.b1 = start(c.b1.size());
      grads.w2 = start(c.w2.size()), grads.b2 = start(c.b2.size());
    }
    GpuRun whole;
    {
      const ScopedSmMargin none(0);
      whole = run_on_gpu(c, DType::kBF16, 0, false, false, &grads);
    }
    const ScopedSmMargin fewer(sms - 32);
    const GpuRun run = run_on_gpu(c, DType::kBF16, 0, false, false, &grads);
    EXPECT_TRUE(run.canaries_intact);
    expect_same_backward(run, whole, accumulate ? "fp32 gradients accumulated into" : "fp32 gradients");
  }
}

// A margin that leaves the expert GEMMs less than one cluster of two SMs is refused before the call launches
// anything, naming the margin and the device's SMs; the next call with a valid margin runs.
TEST(GpuSmMargin, AMarginThatLeavesNoClusterIsRefused) {
  REQUIRE_GPU();
  const int sms = cuda_sm_count(0);
  MoEProblem p;
  p.T = 96, p.d = 64, p.n = 64, p.E = 4, p.K = 2;
  const LayerCase<double> c(p, 4052);
  for (int margin : {sms - 1, sms, 10 * sms}) {
    const ScopedSmMargin too_many(margin);
    try {
      run_on_gpu(c, DType::kBF16);
      ADD_FAILURE() << "margin " << margin << ": no error";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("SM margin"), std::string::npos) << what;
      EXPECT_NE(what.find("at most " + std::to_string(sms - 2)), std::string::npos) << what;
      EXPECT_NE(what.find(std::to_string(margin)), std::string::npos) << what;
    }
  }
  const ScopedSmMargin most(sms - 2);
  EXPECT_NO_THROW(run_on_gpu(c, DType::kBF16));
}

}  // namespace
}  // namespace machmoe::test
