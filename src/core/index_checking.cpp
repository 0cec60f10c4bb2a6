// The index-checking switch, and the host side of grouped_expert_index (include/machmoe/index_checking.hpp).
#include "machmoe/index_checking.hpp"

#include <atomic>
#include <cstdlib>
#include <string>

#include "core/checks.hpp"
#include "core/env.hpp"
#include "core/host_io.hpp"
#include "machmoe/error.hpp"
#include "machmoe/problem.hpp"  // Limits (a CPU-only build gets it from nowhere else)

#ifdef MACHMOE_WITH_CUDA
#include "gpu/layer_cuda.hpp"
#endif

namespace machmoe {

namespace {
std::atomic<bool>& checking_flag() {
  static std::atomic<bool> flag{detail::env_switch("MACHMOE_CHECK_INDICES", false)};
  return flag;
}
}  // namespace

void set_index_checking(bool enabled) { checking_flag().store(enabled); }

bool index_checking_enabled() { return checking_flag().load(); }

void check_device_errors(const Device& device, void* stream) {
  const detail::ArgChecker c("check_device_errors", "device");
  if (device.type == DeviceType::kCPU) {
    c.device(device, "device");
    if (stream != nullptr) c.fail("stream", "nullptr for the cpu", "a non-null stream");
    return;
  }
#ifdef MACHMOE_WITH_CUDA
  c.device(device, "device");  // also an unknown device type
  gpu::check_device_errors_cuda(device.index, stream);
#else
  throw_argument_error("check_device_errors", "device",
                       "cpu (this build has no CUDA support: nvcc was not found at configure time)",
                       device_name(device));
#endif
}

void grouped_expert_index(const TensorView& counts, const TensorView& index, void* stream) {
  const detail::ArgChecker c("grouped_expert_index", "expert_counts");
  c.ranked(counts, "expert_counts", 1, "an (E,) tensor");
  c.ranked(index, "expert_index", 1, "a (rows,) tensor");
  const std::int64_t E = counts.shape[0], rows = index.shape[0];
  if (E < 1 || E > Limits::kMaxExperts)
    c.fail("expert_counts", "between 1 and " + std::to_string(Limits::kMaxExperts) + " experts",
           std::to_string(E) + " entries");
  if (index.device != counts.device)
    c.fail("expert_index", "a tensor on " + device_name(counts.device) + " (the device of expert_counts)",
           "a tensor on " + device_name(index.device));
  c.index_tensor(counts, "expert_counts", {E}, counts.device);
  c.index_tensor(index, "expert_index", {rows}, counts.device);
  if (index.dtype == DType::kInt32 && rows > Limits::kMaxPairs)
    c.fail("expert_index", "dtype int64 for more than 2^31 - 1 rows", "int32");
  if (counts.device.type == DeviceType::kCUDA) {
#ifdef MACHMOE_WITH_CUDA
    c.device(counts.device, "expert_counts");
    gpu::grouped_expert_index_cuda(counts, index, stream);
    return;
#else
    c.fail("expert_counts", "a tensor on cpu (this build has no CUDA support)", device_name(counts.device));
#endif
  }
  c.device(counts.device, "expert_counts");
  if (stream != nullptr) c.fail("stream", "nullptr for cpu tensors", "a non-null stream");
  // Host data: validate everything before writing anything.
  const std::vector<std::int64_t> f = detail::read_index(counts);
  std::int64_t total = 0;
  for (std::int64_t e = 0; e < E; ++e) {
    if (f[e] < 0) c.fail("expert_counts[" + std::to_string(e) + "]", "a count >= 0", std::to_string(f[e]));
    // Compared before adding (0 <= total <= rows here, so rows - total cannot wrap): adding first overflows for
    // counts near 2^63, and a sum that wraps back to exactly `rows` would send the fill below past `expert`.
    if (f[e] > rows - total)
      c.fail("expert_counts", "counts summing to the " + std::to_string(rows) + " grouped rows",
             "a sum above " + std::to_string(rows) + " by expert_counts[" + std::to_string(e) + "] = " +
                 std::to_string(f[e]));
    total += f[e];
  }
  if (total != rows)
    c.fail("expert_counts", "counts summing to the " + std::to_string(rows) + " grouped rows",
           "a sum of " + std::to_string(total));
  std::vector<std::int64_t> expert(static_cast<std::size_t>(rows));
  std::int64_t r = 0;
  for (std::int64_t e = 0; e < E; ++e)
    for (std::int64_t i = 0; i < f[e]; ++i) expert[static_cast<std::size_t>(r++)] = e;
  if (index.dtype == DType::kInt64) {
    detail::for_each_element(index, [&](std::int64_t off, std::int64_t i) {
      static_cast<std::int64_t*>(index.data)[off] = expert[static_cast<std::size_t>(i)];
    });
  } else {
    detail::write_int32(index, expert.data());
  }
}

}  // namespace machmoe
