// Arguments that used to get past the checks: logits without experts, problems handed to the sizing functions
// unchecked, views with negative extents or a malformed rank, device messages naming an argument the call does not
// have, device ordinals no device has, and row strides cuBLAS cannot take. Each must be refused with a message that
// names the function, the argument, what was expected and what was given.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/checks.hpp"
#include "machmoe/machmoe.hpp"
#include "test_support.hpp"

namespace machmoe::test {
namespace {

// ---- losses: logits of shape (T, 0) ------------------------------------------------------------------------------

TEST(ArgumentHardening, LossesRejectLogitsWithoutExperts) {
  std::vector<double> z(4, 0.0), g(4, 0.0), loss(1, -1.0);
  std::vector<std::int32_t> counts(1, 0);
  const TensorView z30 = TensorView::contiguous(z.data(), DType::kFP64, {3, 0});
  const TensorView g30 = TensorView::contiguous(g.data(), DType::kFP64, {3, 0});
  const TensorView lv = TensorView::contiguous(loss.data(), DType::kFP64, {1});
  // Used to take max_element of an empty row (a crash).
  expect_error([&] { router_z_loss(z30, lv, g30); }, {"machmoe::router_z_loss", "'router_logits'", "E >= 1", "(3, 0)"});
  expect_error([&] { router_z_loss(z30, lv, TensorView()); }, {"'router_logits'", "E >= 1"});
  expect_error([&] { load_balancing_loss(z30, TensorView::contiguous(counts.data(), DType::kInt32, {0}), lv, g30); },
               {"machmoe::load_balancing_loss", "'router_logits'", "E >= 1", "(3, 0)"});
  EXPECT_EQ(loss[0], -1.0);  // nothing written
  // No tokens is an empty batch, not an error.
  const TensorView z04 = TensorView::contiguous(z.data(), DType::kFP64, {0, 4});
  router_z_loss(z04, lv, TensorView::contiguous(g.data(), DType::kFP64, {0, 4}));
  EXPECT_EQ(loss[0], 0.0);
}

// ---- the sizing functions of memory.hpp validate the problem -----------------------------------------------------

MoEProblem small_problem() {
  MoEProblem p;
  p.T = 64, p.d = 32, p.n = 16, p.E = 8, p.K = 2;
  return p;
}

/// Every public sizing function, called on `p` and `dt`, named as its messages name it.
std::vector<std::pair<std::string, std::function<void()>>> sizing_calls(const MoEProblem& p, DType dt) {
  const Device gpu = Device::cuda(0);  // the sizes of a device: no device needed
  return {
      {"saved_layout", [=] { (void)saved_layout(p, dt); }},
      {"activation_memory", [=] { (void)activation_memory(p, dt); }},
      {"forward_workspace_layout", [=] { (void)forward_workspace_layout(p, dt); }},
      {"backward_workspace_layout", [=] { (void)backward_workspace_layout(p, dt); }},
      {"backward_workspace_layout", [=] { (void)backward_workspace_layout(p, dt, true, false); }},
      {"deferred_layout", [=] { (void)deferred_layout(p, dt); }},
      {"forward_workspace_bytes", [=] { (void)forward_workspace_bytes(p, dt, gpu); }},
      {"forward_workspace_bytes", [=] { (void)forward_workspace_bytes(p, dt, Device::cpu()); }},
      {"backward_workspace_bytes", [=] { (void)backward_workspace_bytes(p, dt, gpu, true); }},
      {"backward_workspace_bytes", [=] { (void)backward_workspace_bytes(p, dt, Device::cpu()); }},
      {"backward_input_workspace_bytes", [=] { (void)backward_input_workspace_bytes(p, dt, gpu); }},
      {"backward_input_workspace_bytes", [=] { (void)backward_input_workspace_bytes(p, dt, Device::cpu()); }},
      {"backward_dx_chunks", [=] { (void)backward_dx_chunks(p); }},
      {"backward_dx_chunk_rows", [=] { (void)backward_dx_chunk_rows(p); }},
      {"forward_y_chunks", [=] { (void)forward_y_chunks(p); }},
      {"forward_y_chunk_rows", [=] { (void)forward_y_chunk_rows(p); }},
  };
}

TEST(ArgumentHardening, SizingFunctionsValidateTheProblem) {
  for (const auto& [name, call] : sizing_calls(small_problem(), DType::kBF16)) EXPECT_NO_THROW(call()) << name;

  MoEProblem n0 = small_problem();
  n0.n = 0;  // forward_workspace_bytes divided by it (SIGFPE)
  for (const auto& [name, call] : sizing_calls(n0, DType::kBF16))
    expect_error(call, {("machmoe::" + name + ":").c_str(), "'problem.n'", "got 0"});

  MoEProblem t_neg = small_problem();
  t_neg.T = -1;  // saved_layout wrapped T + 1 and T * E to size_t (a huge size)
  for (const auto& [name, call] : sizing_calls(t_neg, DType::kFP32))
    expect_error(call, {("machmoe::" + name + ":").c_str(), "'problem.T'", "[0, 2147483647]", "got -1"});

  MoEProblem e0 = small_problem();
  e0.E = 0, e0.K = 0;
  for (const auto& [name, call] : sizing_calls(e0, DType::kFP32))
    expect_error(call, {("machmoe::" + name + ":").c_str(), "'problem.E'", "got 0"});

  // The data dtype of functions that take one: a floating dtype the layer runs on.
  for (const auto& [name, call] : sizing_calls(small_problem(), DType::kInt32)) {
    if (name.find("chunk") != std::string::npos) continue;  // no dtype argument
    expect_error(call, {("machmoe::" + name + ":").c_str(), "'data_dtype'", "bf16, fp16, fp32 or fp64", "int32"});
  }
  for (const auto& [name, call] : sizing_calls(small_problem(), static_cast<DType>(42))) {
    if (name.find("chunk") != std::string::npos) continue;
    expect_error(call, {"'data_dtype'", "dtype code 42"});
  }
}

// ---- views: negative extents, malformed ranks ---------------------------------------------------------------------

TEST(ArgumentHardening, NegativeExtentsAreRejected) {
  std::vector<double> buf(64, 0.0), loss(1);
  std::vector<std::int32_t> ibuf(16, 0);
  // combine_rows: rows (-1, -4) with no pairs and no tokens used to pass every check.
  const TensorView rows = TensorView::contiguous(buf.data(), DType::kFP64, {-1, -4});
  const TensorView rp = TensorView::contiguous(ibuf.data(), DType::kInt32, {0});
  const TensorView out = TensorView::contiguous(buf.data(), DType::kFP64, {0, -4});
  expect_error([&] { combine_rows(rows, {}, rp, {}, 1, out); },
               {"machmoe::combine_rows", "'rows'", "non-negative extents", "(-1, -4)"});
  expect_error([&] { combine_rows_backward(out, rows, {}, rp, {}, 1, {}, {}); },
               {"machmoe::combine_rows_backward", "'rows'", "non-negative extents", "(-1, -4)"});
  const TensorView rows_ok = TensorView::contiguous(buf.data(), DType::kFP64, {2, 4});
  expect_error([&] { combine_rows(rows_ok, {}, TensorView::contiguous(ibuf.data(), DType::kInt32, {-2}), {}, 1,
                                  TensorView::contiguous(buf.data(), DType::kFP64, {-2, 4})); },
               {"'row_of_pair'", "non-negative extents", "(-2,)"});
  // grouped_expert_index: the rows come from the index view.
  expect_error([&] { grouped_expert_index(TensorView::contiguous(ibuf.data(), DType::kInt32, {2}),
                                          TensorView::contiguous(ibuf.data(), DType::kInt32, {-4})); },
               {"machmoe::grouped_expert_index", "'expert_index'", "non-negative extents", "(-4,)"});
  // The losses: T and E come from the logits.
  const TensorView lv = TensorView::contiguous(loss.data(), DType::kFP64, {1});
  expect_error([&] { router_z_loss(TensorView::contiguous(buf.data(), DType::kFP64, {-1, 4}), lv, {}); },
               {"machmoe::router_z_loss", "'router_logits'", "non-negative extents", "(-1, 4)"});
  expect_error([&] { load_balancing_loss(TensorView::contiguous(buf.data(), DType::kFP64, {-3, -4}),
                                         TensorView::contiguous(ibuf.data(), DType::kInt32, {-4}), lv, {}); },
               {"machmoe::load_balancing_loss", "'router_logits'", "non-negative extents", "(-3, -4)"});
}

TEST(ArgumentHardening, ShapesWhoseElementCountOverflowsAreRejected) {
  std::vector<double> loss(1);
  const std::int64_t big = std::int64_t{1} << 32;
  // (2^32, 2^32) has 2^64 elements: numel() wrapped to 0, and a null pointer passed as addressing nothing.
  const TensorView huge = TensorView::contiguous(nullptr, DType::kFP64, {big, big});
  expect_error([&] { router_z_loss(huge, TensorView::contiguous(loss.data(), DType::kFP64, {1}), {}); },
               {"machmoe::router_z_loss", "'router_logits'", "fits in 64 bits", "(4294967296, 4294967296)"});
  // A zero extent anywhere: no elements, whatever the others.
  router_z_loss(TensorView::contiguous(nullptr, DType::kFP64, {0, big}),
                TensorView::contiguous(loss.data(), DType::kFP64, {1}), {});
  EXPECT_EQ(loss[0], 0.0);
}

/// A view whose rank is outside [0, kMaxRank], as a binding or a hand-filled struct could make.
TensorView with_rank(void* data, DType dt, int rank) {
  TensorView v = TensorView::contiguous(data, dt, {1, 2, 3, 4});
  v.rank = rank;
  return v;
}

TEST(ArgumentHardening, PrintingAMalformedRankStaysInsideTheView) {
  std::vector<double> buf(24);
  const TensorView big = with_rank(buf.data(), DType::kFP64, 9), neg = with_rank(buf.data(), DType::kFP64, -3);
  EXPECT_EQ(big.shape_string(), "(1, 2, 3, 4)");
  EXPECT_EQ(big.stride_string(), "(24, 12, 4, 1)");
  EXPECT_EQ(big.numel(), 24);
  EXPECT_EQ(neg.shape_string(), "()");
  EXPECT_EQ(neg.numel(), 1);
  EXPECT_TRUE(neg.is_contiguous());
}

TEST(ArgumentHardening, MalformedRankIsRejectedBeforeTheShapeIsRead) {
  std::vector<double> buf(64, 0.0), loss(1);
  std::vector<std::int32_t> ibuf(16, 0);
  for (int rank : {5, 1000, -1}) {
    SCOPED_TRACE(rank);
    const std::string got = "rank " + std::to_string(rank);
    const TensorView bad = with_rank(buf.data(), DType::kFP64, rank);
    const TensorView bad_i = with_rank(ibuf.data(), DType::kInt32, rank);
    const TensorView rows = TensorView::contiguous(buf.data(), DType::kFP64, {2, 4});
    const TensorView rp = TensorView::contiguous(ibuf.data(), DType::kInt32, {2});
    const TensorView out = TensorView::contiguous(buf.data(), DType::kFP64, {2, 4});
    const TensorView scores = TensorView::contiguous(buf.data(), DType::kFP64, {2});
    expect_error([&] { combine_rows(bad, {}, rp, {}, 1, out); },
                 {"machmoe::combine_rows", "'rows'", "rank 0 to 4", got.c_str()});
    expect_error([&] { combine_rows(rows, {}, bad_i, {}, 1, out); }, {"'row_of_pair'", "rank 0 to 4", got.c_str()});
    expect_error([&] { combine_rows(rows, {}, rp, {}, 1, bad); }, {"'out'", "rank 0 to 4", got.c_str()});
    expect_error([&] { combine_rows_backward(bad, rows, scores, rp, {}, 1, {}, {}); },
                 {"'grad_out'", "rank 0 to 4", got.c_str()});
    expect_error([&] { combine_rows_backward(out, rows, scores, rp, {}, 1, bad, {}); },
                 {"'grad_rows'", "rank 0 to 4", got.c_str()});
    expect_error([&] { grouped_expert_index(bad_i, rp); }, {"'expert_counts'", "rank 0 to 4", got.c_str()});
    expect_error([&] { grouped_expert_index(TensorView::contiguous(ibuf.data(), DType::kInt32, {2}), bad_i); },
                 {"'expert_index'", "rank 0 to 4", got.c_str()});
    const TensorView lv = TensorView::contiguous(loss.data(), DType::kFP64, {1});
    expect_error([&] { router_z_loss(bad, lv, {}); }, {"'router_logits'", "rank 0 to 4", got.c_str()});
    expect_error([&] { router_z_loss(TensorView::contiguous(buf.data(), DType::kFP64, {2, 4}), bad, {}); },
                 {"'loss'", "rank 0 to 4", got.c_str()});
  }
}

// ---- the layer: views with a malformed rank, devices --------------------------------------------------------------

/// A valid fp64 top-K layer call on host buffers (T=5, d=8, n=4, E=4, K=2).
struct SmallCall {
  LayerCase<double> lc{[] {
                         MoEProblem p;
                         p.T = 5, p.d = 8, p.n = 4, p.E = 4, p.K = 2;
                         return p;
                       }(),
                       11};
  HostLayerInputs<double> in{lc, DType::kFP64};
  std::vector<double> out = std::vector<double>(40), logits = std::vector<double>(20);
  std::vector<std::int32_t> counts = std::vector<std::int32_t>(4);
  std::vector<unsigned char> saved = std::vector<unsigned char>(saved_layout(lc.problem, DType::kFP64).total_bytes);
  TensorView x = TensorView::contiguous(in.x.data(), DType::kFP64, {5, 8});
  ForwardOutputs fo;

  SmallCall() {
    fo.out = TensorView::contiguous(out.data(), DType::kFP64, {5, 8});
    fo.router_logits = TensorView::contiguous(logits.data(), DType::kFP64, {5, 4});
    fo.expert_counts = TensorView::contiguous(counts.data(), DType::kInt32, {4});
  }
  void forward_call() { forward(lc.problem, x, in.weights, nullptr, fo, {saved.data(), saved.size(), nullptr, 0}); }
  /// Every view of the call on `device`.
  void move_to(const Device& device) {
    for (TensorView* v : {&x, &in.weights.router_weight, &in.weights.w1, &in.weights.w2, &fo.out, &fo.router_logits,
                          &fo.expert_counts})
      v->device = device;
  }
};

TEST(ArgumentHardening, LayerRejectsAMalformedRank) {
  SmallCall c;
  c.forward_call();  // valid as built
  c.x.rank = 6;
  expect_error([&] { c.forward_call(); }, {"machmoe::forward", "'x'", "rank 0 to 4", "rank 6"});
  SmallCall d;
  d.in.weights.w2.rank = -2;
  expect_error([&] { d.forward_call(); }, {"'weights.w2'", "rank 0 to 4", "rank -2"});
}

TEST(ArgumentHardening, DeviceMessagesNameTheCallsOwnReferenceArgument) {
  std::vector<double> buf(64, 0.0), loss(1);
  std::vector<std::int32_t> ibuf(16, 0);
  const TensorView rows = TensorView::contiguous(buf.data(), DType::kFP64, {2, 4});
  const TensorView rp = TensorView::contiguous(ibuf.data(), DType::kInt32, {2});
  const TensorView out_gpu = TensorView::contiguous(buf.data(), DType::kFP64, {2, 4}, Device::cuda(0));
  expect_error([&] { combine_rows(rows, {}, rp, {}, 1, out_gpu); },
               {"'out'", "a tensor on cpu (the device of rows)", "got a tensor on cuda:0"});
  const TensorView z = TensorView::contiguous(buf.data(), DType::kFP64, {2, 4});
  expect_error([&] { router_z_loss(z, TensorView::contiguous(loss.data(), DType::kFP64, {1}, Device::cuda(0)), {}); },
               {"'loss'", "(the device of router_logits)"});
  // The layer's reference argument is x.
  SmallCall c;
  c.in.weights.w1.device = Device::cuda(0);
  expect_error([&] { c.forward_call(); }, {"'weights.w1'", "(the device of x)"});
}

TEST(ArgumentHardening, DeviceOrdinalsAndTypesAreChecked) {
  const detail::ArgChecker c("probe", "x");
  c.device(Device::cpu(), "x");
  expect_error([&] { c.device(Device{DeviceType::kCPU, 3}, "x"); },
               {"machmoe::probe", "'x'", "index 0 on the cpu", "cpu device index 3"});
  expect_error([&] { c.device(Device{static_cast<DeviceType>(9), 0}, "x"); }, {"'x'", "cpu or cuda", "code 9"});
  EXPECT_EQ(device_name(Device{static_cast<DeviceType>(9), 1}), "device of type code 9:1");
  const int count = cuda_device_count();
  for (int ordinal : {count, count + 6, -1}) {
    const std::string got = "got cuda:" + std::to_string(ordinal);
    if (count == 0)
      expect_error([&] { c.device(Device::cuda(ordinal), "x"); }, {"'x'", "sees none", got.c_str()});
    else
      expect_error([&] { c.device(Device::cuda(ordinal), "x"); },
                   {"'x'", ("[0, " + std::to_string(count) + ")").c_str(), got.c_str()});
  }
  for (int ordinal = 0; ordinal < count; ++ordinal) c.device(Device::cuda(ordinal), "x");
  // Compute capability: 0 for an ordinal no device has (and without CUDA); a device that passed above is a Hopper,
  // the only GPU the CUDA build's kernels run on.
  for (int ordinal : {-1, count, count + 6}) {
    EXPECT_EQ(cuda_compute_capability(ordinal), 0) << ordinal;
    EXPECT_EQ(cuda_memory_bandwidth_gbps(ordinal), 0) << ordinal;
    EXPECT_EQ(cuda_device_description(ordinal), "") << ordinal;
  }
  for (int ordinal = 0; ordinal < count; ++ordinal)
    EXPECT_EQ(cuda_compute_capability(ordinal), kCudaComputeCapability) << ordinal;

  // Entry points: a cpu device with another index used to pass (every view had the same wrong index).
  SmallCall call;
  call.move_to(Device{DeviceType::kCPU, 2});
  expect_error([&] { call.forward_call(); }, {"machmoe::forward", "'x'", "index 0 on the cpu"});
  expect_error([] { check_device_errors(Device{DeviceType::kCPU, 1}); },
               {"machmoe::check_device_errors", "'device'", "index 0 on the cpu"});
  // A CUDA ordinal no device has: without CUDA the build's own error comes first; with it, the ordinal's.
  SmallCall gpu;
  gpu.move_to(Device::cuda(count + 7));
  const std::string ordinal_got = "cuda:" + std::to_string(count + 7);
  if (!built_with_cuda()) {
    expect_error([&] { gpu.forward_call(); }, {"'x'", "this build has no CUDA support", ordinal_got.c_str()});
    expect_error([&] { check_device_errors(Device::cuda(count + 7)); },
                 {"'device'", "this build has no CUDA support", ordinal_got.c_str()});
    std::vector<std::int32_t> ibuf(4, 0);
    const TensorView counts = TensorView::contiguous(ibuf.data(), DType::kInt32, {2}, Device::cuda(7));
    const TensorView index = TensorView::contiguous(ibuf.data(), DType::kInt32, {0}, Device::cuda(7));
    expect_error([&] { grouped_expert_index(counts, index); },
                 {"'expert_counts'", "this build has no CUDA support", "cuda:7"});
  } else {
    expect_error([] { check_device_errors(Device::cuda(-1)); }, {"'device'", "got cuda:-1"});
  }
}

// ---- row strides the GPU path hands to cuBLAS ----------------------------------------------------------------------

TEST(ArgumentHardening, CublasRowStridesMustFitAnInt) {
  const detail::ArgChecker c("forward", "x");
  std::vector<float> buf(64);
  const char* why = "an operand of the router GEMM";
  c.int32_row_stride(TensorView::contiguous(buf.data(), DType::kFP32, {4, 8}), "x", why);
  c.int32_row_stride(TensorView::strided(buf.data(), DType::kFP32, {4, 8}, {2147483647, 1}), "x", why);
  expect_error([&] { c.int32_row_stride(TensorView::strided(buf.data(), DType::kFP32, {4, 8}, {2147483648LL, 1}),
                                        "x", why); },
               {"machmoe::forward", "'x.stride'", "[8, 2^31 - 1]", "cuBLAS", "(2147483648, 1)"});
  // One row: the layout checks allow any stride, cuBLAS still wants at least the row's length.
  expect_error([&] { c.int32_row_stride(TensorView::strided(buf.data(), DType::kFP32, {1, 8}, {0, 1}), "x", why); },
               {"'x.stride'", "[8, 2^31 - 1]", "(0, 1)"});
  // No elements: nothing is read, any strides.
  c.int32_row_stride(TensorView::strided(buf.data(), DType::kFP32, {0, 8}, {0, 0}), "x", why);
  c.int32_row_stride(TensorView(), "x", why);
}

// ---- strides: rows may be padded but never overlap -----------------------------------------------------------------

TEST(ArgumentHardening, SizeOneDimensionsCannotHideOverlappingStrides) {
  const detail::ArgChecker c("forward", "x");
  std::vector<double> buf(64, 0.0);
  const auto check = [&](std::initializer_list<std::int64_t> shape, std::initializer_list<std::int64_t> stride) {
    const TensorView t = TensorView::strided(buf.data(), DType::kFP64, shape, stride);
    std::vector<std::int64_t> s(t.shape, t.shape + t.rank);
    switch (t.rank) {  // tensor() takes the expected shape as a list
      case 2: c.tensor(t, "out", {s[0], s[1]}, DType::kFP64, Device::cpu()); break;
      case 3: c.tensor(t, "out", {s[0], s[1], s[2]}, DType::kFP64, Device::cpu()); break;
      default: c.tensor(t, "out", {s[0], s[1], s[2], s[3]}, DType::kFP64, Device::cpu()); break;
    }
  };
  // Used to pass: the stride * shape of a size-1 inner dimension (0 here) bounded the outer stride.
  expect_error([&] { check({3, 1}, {0, 0}); },
               {"machmoe::forward", "'out.stride'", "non-overlapping", "dimension 0 needs stride >= 1", "got (0, 0)"});
  expect_error([&] { check({2, 1, 4}, {2, 0, 1}); }, {"'out.stride'", "dimension 0 needs stride >= 4", "(2, 0, 1)"});
  expect_error([&] { check({2, 1, 2, 3}, {4, 0, 3, 1}); }, {"'out.stride'", "dimension 0 needs stride >= 6"});
  // And where stride * shape wrapped: 2^62 * 3 is negative in 64 bits.
  expect_error([&] { check({2, 3, 4}, {8, std::int64_t{1} << 62, 1}); },
               {"'out.stride'", "fewer than 2^63 elements", "(8, 4611686018427387904, 1)", "(2, 3, 4)"});
  expect_error([&] { check({3, 2}, {0, 1}); }, {"'out.stride'", "dimension 0 needs stride >= 2"});  // as before
  // Still accepted: contiguous views as torch gives them ((T, 1) has strides (1, 1)), padded rows, and size-1
  // dimensions with any stride where nothing overlaps; a view with no elements takes any strides.
  check({3, 1}, {1, 1});
  check({3, 1}, {5, 1});
  check({3, 1}, {1, 999});
  check({1, 8}, {0, 1});
  check({2, 1, 4}, {4, 0, 1});
  check({2, 1, 4}, {4, 77, 1});
  check({2, 1, 4}, {1000, -3, 1});
  check({2, 3, 4}, {12, 4, 1});
  check({2, 3, 4}, {15, 5, 1});  // padded rows: the last row of a block ends at 14
  check({2, 2, 1, 3}, {6, 3, 0, 1});
  check({1, 1, 1, 1}, {0, 0, 0, 0});
  check({0, 4}, {0, 0});
  check({3, 0, 4}, {-1, 0, 7});
  // End to end: an output whose 3 rows of one element share one address (d = 1) is refused, unwritten.
  MoEProblem p;
  p.T = 3, p.d = 1, p.n = 2, p.E = 2, p.K = 1;
  const LayerCase<double> lc(p, 5);
  HostLayerInputs<double> in(lc, DType::kFP64);
  std::vector<double> out(1, -99.0), logits(6, -99.0);
  std::vector<std::int32_t> counts(2, -5);
  std::vector<unsigned char> saved(saved_layout(p, DType::kFP64).total_bytes, 0xAB);
  ForwardOutputs fo;
  fo.out = TensorView::strided(out.data(), DType::kFP64, {3, 1}, {0, 0});
  fo.router_logits = TensorView::contiguous(logits.data(), DType::kFP64, {3, 2});
  fo.expert_counts = TensorView::contiguous(counts.data(), DType::kInt32, {2});
  const TensorView x = TensorView::contiguous(in.x.data(), DType::kFP64, {3, 1});
  const ForwardBuffers fb{saved.data(), saved.size(), nullptr, 0};
  expect_error([&] { forward(p, x, in.weights, nullptr, fo, fb); },
               {"machmoe::forward", "'outputs.out.stride'", "dimension 0 needs stride >= 1", "got (0, 0)"});
  EXPECT_EQ(out, std::vector<double>(1, -99.0));
  EXPECT_EQ(logits, std::vector<double>(6, -99.0));
  EXPECT_EQ(counts, std::vector<std::int32_t>(2, -5));
  EXPECT_EQ(saved, std::vector<unsigned char>(saved.size(), 0xAB));
  fo.out = TensorView::strided(out.data(), DType::kFP64, {3, 1}, {1, 1});  // torch's contiguous (T, 1)
  out.assign(3, -99.0);
  fo.out.data = out.data();
  forward(p, x, in.weights, nullptr, fo, fb);
  EXPECT_NE(out[0], -99.0);
}

}  // namespace
}  // namespace machmoe::test
