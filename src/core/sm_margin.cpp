// The SM margin (include/machmoe/sm_margin.hpp): a process-wide setting, read by the GPU layer at each launch.
#include "machmoe/sm_margin.hpp"

#include <atomic>
#include <string>

#include "core/env.hpp"
#include "machmoe/error.hpp"

namespace machmoe {

namespace {
std::atomic<int>& margin_value() {
  static std::atomic<int> value{detail::env_nonnegative_int("MACHMOE_SM_MARGIN", 0)};
  return value;
}
}  // namespace

void set_sm_margin(int sms) {
  if (sms < 0) throw_argument_error("set_sm_margin", "sms", "a number of SMs >= 0", std::to_string(sms));
  margin_value().store(sms, std::memory_order_relaxed);
}

int sm_margin() { return margin_value().load(std::memory_order_relaxed); }

}  // namespace machmoe
