#include "gpu/stage_timing.hpp"

#include <utility>
#include <vector>

#include "gpu/cuda_check.hpp"
#include "machmoe/profiling.hpp"

namespace machmoe {
namespace {

struct Mark {
  const char* name;  // null: end of the previous stage
  cudaEvent_t event;
};

struct Recorder {
  bool on = false;
  std::vector<Mark> marks;
  std::vector<cudaEvent_t> pool;
  ~Recorder() {
    for (const Mark& m : marks) cudaEventDestroy(m.event);
    for (cudaEvent_t e : pool) cudaEventDestroy(e);
  }
};

Recorder& recorder() {
  thread_local Recorder r;
  return r;
}

}  // namespace

void enable_stage_timing(bool on) { recorder().on = on; }

std::vector<StageTime> collect_stage_timings() {
  Recorder& r = recorder();
  std::vector<StageTime> out;
  if (!r.marks.empty()) MACHMOE_CUDA_CHECK(cudaEventSynchronize(r.marks.back().event));
  for (std::size_t i = 0; i + 1 < r.marks.size(); ++i) {
    if (!r.marks[i].name) continue;
    float ms = 0;
    MACHMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, r.marks[i].event, r.marks[i + 1].event));
    // A stage that runs in pieces (the backward's dX~ in chunks of tokens) is reported once, its pieces summed.
    bool merged = false;
    for (StageTime& st : out)
      if (st.stage == r.marks[i].name) st.ms += ms, merged = true;
    if (!merged) out.push_back({r.marks[i].name, ms});
  }
  for (const Mark& m : r.marks) r.pool.push_back(m.event);
  r.marks.clear();
  return out;
}

namespace gpu {

void mark_stage(const char* name, cudaStream_t stream) {
  Recorder& r = recorder();
  if (!r.on) return;
  cudaEvent_t e;
  if (r.pool.empty()) {
    MACHMOE_CUDA_CHECK(cudaEventCreate(&e));
  } else {
    e = r.pool.back();
    r.pool.pop_back();
  }
  MACHMOE_CUDA_CHECK(cudaEventRecord(e, stream));
  r.marks.push_back({name, e});
}

}  // namespace gpu
}  // namespace machmoe
