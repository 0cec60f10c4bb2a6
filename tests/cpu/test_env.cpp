// The environment's MACHMOE_* settings (src/core/env.hpp): the one convention every switch and number of the library
// reads through. Each test sets and unsets its own variable, a name no setting of the library uses.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "core/env.hpp"

namespace machmoe::test {
namespace {

constexpr const char* kName = "MACHMOE_TEST_ENV_SETTING";

/// Sets kName to `value` (nullptr: unsets it) for one test, and unsets it when the test ends.
struct EnvGuard {
  explicit EnvGuard(const char* value) {
    if (value == nullptr)
      unsetenv(kName);
    else
      setenv(kName, value, 1);
  }
  ~EnvGuard() { unsetenv(kName); }
};

TEST(EnvSwitch, UnsetOrEmptyGivesTheDefault) {
  for (const char* value : {static_cast<const char*>(nullptr), ""}) {
    EnvGuard guard(value);
    EXPECT_TRUE(detail::env_switch(kName, true)) << (value ? "empty" : "unset");
    EXPECT_FALSE(detail::env_switch(kName, false)) << (value ? "empty" : "unset");
  }
}

TEST(EnvSwitch, ZeroIsOffAndAnythingElseIsOn) {
  for (const char* off : {"0", "00", "0x"}) {
    EnvGuard guard(off);
    EXPECT_FALSE(detail::env_switch(kName, true)) << off;
  }
  for (const char* on : {"1", "2", "yes", "on"}) {
    EnvGuard guard(on);
    EXPECT_TRUE(detail::env_switch(kName, false)) << on;
  }
}

TEST(EnvNonnegativeInt, ReadsWholeDecimalNumbers) {
  {
    EnvGuard guard(nullptr);
    EXPECT_EQ(detail::env_nonnegative_int(kName, 7), 7);
  }
  {
    EnvGuard guard("");
    EXPECT_EQ(detail::env_nonnegative_int(kName, 7), 7);
  }
  for (const auto& [text, value] : {std::pair<const char*, int>{"0", 0}, {"24", 24}, {"2147483647", 2147483647}}) {
    EnvGuard guard(text);
    EXPECT_EQ(detail::env_nonnegative_int(kName, 7), value) << text;
  }
}

TEST(EnvNonnegativeInt, AnythingElseIsReportedAndGivesTheDefault) {
  for (const char* bad : {"-3", "+3", " 3", "3 ", "12x", "abc", "2147483648", "99999999999999999999"}) {
    EnvGuard guard(bad);
    testing::internal::CaptureStderr();
    EXPECT_EQ(detail::env_nonnegative_int(kName, 7), 7) << bad;
    EXPECT_EQ(testing::internal::GetCapturedStderr(),
              std::string("machmoe: warning: MACHMOE_TEST_ENV_SETTING=") + bad + " is not a non-negative integer; using 7\n");
  }
}

}  // namespace
}  // namespace machmoe::test
