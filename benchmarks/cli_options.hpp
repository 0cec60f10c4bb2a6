// Command-line options of sonicmoe-bench, parsed strictly: unknown options, missing or malformed values and
// invalid combinations are errors that say what was expected.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sonicmoe/problem.hpp"
#include "sonicmoe/tensor.hpp"

namespace sonicmoe::bench {

struct NamedConfig {
  const char* name;
  std::int64_t T, d, n, E, K;
  const char* note;
};

/// The 12 main configurations of TARGETS.md plus the reduced CPU default.
const std::vector<NamedConfig>& named_configs();

struct Options {
  MoEProblem problem;
  std::string config_name;  // name of the configuration the sizes came from ("custom" if overridden)
  DType dtype = DType::kFP32;
  int iters = 3;
  int warmup = 1;
  std::uint64_t seed = 0;
  bool help = false;
};

/// Parses argv. Throws sonicmoe::Error with a message naming the option on bad input.
/// `have_gpu_backend` selects the default configuration (7B on a GPU backend, the reduced CPU size otherwise).
Options parse_options(const std::vector<std::string>& args, bool have_gpu_backend);

std::string usage();

}  // namespace sonicmoe::bench
