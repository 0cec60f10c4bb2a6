// The environment's MACHMOE_* settings (core/env.hpp).
#include "core/env.hpp"

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>

namespace machmoe::detail {

bool env_switch(const char* name, bool unset_value) {
  const char* v = std::getenv(name);
  if (v == nullptr || v[0] == '\0') return unset_value;
  return v[0] != '0';
}

int env_nonnegative_int(const char* name, int unset_value) {
  const char* v = std::getenv(name);
  if (v == nullptr || v[0] == '\0') return unset_value;
  char* end = nullptr;
  errno = 0;
  const long parsed = std::strtol(v, &end, 10);
  // A leading digit: strtol would skip white space and take a sign, and neither belongs in a count.
  if (v[0] < '0' || v[0] > '9' || errno != 0 || *end != '\0' || parsed > INT_MAX) {
    std::fprintf(stderr, "machmoe: warning: %s=%s is not a non-negative integer; using %d\n", name, v, unset_value);
    return unset_value;
  }
  return static_cast<int>(parsed);
}

}  // namespace machmoe::detail
