// A hang watchdog for the GPU test binary: a GPU kernel that deadlocks (an mbarrier phase nobody completes, a
// named barrier some threads skip) blocks cudaDeviceSynchronize forever, and the run shows nothing but the
// "[ RUN ]" line of the test that hung. This listener arms a timer when each test starts; if the test is still
// running after the limit, it prints the test's name, how long it ran and the last progress note the test left
// (machmoe::test::progress: the kernel configuration it was on), then ends the process with exit status 124
// (timeout's), so that a driver script or ctest moves on to the next test (ctest runs each test in its own process:
// one run then names every hanging test).
//
// MACHMOE_GPU_TEST_TIMEOUT_S: the limit in seconds (default 120; 0 turns the watchdog off). Registered before main
// runs (gtest_main), so every test of the binary is covered, also when the binary is run by hand.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

#include "gpu_support.hpp"

namespace machmoe::test {
namespace {

std::mutex& note_mutex() {
  static std::mutex mu;
  return mu;
}
std::string& note() {
  static std::string s;
  return s;
}

double timeout_seconds() {
  const char* v = std::getenv("MACHMOE_GPU_TEST_TIMEOUT_S");
  if (v == nullptr || v[0] == '\0') return 120.0;
  char* end = nullptr;
  const double s = std::strtod(v, &end);
  if (end == v || s < 0) {
    std::fprintf(stderr, "machmoe watchdog: MACHMOE_GPU_TEST_TIMEOUT_S=%s is not a number of seconds; using 120\n", v);
    return 120.0;
  }
  return s;
}

/// The watchdog's state: allocated once and never freed, so that the detached timer thread never sees it destroyed
/// (gtest deletes its listeners when the process exits, while the thread may still wait on the condition variable).
struct WatchState {
  double limit = 0;
  std::mutex mu;
  std::condition_variable cv;
  std::string name;
  std::chrono::steady_clock::time_point start;
  bool armed = false;
  unsigned long long generation = 0;
};

[[noreturn]] void watch(WatchState* w) {
  std::unique_lock<std::mutex> lock(w->mu);
  for (;;) {
    w->cv.wait(lock, [w] { return w->armed; });
    const unsigned long long gen = w->generation;
    const auto deadline = w->start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                         std::chrono::duration<double>(w->limit));
    if (w->cv.wait_until(lock, deadline, [&] { return w->generation != gen; })) continue;  // ended in time
    const double ran = std::chrono::duration<double>(std::chrono::steady_clock::now() - w->start).count();
    std::string last;
    {
      const std::lock_guard<std::mutex> nl(note_mutex());
      last = note();
    }
    std::fprintf(stderr,
                 "\n[ WATCHDOG ] %s still running after %.0f s (limit MACHMOE_GPU_TEST_TIMEOUT_S = %.0f s): presumed "
                 "hung (a GPU kernel that never finishes?)\n[ WATCHDOG ] last progress note: %s\n[ WATCHDOG ] exiting "
                 "with status 124; run the others with --gtest_filter=-%s, or through ctest (one process per test)\n",
                 w->name.c_str(), ran, w->limit, last.empty() ? "(none)" : last.c_str(), w->name.c_str());
    std::fflush(stderr);
    std::fflush(stdout);
    std::_Exit(124);
  }
}

class Watchdog : public testing::EmptyTestEventListener {
 public:
  explicit Watchdog(double seconds) : w_(new WatchState) {
    w_->limit = seconds;
    std::thread(watch, w_).detach();
  }

  void OnTestStart(const testing::TestInfo& info) override {
    {
      const std::lock_guard<std::mutex> lock(note_mutex());
      note().clear();
    }
    const std::lock_guard<std::mutex> lock(w_->mu);
    w_->name = std::string(info.test_suite_name()) + "." + info.name();
    w_->start = std::chrono::steady_clock::now();
    w_->armed = true;
    ++w_->generation;
    w_->cv.notify_all();
  }
  void OnTestEnd(const testing::TestInfo&) override {
    const std::lock_guard<std::mutex> lock(w_->mu);
    w_->armed = false;
    ++w_->generation;
    w_->cv.notify_all();
  }

 private:
  WatchState* w_;  // never freed (see WatchState)
};

const bool registered = [] {
  const double s = timeout_seconds();
  if (s > 0) testing::UnitTest::GetInstance()->listeners().Append(new Watchdog(s));
  return true;
}();

}  // namespace

void progress(const std::string& what) {
  if (std::getenv("MACHMOE_GPU_TEST_PROGRESS") != nullptr) {
    std::fprintf(stderr, "[ progress ] %s\n", what.c_str());
    std::fflush(stderr);
  }
  const std::lock_guard<std::mutex> lock(note_mutex());
  note() = what;
}

}  // namespace machmoe::test
