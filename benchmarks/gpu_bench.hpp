// The GPU side of machmoe-bench (built only with CUDA).
#pragma once

#include <string>
#include <vector>

#include "cli_options.hpp"

namespace machmoe::bench {

/// Runs the configurations on CUDA device 0, prints the tables, and appends one JSON object per configuration to
/// `json_objects`. Returns the process exit code.
int run_gpu(const std::vector<Options>& runs, std::vector<std::string>& json_objects);

}  // namespace machmoe::bench
