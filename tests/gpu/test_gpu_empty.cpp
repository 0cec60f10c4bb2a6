// Empty work and device-side index checking on the GPU runtime.
//  * T = 0 and caller routing without pairs: empty outputs, zero counts, zero gradients written by memsets into
//    poisoned buffers (DeviceBuffer fills with 0xFF, a NaN in every float type), canaries intact, capturable.
//  * Index checking (include/machmoe/index_checking.hpp): out-of-range and misordered caller indices and bad grouped
//    counts are recorded on the device and raised at check_device_errors() or at the next entry point, never read
//    out of bounds; with checking off they are skipped silently, as before.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
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

// ---- index checking ------------------------------------------------------------------------------------------------

/// Turns checking on for a test and restores the previous state.
struct CheckingOn {
  bool before = index_checking_enabled();
  CheckingOn() { set_index_checking(true); }
  ~CheckingOn() { set_index_checking(before); }
};

/// A caller-routing forward on the device with the given int64 triples (fp32 data, T = 6, E = 4, K = 2).
struct CallerForward {
  MoEProblem p;
  LayerCase<double> c;
  DeviceBuffer x, w1, w2, tok, exp, score, out, counts, saved, ws, gout, dx, dw1, dw2, dsc, bws;
  LayerWeights w;
  RoutingTriples rt;
  cudaStream_t stream = nullptr;

  static MoEProblem problem(std::int64_t pairs) {
    MoEProblem q;
    q.T = 6, q.d = 64, q.n = 32, q.E = 4, q.K = 2, q.routing = RoutingMode::kCallerSupplied, q.num_pairs = pairs;
    return q;
  }
  template <class V>
  static std::vector<unsigned char> bytes(const V& v) {
    std::vector<unsigned char> b(v.size() * sizeof(v[0]));
    if (!v.empty()) std::memcpy(b.data(), v.data(), b.size());
    return b;
  }
  CallerForward(const std::vector<std::int64_t>& token, const std::vector<std::int64_t>& expert)
      : p(problem(static_cast<std::int64_t>(token.size()))),
        c(p, 21),
        x(encode(c.x, DType::kFP32)),
        w1(encode(c.w1, DType::kFP32)),
        w2(encode(c.w2, DType::kFP32)),
        tok(bytes(token)),
        exp(bytes(expert)),
        score(bytes(std::vector<float>(token.size(), 0.5f))),
        out(p.T * p.d * 4),
        counts(p.E * 4),
        saved(saved_layout(p, DType::kFP32).total_bytes),
        ws(forward_workspace_bytes(p, DType::kFP32, Device::cuda(0))),
        gout(encode(c.grad_out, DType::kFP32)),
        dx(p.T * p.d * 4),
        dw1(c.w1.size() * 4),
        dw2(c.w2.size() * 4),
        dsc(token.size() * 4),
        bws(backward_workspace_bytes(p, DType::kFP32, Device::cuda(0))) {
    const Device dev = Device::cuda(0);
    w.w1 = TensorView::contiguous(w1.get(), DType::kFP32, {p.E, p.w1_rows(), p.d}, dev);
    w.w2 = TensorView::contiguous(w2.get(), DType::kFP32, {p.E, p.d, p.n}, dev);
    rt.token_index = TensorView::contiguous(tok.get(), DType::kInt64, {p.num_pairs}, dev);
    rt.expert_index = TensorView::contiguous(exp.get(), DType::kInt64, {p.num_pairs}, dev);
    rt.score = TensorView::contiguous(score.get(), DType::kFP32, {p.num_pairs}, dev);
  }
  TensorView xv() const { return TensorView::contiguous(x.get(), DType::kFP32, {p.T, p.d}, Device::cuda(0)); }
  void forward_call() {
    const Device dev = Device::cuda(0);
    ForwardOutputs fo;
    fo.out = TensorView::contiguous(out.get(), DType::kFP32, {p.T, p.d}, dev);
    fo.expert_counts = TensorView::contiguous(counts.get(), DType::kInt32, {p.E}, dev);
    forward(p, xv(), w, &rt, fo, {saved.get(), saved.bytes(), ws.get(), ws.bytes()}, stream);
  }
  void backward_call() {
    const Device dev = Device::cuda(0);
    BackwardInputs bi;
    bi.grad_out = TensorView::contiguous(gout.get(), DType::kFP32, {p.T, p.d}, dev);
    BackwardOutputs bo;
    bo.grad_x = TensorView::contiguous(dx.get(), DType::kFP32, {p.T, p.d}, dev);
    bo.grad_weights.w1 = TensorView::contiguous(dw1.get(), DType::kFP32, {p.E, p.w1_rows(), p.d}, dev);
    bo.grad_weights.w2 = TensorView::contiguous(dw2.get(), DType::kFP32, {p.E, p.d, p.n}, dev);
    bo.grad_scores = TensorView::contiguous(dsc.get(), DType::kFP32, {p.num_pairs}, dev);
    backward(p, xv(), w, &rt, bi, bo, {saved.get(), saved.bytes(), bws.get(), bws.bytes()}, stream);
  }
};

TEST(GpuIndexChecking, OutOfRangeAndMisorderedCallerIndicesRaiseAtCheckDeviceErrors) {
  REQUIRE_GPU();
  const CheckingOn on;
  struct Bad {
    std::vector<std::int64_t> token, expert;
    std::vector<const char*> fragments;
  };
  const Bad cases[] = {
      {{0, 0, 1, 3, 3, 5}, {1, 2, 0, 9, 1, 2}, {"'routing.expert_index[3]'", "[0, 4)", "got 9", "cuda:0"}},
      {{0, 0, 1, 3, 3, 5}, {1, 2, -1, 3, 1, 2}, {"'routing.expert_index[2]'", "[0, 4)", "got -1"}},
      {{0, 0, 1, 3, 3, 6}, {1, 2, 0, 3, 1, 2}, {"'routing.token_index[5]'", "[0, 6)", "got 6"}},
      {{0, 0, 2, 1, 3, 5}, {1, 2, 0, 3, 1, 2}, {"'routing.token_index[3]'", "ascending", ">= 2", "got 1"}},
      {{0, 0, 0, 3, 3, 5}, {1, 2, 0, 3, 1, 2},
       {"'routing.token_index[2]'", "at most K = 2 pairs per token", "at least 3 pairs for token 0"}},
  };
  for (const Bad& b : cases) {
    CallerForward f(b.token, b.expert);
    ASSERT_NO_THROW(f.forward_call()) << "the forward that records the violation does not wait for it";
    try {
      check_device_errors(Device::cuda(0), f.stream);
      ADD_FAILURE() << "no error for " << b.fragments[0];
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("check_device_errors"), std::string::npos) << msg;
      for (const char* frag : b.fragments) EXPECT_NE(msg.find(frag), std::string::npos) << "message: " << msg;
    }
    EXPECT_NO_THROW(check_device_errors(Device::cuda(0), f.stream)) << "the record is cleared once raised";
    EXPECT_TRUE(f.out.canary_intact());
  }
  // Valid triples record nothing.
  CallerForward good({0, 0, 1, 3, 3, 5}, {1, 2, 0, 3, 1, 2});
  good.forward_call();
  EXPECT_NO_THROW(check_device_errors(Device::cuda(0), good.stream));
}

// The next entry point raises what an earlier, completed launch recorded, without waiting for anything itself.
TEST(GpuIndexChecking, NextEntryPointRaisesAnEarlierLaunchsViolation) {
  REQUIRE_GPU();
  const CheckingOn on;
  CallerForward f({0, 0, 1, 3, 3, 5}, {1, 2, 0, 3, 7, 2});
  f.forward_call();
  ASSERT_EQ(cudaStreamSynchronize(f.stream), cudaSuccess);
  expect_error([&] { f.backward_call(); }, {"machmoe::backward", "'routing.expert_index[4]'", "got 7"});
  EXPECT_NO_THROW(f.backward_call()) << "raised once, then cleared";
  EXPECT_NO_THROW(check_device_errors(Device::cuda(0), f.stream));
}

// Default mode: the same indices are skipped (expert-parallel sentinels) and nothing is raised, ever.
TEST(GpuIndexChecking, OffByDefaultSkipsSilently) {
  REQUIRE_GPU();
  const bool before = index_checking_enabled();
  set_index_checking(false);
  CallerForward f({0, 0, 1, 3, 3, 5}, {1, 2, 0, 9, -1, 2});
  EXPECT_NO_THROW(f.forward_call());
  EXPECT_NO_THROW(check_device_errors(Device::cuda(0), f.stream));
  EXPECT_NO_THROW(f.backward_call());
  ASSERT_EQ(cudaStreamSynchronize(f.stream), cudaSuccess);
  const std::vector<unsigned char> h = f.counts.download();
  std::int32_t counts[4];
  std::memcpy(counts, h.data(), sizeof counts);
  EXPECT_EQ(counts[0], 1);
  EXPECT_EQ(counts[1], 1);
  EXPECT_EQ(counts[2], 2);
  EXPECT_EQ(counts[3], 0) << "the pair with expert 9 is skipped";
  set_index_checking(before);
}

std::vector<std::int32_t> grouped_index_on_gpu(const std::vector<std::int64_t>& counts, std::int64_t rows) {
  DeviceBuffer c(CallerForward::bytes(counts)), idx(static_cast<std::size_t>(rows) * 4);
  const Device dev = Device::cuda(0);
  grouped_expert_index(TensorView::contiguous(c.get(), DType::kInt64, {static_cast<std::int64_t>(counts.size())}, dev),
                       TensorView::contiguous(idx.get(), DType::kInt32, {rows}, dev));
  const std::vector<unsigned char> h = idx.download();
  std::vector<std::int32_t> out(static_cast<std::size_t>(rows));
  if (rows > 0) std::memcpy(out.data(), h.data(), h.size());
  EXPECT_TRUE(idx.canary_intact()) << "grouped_expert_index wrote past its output";
  return out;
}

TEST(GpuGroupedExpertIndex, MatchesTheExpansionAndStaysInBounds) {
  REQUIRE_GPU();
  const bool before = index_checking_enabled();
  set_index_checking(false);
  // Many experts (several 256-expert chunks) and several 2048-row blocks, with empty experts.
  std::vector<std::int64_t> counts(700);
  std::vector<std::int32_t> expect;
  for (std::size_t e = 0; e < counts.size(); ++e) {
    counts[e] = (e % 7 == 3) ? 0 : static_cast<std::int64_t>((e * 37) % 23);
    for (std::int64_t i = 0; i < counts[e]; ++i) expect.push_back(static_cast<std::int32_t>(e));
  }
  const std::int64_t rows = static_cast<std::int64_t>(expect.size());
  EXPECT_EQ(grouped_index_on_gpu(counts, rows), expect);
  // Counts summing past the rows: the first rows as before, nothing written past the output.
  std::vector<std::int32_t> head(expect.begin(), expect.begin() + 5000);
  EXPECT_EQ(grouped_index_on_gpu(counts, 5000), head);
  // Counts summing short of the rows: the rows past the total get expert E (skipped by the layer).
  const std::vector<std::int32_t> tail = grouped_index_on_gpu({2, 1}, 5);
  EXPECT_EQ(tail, (std::vector<std::int32_t>{0, 0, 1, 2, 2}));
  // Negative counts: every row still gets an expert in [0, E].
  for (std::int32_t e : grouped_index_on_gpu({3, -2, 4, -100, 2}, 9)) {
    EXPECT_GE(e, 0);
    EXPECT_LE(e, 5);
  }
  EXPECT_NO_THROW(check_device_errors(Device::cuda(0)));
  set_index_checking(before);
}

TEST(GpuGroupedExpertIndex, BadCountsRaiseWithChecking) {
  REQUIRE_GPU();
  const CheckingOn on;
  grouped_index_on_gpu({3, -2, 4}, 5);
  expect_error([] { check_device_errors(Device::cuda(0)); },
               {"'expert_counts[1]'", "a count >= 0", "got -2"});
  grouped_index_on_gpu({3, 2, 4}, 5);
  expect_error([] { check_device_errors(Device::cuda(0)); },
               {"'expert_counts'", "summing to the 5 grouped rows", "got a sum of 9"});
  grouped_index_on_gpu({0, 0}, 0);  // no rows: the counts are still validated, and these are right
  EXPECT_NO_THROW(check_device_errors(Device::cuda(0)));
  grouped_index_on_gpu({1, 0}, 0);
  expect_error([] { check_device_errors(Device::cuda(0)); }, {"'expert_counts'", "summing to the 0 grouped rows"});
}

}  // namespace
}  // namespace machmoe::test
