// Empty work on the GPU runtime: T = 0 and caller routing without pairs give empty outputs, zero counts and zero
// gradients, written by memsets into poisoned buffers (DeviceBuffer fills with 0xFF, a NaN in every float type),
// with the canaries intact, also under CUDA-graph capture.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "gpu_support.hpp"

namespace machmoe::test {
namespace {

void expect_all_zero(const std::vector<double>& v, const std::string& what) {
  for (std::size_t i = 0; i < v.size(); ++i) ASSERT_EQ(v[i], 0.0) << what << "[" << i << "]";
}

void expect_empty_results(const GpuRun& g, const std::string& label) {
  const MoEProblem& p = g.problem;
  EXPECT_TRUE(g.canaries_intact) << label;
  EXPECT_EQ(g.out.size(), static_cast<std::size_t>(p.T * p.d)) << label;
  expect_all_zero(g.out, label + " out");
  for (std::int64_t e = 0; e < p.E; ++e) EXPECT_EQ(g.counts[e], 0) << label << " expert_counts[" << e << "]";
  expect_all_zero(g.dx, label + " grad_x");
  expect_all_zero(g.dw1, label + " grad w1");
  expect_all_zero(g.dw2, label + " grad w2");
  expect_all_zero(g.db1, label + " grad b1");
  expect_all_zero(g.db2, label + " grad b2");
  if (p.routing != RoutingMode::kCallerSupplied) expect_all_zero(g.dwr, label + " grad router_weight");
}

TEST(GpuEmptyWork, ZeroTokensEveryRoutingFullSplitAndCaptured) {
  REQUIRE_GPU();
  for (RoutingMode r : {RoutingMode::kTopK, RoutingMode::kTokenRounding, RoutingMode::kCallerSupplied})
    for (CacheMode cm : {CacheMode::kPreActivation, CacheMode::kInputOnly})
      for (DType dt : {DType::kBF16, DType::kFP16, DType::kFP32}) {
        MoEProblem p;
        p.T = 0, p.d = 128, p.n = 64, p.E = 8, p.K = 2, p.routing = r, p.cache = cm, p.tile_m = 64;
        p.has_b1 = p.has_b2 = true;
        const LayerCase<double> c(p, 3);
        const std::string label = std::string(routing_mode_name(r)) + " " + cache_mode_name(cm) + " " + dtype_name(dt);
        expect_empty_results(run_on_gpu(c, dt), label + " full");
        expect_empty_results(run_on_gpu(c, dt, 0, false, /*split=*/true), label + " split");
        GpuRun captured;
        ASSERT_NO_THROW(captured = run_on_gpu(c, dt, 0, /*graph=*/true)) << label;
        expect_empty_results(captured, label + " captured");
      }
}

TEST(GpuEmptyWork, CallerRoutingWithNoPairsGivesZeroOutputAndGradients) {
  REQUIRE_GPU();
  for (std::int64_t row_pad : {0, 8}) {
    MoEProblem p;
    p.T = 37, p.d = 128, p.n = 64, p.E = 8, p.K = 2, p.routing = RoutingMode::kCallerSupplied;
    p.has_b1 = p.has_b2 = true;
    LayerCase<double> c(p, 4);
    c.pair_token.clear(), c.pair_expert.clear(), c.pair_score.clear();
    c.problem.num_pairs = 0;
    expect_empty_results(run_on_gpu(c, DType::kBF16, row_pad), "row_pad=" + std::to_string(row_pad));
    expect_empty_results(run_on_gpu(c, DType::kBF16, row_pad, false, true), "split row_pad=" + std::to_string(row_pad));
  }
}

}  // namespace
}  // namespace machmoe::test
