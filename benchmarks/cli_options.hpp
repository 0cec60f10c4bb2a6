// Command-line options of machmoe-bench, parsed strictly: unknown options, missing or malformed values and
// invalid combinations are errors that say what was expected.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "machmoe/problem.hpp"
#include "machmoe/tensor.hpp"

namespace machmoe::bench {

struct NamedConfig {
  const char* name;
  std::int64_t T, d, n, E, K;
  const char* note;
};

/// The 12 main configurations of docs/TARGETS.md (no note), the reduced CPU default and the odd-shape rows of target
/// T13 (gpt-oss's d = n = 2880 beside 2944), which carry a note.
const std::vector<NamedConfig>& named_configs();

enum class Backend { kAuto, kCpu, kGpu };

struct Options {
  MoEProblem problem;
  std::string config_name;  // name of the configuration the sizes came from
  Backend backend = Backend::kAuto;
  bool gpu = false;          // resolved: the run uses the GPU backend
  DType dtype = DType::kFP32;  // resolved: bf16 on the GPU, fp32 on the CPU unless --dtype says otherwise
  DType grad_dtype = DType::kFP32;  // resolved: the weight gradients' dtype, dtype unless --grad-dtype fp32 (GPU)
  bool accumulate_grads = false;    // add the weight gradients into their buffers instead of overwriting them
  int iters = 3;             // resolved: 10 on the GPU, 3 on the CPU unless --iters says otherwise (<= kMaxRepetitions)
  int warmup = 1;            // resolved: 3 on the GPU, 1 on the CPU (<= kMaxRepetitions)
  int warmup_ms = 0;         // GPU: the least time of untimed repetitions before each timing (default kGpuWarmupMs)
  int timed_ms = 0;          // GPU: the least time of timed repetitions per timing (default kGpuTimedMs)
  int stage_runs = 5;        // GPU: the least instrumented runs of the stage table, which also last at least timed_ms
                             // (up to kMaxStageRuns runs); the median per stage
  std::uint64_t seed = 0;
  int sm_margin = -1;        // GPU: --sm-margin (set_sm_margin before the runs, all of which share it: run_gpu reads
                             // the first run's); -1: not given (the library's setting)
  bool all_configs = false;  // run the 12 main configurations
  std::string json_path;     // write results as JSON here when set
  bool profile = false;      // GPU: bracket one extra forward with cudaProfilerStart/Stop (ncu/nsys capture range)
  bool help = false;
};

/// An option that takes a decimal integer, and the range it accepts (usage() lists them).
struct IntegerOption {
  const char* name;
  std::int64_t lo, hi;
  const char* what;
};
const std::vector<IntegerOption>& integer_options();

/// The most repetitions --iters and --warmup take: enough for any measurement, few enough that a run ends.
inline constexpr std::int64_t kMaxRepetitions = 100000;
/// GPU: milliseconds of untimed repetitions before every timed measurement (the layer's forward and backward, each
/// GEMM of the cuBLAS bound, the copy bandwidth), so that each is timed at the clock a sustained load holds. An H100
/// at its 700 W cap under these GEMMs drops from 1980 MHz to 1400-1500 within 0.1 s of load and swings down to
/// 1125-1260 when the power average reaches the cap after about a second (docs/BENCHMARKS.md, session 42): a
/// measurement that starts on an idle board, or just after a memory-bound phase, runs faster than a training loop.
inline constexpr std::int64_t kGpuWarmupMs = 1000;
/// GPU: the least milliseconds of timed repetitions per measurement (at least --iters of them, the median reported).
/// Under the cap the clock keeps swinging (1125-1530 MHz with a period of about a second on that H100), so ten calls
/// of a 1 ms forward caught one phase of it: medians over a second of calls span the swings.
inline constexpr std::int64_t kGpuTimedMs = 1000;
/// The most --warmup-ms and --time-ms take.
inline constexpr std::int64_t kMaxWarmupMs = 60000;
/// The most instrumented runs --stage-runs takes (each is a whole forward + backward with an event per stage).
inline constexpr std::int64_t kMaxStageRuns = 1000;
/// --sm-margin's bound: more SMs than any GPU has (the layer refuses a margin that leaves its device fewer than two).
inline constexpr std::int64_t kMaxSmMargin = 4096;

/// Parses `text` as a decimal integer in [lo, hi]: optional '-' then digits only, overflow detected (never
/// wrapped). Throws machmoe::Error naming `option`, the range and the text given.
std::int64_t parse_integer(const std::string& option, const std::string& text, std::int64_t lo, std::int64_t hi);

/// The 12 main configurations with every other option of `base` (for --all-configs).
std::vector<Options> main_config_runs(const Options& base);

/// Parses argv. Throws machmoe::Error with a message naming the option on bad input.
/// `have_gpu_backend` (a CUDA build with a device) resolves --backend auto and the defaults that depend on it:
/// the 7B configuration in bf16 on the GPU, the reduced size in fp32 on the CPU reference.
Options parse_options(const std::vector<std::string>& args, bool have_gpu_backend);

std::string usage();

/// The options of the problem a run measured, as JSON members without braces ("activation":"swiglu",...,"y_chunks":0):
/// everything but the sizes that changes what is timed (activation and its parameters, biases, layout, score,
/// routing, rounding rule and tile, cache mode, the chunks of tokens of dX~ and Y, the weight gradients' dtype and
/// accumulation). The CPU and the GPU JSON both carry them, so that runs of different options are never taken for
/// one another (scripts/bench_tables.py pairs runs by them). An infinite --swiglu-limit is written as "inf".
std::string problem_json_members(const Options& o);

/// Writes `objects` as a JSON array to `path` (nothing when `path` is empty). Returns 0, or 1 after a message on
/// stderr naming the path and the reason when the file cannot be opened, written (e.g. a full disk) or closed.
int write_json(const std::string& path, const std::vector<std::string>& objects);

/// The "gpu:" line the CPU reference run prints: the device it leaves unused and why (--backend cpu), or that none
/// was found. `gpus` and `description` are what the runtime reports for device 0.
std::string cpu_run_gpu_line(const Options& o, int gpus, const std::string& description);

}  // namespace machmoe::bench
