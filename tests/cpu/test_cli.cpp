// machmoe-bench's option parsing.
#include <gtest/gtest.h>

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
  for (const NamedConfig& c : named_configs()) main_configs += std::string(c.name) != "cpu-small";
  EXPECT_EQ(main_configs, 12);
  const Options o = parse_options({"--K", "2", "--config", "120B-2048", "--activation", "gelu", "--bias", "both"}, false);
  EXPECT_EQ(o.problem.n, 2048);
  EXPECT_EQ(o.problem.K, 2) << "size overrides apply on top of --config whatever the order";
  EXPECT_EQ(o.problem.activation, Activation::kGELU);
  EXPECT_TRUE(o.problem.has_b1 && o.problem.has_b2);
}

TEST(Cli, BadOptionsGiveClearErrors) {
  EXPECT_NE(error_of({"--frobnicate"}).find("unknown option '--frobnicate'"), std::string::npos);
  EXPECT_NE(error_of({"--T"}).find("a value after --T"), std::string::npos);
  EXPECT_NE(error_of({"--T", "12x"}).find("'--T': expected an integer >= 1, got '12x'"), std::string::npos);
  EXPECT_NE(error_of({"--iters", "0"}).find("'--iters'"), std::string::npos);
  EXPECT_NE(error_of({"--config", "13B"}).find("'--config'"), std::string::npos);
  EXPECT_NE(error_of({"--activation", "swish"}).find("one of {swiglu"), std::string::npos);
  EXPECT_NE(error_of({"--routing", "caller"}).find("'--routing'"), std::string::npos);
  EXPECT_NE(error_of({"--dtype", "bf16"}).find("fp32 or fp64"), std::string::npos);
  EXPECT_NE(error_of({"--K", "200"}).find("'problem.K'"), std::string::npos);
  EXPECT_NE(error_of({"--routing", "token_rounding", "--tile", "100"}).find("'problem.tile_m'"), std::string::npos);
  EXPECT_NE(error_of({"stray"}).find("'stray'"), std::string::npos);
  EXPECT_NE(error_of({"--backend", "gpu"}).find("no GPU backend here"), std::string::npos);
  EXPECT_NE(error_of({"--backend", "tpu"}).find("{auto, gpu, cpu}"), std::string::npos);
  EXPECT_NE(error_of({"--all-configs"}).find("'--all-configs'"), std::string::npos);
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
  const Options all = parse_options({"--all-configs", "--activation", "geglu"}, true);
  const std::vector<Options> runs = main_config_runs(all);
  ASSERT_EQ(runs.size(), 12u);
  EXPECT_EQ(runs[11].config_name, "120B-2048");
  EXPECT_EQ(runs[11].problem.activation, Activation::kGeGLU);
}

}  // namespace
}  // namespace machmoe::bench
