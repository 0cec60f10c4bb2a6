// The SM margin (include/machmoe/sm_margin.hpp): a process-wide setting, read by the GPU layer at each launch.
#include "machmoe/sm_margin.hpp"

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>

#include "machmoe/error.hpp"

namespace machmoe {

namespace {
std::atomic<int>& margin_value() {
  static std::atomic<int> value{[] {
    const char* v = std::getenv("MACHMOE_SM_MARGIN");
    if (v == nullptr || v[0] == '\0') return 0;
    char* end = nullptr;
    errno = 0;
    const long m = std::strtol(v, &end, 10);
    if (errno != 0 || end == v || *end != '\0' || m < 0 || m > std::numeric_limits<int>::max()) {
      std::fprintf(stderr, "machmoe: warning: MACHMOE_SM_MARGIN=%s is not a non-negative integer; using 0\n", v);
      return 0;
    }
    return static_cast<int>(m);
  }()};
  return value;
}
}  // namespace

void set_sm_margin(int sms) {
  if (sms < 0) throw_argument_error("set_sm_margin", "sms", "a number of SMs >= 0", std::to_string(sms));
  margin_value().store(sms, std::memory_order_relaxed);
}

int sm_margin() { return margin_value().load(std::memory_order_relaxed); }

}  // namespace machmoe
