// machmoe-bench: the project's main job. Runs one MoE layer forward and backward through the public API with
// the best backend this build has, and prints the configuration, timings, model FLOPs and memory accounting.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cli_options.hpp"
#include "machmoe/machmoe.hpp"

#ifdef MACHMOE_WITH_CUDA
#include "gpu_bench.hpp"
#endif

int write_json(const std::string& path, const std::vector<std::string>& objects);

namespace {

using namespace machmoe;

double mib(std::size_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

template <class R>
std::vector<R> normal(std::mt19937_64& rng, std::size_t count, double stddev) {
  std::normal_distribution<double> dist(0.0, stddev);
  std::vector<R> v(count);
  for (R& x : v) x = static_cast<R>(dist(rng));
  return v;
}

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

template <class R>
int run(const bench::Options& o) {
  const MoEProblem& p = o.problem;
  const DType dt = o.dtype;
  const auto sz = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  std::mt19937_64 rng(o.seed);
  // Realistic magnitudes: x ~ N(0, 1), weights ~ N(0, 1/sqrt(fan_in)).
  std::vector<R> x = normal<R>(rng, sz(p.T * p.d), 1.0);
  std::vector<R> wr = normal<R>(rng, sz(p.E * p.d), 1.0 / std::sqrt(double(p.d)));
  std::vector<R> w1 = normal<R>(rng, sz(p.E * p.w1_rows() * p.d), 1.0 / std::sqrt(double(p.d)));
  std::vector<R> w2 = normal<R>(rng, sz(p.E * p.d * p.n), 1.0 / std::sqrt(double(p.n)));
  std::vector<R> b1 = p.has_b1 ? normal<R>(rng, sz(p.E * p.w1_rows()), 0.1) : std::vector<R>();
  std::vector<R> b2 = p.has_b2 ? normal<R>(rng, sz(p.E * p.d), 0.1) : std::vector<R>();
  std::vector<R> dout = normal<R>(rng, sz(p.T * p.d), 1.0);

  std::vector<R> out(sz(p.T * p.d)), logits(sz(p.T * p.E)), dx(sz(p.T * p.d)), dwr(wr.size()), dw1(w1.size()),
      dw2(w2.size()), db1(b1.size()), db2(b2.size());
  std::vector<std::int32_t> counts(sz(p.E));
  const SavedLayout layout = saved_layout(p, dt);
  std::vector<unsigned char> saved(layout.total_bytes);

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
  BackwardBuffers bb{saved.data(), saved.size(), nullptr, 0};

  std::printf("machmoe-bench %s\n", kVersion);
  const int gpus = cuda_device_count();
  std::printf("build:    %s\n", built_with_cuda() ? "with CUDA sources (sm_90a)" : "CPU only (no nvcc at build time)");
  if (gpus > 0)
    std::printf("gpu:      %s (the layer's CUDA backend is not in this build yet; running the CPU reference)\n",
                cuda_device_description(0).c_str());
  else
    std::printf("gpu:      none found; running the CPU reference\n");
  std::printf("backend:  cpu-reference (%s)\n", dtype_name(dt));
  std::printf("config:   %s\n", o.config_name.c_str());
  std::printf("problem:  %s\n", p.to_string().c_str());
  std::fflush(stdout);

  std::printf("running:  %d warm-up + %d timed forward passes...\n", o.warmup, o.iters);
  std::fflush(stdout);
  const double fwd_ms = median_ms(o.warmup, o.iters, [&] { forward(p, xv, w, nullptr, fo, fb); });
  std::printf("running:  %d warm-up + %d timed backward passes...\n", o.warmup, o.iters);
  std::fflush(stdout);
  const double bwd_ms = median_ms(o.warmup, o.iters, [&] { backward(p, xv, w, nullptr, bi, bo, bb); });

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
                  "\"E\":%lld,\"K\":%lld,\"forward_ms\":%.6f,\"backward_ms\":%.6f,\"activation_bytes_accounted\":%zu}",
                  o.config_name.c_str(), dtype_name(dt), (long long)p.T, (long long)p.d, (long long)p.n,
                  (long long)p.E, (long long)p.K, fwd_ms, bwd_ms, am.total_bytes());
    return write_json(o.json_path, {buf});
  }
  return 0;
}

}  // namespace

int write_json(const std::string& path, const std::vector<std::string>& objects) {
  if (path.empty()) return 0;
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) {
    std::fprintf(stderr, "error: cannot write --json file '%s'\n", path.c_str());
    return 1;
  }
  std::fputs("[\n", f);
  for (std::size_t i = 0; i < objects.size(); ++i) std::fprintf(f, "  %s%s\n", objects[i].c_str(), i + 1 < objects.size() ? "," : "");
  std::fputs("]\n", f);
  std::fclose(f);
  return 0;
}

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
      return rc ? rc : write_json(o.json_path, json);
    }
#endif
    return o.dtype == DType::kFP64 ? run<double>(o) : run<float>(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
