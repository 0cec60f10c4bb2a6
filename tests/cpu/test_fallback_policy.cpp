// The fallback policy (include/machmoe/fallback.hpp) and the report the GPU dispatcher makes when a GEMM falls back
// to the GPU reference kernel (src/core/fallback.hpp): a warning naming the stage, the shape and the reason once
// per process and reason, or machmoe::Error under FallbackPolicy::kError. Host code: tested without a device.
#include <gtest/gtest.h>

#include <string>

#include "core/fallback.hpp"
#include "machmoe/error.hpp"
#include "machmoe/fallback.hpp"

namespace machmoe::test {
namespace {

/// Restores the process-wide policy when a test ends, whatever it set.
struct PolicyGuard {
  FallbackPolicy saved = fallback_policy();
  ~PolicyGuard() { set_fallback_policy(saved); }
};

TEST(FallbackPolicy, MessageNamesStageShapeAndReason) {
  EXPECT_EQ(detail::fallback_message("forward/up_projection", "M = 64 routed rows at most, N = 20, K = 2880",
                                     "N = 20 is not a positive multiple of 8 (16-byte rows)"),
            "machmoe: forward/up_projection (M = 64 routed rows at most, N = 20, K = 2880) runs on the slow GPU "
            "reference GEMM: N = 20 is not a positive multiple of 8 (16-byte rows)");
}

TEST(FallbackPolicy, ErrorPolicyThrowsTheMessage) {
  PolicyGuard guard;
  set_fallback_policy(FallbackPolicy::kError);
  EXPECT_EQ(fallback_policy(), FallbackPolicy::kError);
  EXPECT_STREQ(fallback_policy_name(fallback_policy()), "error");
  try {
    detail::report_reference_fallback("test/error_stage", "M = 1, N = 12, K = 8", "N = 12 is not a multiple", false);
    FAIL() << "no machmoe::Error under FallbackPolicy::kError";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("test/error_stage"), std::string::npos) << what;
    EXPECT_NE(what.find("M = 1, N = 12, K = 8"), std::string::npos) << what;
    EXPECT_NE(what.find("N = 12 is not a multiple"), std::string::npos) << what;
    EXPECT_NE(what.find("MACHMOE_FALLBACK=error"), std::string::npos) << what;
  }
  // The reference path asked for by a switch is never an error.
  testing::internal::CaptureStderr();
  EXPECT_NO_THROW(detail::report_reference_fallback("test/deliberate_stage", "M = 1", "switched off", true));
  EXPECT_NE(testing::internal::GetCapturedStderr().find("test/deliberate_stage"), std::string::npos);
}

TEST(FallbackPolicy, WarnPolicyWarnsOncePerStageAndReason) {
  PolicyGuard guard;
  set_fallback_policy(FallbackPolicy::kWarn);
  EXPECT_STREQ(fallback_policy_name(fallback_policy()), "warn");
  testing::internal::CaptureStderr();
  EXPECT_NO_THROW(detail::report_reference_fallback("test/warn_stage", "M = 2, N = 4, K = 8", "reason A", false));
  const std::string first = testing::internal::GetCapturedStderr();
  EXPECT_NE(first.find("WARNING"), std::string::npos) << first;
  EXPECT_NE(first.find("test/warn_stage (M = 2, N = 4, K = 8)"), std::string::npos) << first;
  EXPECT_NE(first.find("reason A"), std::string::npos) << first;
  testing::internal::CaptureStderr();
  detail::report_reference_fallback("test/warn_stage", "M = 3, N = 4, K = 8", "reason A", false);  // seen: quiet
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
  testing::internal::CaptureStderr();
  detail::report_reference_fallback("test/warn_stage", "M = 2, N = 4, K = 8", "reason B", false);  // a new reason
  EXPECT_NE(testing::internal::GetCapturedStderr().find("reason B"), std::string::npos);
}

TEST(FallbackPolicy, RejectsValuesOutsideTheEnum) {
  PolicyGuard guard;
  EXPECT_THROW(set_fallback_policy(static_cast<FallbackPolicy>(7)), Error);
  EXPECT_EQ(fallback_policy(), guard.saved);
}

}  // namespace
}  // namespace machmoe::test
