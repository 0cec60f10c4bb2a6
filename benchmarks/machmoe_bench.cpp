// machmoe-bench: the project's main job. Runs one MoE layer forward and backward through the public API with
// the best backend this build has, and prints the configuration, timings, model FLOPs and memory accounting.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <new>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <unistd.h>

#include "cli_options.hpp"
#include "machmoe/machmoe.hpp"

#ifdef MACHMOE_WITH_CUDA
#include "gpu_bench.hpp"
#endif

namespace {

using namespace machmoe;

double mib(std::size_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

template <class F>
double median_ms(int warmup, int iters, F&& f) {
  for (int i = 0; i < warmup; ++i) f();
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

template <class R>
double frobenius(const std::vector<R>& v) {
  double s = 0;
  for (R x : v) s += static_cast<double>(x) * static_cast<double>(x);
  return std::sqrt(s);
}

/// What the CPU run could not allocate: a host buffer of ours (named, with its size) or the reference's scratch.
class OutOfHostMemory : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// One host buffer of the CPU run, for the memory check before anything is allocated and for the messages.
struct HostBuffer {
  std::string name;   // e.g. "w1 (E x w1_rows x d)"
  std::int64_t count;  // elements
  std::size_t elem;    // bytes per element
  std::uint64_t bytes() const { return static_cast<std::uint64_t>(count) * elem; }  // < 2^61: sizes are validated
};

std::string buffer_text(const HostBuffer& b) {
  return "'" + b.name + "' (" + std::to_string(b.count) + " elements of " + std::to_string(b.elem) + " bytes = " +
         std::to_string(b.bytes()) + " bytes)";
}

/// Physical memory of this machine, 0 when unknown. A run that needs more would be killed by the kernel while it
/// fills its buffers (allocation itself succeeds under overcommit), so it is refused up front instead.
std::uint64_t physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page) : 0;
}

/// The buffers run() allocates, sized from the validated problem (each product < 2^58 elements). Biases and
/// their gradients have count 0 when the problem has none.
struct HostPlan {
  HostBuffer x, router_weight, w1, w2, b1, b2, grad_out, out, router_logits, grad_x, grad_router_weight, grad_w1,
      grad_w2, grad_b1, grad_b2, expert_counts, saved;

  HostPlan(const MoEProblem& p, DType dt) {
    const std::size_t el = dtype_size(dt);
    const std::int64_t b1_count = p.has_b1 ? p.E * p.w1_rows() : 0, b2_count = p.has_b2 ? p.E * p.d : 0;
    x = {"x (T x d)", p.T * p.d, el};
    router_weight = {"router_weight (E x d)", p.E * p.d, el};
    w1 = {"w1 (E x w1_rows x d)", p.E * p.w1_rows() * p.d, el};
    w2 = {"w2 (E x d x n)", p.E * p.d * p.n, el};
    b1 = {"b1 (E x w1_rows)", b1_count, el};
    b2 = {"b2 (E x d)", b2_count, el};
    grad_out = {"grad_out (T x d)", p.T * p.d, el};
    out = {"out (T x d)", p.T * p.d, el};
    router_logits = {"router_logits (T x E)", p.T * p.E, el};
    grad_x = {"grad_x (T x d)", p.T * p.d, el};
    grad_router_weight = {"grad_router_weight (E x d)", p.E * p.d, el};
    grad_w1 = {"grad_w1 (E x w1_rows x d)", p.E * p.w1_rows() * p.d, el};
    grad_w2 = {"grad_w2 (E x d x n)", p.E * p.d * p.n, el};
    grad_b1 = {"grad_b1 (E x w1_rows)", b1_count, el};
    grad_b2 = {"grad_b2 (E x d)", b2_count, el};
    expert_counts = {"expert_counts (E)", p.E, 4};
    saved = {"saved (saved_layout bytes)", static_cast<std::int64_t>(saved_layout(p, dt).total_bytes), 1};
  }
  std::vector<const HostBuffer*> all() const {
    return {&x,      &router_weight, &w1,      &w2,      &b1,      &b2,      &grad_out,      &out, &router_logits,
            &grad_x, &grad_router_weight, &grad_w1, &grad_w2, &grad_b1, &grad_b2, &expert_counts, &saved};
  }
};

/// Refuses a run whose own buffers exceed physical memory, naming the total and the largest buffer.
void check_host_memory(const HostPlan& plan, const MoEProblem& p) {
  const std::uint64_t phys = physical_memory_bytes();
  if (phys == 0) return;
  std::uint64_t total = 0;  // 17 buffers of < 2^61 bytes each cannot wrap 64 bits
  const HostBuffer* largest = &plan.x;
  for (const HostBuffer* b : plan.all()) {
    total += b->bytes();
    if (b->bytes() > largest->bytes()) largest = b;
  }
  if (total > phys)
    throw OutOfHostMemory("the CPU run needs " + std::to_string(total) + " bytes of host buffers, more than this "
                          "machine's " + std::to_string(phys) + " bytes of memory; the largest is " +
                          buffer_text(*largest) + "; problem: " + p.to_string());
}

/// A zeroed host vector for buffer `b`, or OutOfHostMemory naming it.
template <class R>
std::vector<R> allocate(const HostBuffer& b, const MoEProblem& p) {
  try {
    return std::vector<R>(static_cast<std::size_t>(b.count));
  } catch (const std::bad_alloc&) {
    throw OutOfHostMemory("cannot allocate host buffer " + buffer_text(b) + "; problem: " + p.to_string());
  } catch (const std::length_error&) {
    throw OutOfHostMemory("host buffer " + buffer_text(b) + " exceeds std::vector's limit; problem: " + p.to_string());
  }
}

template <class R>
std::vector<R> normal(const HostBuffer& b, const MoEProblem& p, std::mt19937_64& rng, double stddev) {
  std::vector<R> v = allocate<R>(b, p);
  std::normal_distribution<double> dist(0.0, stddev);
  for (R& x : v) x = static_cast<R>(dist(rng));
  return v;
}

/// Runs one pass of the reference, turning its own scratch allocation failures into a message with the problem.
template <class F>
void reference_pass(const char* pass, const MoEProblem& p, F&& f) {
  try {
    f();
  } catch (const std::bad_alloc&) {
    throw OutOfHostMemory(std::string("the CPU reference ran out of host memory for its own scratch in the ") + pass +
                          " pass; problem: " + p.to_string());
  }
}

template <class R>
int run(const bench::Options& o) {
  const MoEProblem& p = o.problem;
  const DType dt = o.dtype;
  const HostPlan plan(p, dt);
  check_host_memory(plan, p);
  std::mt19937_64 rng(o.seed);
  // Realistic magnitudes: x ~ N(0, 1), weights ~ N(0, 1/sqrt(fan_in)).
  std::vector<R> x = normal<R>(plan.x, p, rng, 1.0);
  std::vector<R> wr = normal<R>(plan.router_weight, p, rng, 1.0 / std::sqrt(double(p.d)));
  std::vector<R> w1 = normal<R>(plan.w1, p, rng, 1.0 / std::sqrt(double(p.d)));
  std::vector<R> w2 = normal<R>(plan.w2, p, rng, 1.0 / std::sqrt(double(p.n)));
  std::vector<R> b1 = normal<R>(plan.b1, p, rng, 0.1);
  std::vector<R> b2 = normal<R>(plan.b2, p, rng, 0.1);
  std::vector<R> dout = normal<R>(plan.grad_out, p, rng, 1.0);

  std::vector<R> out = allocate<R>(plan.out, p), logits = allocate<R>(plan.router_logits, p),
                 dx = allocate<R>(plan.grad_x, p), dwr = allocate<R>(plan.grad_router_weight, p),
                 dw1 = allocate<R>(plan.grad_w1, p), dw2 = allocate<R>(plan.grad_w2, p),
                 db1 = allocate<R>(plan.grad_b1, p), db2 = allocate<R>(plan.grad_b2, p);
  std::vector<std::int32_t> counts = allocate<std::int32_t>(plan.expert_counts, p);
  std::vector<unsigned char> saved = allocate<unsigned char>(plan.saved, p);

  LayerWeights w;
  w.router_weight = TensorView::contiguous(wr.data(), dt, {p.E, p.d});
  w.w1 = TensorView::contiguous(w1.data(), dt, {p.E, p.w1_rows(), p.d});
  w.w2 = TensorView::contiguous(w2.data(), dt, {p.E, p.d, p.n});
  if (p.has_b1) w.b1 = TensorView::contiguous(b1.data(), dt, {p.E, p.w1_rows()});
  if (p.has_b2) w.b2 = TensorView::contiguous(b2.data(), dt, {p.E, p.d});
  const TensorView xv = TensorView::contiguous(x.data(), dt, {p.T, p.d});
  ForwardOutputs fo;
  fo.out = TensorView::contiguous(out.data(), dt, {p.T, p.d});
  fo.router_logits = TensorView::contiguous(logits.data(), dt, {p.T, p.E});
  fo.expert_counts = TensorView::contiguous(counts.data(), DType::kInt32, {p.E});
  ForwardBuffers fb{saved.data(), saved.size(), nullptr, 0};
  BackwardInputs bi;
  bi.grad_out = TensorView::contiguous(dout.data(), dt, {p.T, p.d});
  BackwardOutputs bo;
  bo.grad_x = TensorView::contiguous(dx.data(), dt, {p.T, p.d});
  bo.grad_weights.router_weight = TensorView::contiguous(dwr.data(), dt, {p.E, p.d});
  bo.grad_weights.w1 = TensorView::contiguous(dw1.data(), dt, {p.E, p.w1_rows(), p.d});
  bo.grad_weights.w2 = TensorView::contiguous(dw2.data(), dt, {p.E, p.d, p.n});
  if (p.has_b1) bo.grad_weights.b1 = TensorView::contiguous(db1.data(), dt, {p.E, p.w1_rows()});
  if (p.has_b2) bo.grad_weights.b2 = TensorView::contiguous(db2.data(), dt, {p.E, p.d});
  bo.grad_weights.accumulate = o.accumulate_grads;
  BackwardBuffers bb{saved.data(), saved.size(), nullptr, 0};

  std::printf("machmoe-bench %s\n", kVersion);
  const int gpus = cuda_device_count();
  std::printf("build:    %s\n", built_with_cuda() ? "with CUDA sources (sm_90a)" : "CPU only (no nvcc at build time)");
  // A device is only seen by a CUDA build, which runs the GPU backend unless --backend cpu asked for the reference.
  std::printf("%s\n", bench::cpu_run_gpu_line(o, gpus, gpus > 0 ? cuda_device_description(0) : "").c_str());
  std::printf("backend:  cpu-reference (%s)\n", dtype_name(dt));
  std::printf("config:   %s\n", o.config_name.c_str());
  std::printf("problem:  %s\n", p.to_string().c_str());
  if (o.accumulate_grads)  // the buffers start at zero (value-initialised), like a fresh main_grad
    std::printf("grads:    weight gradients accumulated into their buffers (%s)\n", dtype_name(dt));
  std::fflush(stdout);

  std::printf("running:  %d warm-up + %d timed forward passes...\n", o.warmup, o.iters);
  std::fflush(stdout);
  const double fwd_ms = median_ms(o.warmup, o.iters, [&] {
    reference_pass("forward", p, [&] { forward(p, xv, w, nullptr, fo, fb); });
  });
  std::printf("running:  %d warm-up + %d timed backward passes...\n", o.warmup, o.iters);
  std::fflush(stdout);
  const double bwd_ms = median_ms(o.warmup, o.iters, [&] {
    reference_pass("backward", p, [&] { backward(p, xv, w, nullptr, bi, bo, bb); });
  });

  std::int64_t pairs = 0;
  for (std::int32_t c : counts) pairs += c;
  std::int64_t empty_experts = 0;
  for (std::int32_t c : counts) empty_experts += c == 0;
  // Model FLOPs (docs/TARGETS.md): GLU 6 / 12 * pairs * n * d, non-GLU 4 / 8; padding never counted, so token-rounded
  // pairs count as routed pairs.
  const double unit = static_cast<double>(pairs) * double(p.n) * double(p.d);
  const double fwd_flop = (is_glu(p.activation) ? 6.0 : 4.0) * unit;
  const double bwd_flop = (is_glu(p.activation) ? 12.0 : 8.0) * unit;

  std::printf("\nrouting:  %lld routed pairs (T*K = %lld), %lld of %lld experts empty\n", (long long)pairs,
              (long long)(p.T * p.K), (long long)empty_experts, (long long)p.E);
  std::printf("\n%-10s %12s %14s %12s\n", "pass", "median ms", "model GFLOP", "GFLOP/s");
  std::printf("%-10s %12.3f %14.3f %12.2f\n", "forward", fwd_ms, fwd_flop * 1e-9, fwd_flop * 1e-6 / fwd_ms);
  std::printf("%-10s %12.3f %14.3f %12.2f\n", "backward", bwd_ms, bwd_flop * 1e-9, bwd_flop * 1e-6 / bwd_ms);
  std::printf("%-10s %12.3f %14.3f %12.2f\n", "total", fwd_ms + bwd_ms, (fwd_flop + bwd_flop) * 1e-9,
              (fwd_flop + bwd_flop) * 1e-6 / (fwd_ms + bwd_ms));

  const ActivationMemory am = activation_memory(p, dt);
  const ActivationMemory am_bf16 = activation_memory(p, DType::kBF16);
  std::printf("\nactivation memory kept for backward (cache=%s):\n", cache_mode_name(p.cache));
  std::printf("  %-28s %14s %14s\n", "", dtype_name(dt), "bf16 (GPU)");
  std::printf("  %-28s %14.3f %14.3f MiB\n", "X (caller's input)", mib(am.x_bytes), mib(am_bf16.x_bytes));
  std::printf("  %-28s %14.3f %14.3f MiB\n", "H (pre-activation)", mib(am.h_bytes), mib(am_bf16.h_bytes));
  std::printf("  %-28s %14.3f %14.3f MiB\n", "router logits", mib(am.logits_bytes), mib(am_bf16.logits_bytes));
  std::printf("  %-28s %14.3f %14.3f MiB\n", "scores + routing metadata", mib(am.metadata_bytes),
              mib(am_bf16.metadata_bytes));
  std::printf("  %-28s %14.3f %14.3f MiB\n", "total", mib(am.total_bytes()), mib(am_bf16.total_bytes()));
  const double tk = double(p.max_pairs());
  std::printf("  bf16 closed form: 2Td%s = %.3f MiB, + metadata %.1f bytes per routed pair\n",
              p.cache == CacheMode::kPreActivation ? " + 2TK*w1_rows" : "",
              mib(static_cast<std::size_t>(2.0 * double(p.T * p.d) +
                                           (p.cache == CacheMode::kPreActivation ? 2.0 * tk * double(p.w1_rows()) : 0.0))),
              double(am_bf16.metadata_bytes) / tk);
  std::printf("  GPU workspace (bf16): forward %.3f MiB, backward %.3f MiB\n",
              mib(forward_workspace_layout(p, DType::kBF16).total_bytes),
              mib(backward_workspace_layout(p, DType::kBF16).total_bytes));
  std::printf("\nchecksums: ||out||_F = %.6e, ||dx||_F = %.6e, ||dW1||_F = %.6e\n", frobenius(out), frobenius(dx),
              frobenius(dw1));
  if (!o.json_path.empty()) {
    char buf[512];
    std::snprintf(buf, sizeof buf,
                  "{\"config\":\"%s\",\"backend\":\"cpu-reference\",\"dtype\":\"%s\",\"T\":%lld,\"d\":%lld,\"n\":%lld,"
                  "\"E\":%lld,\"K\":%lld,",
                  o.config_name.c_str(), dtype_name(dt), (long long)p.T, (long long)p.d, (long long)p.n,
                  (long long)p.E, (long long)p.K);
    char timings[256];
    std::snprintf(timings, sizeof timings,
                  ",\"iters\":%d,\"warmup\":%d,\"forward_ms\":%.6f,\"backward_ms\":%.6f,"
                  "\"activation_bytes_accounted\":%zu}",
                  o.iters, o.warmup, fwd_ms, bwd_ms, am.total_bytes());
    // The problem's options as the GPU JSON records them (bench::problem_json_members), so runs pair alike.
    return bench::write_json(o.json_path, {buf + bench::problem_json_members(o) + timings});
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  bench::Options o;
  const bool have_gpu = built_with_cuda() && cuda_device_count() > 0;
  try {
    o = bench::parse_options(args, have_gpu);
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n(run machmoe-bench --help for the options)\n", e.what());
    return 2;
  }
  if (o.help) {
    std::fputs(bench::usage().c_str(), stdout);
    return 0;
  }
  try {
#ifdef MACHMOE_WITH_CUDA
    if (o.gpu) {
      std::printf("machmoe-bench %s, backend: gpu (%s)\n", kVersion, dtype_name(o.dtype));
      std::vector<std::string> json;
      const int rc = bench::run_gpu(o.all_configs ? bench::main_config_runs(o) : std::vector<bench::Options>{o}, json);
      return rc ? rc : bench::write_json(o.json_path, json);
    }
#endif
    return o.dtype == DType::kFP64 ? run<double>(o) : run<float>(o);
  } catch (const OutOfHostMemory& e) {
    std::fprintf(stderr, "error: config %s: %s\n", o.config_name.c_str(), e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    // Allocations of our own are named where they happen; this is anything else, still with the configuration.
    std::fprintf(stderr, "error: out of host memory (std::bad_alloc); config %s, problem: %s\n",
                 o.config_name.c_str(), o.problem.to_string().c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
