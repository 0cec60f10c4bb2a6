// sonicmoe-bench's option parsing.
#include <gtest/gtest.h>

#include "cli_options.hpp"
#include "sonicmoe/error.hpp"

namespace sonicmoe::bench {
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
}

}  // namespace
}  // namespace sonicmoe::bench
