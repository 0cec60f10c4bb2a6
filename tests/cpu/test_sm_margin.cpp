// The SM margin (include/machmoe/sm_margin.hpp) as host code sees it: the setting and its check, a CPU layer call
// that ignores it, and machmoe-bench's --sm-margin. What the GPU does with it is tests/gpu/test_gpu_layer.cpp's
// GpuSmMargin and tests/python/test_sm_margin.py's.
#include <gtest/gtest.h>

#include <string>

#include "cli_options.hpp"
#include "machmoe/device.hpp"
#include "machmoe/error.hpp"
#include "machmoe/sm_margin.hpp"

namespace machmoe::test {
namespace {

/// Restores the process-wide margin when a test ends, whatever it set.
struct MarginGuard {
  int saved = sm_margin();
  ~MarginGuard() { set_sm_margin(saved); }
};

TEST(SmMargin, SetAndRead) {
  MarginGuard guard;
  set_sm_margin(16);
  EXPECT_EQ(sm_margin(), 16);
  set_sm_margin(0);
  EXPECT_EQ(sm_margin(), 0);
}

TEST(SmMargin, ANegativeMarginIsRefusedAndChangesNothing) {
  MarginGuard guard;
  set_sm_margin(7);
  try {
    set_sm_margin(-1);
    FAIL() << "no machmoe::Error for a negative margin";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "machmoe::set_sm_margin: argument 'sms': expected a number of SMs >= 0, got -1");
  }
  EXPECT_EQ(sm_margin(), 7);
}

TEST(SmMargin, NoDeviceHasSmsWhereThereIsNone) {
  // Out-of-range ordinals are no device on any machine; on a machine without CUDA, no ordinal is.
  EXPECT_EQ(cuda_sm_count(-1), 0);
  EXPECT_EQ(cuda_sm_count(1 << 20), 0);
  if (cuda_device_count() == 0) {
    EXPECT_EQ(cuda_sm_count(0), 0);
  }
}

TEST(SmMargin, BenchmarkOption) {
  using bench::parse_options;
  EXPECT_EQ(parse_options({}, false).sm_margin, -1);  // not given: the library's setting stands
  EXPECT_EQ(parse_options({"--sm-margin", "0"}, true).sm_margin, 0);
  EXPECT_EQ(parse_options({"--sm-margin", "24"}, true).sm_margin, 24);
  try {  // the CPU reference has no grid to cut: refused like the other GPU-only options
    parse_options({"--backend", "cpu", "--sm-margin", "8"}, true);
    ADD_FAILURE() << "--sm-margin on the CPU: accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'--sm-margin': expected a GPU backend"), std::string::npos) << e.what();
  }
  for (const char* bad : {"-1", "4097", "8x", ""}) {
    try {
      parse_options({"--sm-margin", bad}, true);
      ADD_FAILURE() << "--sm-margin " << bad << ": accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("'--sm-margin': expected a decimal integer in [0, 4096]"),
                std::string::npos)
          << e.what();
    }
  }
}

}  // namespace
}  // namespace machmoe::test
