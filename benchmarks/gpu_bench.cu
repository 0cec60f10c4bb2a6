// machmoe-bench on the GPU: times the layer (CUDA events, median), its stages, the cuBLAS bound of docs/TARGETS.md
// measured in the same run, and activation/peak memory both as accounted and as measured by the driver.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "gpu_bench.hpp"
#include "machmoe/machmoe.hpp"

namespace machmoe::bench {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) throw std::runtime_error(std::string(what) + ": " + cublasGetStatusString(s));
}

template <class T>
__device__ T cast_from(float v);
template <>
__device__ __nv_bfloat16 cast_from<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __half cast_from<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ float cast_from<float>(float v) { return v; }

/// N(0, stddev) from a counter-based hash (splitmix64) and Box-Muller: fresh, reproducible, never zeros.
template <class T>
__global__ void normal_init_kernel(T* p, std::size_t n, std::uint64_t seed, float stddev) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    std::uint64_t z = seed + 0x9E3779B97F4A7C15ull * (i + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u1 = (static_cast<float>(z >> 40) + 1.0f) / 16777217.0f;
    const float u2 = static_cast<float>((z >> 16) & 0xFFFFFF) / 16777216.0f;
    p[i] = cast_from<T>(stddev * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2));
  }
}

/// A device buffer; a failed allocation names the buffer and its size (the configuration is added by run_gpu).
struct Dev {
  void* p = nullptr;
  std::size_t bytes = 0;
  Dev(std::size_t b, const char* name) : bytes(b) {
    const cudaError_t e = cudaMalloc(&p, std::max<std::size_t>(b, 1));
    if (e != cudaSuccess) {
      cudaGetLastError();  // clear the (non-sticky) allocation error so that later calls are not blamed for it
      throw std::runtime_error("cudaMalloc of device buffer '" + std::string(name) + "' (" + std::to_string(b) +
                               " bytes) failed: " + cudaGetErrorString(e));
    }
  }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
};

void fill_normal(DType dt, Dev& d, std::size_t n, std::uint64_t seed, float stddev, cudaStream_t s) {
  const unsigned grid = 1024;
  if (dt == DType::kBF16) normal_init_kernel<<<grid, 256, 0, s>>>(static_cast<__nv_bfloat16*>(d.p), n, seed, stddev);
  else if (dt == DType::kFP16) normal_init_kernel<<<grid, 256, 0, s>>>(static_cast<__half*>(d.p), n, seed, stddev);
  else normal_init_kernel<<<grid, 256, 0, s>>>(static_cast<float*>(d.p), n, seed, stddev);
  check(cudaGetLastError(), "normal_init");
}

std::size_t used_bytes() {
  std::size_t free_b = 0, total = 0;
  check(cudaMemGetInfo(&free_b, &total), "cudaMemGetInfo");
  return total - free_b;
}

/// How a measurement repeats its work: `warmup` untimed calls, then untimed calls until `warmup_ms` have passed since
/// the first (each waited for, as the timed calls are), then timed calls, at least `iters` and until `timed_ms` have
/// passed. The time-based warm-up brings the board to the clock it holds under sustained load, and the timed window
/// spans the power controller's swings of that clock (cli_options.hpp, kGpuWarmupMs and kGpuTimedMs).
struct Repetitions {
  int warmup = 2, iters = 10, warmup_ms = 0, timed_ms = 0;
};

/// A pair of CUDA events that times one call at a time on a stream, each call waited for.
class CallTimer {
 public:
  explicit CallTimer(cudaStream_t s) : s_(s) {
    check(cudaEventCreate(&a_), "event"), check(cudaEventCreate(&b_), "event");
  }
  ~CallTimer() { cudaEventDestroy(a_), cudaEventDestroy(b_); }
  CallTimer(const CallTimer&) = delete;
  CallTimer& operator=(const CallTimer&) = delete;
  /// The GPU time from the end of the stream's earlier work (or from now, on an idle stream) to the end of f's work:
  /// it includes any time the GPU waits for the host to enqueue f's launches.
  double ms(const std::function<void()>& f) {
    check(cudaEventRecord(a_, s_), "record");
    f();
    check(cudaEventRecord(b_, s_), "record");
    check(cudaEventSynchronize(b_), "sync");
    float t = 0;
    check(cudaEventElapsedTime(&t, a_, b_), "elapsed");
    return t;
  }

 private:
  cudaStream_t s_;
  cudaEvent_t a_ = nullptr, b_ = nullptr;
};

/// The upper median of v (not empty).
double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// Median of the timed calls of f (CUDA events around each call, each waited for).
double median_ms(const Repetitions& rep, cudaStream_t s, const std::function<void()>& f) {
  CallTimer timer(s);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0;; ++i) {
    const double elapsed =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (i >= rep.warmup && elapsed >= rep.warmup_ms) break;
    f();
    check(cudaStreamSynchronize(s), "warm-up");
  }
  std::vector<double> ms;
  const auto timed_start = std::chrono::steady_clock::now();
  for (int i = 0;; ++i) {
    const double elapsed =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - timed_start).count();
    if (i >= rep.iters && (elapsed >= rep.timed_ms || i >= kMaxRepetitions)) break;
    ms.push_back(timer.ms(f));
  }
  return median_of(std::move(ms));
}

/// Device-to-device copy bandwidth, bytes read + written per second.
double copy_bandwidth(cudaStream_t s, int warmup_ms, int timed_ms) {
  const std::size_t bytes = std::size_t{1} << 30;
  Dev a(bytes, "copy source"), b(bytes, "copy destination");
  check(cudaMemsetAsync(a.p, 1, bytes, s), "memset");
  const double ms = median_ms({2, 10, warmup_ms, timed_ms}, s, [&] {
    check(cudaMemcpyAsync(b.p, a.p, bytes, cudaMemcpyDeviceToDevice, s), "copy");
  });
  return 2.0 * bytes / (ms * 1e-3);
}

/// Time of a strided-batched GEMM (batch E) of row-major (M x K) * (K x N), the data dtype, fp32 accumulation.
double batched_gemm_ms(cublasHandle_t h, DType dt, std::int64_t E, std::int64_t M, std::int64_t N, std::int64_t K,
                       cudaStream_t s, int warmup_ms, int timed_ms) {
  const std::size_t el = dtype_size(dt);
  Dev A(el * E * M * K, "cuBLAS bound A"), B(el * E * K * N, "cuBLAS bound B"), C(el * E * M * N, "cuBLAS bound C");
  fill_normal(dt, A, E * M * K, 1, 1.0f, s), fill_normal(dt, B, E * K * N, 2, 1.0f, s);
  const cudaDataType_t t = dt == DType::kBF16 ? CUDA_R_16BF : dt == DType::kFP16 ? CUDA_R_16F : CUDA_R_32F;
  const float alpha = 1, beta = 0;
  check(cublasSetStream(h, s), "cublasSetStream");
  // Row-major C = A B is column-major C^T = B^T A^T: m = N, n = M, k = K.
  return median_ms({2, 10, warmup_ms, timed_ms}, s, [&] {
    check(cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, N, M, K, &alpha, B.p, t, N, K * N, A.p, t, K, M * K,
                                     &beta, C.p, t, N, M * N, E, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
          "cublasGemmStridedBatchedEx");
  });
}

/// The cuBLAS bound: one strided-batched GEMM per expert GEMM of the layer (balanced routing, T K / E rows per
/// expert), plus the aggregations at copy bandwidth. Each GEMM's time is also the per-stage yardstick of the
/// matching kernel (stage name -> ms).
struct Bound {
  double fwd_ms, bwd_ms;
  std::vector<std::pair<std::string, double>> stage_ms;
  double stage(const std::string& name) const {
    for (const auto& [n, ms] : stage_ms)
      if (n == name) return ms;
    return 0.0;
  }
};

Bound cublas_bound(cublasHandle_t h, const MoEProblem& p, DType dt, double copy_bw, cudaStream_t s, int warmup_ms,
                   int timed_ms) {
  const std::int64_t Te = std::max<std::int64_t>(1, p.T * p.K / p.E), r = p.w1_rows(), E = p.E;
  // The aggregations read TK rows of d and write T (bytes of the data dtype: 2 for bf16, 4 for fp32).
  const double agg_ms = static_cast<double>(dtype_size(dt)) * (p.T * p.K * p.d + p.T * p.d) / copy_bw * 1e3;
  const double up = batched_gemm_ms(h, dt, E, Te, r, p.d, s, warmup_ms, timed_ms);
  const double down = batched_gemm_ms(h, dt, E, Te, p.d, p.n, s, warmup_ms, timed_ms);
  const double da = batched_gemm_ms(h, dt, E, Te, p.n, p.d, s, warmup_ms, timed_ms);
  const double dw2 = batched_gemm_ms(h, dt, E, p.d, p.n, Te, s, warmup_ms, timed_ms);
  const double dxe = batched_gemm_ms(h, dt, E, Te, p.d, r, s, warmup_ms, timed_ms);
  const double dw1 = batched_gemm_ms(h, dt, E, r, p.d, Te, s, warmup_ms, timed_ms);
  return {up + down + agg_ms,
          da + dw2 + dxe + dw1 + agg_ms,
          {{"forward/up_projection", up},
           {"forward/down_projection", down},
           {"backward/dh_kernel", da},
           {"backward/dx_expanded", dxe},
           {"backward/dw2", dw2},
           {"backward/dw1", dw1}}};
}

double mib(double b) { return b / (1024.0 * 1024.0); }

struct Result {
  std::string config;
  double fwd_ms = 0, bwd_ms = 0, fwd_tflops = 0, bwd_tflops = 0, bound_fwd = 0, bound_bwd = 0;
  double act_accounted = 0, act_measured = 0, peak_total = 0, peak_transient = 0;
  std::vector<StageTime> stages;
  int stage_runs = 0;                   // instrumented runs taken (median per stage)
  double stage_ms = 0;                  // wall time they took
  double stage_sum_fwd = 0, stage_sum_bwd = 0;  // the medians of the forward's / backward's stages, added up
  Bound bound;
};

/// Per stage, the median of its times over several instrumented runs, in the first run's stage order (a stage
/// missing from some run takes the median of the runs that have it).
std::vector<StageTime> median_stage_times(const std::vector<std::vector<StageTime>>& runs) {
  std::vector<StageTime> out;
  if (runs.empty()) return out;
  for (const StageTime& first : runs[0]) {
    std::vector<double> ms;
    for (const auto& run : runs)
      for (const StageTime& st : run)
        if (st.stage == first.stage) ms.push_back(st.ms);
    std::sort(ms.begin(), ms.end());
    const std::size_t h = ms.size() / 2;
    out.push_back({first.stage, ms.size() % 2 ? ms[h] : 0.5 * (ms[h - 1] + ms[h])});
  }
  return out;
}

/// Diagnostics (--profile): the stages of a pass called alone, the stream idle before each call as in the timed passes,
/// against the queued stage runs' medians. A stage longer alone held the GPU waiting for the host to enqueue what
/// follows its mark (a stage shorter alone ran at another clock: the duty cycles differ). "Outside the stages" is the
/// median call less its stages' medians: the wait before the first mark, between the phases and after the last mark.
void print_isolated_stages(const std::string& config, const char* pass, const std::vector<StageTime>& queued,
                           cudaStream_t s, const std::function<void()>& call) {
  const int reps = 20;
  CallTimer timer(s);
  std::vector<std::vector<StageTime>> runs;
  std::vector<double> totals;
  for (int i = 0; i < reps; ++i) {
    totals.push_back(timer.ms([&] {
      enable_stage_timing(true);
      call();
      enable_stage_timing(false);
    }));
    runs.push_back(collect_stage_timings());
  }
  const double total = median_of(totals);
  const std::vector<StageTime> alone = median_stage_times(runs);
  double sum = 0;
  for (const StageTime& st : alone) sum += st.ms;
  std::printf("  [%s] %s called alone, median of %d: %.4f ms, its stages %.4f ms, outside the stages %.4f ms\n",
              config.c_str(), pass, reps, total, sum, total - sum);
  for (const StageTime& st : alone) {
    double q = 0;
    for (const StageTime& qs : queued)
      if (qs.stage == st.stage) q = qs.ms;
    std::printf("    %-34s alone %.4f ms, queued %.4f ms, %+.4f\n", st.stage.c_str(), st.ms, q, st.ms - q);
  }
}

Result run_one(const Options& o, cublasHandle_t h, double copy_bw, cudaStream_t s) {
  const MoEProblem& p = o.problem;
  const DType dt = o.dtype;
  const Device dev = Device::cuda(0);
  const std::size_t el = dtype_size(dt);
  const auto n = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  check(cudaDeviceSynchronize(), "sync");
  const std::size_t used0 = used_bytes();

  Dev x(el * n(p.T * p.d), "x"), wr(el * n(p.E * p.d), "router_weight"), w1(el * n(p.E * p.w1_rows() * p.d), "w1"),
      w2(el * n(p.E * p.d * p.n), "w2");
  Dev b1(el * n(p.has_b1 ? p.E * p.w1_rows() : 0), "b1"), b2(el * n(p.has_b2 ? p.E * p.d : 0), "b2"),
      gout(el * n(p.T * p.d), "grad_out");
  Dev out(el * n(p.T * p.d), "out"), logits(el * n(p.T * p.E), "router_logits"), counts(4 * n(p.E), "expert_counts");
  const DType gdt = o.grad_dtype;  // the weight gradients' dtype
  const std::size_t gel = dtype_size(gdt);
  Dev dx(x.bytes, "grad_x"), dwr(gel * n(p.E * p.d), "grad_router_weight"),
      dw1(gel * n(p.E * p.w1_rows() * p.d), "grad_w1"), dw2(gel * n(p.E * p.d * p.n), "grad_w2"),
      db1(gel * n(p.has_b1 ? p.E * p.w1_rows() : 0), "grad_b1"), db2(gel * n(p.has_b2 ? p.E * p.d : 0), "grad_b2");
  const std::uint64_t seed = o.seed * 1000003ull;
  fill_normal(dt, x, n(p.T * p.d), seed + 1, 1.0f, s);
  fill_normal(dt, wr, n(p.E * p.d), seed + 2, 1.0f / std::sqrt(float(p.d)), s);
  fill_normal(dt, w1, n(p.E * p.w1_rows() * p.d), seed + 3, 1.0f / std::sqrt(float(p.d)), s);
  fill_normal(dt, w2, n(p.E * p.d * p.n), seed + 4, 1.0f / std::sqrt(float(p.n)), s);
  if (p.has_b1) fill_normal(dt, b1, n(p.E * p.w1_rows()), seed + 5, 0.1f, s);
  if (p.has_b2) fill_normal(dt, b2, n(p.E * p.d), seed + 6, 0.1f, s);
  fill_normal(dt, gout, n(p.T * p.d), seed + 7, 1.0f, s);

  LayerWeights w;
  w.router_weight = TensorView::contiguous(wr.p, dt, {p.E, p.d}, dev);
  w.w1 = TensorView::contiguous(w1.p, dt, {p.E, p.w1_rows(), p.d}, dev);
  w.w2 = TensorView::contiguous(w2.p, dt, {p.E, p.d, p.n}, dev);
  if (p.has_b1) w.b1 = TensorView::contiguous(b1.p, dt, {p.E, p.w1_rows()}, dev);
  if (p.has_b2) w.b2 = TensorView::contiguous(b2.p, dt, {p.E, p.d}, dev);
  const TensorView xv = TensorView::contiguous(x.p, dt, {p.T, p.d}, dev);
  ForwardOutputs fo;
  fo.out = TensorView::contiguous(out.p, dt, {p.T, p.d}, dev);
  fo.router_logits = TensorView::contiguous(logits.p, dt, {p.T, p.E}, dev);
  fo.expert_counts = TensorView::contiguous(counts.p, DType::kInt32, {p.E}, dev);
  BackwardInputs bi;
  bi.grad_out = TensorView::contiguous(gout.p, dt, {p.T, p.d}, dev);
  BackwardOutputs bo;
  bo.grad_x = TensorView::contiguous(dx.p, dt, {p.T, p.d}, dev);
  bo.grad_weights.router_weight = TensorView::contiguous(dwr.p, gdt, {p.E, p.d}, dev);
  bo.grad_weights.w1 = TensorView::contiguous(dw1.p, gdt, {p.E, p.w1_rows(), p.d}, dev);
  bo.grad_weights.w2 = TensorView::contiguous(dw2.p, gdt, {p.E, p.d, p.n}, dev);
  if (p.has_b1) bo.grad_weights.b1 = TensorView::contiguous(db1.p, gdt, {p.E, p.w1_rows()}, dev);
  if (p.has_b2) bo.grad_weights.b2 = TensorView::contiguous(db2.p, gdt, {p.E, p.d}, dev);
  bo.grad_weights.accumulate = o.accumulate_grads;
  if (o.accumulate_grads) {  // accumulation reads the buffers: start them at zero like a fresh main_grad
    for (const Dev* g : {&dwr, &dw1, &dw2, &db1, &db2})
      if (g->bytes) check(cudaMemsetAsync(g->p, 0, g->bytes, s), "zero gradients");
  }
  check(cudaStreamSynchronize(s), "init");

  Result r;
  r.config = o.config_name;
  {  // Warm up: the first call on a thread creates the library's cuBLAS handle (cuBLAS's one-time allocation),
     // which must not be counted as activation memory.
    Dev saved0(saved_layout(p, dt).total_bytes, "saved"), fws0(forward_workspace_bytes(p, dt, dev), "forward workspace"),
        bws0(backward_workspace_bytes(p, dt, dev), "backward workspace");
    forward(p, xv, w, nullptr, fo, {saved0.p, saved0.bytes, fws0.p, fws0.bytes}, s);
    backward(p, xv, w, nullptr, bi, bo, {saved0.p, saved0.bytes, bws0.p, bws0.bytes}, s);
    check(cudaStreamSynchronize(s), "warm-up");
  }
  // Memory, as a framework would hold it: the forward's workspace is released before the backward's is taken.
  const std::size_t base = used_bytes();
  std::size_t peak = base;
  const SavedLayout sl = saved_layout(p, dt);
  Dev saved(sl.total_bytes, "saved");
  std::size_t after_fwd;
  {
    Dev fws(forward_workspace_bytes(p, dt, dev), "forward workspace");
    peak = std::max(peak, used_bytes());
    forward(p, xv, w, nullptr, fo, {saved.p, saved.bytes, fws.p, fws.bytes}, s);
    check(cudaStreamSynchronize(s), "forward");
  }
  after_fwd = used_bytes();
  {
    Dev bws(backward_workspace_bytes(p, dt, dev), "backward workspace");
    peak = std::max(peak, used_bytes());
    backward(p, xv, w, nullptr, bi, bo, {saved.p, saved.bytes, bws.p, bws.bytes}, s);
    check(cudaStreamSynchronize(s), "backward");
  }
  r.act_accounted = static_cast<double>(activation_memory(p, dt).total_bytes());
  r.act_measured = static_cast<double>(after_fwd - base) + static_cast<double>(x.bytes);
  r.peak_total = static_cast<double>(peak - used0);
  r.peak_transient = static_cast<double>(peak - base);

  // Timing: both workspaces held, forward and backward timed separately (backward reuses one forward's state).
  Dev fws(forward_workspace_bytes(p, dt, dev), "forward workspace"),
      bws(backward_workspace_bytes(p, dt, dev), "backward workspace");
  const ForwardBuffers fb{saved.p, saved.bytes, fws.p, fws.bytes};
  const BackwardBuffers bb{saved.p, saved.bytes, bws.p, bws.bytes};
  std::fprintf(stderr, "  [%s] timing forward (%d + %d ms, then >= %d and >= %d ms)...\n", o.config_name.c_str(),
               o.warmup, o.warmup_ms, o.iters, o.timed_ms);
  const Repetitions rep{o.warmup, o.iters, o.warmup_ms, o.timed_ms};
  r.fwd_ms = median_ms(rep, s, [&] { forward(p, xv, w, nullptr, fo, fb, s); });
  std::fprintf(stderr, "  [%s] timing backward (%d + %d ms, then >= %d and >= %d ms)...\n", o.config_name.c_str(),
               o.warmup, o.warmup_ms, o.iters, o.timed_ms);
  r.bwd_ms = median_ms(rep, s, [&] { backward(p, xv, w, nullptr, bi, bo, bb, s); });
  if (o.profile) {
    // Diagnostics: the forward and the backward each issued back to back (the host runs ahead, so its launch
    // latency is hidden; the difference to the timed call is host time the GPU waits for, or the clock: the duty
    // cycles differ), with the host's time to enqueue one call (median over those calls, which the GPU is behind);
    // then one forward and one backward as the profiler's capture range (a profiler's kernel list: the forward's
    // launches, then the backward's). A call timed behind a kernel that held the GPU idle for 5 ms ran 10-16 %
    // faster than either (H200, session 65), and a backward behind a single warp spinning for 0.75 ms 15-17 % faster
    // on three 1.4B and 7B rows (session 89): the board's clock after a (nearly) idle stretch, not the host's
    // latency, so such a figure is not offered. Where the host's latency does sit is shown after the stage runs
    // (print_isolated_stages).
    const int reps = 20;
    const auto back_to_back_ms = [&](const char* pass, double timed_ms, const std::function<void()>& f) {
      std::vector<double> host_us;
      const double t = CallTimer(s).ms([&] {
        for (int i = 0; i < reps; ++i) {
          const auto h0 = std::chrono::steady_clock::now();
          f();
          host_us.push_back(
              std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - h0).count());
        }
      });
      std::printf("  [%s] %s %d back-to-back: %.4f ms each (one timed call: %.4f ms; host enqueue %.1f us)\n",
                  o.config_name.c_str(), pass, reps, t / reps, timed_ms, median_of(host_us));
    };
    back_to_back_ms("forward", r.fwd_ms, [&] { forward(p, xv, w, nullptr, fo, fb, s); });
    back_to_back_ms("backward", r.bwd_ms, [&] { backward(p, xv, w, nullptr, bi, bo, bb, s); });
    check(cudaProfilerStart(), "cudaProfilerStart");
    forward(p, xv, w, nullptr, fo, fb, s);
    backward(p, xv, w, nullptr, bi, bo, bb, s);
    check(cudaStreamSynchronize(s), "profiled forward and backward");
    check(cudaProfilerStop(), "cudaProfilerStop");
  }
  // Stage times: per stage, the median over instrumented runs that go on for at least o.stage_runs runs and, like the
  // timed passes, at least o.timed_ms of wall time (one run's figures spread by up to 15 %, too much for an A/B of one
  // kernel). The time matters as much as the count: under the power cap the board's clock swings within a second (an
  // H200 at 700 W, session 61: 1215-1920 MHz over a run of every main row), and three to five runs of a 20 ms forward +
  // backward caught one phase of it, so their stages added up to 0.98-1.24x the timed passes, differently from row to
  // row (docs/BENCHMARKS.md). Each instrumented run is queued behind an uninstrumented forward + backward, so its first
  // mark is passed when the GPU finishes that work, with the run's launches already queued: a stage is GPU time.
  // Started on an idle GPU, the first stage (the router GEMM) also held the host's latency to its launch: 0.04-0.08 ms
  // on the 1.4B rows where ncu timed the kernel at 0.027-0.031 ms (docs/BENCHMARKS.md, session 43).
  std::vector<std::vector<StageTime>> stage_runs;
  const auto stage_start = std::chrono::steady_clock::now();
  const auto stage_elapsed_ms = [&] {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - stage_start).count();
  };
  while (static_cast<std::int64_t>(stage_runs.size()) < o.stage_runs ||
         (stage_elapsed_ms() < o.timed_ms && static_cast<std::int64_t>(stage_runs.size()) < kMaxStageRuns)) {
    forward(p, xv, w, nullptr, fo, fb, s);
    backward(p, xv, w, nullptr, bi, bo, bb, s);
    enable_stage_timing(true);
    forward(p, xv, w, nullptr, fo, fb, s);
    backward(p, xv, w, nullptr, bi, bo, bb, s);
    enable_stage_timing(false);
    stage_runs.push_back(collect_stage_timings());
  }
  r.stage_ms = stage_elapsed_ms();
  r.stage_runs = static_cast<int>(stage_runs.size());
  r.stages = median_stage_times(stage_runs);
  for (const StageTime& st : r.stages)
    (st.stage.rfind("forward/", 0) == 0 ? r.stage_sum_fwd : r.stage_sum_bwd) += st.ms;
  if (o.profile) {
    print_isolated_stages(o.config_name, "forward", r.stages, s, [&] { forward(p, xv, w, nullptr, fo, fb, s); });
    print_isolated_stages(o.config_name, "backward", r.stages, s, [&] { backward(p, xv, w, nullptr, bi, bo, bb, s); });
  }

  std::vector<std::int32_t> hc(n(p.E));
  check(cudaMemcpy(hc.data(), counts.p, 4 * n(p.E), cudaMemcpyDeviceToHost), "counts");
  double pairs = 0;
  for (std::int32_t c : hc) pairs += c;
  const double unit = pairs * double(p.n) * double(p.d);
  r.fwd_tflops = (is_glu(p.activation) ? 6.0 : 4.0) * unit / (r.fwd_ms * 1e9);
  r.bwd_tflops = (is_glu(p.activation) ? 12.0 : 8.0) * unit / (r.bwd_ms * 1e9);
  std::fprintf(stderr, "  [%s] cuBLAS bound...\n", o.config_name.c_str());
  const Bound b = cublas_bound(h, p, dt, copy_bw, s, o.warmup_ms, o.timed_ms);
  r.bound_fwd = b.fwd_ms, r.bound_bwd = b.bwd_ms;
  r.bound = b;
  return r;
}

/// The bytes a memory-bound stage must move at the least, read + written, for its yardstick against the copy
/// bandwidth; 0 where the stage has none. The gather-sums read P rows of d and write T (plus 8 bytes of index and
/// score per pair). The dH kernel reads dO once per pair (gathered: a token's row for each of its K experts) and H,
/// and writes dH and A' (es: bytes of the data dtype; P = T K pairs, r = w1_rows). On the small configurations its
/// bytes, not its FLOPs, set its time, which this yardstick shows beside the cuBLAS GEMM's.
double stage_min_bytes(const std::string& stage, const MoEProblem& p, double es) {
  const double pairs = static_cast<double>(p.T) * static_cast<double>(p.K);
  if (stage.find("aggregation") != std::string::npos) return es * (pairs * p.d + double(p.T) * p.d) + 8.0 * pairs;
  if (stage == "backward/dh_kernel") return es * pairs * (double(p.d) + 2.0 * p.w1_rows() + p.n) + 8.0 * pairs;
  return 0.0;
}

std::string json_of(const Result& r, const Options& o, const std::string& gpu, double copy_bw) {
  std::ostringstream j;
  const MoEProblem& p = o.problem;
  // The problem's options (activation and its parameters, biases, layout, score, routing, rounding, tile, cache,
  // chunks, the gradients' dtype and accumulation) as the CPU JSON records them: runs of different options differ.
  j << "{\"config\":\"" << r.config << "\",\"backend\":\"gpu\",\"gpu\":\"" << gpu << "\",\"dtype\":\""
    << dtype_name(o.dtype) << "\",\"T\":" << p.T << ",\"d\":" << p.d << ",\"n\":" << p.n << ",\"E\":" << p.E
    << ",\"K\":" << p.K << "," << problem_json_members(o) << ",\"copy_bandwidth_GBps\":" << copy_bw * 1e-9
    << ",\"sm_margin\":" << sm_margin()
    << ",\"forward_ms\":" << r.fwd_ms
    << ",\"backward_ms\":" << r.bwd_ms << ",\"forward_tflops\":" << r.fwd_tflops
    << ",\"backward_tflops\":" << r.bwd_tflops << ",\"cublas_bound_forward_ms\":" << r.bound_fwd
    << ",\"cublas_bound_backward_ms\":" << r.bound_bwd << ",\"efficiency_forward\":" << r.bound_fwd / r.fwd_ms
    << ",\"efficiency_backward\":" << r.bound_bwd / r.bwd_ms
    << ",\"activation_bytes_accounted\":" << r.act_accounted << ",\"activation_bytes_measured\":" << r.act_measured
    << ",\"peak_bytes\":" << r.peak_total << ",\"peak_transient_bytes\":" << r.peak_transient
    << ",\"iters\":" << o.iters << ",\"warmup\":" << o.warmup << ",\"warmup_ms\":" << o.warmup_ms
    << ",\"timed_ms\":" << o.timed_ms
    << ",\"stage_runs\":" << r.stage_runs << ",\"stage_wall_ms\":" << r.stage_ms
    << ",\"stage_sum_forward_ms\":" << r.stage_sum_fwd << ",\"stage_sum_backward_ms\":" << r.stage_sum_bwd
    << ",\"stages_ms\":{";
  for (std::size_t i = 0; i < r.stages.size(); ++i)
    j << (i ? "," : "") << "\"" << r.stages[i].stage << "\":" << r.stages[i].ms;
  j << "},\"cublas_stage_ms\":{";
  for (std::size_t i = 0; i < r.bound.stage_ms.size(); ++i)
    j << (i ? "," : "") << "\"" << r.bound.stage_ms[i].first << "\":" << r.bound.stage_ms[i].second;
  j << "},\"dh_kernel_bytes_at_copy_ms\":"
    << stage_min_bytes("backward/dh_kernel", p, static_cast<double>(dtype_size(o.dtype))) / copy_bw * 1e3 << "}";
  return j.str();
}

}  // namespace

/// Model FLOPs of an expert-GEMM stage (0 for other stages): up, dX~ and dW1 2 TK d w1_rows; down, dH (dA') and
/// dW2 2 TK n d.
double stage_gemm_flops(const std::string& stage, const MoEProblem& p) {
  const double pairs = static_cast<double>(p.T) * static_cast<double>(p.K);
  if (stage == "forward/up_projection" || stage == "backward/dx_expanded" || stage == "backward/dw1")
    return 2.0 * pairs * p.d * p.w1_rows();
  if (stage == "forward/down_projection" || stage == "backward/dh_kernel" || stage == "backward/dw2")
    return 2.0 * pairs * p.n * p.d;
  return 0.0;
}

int run_gpu(const std::vector<Options>& runs, std::vector<std::string>& json_objects) {
  cudaStream_t s;
  check(cudaSetDevice(0), "cudaSetDevice");
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  cublasHandle_t h;
  check(cublasCreate(&h), "cublasCreate");
  const std::string gpu = cuda_device_description(0);
  std::printf("gpu:      %s\n", gpu.c_str());
  if (!runs.empty() && runs.front().sm_margin >= 0) set_sm_margin(runs.front().sm_margin);
  if (sm_margin() > 0)
    std::printf("sm margin: %d SMs left to other streams: the expert GEMMs run on %d of the %d SMs (the cuBLAS bound "
                "on all of them)\n",
                sm_margin(), cuda_sm_count(0) - sm_margin(), cuda_sm_count(0));
  std::fflush(stdout);
  const double bw = copy_bandwidth(s, runs.empty() ? 0 : runs.front().warmup_ms,
                                   runs.empty() ? 0 : runs.front().timed_ms);
  std::printf("copy bandwidth (device-to-device, read+write): %.0f GB/s\n", bw * 1e-9);
  std::vector<Result> results;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const Options& o = runs[i];
    std::fprintf(stderr, "[%zu/%zu] %s: %s\n", i + 1, runs.size(), o.config_name.c_str(), o.problem.to_string().c_str());
    try {
      results.push_back(run_one(o, h, bw, s));
    } catch (const std::exception& e) {
      throw std::runtime_error("config " + o.config_name + " (" + o.problem.to_string() + ", " +
                               dtype_name(o.dtype) + "): " + e.what());
    }
    const Result& r = results.back();
    json_objects.push_back(json_of(r, o, gpu, bw));
    std::printf("\nconfig %s (%s, %s", o.config_name.c_str(), o.problem.to_string().c_str(), dtype_name(o.dtype));
    if (o.grad_dtype != o.dtype || o.accumulate_grads)
      std::printf("; weight gradients %s%s", dtype_name(o.grad_dtype), o.accumulate_grads ? ", accumulated" : "");
    std::printf(")\n");
    std::printf("  %-10s %10s %10s %12s %10s\n", "pass", "ms", "TFLOP/s", "cuBLAS bound", "efficiency");
    std::printf("  %-10s %10.3f %10.1f %12.3f %10.3f\n", "forward", r.fwd_ms, r.fwd_tflops, r.bound_fwd,
                r.bound_fwd / r.fwd_ms);
    std::printf("  %-10s %10.3f %10.1f %12.3f %10.3f\n", "backward", r.bwd_ms, r.bwd_tflops, r.bound_bwd,
                r.bound_bwd / r.bwd_ms);
    std::printf("  stages (median of %d instrumented runs over %.0f ms; they add up to %.3f ms forward, %.3f ms "
                "backward):\n",
                r.stage_runs, r.stage_ms, r.stage_sum_fwd, r.stage_sum_bwd);
    const MoEProblem& p = o.problem;
    for (const StageTime& st : r.stages) {
      std::printf("    %-32s %9.3f ms", st.stage.c_str(), st.ms);
      // The gather-sums: their rate against the copy bandwidth measured above. The dH kernel: the time its bytes
      // take at that bandwidth, its floor where the GEMM is short.
      const double bytes = stage_min_bytes(st.stage, p, static_cast<double>(dtype_size(o.dtype)));
      if (bytes > 0 && st.ms > 0 && st.stage.find("aggregation") != std::string::npos)
        std::printf("   %6.0f GB/s = %.2f of copy bandwidth", bytes / (st.ms * 1e6), bytes / (st.ms * 1e-3) / bw);
      const double gemm_flops = stage_gemm_flops(st.stage, p);
      if (gemm_flops > 0 && st.ms > 0) std::printf("   %6.1f TFLOP/s", gemm_flops / (st.ms * 1e9));
      const double cublas = r.bound.stage(st.stage);
      if (cublas > 0 && st.ms > 0) std::printf("   cuBLAS %.3f ms = %.2f of it", cublas, cublas / st.ms);
      if (bytes > 0 && st.ms > 0 && st.stage == "backward/dh_kernel")
        std::printf("; its bytes at copy bandwidth %.3f ms", bytes / bw * 1e3);
      std::printf("\n");
    }
    std::printf("  activation memory: accounted %.1f MiB, measured %.1f MiB; peak %.1f MiB (%.1f MiB above "
                "inputs, parameters, outputs and gradients)\n",
                mib(r.act_accounted), mib(r.act_measured), mib(r.peak_total), mib(r.peak_transient));
    std::fflush(stdout);
  }
  if (results.size() > 1) {
    std::printf("\nsummary (%s, %s)\n", gpu.c_str(), dtype_name(runs[0].dtype));
    std::printf("| config | fwd ms | fwd TFLOP/s | fwd eff | up-proj TFLOP/s | down-proj TFLOP/s | bwd ms | bwd TFLOP/s | "
                "bwd eff | act MiB (acct/meas) | peak MiB |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
    std::vector<std::string> backward_rows;
    for (std::size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      double up = 0, down = 0;
      for (const StageTime& st : r.stages) {
        const double f = stage_gemm_flops(st.stage, runs[i].problem);
        if (st.stage == "forward/up_projection" && st.ms > 0) up = f / (st.ms * 1e9);
        if (st.stage == "forward/down_projection" && st.ms > 0) down = f / (st.ms * 1e9);
      }
      std::printf("| %s | %.3f | %.1f | %.3f | %.1f | %.1f | %.3f | %.1f | %.3f | %.1f / %.1f | %.1f |\n",
                  r.config.c_str(), r.fwd_ms, r.fwd_tflops, r.bound_fwd / r.fwd_ms, up, down, r.bwd_ms, r.bwd_tflops,
                  r.bound_bwd / r.bwd_ms, mib(r.act_accounted), mib(r.act_measured), mib(r.peak_total));
      // Backward stages: ms, TFLOP/s and the ratio to the matching cuBLAS GEMM.
      std::string row = "| " + r.config + " |";
      for (const char* stage : {"backward/dh_kernel", "backward/dx_expanded", "backward/dw2", "backward/dw1"}) {
        double ms = 0;
        for (const StageTime& st : r.stages)
          if (st.stage == stage) ms = st.ms;
        const double f = stage_gemm_flops(stage, runs[i].problem), cublas = r.bound.stage(stage);
        char cell[96];
        std::snprintf(cell, sizeof cell, " %.3f / %.0f / %.2f |", ms, ms > 0 ? f / (ms * 1e9) : 0.0,
                      ms > 0 ? cublas / ms : 0.0);
        row += cell;
      }
      backward_rows.push_back(row);
    }
    std::printf("\nbackward GEMM stages: ms / TFLOP/s / cuBLAS-GEMM time over stage time\n");
    std::printf("| config | dH (dA') | dX~ | dW2 | dW1 |\n|---|---|---|---|---|\n");
    for (const std::string& row : backward_rows) std::printf("%s\n", row.c_str());
  }
  cublasDestroy(h);
  cudaStreamDestroy(s);
  return 0;
}

}  // namespace machmoe::bench
