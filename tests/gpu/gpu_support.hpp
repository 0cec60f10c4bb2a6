// Helpers of the GPU tests: device buffers, host encoding of bf16/fp16/fp32, and one forward+backward through the
// public API on device memory, with poisoned outputs and canaries around every caller buffer.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "machmoe/machmoe.hpp"
#include "test_support.hpp"

namespace machmoe::test {

#define GPU_CHECK(call) ASSERT_EQ((call), cudaSuccess) << #call

/// Fails (does not skip) when there is no GPU: a GPU test that passes without one would prove nothing.
inline void require_gpu() {
  ASSERT_GT(cuda_device_count(), 0) << "GPU test run on a machine without a usable CUDA device";
}
/// In a test body: stop the test when require_gpu() failed.
#define REQUIRE_GPU() ASSERT_NO_FATAL_FAILURE(::machmoe::test::require_gpu())

/// The fallback policy for a scope, restored on exit. A test that claims a layer ran on the Hopper kernels sets
/// FallbackPolicy::kError: a GEMM that fell back would throw instead of passing quietly on the reference path
/// (the default policy only writes a line to stderr).
class ScopedFallbackPolicy {
 public:
  explicit ScopedFallbackPolicy(FallbackPolicy policy) : saved_(fallback_policy()) { set_fallback_policy(policy); }
  ~ScopedFallbackPolicy() { set_fallback_policy(saved_); }
  ScopedFallbackPolicy(const ScopedFallbackPolicy&) = delete;
  ScopedFallbackPolicy& operator=(const ScopedFallbackPolicy&) = delete;

 private:
  FallbackPolicy saved_;
};

/// Records what the running test is doing now (e.g. the kernel configuration it is about to launch): the hang
/// watchdog (gpu_watchdog.cpp) prints the last note when a test overruns MACHMOE_GPU_TEST_TIMEOUT_S (default 120 s)
/// and exits with status 124. With MACHMOE_GPU_TEST_PROGRESS set, every note is also printed to stderr at once.
void progress(const std::string& what);

inline std::uint16_t to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<std::uint16_t>(u >> 16);
}
inline float from_bf16(std::uint16_t h) {
  const std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/// Encodes doubles into `dt` bytes.
inline std::vector<unsigned char> encode(const std::vector<double>& v, DType dt) {
  std::vector<unsigned char> out(v.size() * dtype_size(dt));
  for (std::size_t i = 0; i < v.size(); ++i) {
    const float f = static_cast<float>(v[i]);
    if (dt == DType::kBF16) {
      const std::uint16_t h = to_bf16(f);
      std::memcpy(&out[2 * i], &h, 2);
    } else if (dt == DType::kFP16) {
      const __half h = __float2half_rn(f);
      std::memcpy(&out[2 * i], &h, 2);
    } else {
      std::memcpy(&out[4 * i], &f, 4);
    }
  }
  return out;
}

inline std::vector<double> decode(const unsigned char* bytes, std::size_t count, DType dt) {
  std::vector<double> out(count);
  for (std::size_t i = 0; i < count; ++i) {
    if (dt == DType::kBF16) {
      std::uint16_t h;
      std::memcpy(&h, bytes + 2 * i, 2);
      out[i] = from_bf16(h);
    } else if (dt == DType::kFP16) {
      __half h;
      std::memcpy(&h, bytes + 2 * i, 2);
      out[i] = __half2float(h);
    } else {
      float f;
      std::memcpy(&f, bytes + 4 * i, 4);
      out[i] = f;
    }
  }
  return out;
}

/// Rounds values to `dt` and back, so the CPU reference sees exactly the GPU's inputs.
inline std::vector<double> quantize(const std::vector<double>& v, DType dt) {
  const std::vector<unsigned char> b = encode(v, dt);
  return decode(b.data(), v.size(), dt);
}

/// Device allocation with a canary of kCanary bytes after the requested size. With a `lead`, the buffer starts that
/// many bytes into its allocation (cudaMalloc's are 256-byte aligned), and those bytes are a canary too.
class DeviceBuffer {
 public:
  static constexpr std::size_t kCanary = 4096;
  static constexpr unsigned char kCanaryByte = 0xA5;
  explicit DeviceBuffer(std::size_t bytes, unsigned char fill = 0xFF, std::size_t lead = 0)
      : bytes_(bytes), lead_(lead) {
    if (cudaMalloc(&base_, lead + bytes + kCanary) != cudaSuccess) throw std::runtime_error("cudaMalloc failed");
    ptr_ = static_cast<char*>(base_) + lead;
    cudaMemset(base_, kCanaryByte, lead);
    cudaMemset(ptr_, fill, bytes);
    cudaMemset(static_cast<char*>(ptr_) + bytes, kCanaryByte, kCanary);
    // cudaMemset on device memory returns before it runs, on the legacy default stream, which does not order the
    // non-blocking streams the layer runs on: a layer's zero-fill could land before this fill and be overwritten by
    // it (GpuEmptyWork read the 0xFF poison as dW2 once, with the other gtest shard loading the GPU). Done here.
    if (cudaStreamSynchronize(cudaStreamLegacy) != cudaSuccess) throw std::runtime_error("DeviceBuffer fill failed");
  }
  DeviceBuffer(const std::vector<unsigned char>& host, unsigned char fill = 0xFF) : DeviceBuffer(host.size(), fill) {
    cudaMemcpy(ptr_, host.data(), host.size(), cudaMemcpyHostToDevice);
    // From pageable memory the copy may return before its DMA into ptr_ has finished (CUDA's API synchronisation
    // rules); the non-blocking streams the layer runs on would not wait for it.
    if (cudaStreamSynchronize(cudaStreamLegacy) != cudaSuccess) throw std::runtime_error("DeviceBuffer upload failed");
  }
  ~DeviceBuffer() { cudaFree(base_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return ptr_; }
  std::size_t bytes() const { return bytes_; }
  std::vector<unsigned char> download() const {
    std::vector<unsigned char> h(bytes_);
    cudaMemcpy(h.data(), ptr_, bytes_, cudaMemcpyDeviceToHost);
    return h;
  }
  /// The canaries behind the buffer and, with a lead, in front of it.
  bool canary_intact() const {
    std::vector<unsigned char> h(kCanary);
    cudaMemcpy(h.data(), static_cast<char*>(ptr_) + bytes_, kCanary, cudaMemcpyDeviceToHost);
    std::vector<unsigned char> front(lead_);
    if (lead_ > 0) cudaMemcpy(front.data(), base_, lead_, cudaMemcpyDeviceToHost);
    const auto intact = [](const std::vector<unsigned char>& v) {
      return std::all_of(v.begin(), v.end(), [](unsigned char c) { return c == kCanaryByte; });
    };
    return intact(h) && intact(front);
  }

 private:
  void* base_ = nullptr;  // the allocation
  void* ptr_ = nullptr;   // the buffer: base_ + lead_
  std::size_t bytes_ = 0, lead_ = 0;
};

/// Everything a forward + backward on the GPU produced, decoded to double.
struct GpuRun {
  std::vector<double> out, logits, dx, dwr, dw1, db1, dw2, db2, dscores;
  std::vector<std::int32_t> counts;
  std::vector<unsigned char> saved;   // the raw saved buffer after the forward
  std::vector<unsigned char> raw_out, raw_dx, raw_dw1, raw_dw2;  // bitwise comparisons
  bool canaries_intact = true;
  bool w1_gap_intact = true;  // GpuRunOptions::w1_gap: the poison between W1's gradient's halves is untouched
  MoEProblem problem;
};

/// Expects `b` to hold bitwise `a`'s backward results: grad x, every weight gradient, the score gradients. `a` must
/// be a complete backward: its outputs start poisoned (0xFF bytes, NaN in every dtype), so equal raw bytes would
/// also pass where neither run wrote; a NaN in `a` fails instead.
inline void expect_same_backward(const GpuRun& b, const GpuRun& a, const std::string& what) {
  for (const auto* v : {&a.dx, &a.dw1, &a.dw2}) {
    const auto nan = std::find_if(v->begin(), v->end(), [](double x) { return std::isnan(x); });
    EXPECT_TRUE(nan == v->end()) << what << ": the baseline left element " << (nan - v->begin())
                                 << " unwritten (NaN)";
  }
  EXPECT_EQ(b.raw_dx, a.raw_dx) << what;
  EXPECT_EQ(b.raw_dw1, a.raw_dw1) << what;
  EXPECT_EQ(b.raw_dw2, a.raw_dw2) << what;
  EXPECT_EQ(b.db1, a.db1) << what;
  EXPECT_EQ(b.db2, a.db2) << what;
  EXPECT_EQ(b.dwr, a.dwr) << what;
  EXPECT_EQ(b.dscores, a.dscores) << what;
}

/// The weight-gradient buffers of a run: their dtype (the data dtype or fp32) and, with `accumulate`, what they hold
/// before the backward (host values, encoded to `dtype`; the layer's shapes, router_weight empty for caller routing).
/// GpuRun's dwr, dw1, db1, dw2, db2 are then the buffers after the backward, decoded from `dtype`.
struct WeightGradMode {
  DType dtype = DType::kFP32;
  bool accumulate = false;
  std::vector<double> wr, w1, b1, w2, b2;
};

/// How run_on_gpu runs a case, beyond its dtype.
struct GpuRunOptions {
  std::int64_t row_pad = 0;  // > 0: x with padded rows (ld = d + row_pad)
  // Forward and backward captured into a CUDA graph in global capture mode (any allocation or host synchronisation
  // inside them fails the capture), the graph replayed twice.
  bool graph = false;
  bool split = false;  // the backward as backward_input() then backward_weight() through a deferred buffer
  // The weight gradients' dtype and accumulation mode (optional); by default they are overwritten in the data dtype.
  const WeightGradMode* grads = nullptr;
  // The full backward takes the saved buffer over (BackwardBuffers::consume_saved) with the smaller workspace that
  // allows; GpuRun::saved is then the buffer after the backward.
  bool consume_saved = false;
  bool w1_later = false;  // with consume_saved: W1's gradients left to finish_backward_w1()
  // The raw buffers (saved, the workspaces, deferred) start this many bytes into their allocations, which are
  // 256-byte aligned (a multiple of kBufferAlignment: the library's whole requirement), canaries in front.
  std::size_t buffer_lead = 0;
  // >= 0, with one expert: the expert stride of every weight, bias and weight-gradient view. That dimension never
  // moves, so any value is legal (a broadcast weight's 0, a slice's odd one); the buffers stay contiguous.
  std::int64_t one_expert_stride = -1;
  // >= 0 (concatenated GLU layout): W1 and its gradient as 4D (E, 2, n, d) views whose halves lie apart, each in a
  // buffer holding every expert's gate rows, w1_gap elements of poison, then the up rows (as torchtitan's w1 and
  // w3, two allocations). GpuRun's dw1 and raw_dw1 are still in the joined (E, 2n, d) order.
  std::int64_t w1_gap = -1;
};

/// Between W1's joined (E, 2n, d) order and GpuRunOptions::w1_gap's halves apart (el bytes an element): calls
/// f(joined byte offset, apart byte offset) for each row of d elements.
template <class F>
void for_each_w1_row(const MoEProblem& p, std::int64_t gap, std::size_t el, F&& f) {
  const std::int64_t half = p.E * p.n * p.d;
  for (std::int64_t e = 0; e < p.E; ++e)
    for (std::int64_t r = 0; r < 2 * p.n; ++r)
      f(static_cast<std::size_t>((e * 2 * p.n + r) * p.d) * el,
        static_cast<std::size_t>((r / p.n) * (half + gap) + (e * p.n + r % p.n) * p.d) * el);
}

/// The apart form of joined W1 bytes, its gap 0xFF bytes.
inline std::vector<unsigned char> w1_to_apart(const std::vector<unsigned char>& joined, const MoEProblem& p,
                                              std::int64_t gap, std::size_t el) {
  std::vector<unsigned char> apart(static_cast<std::size_t>(2 * p.E * p.n * p.d + gap) * el, 0xFF);
  for_each_w1_row(p, gap, el, [&](std::size_t j, std::size_t a) { std::memcpy(&apart[a], &joined[j], p.d * el); });
  return apart;
}

/// The joined form of apart W1 bytes.
inline std::vector<unsigned char> w1_to_joined(const std::vector<unsigned char>& apart, const MoEProblem& p,
                                               std::int64_t gap, std::size_t el) {
  std::vector<unsigned char> joined(static_cast<std::size_t>(2 * p.E * p.n * p.d) * el);
  for_each_w1_row(p, gap, el, [&](std::size_t j, std::size_t a) { std::memcpy(&joined[j], &apart[a], p.d * el); });
  return joined;
}

/// Runs the case on the GPU in `dt` (GpuRunOptions says how).
inline GpuRun run_on_gpu(const LayerCase<double>& c, DType dt, const GpuRunOptions& o) {
  const std::int64_t row_pad = o.row_pad;
  const bool graph = o.graph, split = o.split, consume_saved = o.consume_saved, w1_later = o.w1_later;
  const WeightGradMode* grads = o.grads;
  const MoEProblem& p = c.problem;
  GpuRun r;
  r.problem = p;
  const Device dev = Device::cuda(0);
  const std::size_t el = dtype_size(dt);
  const DType gt = grads ? grads->dtype : dt;
  const std::size_t gel = dtype_size(gt);
  // A weight-gradient buffer: its initial contents when accumulating, else poisoned.
  auto grad_buffer = [&](const std::vector<double>* init, std::size_t count) {
    if (grads && grads->accumulate) {
      if (init->size() != count) throw std::runtime_error("WeightGradMode: initial values of the wrong size");
      return std::make_unique<DeviceBuffer>(encode(*init, gt));
    }
    return std::make_unique<DeviceBuffer>(count * gel);
  };
  // x with padded rows.
  std::vector<double> xpad(static_cast<std::size_t>(p.T * (p.d + row_pad)), 0.0);
  for (std::int64_t t = 0; t < p.T; ++t)
    for (std::int64_t k = 0; k < p.d; ++k) xpad[t * (p.d + row_pad) + k] = c.x[t * p.d + k];
  DeviceBuffer x(encode(xpad, dt)), wr(encode(c.router_weight, dt)), w1(encode(c.w1, dt)), w2(encode(c.w2, dt));
  DeviceBuffer b1(encode(c.b1, dt)), b2(encode(c.b2, dt)), gout(encode(c.grad_out, dt));
  DeviceBuffer glog(encode(c.grad_logits, dt));
  std::vector<float> scores_f(c.pair_score.begin(), c.pair_score.end());
  std::vector<std::int64_t> tok(c.pair_token), exp(c.pair_expert);
  auto bytes_of = [](const auto& v) {
    std::vector<unsigned char> b(v.size() * sizeof(v[0]));
    if (!v.empty()) std::memcpy(b.data(), v.data(), b.size());
    return b;
  };
  DeviceBuffer dscore_in(bytes_of(scores_f)), dtok(bytes_of(tok)), dexp(bytes_of(exp));

  const bool caller = p.routing == RoutingMode::kCallerSupplied;
  if (o.one_expert_stride >= 0 && p.E != 1) throw std::runtime_error("GpuRunOptions::one_expert_stride needs E = 1");
  // An (E, rows, cols) view, or (E, cols) with rows = 0, with the expert stride o.one_expert_stride if set.
  const auto expert_view = [&](void* data, DType t, std::int64_t rows, std::int64_t cols) {
    if (rows == 0)
      return o.one_expert_stride < 0 ? TensorView::contiguous(data, t, {p.E, cols}, dev)
                                     : TensorView::strided(data, t, {p.E, cols}, {o.one_expert_stride, 1}, dev);
    return o.one_expert_stride < 0
               ? TensorView::contiguous(data, t, {p.E, rows, cols}, dev)
               : TensorView::strided(data, t, {p.E, rows, cols}, {o.one_expert_stride, cols, 1}, dev);
  };
  LayerWeights w;
  if (!caller) w.router_weight = TensorView::contiguous(wr.get(), dt, {p.E, p.d}, dev);
  w.w1 = expert_view(w1.get(), dt, p.w1_rows(), p.d);
  const bool apart = o.w1_gap >= 0;
  if (apart && (p.weight_layout != WeightLayout::kConcatenated || !is_glu(p.activation)))
    throw std::runtime_error("GpuRunOptions::w1_gap needs the concatenated layout of a GLU activation");
  const std::int64_t w1_half = p.E * p.n * p.d;
  const auto apart_view = [&](void* data, DType t) {
    return TensorView::strided(data, t, {p.E, 2, p.n, p.d}, {p.n * p.d, w1_half + o.w1_gap, p.d, 1}, dev);
  };
  std::unique_ptr<DeviceBuffer> w1_apart;
  if (apart) {
    w1_apart = std::make_unique<DeviceBuffer>(w1_to_apart(encode(c.w1, dt), p, o.w1_gap, el));
    w.w1 = apart_view(w1_apart->get(), dt);
  }
  w.w2 = expert_view(w2.get(), dt, p.d, p.n);
  if (p.has_b1) w.b1 = expert_view(b1.get(), dt, 0, p.w1_rows());
  if (p.has_b2) w.b2 = expert_view(b2.get(), dt, 0, p.d);
  RoutingTriples rt;
  if (caller) {
    rt.token_index = TensorView::contiguous(dtok.get(), DType::kInt64, {p.num_pairs}, dev);
    rt.expert_index = TensorView::contiguous(dexp.get(), DType::kInt64, {p.num_pairs}, dev);
    rt.score = TensorView::contiguous(dscore_in.get(), DType::kFP32, {p.num_pairs}, dev);
  }
  const TensorView xv = TensorView::strided(x.get(), dt, {p.T, p.d}, {p.d + row_pad, 1}, dev);

  DeviceBuffer out(p.T * p.d * el), logits(p.T * p.E * el), counts(p.E * 4);
  const std::size_t lead = o.buffer_lead;
  DeviceBuffer saved(saved_layout(p, dt).total_bytes, 0xFF, lead), fws(forward_workspace_bytes(p, dt, dev), 0xFF, lead);
  ForwardOutputs fo;
  fo.out = TensorView::contiguous(out.get(), dt, {p.T, p.d}, dev);
  if (!caller) fo.router_logits = TensorView::contiguous(logits.get(), dt, {p.T, p.E}, dev);
  fo.expert_counts = TensorView::contiguous(counts.get(), DType::kInt32, {p.E}, dev);
  DeviceBuffer dx(p.T * p.d * el), dsc(std::max<std::int64_t>(p.num_pairs, 0) * 4);
  const std::size_t wr_count = caller ? 0 : static_cast<std::size_t>(p.E * p.d);
  const auto dwr_p = grad_buffer(grads ? &grads->wr : nullptr, wr_count);
  const auto dw1_p = !apart ? grad_buffer(grads ? &grads->w1 : nullptr, c.w1.size())
                     : grads && grads->accumulate
                         ? std::make_unique<DeviceBuffer>(w1_to_apart(encode(grads->w1, gt), p, o.w1_gap, gel))
                         : std::make_unique<DeviceBuffer>(static_cast<std::size_t>(2 * w1_half + o.w1_gap) * gel);
  const auto dw2_p = grad_buffer(grads ? &grads->w2 : nullptr, c.w2.size());
  const auto db1_p = grad_buffer(grads ? &grads->b1 : nullptr, c.b1.size());
  const auto db2_p = grad_buffer(grads ? &grads->b2 : nullptr, c.b2.size());
  DeviceBuffer &dwr = *dwr_p, &dw1 = *dw1_p, &dw2 = *dw2_p, &db1 = *db1_p, &db2 = *db2_p;
  DeviceBuffer bws(split ? backward_input_workspace_bytes(p, dt, dev)
                        : backward_workspace_bytes(p, dt, dev, consume_saved), 0xFF, lead);
  DeviceBuffer deferred(split ? deferred_layout(p, dt).total_bytes : 0, 0xFF, lead);
  // Every buffer exists before the layer runs: nothing may be allocated while a graph is being captured.
  // Owns the stream; on the way out ends a capture an exception left open (so later tests can allocate), then
  // destroys the stream.
  struct StreamGuard {
    cudaStream_t s = nullptr;
    StreamGuard() { cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); }
    ~StreamGuard() {
      cudaStreamCaptureStatus st;
      if (cudaStreamIsCapturing(s, &st) == cudaSuccess && st != cudaStreamCaptureStatusNone) {
        cudaGraph_t g = nullptr;
        cudaStreamEndCapture(s, &g);
        if (g) cudaGraphDestroy(g);
      }
      cudaStreamDestroy(s);
      cudaGetLastError();
    }
  } stream_guard;
  const cudaStream_t stream = stream_guard.s;
  cudaGraph_t captured = nullptr;
  if (graph && cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal) != cudaSuccess)
    throw std::runtime_error("cudaStreamBeginCapture failed");
  forward(p, xv, w, caller ? &rt : nullptr, fo, {saved.get(), saved.bytes(), fws.get(), fws.bytes()}, stream);

  BackwardInputs bi;
  bi.grad_out = TensorView::contiguous(gout.get(), dt, {p.T, p.d}, dev);
  // A case without grad_logits (cleared by the test) has no upstream gradient of the logits: the backward then
  // takes the router's term of dX from the pairs (src/gpu/kernels.hpp, router_term_from_pairs) where it can.
  if (!caller && !c.grad_logits.empty())
    bi.grad_router_logits = TensorView::contiguous(glog.get(), dt, {p.T, p.E}, dev);
  BackwardOutputs bo;
  bo.grad_x = TensorView::contiguous(dx.get(), dt, {p.T, p.d}, dev);
  if (!caller) bo.grad_weights.router_weight = TensorView::contiguous(dwr.get(), gt, {p.E, p.d}, dev);
  bo.grad_weights.w1 = apart ? apart_view(dw1.get(), gt) : expert_view(dw1.get(), gt, p.w1_rows(), p.d);
  bo.grad_weights.w2 = expert_view(dw2.get(), gt, p.d, p.n);
  if (p.has_b1) bo.grad_weights.b1 = expert_view(db1.get(), gt, 0, p.w1_rows());
  if (p.has_b2) bo.grad_weights.b2 = expert_view(db2.get(), gt, 0, p.d);
  bo.grad_weights.accumulate = grads && grads->accumulate;
  if (caller) bo.grad_scores = TensorView::contiguous(dsc.get(), DType::kFP32, {p.num_pairs}, dev);
  if (split) {
    BackwardOutputs in_half = bo, weight_half;
    in_half.grad_weights.w1 = in_half.grad_weights.b1 = in_half.grad_weights.w2 = in_half.grad_weights.b2 = TensorView();
    weight_half.grad_weights = bo.grad_weights;
    weight_half.grad_weights.router_weight = TensorView();
    backward_input(p, xv, w, caller ? &rt : nullptr, bi, in_half, {saved.get(), saved.bytes(), bws.get(), bws.bytes()},
                   {deferred.get(), deferred.bytes()}, stream);
    backward_weight(p, xv, w, caller ? &rt : nullptr, bi.grad_out, weight_half, saved.get(), saved.bytes(),
                    {deferred.get(), deferred.bytes()}, stream);
  } else if (w1_later) {
    BackwardOutputs first = bo, second;
    first.grad_weights.w1 = first.grad_weights.b1 = TensorView();
    first.w1_grads_later = true;
    second.grad_weights.w1 = bo.grad_weights.w1, second.grad_weights.b1 = bo.grad_weights.b1;
    second.grad_weights.accumulate = bo.grad_weights.accumulate;
    backward(p, xv, w, caller ? &rt : nullptr, bi, first,
             {saved.get(), saved.bytes(), bws.get(), bws.bytes(), consume_saved}, stream);
    finish_backward_w1(p, xv, w, caller ? &rt : nullptr, second, saved.get(), saved.bytes(), stream);
  } else {
    backward(p, xv, w, caller ? &rt : nullptr, bi, bo,
             {saved.get(), saved.bytes(), bws.get(), bws.bytes(), consume_saved}, stream);
  }
  if (graph) {
    const cudaError_t end = cudaStreamEndCapture(stream, &captured);  // always ends the capture
    if (end != cudaSuccess || captured == nullptr) throw std::runtime_error("capture failed");
    cudaGraphExec_t exec;
    if (cudaGraphInstantiate(&exec, captured, 0) != cudaSuccess) throw std::runtime_error("instantiate failed");
    for (int replay = 0; replay < 2; ++replay)
      if (cudaGraphLaunch(exec, stream) != cudaSuccess) throw std::runtime_error("graph launch failed");
    if (cudaStreamSynchronize(stream) != cudaSuccess) throw std::runtime_error("graph replay failed");
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(captured);
  }
  if (cudaStreamSynchronize(stream) != cudaSuccess) throw std::runtime_error("stream failed");
  if (cudaGetLastError() != cudaSuccess) throw std::runtime_error("CUDA error after the layer");

  auto dec = [&](const DeviceBuffer& b, std::size_t n, DType t) {
    const std::vector<unsigned char> h = b.download();
    return decode(h.data(), n, t);
  };
  r.raw_out = out.download(), r.raw_dx = dx.download(), r.raw_dw1 = dw1.download(), r.raw_dw2 = dw2.download();
  if (apart) {
    const std::size_t gap_begin = static_cast<std::size_t>(w1_half) * gel;
    r.w1_gap_intact = std::all_of(r.raw_dw1.begin() + gap_begin,
                                  r.raw_dw1.begin() + gap_begin + static_cast<std::size_t>(o.w1_gap) * gel,
                                  [](unsigned char b) { return b == 0xFF; });
    r.raw_dw1 = w1_to_joined(r.raw_dw1, p, o.w1_gap, gel);
    r.canaries_intact = r.canaries_intact && w1_apart->canary_intact();
  }
  r.out = decode(r.raw_out.data(), p.T * p.d, dt);
  if (!caller) r.logits = dec(logits, p.T * p.E, dt), r.dwr = dec(dwr, p.E * p.d, gt);
  r.dx = decode(r.raw_dx.data(), p.T * p.d, dt);
  r.dw1 = decode(r.raw_dw1.data(), c.w1.size(), gt);
  r.dw2 = decode(r.raw_dw2.data(), c.w2.size(), gt);
  if (p.has_b1) r.db1 = dec(db1, c.b1.size(), gt);
  if (p.has_b2) r.db2 = dec(db2, c.b2.size(), gt);
  if (caller) {
    std::vector<unsigned char> h = dsc.download();
    r.dscores.resize(p.num_pairs);
    for (std::int64_t i = 0; i < p.num_pairs; ++i) {
      float f;
      std::memcpy(&f, &h[4 * i], 4);
      r.dscores[i] = f;
    }
  }
  std::vector<unsigned char> hc = counts.download();
  r.counts.resize(p.E);
  std::memcpy(r.counts.data(), hc.data(), 4 * p.E);
  r.saved = saved.download();
  for (const DeviceBuffer* b :
       {&x, &out, &logits, &counts, &saved, &fws, &dx, &dwr, &dw1, &dw2, &db1, &db2, &dsc, &bws, &deferred})
    r.canaries_intact = r.canaries_intact && b->canary_intact();
  return r;
}

/// The positional form: row_pad, graph, split, grads, consume_saved and w1_later as in GpuRunOptions.
inline GpuRun run_on_gpu(const LayerCase<double>& c, DType dt, std::int64_t row_pad = 0, bool graph = false,
                         bool split = false, const WeightGradMode* grads = nullptr, bool consume_saved = false,
                         bool w1_later = false) {
  GpuRunOptions o;
  o.row_pad = row_pad, o.graph = graph, o.split = split, o.grads = grads, o.consume_saved = consume_saved;
  o.w1_later = w1_later;
  return run_on_gpu(c, dt, o);
}

/// The CPU reference on the GPU's (rounded) inputs; top-K routing pinned to the GPU's logits.
struct ReferenceRun {
  ref::ForwardResult<double> f;
  ref::BackwardResult<double> g;
};

inline LayerCase<double> quantized_case(const LayerCase<double>& c, DType dt) {
  LayerCase<double> q = c;
  q.x = quantize(c.x, dt), q.router_weight = quantize(c.router_weight, dt), q.w1 = quantize(c.w1, dt);
  q.w2 = quantize(c.w2, dt), q.b1 = quantize(c.b1, dt), q.b2 = quantize(c.b2, dt);
  q.grad_out = quantize(c.grad_out, dt), q.grad_logits = quantize(c.grad_logits, dt);
  std::vector<float> s(c.pair_score.begin(), c.pair_score.end());  // scores travel as fp32
  q.pair_score.assign(s.begin(), s.end());
  return q;
}

inline ReferenceRun reference_for(const LayerCase<double>& q, const std::vector<double>& gpu_logits) {
  ReferenceRun r;
  ref::LayerInputs<double> in = q.inputs();
  if (q.problem.routing != RoutingMode::kCallerSupplied) in.router_logits = gpu_logits.data();
  r.f = ref::layer_forward(q.problem, in);
  r.g = ref::layer_backward(q.problem, in, r.f.saved, q.grad_out.data(),
                            q.grad_logits.empty() ? nullptr : q.grad_logits.data());
  return r;
}

}  // namespace machmoe::test
