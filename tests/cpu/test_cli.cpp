// machmoe-bench's option parsing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>
#include <unistd.h>

#include "cli_options.hpp"
#include "machmoe/error.hpp"

namespace machmoe::bench {
namespace {

std::string error_of(const std::vector<std::string>& args) {
  try {
    parse_options(args, false);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Cli, DefaultsAndNamedConfigs) {
  const Options cpu = parse_options({}, false);
  EXPECT_EQ(cpu.config_name, "cpu-small");
  const Options gpu = parse_options({}, true);
  EXPECT_EQ(gpu.problem.T, 24576);
  EXPECT_EQ(gpu.problem.d, 1536);
  EXPECT_EQ(gpu.problem.E, 128);
  int main_configs = 0;
  for (const NamedConfig& c : named_configs()) main_configs += *c.note == '\0';
  EXPECT_EQ(main_configs, 12);
  EXPECT_EQ(main_config_runs(Options{}).size(), 12u);
  const Options o = parse_options({"--K", "2", "--config", "120B-2048", "--activation", "gelu", "--bias", "both"}, false);
  EXPECT_EQ(o.problem.n, 2048);
  EXPECT_EQ(o.problem.K, 2) << "size overrides apply on top of --config whatever the order";
  EXPECT_EQ(o.problem.activation, Activation::kGELU);
  EXPECT_TRUE(o.problem.has_b1 && o.problem.has_b2);
}

TEST(Cli, BadOptionsGiveClearErrors) {
  EXPECT_NE(error_of({"--frobnicate"}).find("unknown option '--frobnicate'"), std::string::npos);
  EXPECT_NE(error_of({"--T"}).find("a value after --T"), std::string::npos);
  EXPECT_NE(error_of({"--T", "12x"}).find("'--T': expected a decimal integer in [1, 2147483647] (digits only), got '12x'"),
            std::string::npos);
  EXPECT_NE(error_of({"--iters", "0"}).find("'--iters'"), std::string::npos);
  EXPECT_NE(error_of({"--config", "13B"}).find("'--config'"), std::string::npos);
  EXPECT_NE(error_of({"--activation", "swish"}).find("one of {swiglu"), std::string::npos);
  EXPECT_NE(error_of({"--routing", "caller"}).find("'--routing'"), std::string::npos);
  EXPECT_NE(error_of({"--dtype", "bf16"}).find("fp32 or fp64"), std::string::npos);
  EXPECT_NE(error_of({"--K", "200"}).find("'problem.K'"), std::string::npos);
  EXPECT_NE(error_of({"--routing", "token_rounding", "--tile", "100"}).find("'--tile': expected a multiple of 8"),
            std::string::npos);
  EXPECT_NE(error_of({"stray"}).find("'stray'"), std::string::npos);
  EXPECT_NE(error_of({"--backend", "gpu"}).find("no GPU backend here"), std::string::npos);
  EXPECT_NE(error_of({"--backend", "tpu"}).find("{auto, gpu, cpu}"), std::string::npos);
  EXPECT_NE(error_of({"--all-configs"}).find("'--all-configs'"), std::string::npos);
}

TEST(Cli, GptOssActivationAndItsParameters) {
  const Options d = parse_options({"--activation", "gptoss_swiglu"}, false);
  EXPECT_EQ(d.problem.activation, Activation::kGptOssSwiGLU);
  EXPECT_EQ(d.problem.swiglu_alpha, kGptOssSwiGLUAlpha);
  EXPECT_EQ(d.problem.swiglu_limit, kGptOssSwiGLULimit);
  const Options o =
      parse_options({"--swiglu-limit", "inf", "--activation", "gptoss_swiglu", "--swiglu-alpha", "1.5"}, false);
  EXPECT_EQ(o.problem.swiglu_alpha, 1.5);
  EXPECT_TRUE(std::isinf(o.problem.swiglu_limit));
  EXPECT_NE(error_of({"--swiglu-limit", "5"}).find("'--swiglu-limit': expected --activation gptoss_swiglu with it"),
            std::string::npos);
  EXPECT_NE(error_of({"--activation", "gptoss_swiglu", "--swiglu-limit", "7x"}).find("expected a real number"),
            std::string::npos);
  EXPECT_NE(error_of({"--activation", "gptoss_swiglu", "--swiglu-limit", "0"}).find("'problem.swiglu_limit'"),
            std::string::npos);
  EXPECT_NE(error_of({"--activation", "gptoss_swiglu", "--swiglu-alpha", "nan"}).find("'problem.swiglu_alpha'"),
            std::string::npos);
}

TEST(Cli, GpuDefaultsAndDtypes) {
  const Options g = parse_options({}, true);
  EXPECT_TRUE(g.gpu);
  EXPECT_EQ(g.dtype, DType::kBF16);
  EXPECT_EQ(g.iters, 10);
  const Options c = parse_options({"--backend", "cpu"}, true);
  EXPECT_FALSE(c.gpu);
  EXPECT_EQ(c.dtype, DType::kFP32);
  EXPECT_EQ(c.config_name, "cpu-small");
  EXPECT_EQ(parse_options({"--dtype", "fp16"}, true).dtype, DType::kFP16);
  EXPECT_THROW(parse_options({"--dtype", "fp64"}, true), Error);
  EXPECT_THROW(parse_options({"--dtype", "bf16"}, false), Error);
  // The weight gradients' dtype and accumulation (gradient accumulation into an fp32 main_grad).
  EXPECT_EQ(g.grad_dtype, DType::kBF16);
  EXPECT_FALSE(g.accumulate_grads);
  const Options acc = parse_options({"--grad-dtype", "fp32", "--accumulate-grads"}, true);
  EXPECT_EQ(acc.grad_dtype, DType::kFP32);
  EXPECT_EQ(acc.dtype, DType::kBF16);
  EXPECT_TRUE(acc.accumulate_grads);
  EXPECT_EQ(parse_options({"--grad-dtype", "data", "--dtype", "fp16"}, true).grad_dtype, DType::kFP16);
  EXPECT_TRUE(parse_options({"--accumulate-grads"}, false).accumulate_grads);
  EXPECT_NE(error_of({"--grad-dtype", "fp32"}).find("a GPU backend"), std::string::npos);
  EXPECT_THROW(parse_options({"--grad-dtype", "bf16"}, true), Error);
  const Options all = parse_options({"--all-configs", "--activation", "geglu"}, true);
  const std::vector<Options> runs = main_config_runs(all);
  ASSERT_EQ(runs.size(), 12u);
  EXPECT_EQ(runs[11].config_name, "120B-2048");
  EXPECT_EQ(runs[11].problem.activation, Activation::kGeGLU);
}

// ---- numbers: 64-bit parsing with overflow detection, a documented range per option -----------------------------

TEST(Cli, IntegersParseExactlyOrFailNamingOptionRangeAndText) {
  EXPECT_EQ(parse_integer("--x", "0", 0, 10), 0);
  EXPECT_EQ(parse_integer("--x", "10", 0, 10), 10);
  EXPECT_EQ(parse_integer("--x", "007", 0, 10), 7);
  EXPECT_EQ(parse_integer("--x", "9223372036854775807", 0, INT64_MAX), INT64_MAX);
  auto error = [](const std::string& text) {
    try {
      parse_integer("--x", text, 1, 100);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  // Range errors print the range and the text as given.
  for (const char* t : {"0", "-1", "101", "4294967296", "4294967297", "9223372036854775807", "-9223372036854775808"})
    EXPECT_NE(error(t).find("argument '--x': expected a decimal integer in [1, 100], got '" + std::string(t) + "'"),
              std::string::npos)
        << t << ": " << error(t);
  // Values past 64 bits are reported as such, never wrapped.
  for (const char* t : {"9223372036854775808", "18446744073709551616", "99999999999999999999999", "-9223372036854775809"})
    EXPECT_NE(error(t).find("got '" + std::string(t) + "' (beyond the 64-bit range)"), std::string::npos) << error(t);
  // Anything but [-]digits, whole.
  for (const char* t : {"", " ", "+5", " 5", "5 ", "1e3", "12abc", "0x10", "1.0", "-", "--5", "5\n", "\xef\xbc\x95"})
    EXPECT_NE(error(t).find("(digits only), got '" + std::string(t) + "'"), std::string::npos)
        << "'" << t << "': " << error(t);
}

TEST(Cli, EveryIntegerOptionTakesItsDocumentedRangeAndNothingElse) {
  const std::string help = usage();
  for (const IntegerOption& o : integer_options()) {
    SCOPED_TRACE(o.name);
    const std::string range = "[" + std::to_string(o.lo) + ", " + std::to_string(o.hi) + "]";
    EXPECT_NE(help.find(std::string(o.name) + std::string(12 - std::string(o.name).size(), ' ') + range),
              std::string::npos)
        << "usage() documents the range";
    EXPECT_EQ(parse_integer(o.name, std::to_string(o.lo), o.lo, o.hi), o.lo);
    EXPECT_EQ(parse_integer(o.name, std::to_string(o.hi), o.lo, o.hi), o.hi);
    // Through the command line: below and above the range, and 2^32 + lo (which a 32-bit narrowing would turn
    // into the valid lo), each rejected with the option, its range and the text. (--seed takes all of [0, 2^63).)
    std::vector<std::int64_t> bad = {o.lo - 1, (std::int64_t{1} << 32) + o.lo};
    if (o.hi < INT64_MAX) bad.push_back(o.hi + 1);
    for (const std::int64_t v : bad) {
      if (v >= o.lo && v <= o.hi) continue;
      const std::string text = std::to_string(v);
      const std::vector<std::string> args = std::string(o.name) == "--tile"
                                                ? std::vector<std::string>{"--routing", "token_rounding", o.name, text}
                                                : std::vector<std::string>{o.name, text};
      const std::string msg = error_of(args);
      EXPECT_NE(msg.find("argument '" + std::string(o.name) + "': expected a decimal integer in " + range +
                         ", got '" + text + "'"),
                std::string::npos)
          << text << ": " << msg;
    }
  }
}

TEST(Cli, RepetitionsAndSeedKeepTheirValue) {
  // Before: --iters 4294967296 was narrowed to int (0 timed runs, a read past an empty vector) and --warmup
  // 4294967295 printed "-1 warm-up".
  EXPECT_NE(error_of({"--iters", "4294967296"}).find("'--iters': expected a decimal integer in [1, 100000], got '4294967296'"),
            std::string::npos);
  EXPECT_NE(error_of({"--warmup", "4294967295"}).find("'--warmup': expected a decimal integer in [0, 100000], got '4294967295'"),
            std::string::npos);
  const Options o = parse_options({"--iters", "100000", "--warmup", "0", "--seed", "9223372036854775807"}, false);
  EXPECT_EQ(o.iters, 100000);
  EXPECT_EQ(o.warmup, 0);
  EXPECT_EQ(o.seed, std::uint64_t{9223372036854775807u});
  EXPECT_NE(error_of({"--seed", "-1"}).find("'--seed'"), std::string::npos);
  EXPECT_NE(error_of({"--seed", "18446744073709551615"}).find("beyond the 64-bit range"), std::string::npos);
}

TEST(Cli, WarmupMillisecondsBringTheGpuToItsSustainedClock) {
  EXPECT_EQ(parse_options({}, true).warmup_ms, kGpuWarmupMs);
  EXPECT_EQ(parse_options({"--warmup-ms", "0"}, true).warmup_ms, 0);
  EXPECT_EQ(parse_options({"--warmup-ms", "60000"}, true).warmup_ms, 60000);
  EXPECT_EQ(parse_options({}, true).timed_ms, kGpuTimedMs);
  EXPECT_EQ(parse_options({"--time-ms", "0"}, true).timed_ms, 0);
  EXPECT_EQ(parse_options({}, false).warmup_ms, 0);  // the CPU reference has no power cap to reach
  EXPECT_EQ(parse_options({}, false).timed_ms, 0);
  for (const char* gpu_only : {"--warmup-ms", "--time-ms"}) {
    const std::string cpu = error_of({gpu_only, "500"});
    EXPECT_NE(cpu.find("'" + std::string(gpu_only) + "': expected a GPU backend"), std::string::npos) << cpu;
  }
  EXPECT_NE(error_of({"--warmup-ms", "60001"}).find("'--warmup-ms': expected a decimal integer in [0, 60000]"),
            std::string::npos);
}

TEST(Cli, StageRunsDefaultToFiveAndTakeTheirRange) {
  EXPECT_EQ(parse_options({}, false).stage_runs, 5);
  EXPECT_EQ(parse_options({}, true).stage_runs, 5);
  EXPECT_EQ(parse_options({"--stage-runs", "1"}, true).stage_runs, 1);
  EXPECT_EQ(parse_options({"--stage-runs", "1000"}, true).stage_runs, 1000);
  EXPECT_NE(error_of({"--stage-runs", "0"}).find("'--stage-runs': expected a decimal integer in [1, 1000], got '0'"),
            std::string::npos);
  EXPECT_NE(error_of({"--stage-runs", "1001"}).find("'--stage-runs'"), std::string::npos);
}

TEST(Cli, StageRunsIsAGpuOptionLikeTheOtherTimings) {
  // Before: accepted and ignored by the CPU reference (which has no stage table), while --warmup-ms and --time-ms
  // were refused there.
  const std::string cpu = error_of({"--stage-runs", "7"});
  EXPECT_NE(cpu.find("'--stage-runs': expected a GPU backend"), std::string::npos) << cpu;
  EXPECT_THROW(parse_options({"--backend", "cpu", "--stage-runs", "7"}, true), Error);
  EXPECT_EQ(parse_options({"--backend", "gpu", "--stage-runs", "7"}, true).stage_runs, 7);
}

TEST(Cli, HelpWinsOverEveryOtherOption) {
  // Before: --help --backend gpu on a machine without a GPU was an error (exit 2) instead of the usage.
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{{"--help"},
                                             {"-h"},
                                             {"--help", "--backend", "gpu"},
                                             {"--backend", "gpu", "-h"},
                                             {"--frobnicate", "--help"},
                                             {"--T", "0", "--help"},
                                             {"--help", "--T"},
                                             {"--all-configs", "--help"},
                                             {"--profile", "--profile", "--help"},
                                             {"--T", "1", "--T", "2", "--help"},
                                             {"--help", "--help"}}) {
    std::string joined;
    for (const std::string& a : args) joined += a + " ";
    SCOPED_TRACE(joined);
    Options o;
    ASSERT_NO_THROW(o = parse_options(args, false));
    EXPECT_TRUE(o.help);
  }
  // A value that reads "-h" is still the option's value.
  EXPECT_FALSE(parse_options({"--json", "-h"}, false).help);
}

TEST(Cli, RepeatedFlagsAreRefusedLikeRepeatedOptions) {
  for (const char* flag : {"--accumulate-grads", "--profile", "--all-configs"}) {
    SCOPED_TRACE(flag);
    std::string msg;
    try {
      parse_options({flag, "--backend", "gpu", flag}, true);
    } catch (const Error& e) {
      msg = e.what();
    }
    EXPECT_NE(msg.find("'" + std::string(flag) + "': expected the option once, got it twice"), std::string::npos)
        << msg;
  }
  EXPECT_TRUE(parse_options({"--accumulate-grads", "--profile", "--all-configs"}, true).accumulate_grads);
}

// ---- the JSON file -------------------------------------------------------------------------------------------

std::string read_all(const std::string& path) {
  std::ifstream f(path);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

TEST(Cli, JsonWriteFailuresAreErrors) {
  // Before: fputs and fclose went unchecked, so --json /dev/full exited 0 with nothing written.
  testing::internal::CaptureStderr();
  const int full = write_json("/dev/full", {"{\"a\":1}"});
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(full, 1);
  EXPECT_NE(err.find("'/dev/full'"), std::string::npos) << err;
  testing::internal::CaptureStderr();
  EXPECT_EQ(write_json("/nonexistent-dir/x.json", {"{}"}), 1);
  EXPECT_NE(testing::internal::GetCapturedStderr().find("'/nonexistent-dir/x.json'"), std::string::npos);
  char tmpl[] = "/tmp/machmoe_cli_json_XXXXXX";
  const int fd = mkstemp(tmpl);
  ASSERT_GE(fd, 0);
  close(fd);
  EXPECT_EQ(write_json(tmpl, {"{\"a\":1}", "{\"b\":2}"}), 0);
  EXPECT_EQ(read_all(tmpl), "[\n  {\"a\":1},\n  {\"b\":2}\n]\n");
  std::remove(tmpl);
  EXPECT_EQ(write_json("", {"{}"}), 0);  // no --json: nothing to write
}

TEST(Cli, JsonRecordsEveryOptionOfTheProblem) {
  // Before: the GPU JSON had neither routing, bias, score, layout, tile, rounding, chunks nor the swiglu parameters,
  // so a --routing token_rounding or --bias both run looked like the defaults.
  const std::string d = problem_json_members(parse_options({}, false));
  EXPECT_EQ(d,
            "\"activation\":\"swiglu\",\"swiglu_alpha\":1.702,\"swiglu_limit\":7,\"bias\":\"none\","
            "\"layout\":\"interleaved\",\"score\":\"softmax_topk\",\"routing\":\"topk\",\"rounding\":\"nearest\","
            "\"tile\":128,\"cache\":\"preact\",\"dx_chunks\":0,\"y_chunks\":0,\"grad_dtype\":\"fp32\","
            "\"accumulate_grads\":false");
  const std::string o = problem_json_members(parse_options(
      {"--activation", "gptoss_swiglu", "--swiglu-limit", "inf", "--swiglu-alpha", "1.5", "--bias", "both",
       "--layout", "concatenated", "--score", "topk_softmax", "--routing", "token_rounding", "--rounding", "up",
       "--tile", "64", "--cache", "input_only", "--dx-chunks", "3", "--y-chunks", "2", "--grad-dtype", "fp32",
       "--accumulate-grads"},
      true));
  for (const char* member :
       {"\"activation\":\"gptoss_swiglu\"", "\"swiglu_alpha\":1.5", "\"swiglu_limit\":\"inf\"", "\"bias\":\"both\"",
        "\"layout\":\"concatenated\"", "\"score\":\"topk_softmax\"", "\"routing\":\"token_rounding\"",
        "\"rounding\":\"up\"", "\"tile\":64", "\"cache\":\"input_only\"", "\"dx_chunks\":3", "\"y_chunks\":2",
        "\"grad_dtype\":\"fp32\"", "\"accumulate_grads\":true"})
    EXPECT_NE(o.find(member), std::string::npos) << member << " in " << o;
  for (const char* b : {"b1", "b2"})
    EXPECT_NE(problem_json_members(parse_options({"--bias", b}, false)).find("\"bias\":\"" + std::string(b) + "\""),
              std::string::npos);
}

TEST(Cli, CpuRunSaysWhyItLeavesAGpuUnused) {
  // Before: with a CUDA build, --backend cpu printed "the layer's CUDA backend is not in this build yet".
  const std::string cpu = cpu_run_gpu_line(parse_options({"--backend", "cpu"}, true), 1, "NVIDIA H200");
  EXPECT_EQ(cpu, "gpu:      NVIDIA H200 (not used: --backend cpu; running the CPU reference)");
  EXPECT_EQ(cpu.find("not in this build"), std::string::npos);
  EXPECT_EQ(cpu_run_gpu_line(parse_options({}, false), 0, ""), "gpu:      none found; running the CPU reference");
}

TEST(Cli, TokenChunkOptionsSetTheirOwnPass) {
  const Options none = parse_options({}, false);
  EXPECT_EQ(none.problem.dx_chunks, 0);
  EXPECT_EQ(none.problem.y_chunks, 0);
  const Options y = parse_options({"--y-chunks", "1"}, false);
  EXPECT_EQ(y.problem.y_chunks, 1);
  EXPECT_EQ(y.problem.dx_chunks, 0);
  const Options dx = parse_options({"--dx-chunks", "3"}, false);
  EXPECT_EQ(dx.problem.dx_chunks, 3);
  EXPECT_EQ(dx.problem.y_chunks, 0);
  EXPECT_NE(error_of({"--y-chunks", "-1"}).find("'--y-chunks'"), std::string::npos);
  EXPECT_NE(error_of({"--y-chunks", "1025"}).find("'--y-chunks': expected a decimal integer in [0, 1024]"),
            std::string::npos);
}

TEST(Cli, SizesBeyondTheLibraryLimitsNameTheOption) {
  EXPECT_NE(error_of({"--d", "1048577"}).find("'--d': expected a decimal integer in [1, 1048576]"), std::string::npos);
  EXPECT_NE(error_of({"--E", "65537"}).find("'--E': expected a decimal integer in [1, 65536]"), std::string::npos);
  EXPECT_NE(error_of({"--T", "2147483648"}).find("'--T': expected a decimal integer in [1, 2147483647]"),
            std::string::npos);
  EXPECT_NE(error_of({"--T", "0"}).find("'--T'"), std::string::npos);
  // In range alone but not together: the problem's own check names the combination.
  EXPECT_NE(error_of({"--T", "2147483647", "--K", "2"}).find("'problem.T*K'"), std::string::npos);
}

TEST(Cli, OptionsThatWouldBeIgnoredAreErrors) {
  EXPECT_NE(error_of({"--T", "64", "--T", "32"}).find("'--T': expected the option once, got it twice ('64', then '32')"),
            std::string::npos);
  EXPECT_NE(error_of({"--activation", "gelu", "--activation", "relu"}).find("'--activation': expected the option once"),
            std::string::npos);
  EXPECT_NE(error_of({"--tile", "64"}).find("'--tile': expected --routing token_rounding with it"), std::string::npos);
  EXPECT_NE(error_of({"--rounding", "up"}).find("'--rounding': expected --routing token_rounding"), std::string::npos);
  EXPECT_NE(error_of({"--tile", "12", "--routing", "token_rounding"}).find("'--tile': expected a multiple of 8"),
            std::string::npos);
  EXPECT_NE(error_of({"--json", ""}).find("'--json': expected a file path, got ''"), std::string::npos);
  auto gpu_error = [](const std::vector<std::string>& args) {
    try {
      parse_options(args, true);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(gpu_error({"--all-configs", "--T", "4096"}).find("'--T': expected no configuration or size option with "
                                                            "--all-configs"),
            std::string::npos);
  EXPECT_NE(gpu_error({"--config", "30B-256", "--all-configs"}).find("'--config'"), std::string::npos);
  const Options tr = parse_options({"--routing", "token_rounding", "--tile", "64", "--rounding", "up"}, false);
  EXPECT_EQ(tr.problem.tile_m, 64);
  EXPECT_EQ(tr.problem.rounding, RoundingRule::kUp);
}

}  // namespace
}  // namespace machmoe::bench
