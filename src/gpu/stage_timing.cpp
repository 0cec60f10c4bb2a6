#include "gpu/stage_timing.hpp"

#include <utility>
#include <vector>

#include "gpu/cuda_check.hpp"
#include "machmoe/profiling.hpp"

namespace machmoe {
namespace {

// An event belongs to the device that was current when it was created, and may only be recorded on that device's
// streams: each mark keeps its device, the pool of recycled events is kept per device, and a stage is timed up to
// the next mark of its own device (a thread that profiles layer calls on cuda:0 and cuda:1 interleaved gets each
// device's stages, where one pool handed cuda:0's events to cuda:1's streams and cudaEventRecord failed inside the
// layer call).
struct Mark {
  const char* name;  // null: end of the previous stage
  cudaEvent_t event;
  int device;
};

struct Recorder {
  bool on = false;
  std::vector<Mark> marks;
  std::vector<std::pair<int, cudaEvent_t>> pool;  // (device, event)
  ~Recorder() {
    for (const Mark& m : marks) cudaEventDestroy(m.event);
    for (const auto& de : pool) cudaEventDestroy(de.second);
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
  // Every event, not only the last: the marks may span devices and streams.
  for (const Mark& m : r.marks) MACHMOE_CUDA_CHECK(cudaEventSynchronize(m.event));
  for (std::size_t i = 0; i < r.marks.size(); ++i) {
    if (!r.marks[i].name) continue;
    std::size_t j = i + 1;  // the stage ends at the next mark of its device
    while (j < r.marks.size() && r.marks[j].device != r.marks[i].device) ++j;
    if (j == r.marks.size()) continue;  // never ended (no later mark on its device)
    float ms = 0;
    MACHMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, r.marks[i].event, r.marks[j].event));
    // A stage that runs in pieces (the backward's dX~ in chunks of tokens) is reported once, its pieces summed.
    bool merged = false;
    for (StageTime& st : out)
      if (st.stage == r.marks[i].name) st.ms += ms, merged = true;
    if (!merged) out.push_back({r.marks[i].name, ms});
  }
  for (const Mark& m : r.marks) r.pool.emplace_back(m.device, m.event);
  r.marks.clear();
  return out;
}

namespace gpu {

void mark_stage(const char* name, cudaStream_t stream) {
  Recorder& r = recorder();
  if (!r.on) return;
  int device = 0;
  MACHMOE_CUDA_CHECK(cudaGetDevice(&device));  // the layer's device guard has made the stream's device current
  cudaEvent_t e = nullptr;
  for (std::size_t k = r.pool.size(); k-- > 0;) {
    if (r.pool[k].first != device) continue;
    e = r.pool[k].second;
    r.pool.erase(r.pool.begin() + static_cast<std::ptrdiff_t>(k));
    break;
  }
  if (e == nullptr) MACHMOE_CUDA_CHECK(cudaEventCreate(&e));
  MACHMOE_CUDA_CHECK(cudaEventRecord(e, stream));
  r.marks.push_back({name, e, device});
}

}  // namespace gpu
}  // namespace machmoe
