// Per-stage timing of the GPU layer, for benchmarks. Off by default; while on (per thread), forward() and
// backward() on CUDA record an event at each stage boundary on their stream (a few microseconds per stage).
#pragma once

#include <string>
#include <vector>

namespace machmoe {

struct StageTime {
  std::string stage;  // "forward/up_projection", ...
  double ms = 0;
};

void enable_stage_timing(bool on);
/// Waits for the recorded events and returns each stage's time, in launch order, since the last call.
std::vector<StageTime> collect_stage_timings();

}  // namespace machmoe
