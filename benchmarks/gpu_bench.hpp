// The GPU side of sonicmoe-bench (built only with CUDA).
#pragma once

#include <string>
#include <vector>

#include "cli_options.hpp"

namespace sonicmoe::bench {

/// Runs the configurations on CUDA device 0, prints the tables, and appends one JSON object per configuration to
/// `json_objects`. Returns the process exit code.
int run_gpu(const std::vector<Options>& runs, std::vector<std::string>& json_objects);

}  // namespace sonicmoe::bench
