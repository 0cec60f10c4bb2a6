// The fallback policy (include/machmoe/fallback.hpp) and its reporting (core/fallback.hpp).
#include "core/fallback.hpp"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <utility>

#include "machmoe/error.hpp"
#include "machmoe/fallback.hpp"

namespace machmoe {

namespace {
std::atomic<int>& policy_flag() {
  static std::atomic<int> flag{[] {
    const char* v = std::getenv("MACHMOE_FALLBACK");
    if (v == nullptr || v[0] == '\0' || std::strcmp(v, "warn") == 0) return static_cast<int>(FallbackPolicy::kWarn);
    if (std::strcmp(v, "error") == 0) return static_cast<int>(FallbackPolicy::kError);
    std::fprintf(stderr, "machmoe: warning: MACHMOE_FALLBACK=%s is neither 'warn' nor 'error'; using 'warn'\n", v);
    return static_cast<int>(FallbackPolicy::kWarn);
  }()};
  return flag;
}
}  // namespace

void set_fallback_policy(FallbackPolicy policy) {
  if (policy != FallbackPolicy::kWarn && policy != FallbackPolicy::kError)
    throw_argument_error("set_fallback_policy", "policy", "FallbackPolicy::kWarn or FallbackPolicy::kError",
                         std::to_string(static_cast<int>(policy)));
  policy_flag().store(static_cast<int>(policy));
}

FallbackPolicy fallback_policy() { return static_cast<FallbackPolicy>(policy_flag().load()); }

const char* fallback_policy_name(FallbackPolicy policy) {
  return policy == FallbackPolicy::kError ? "error" : "warn";
}

namespace detail {

std::string fallback_message(const std::string& stage, const std::string& shape, const std::string& reason) {
  return "machmoe: " + stage + " (" + shape + ") runs on the slow GPU reference GEMM: " + reason;
}

void report_reference_fallback(const std::string& stage, const std::string& shape, const std::string& reason,
                               bool deliberate) {
  const std::string message = fallback_message(stage, shape, reason);
  if (!deliberate && fallback_policy() == FallbackPolicy::kError)
    throw Error(message + " (MACHMOE_FALLBACK=error / set_fallback_policy(kError) makes this an error)");
  static std::mutex mu;
  static std::set<std::pair<std::string, std::string>> seen;
  const std::lock_guard<std::mutex> lock(mu);
  if (!seen.emplace(stage, reason).second) return;
  if (deliberate)
    std::fprintf(stderr, "%s (as switched)\n", message.c_str());
  else
    std::fprintf(stderr,
                 "%s. WARNING: several times slower than the Hopper kernels; reported once per process and "
                 "reason, MACHMOE_FALLBACK=error makes it an error.\n",
                 message.c_str());
}

}  // namespace detail
}  // namespace machmoe
