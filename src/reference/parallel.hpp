// Row-parallel loops of the CPU reference. Every output element is computed by one thread, in the same order as
// the serial loop, so the results are bitwise those of one thread whatever the thread count (the reference is what
// every GPU test and the CPU backend compare against, and the library promises bitwise-deterministic results).
//
// Threads: MACHMOE_CPU_THREADS when set (>= 1; at most 1024), else the hardware's; a loop below kMinWorkPerThread
// multiply-adds (about a quarter of a millisecond) per thread runs on fewer threads, a small one on the caller's
// alone (starting a thread costs tens of microseconds).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <system_error>
#include <thread>
#include <vector>

#include "core/env.hpp"

namespace machmoe::ref {

inline std::atomic<int>& cpu_thread_setting() {
  static std::atomic<int> threads{[] {
    const unsigned hw = std::thread::hardware_concurrency();
    const int hardware = hw == 0 ? 1 : static_cast<int>(std::min<unsigned>(hw, 1024));
    // Unset, 0, or not a number (which core/env.hpp reports): the hardware's count.
    const int n = detail::env_nonnegative_int("MACHMOE_CPU_THREADS", hardware);
    return n >= 1 ? std::min(n, 1024) : hardware;
  }()};
  return threads;
}

/// The most threads a loop of the reference uses.
inline int cpu_threads() { return cpu_thread_setting().load(std::memory_order_relaxed); }

/// Sets it for the process (tests compare thread counts; the environment's MACHMOE_CPU_THREADS is the user's way).
inline void set_cpu_threads(int threads) {
  cpu_thread_setting().store(std::max(1, std::min(threads, 1024)), std::memory_order_relaxed);
}

inline constexpr std::int64_t kMinWorkPerThread = std::int64_t{1} << 18;

/// Calls body(begin, end) on contiguous ranges that cover [0, n) once, on up to cpu_threads() threads (the caller
/// runs the first range). work_per_item: multiply-adds per item, which decides how many threads are worth starting.
/// body must not throw.
template <class Body>
void parallel_for(std::int64_t n, std::int64_t work_per_item, Body body) {
  if (n <= 0) return;
  const std::int64_t total = n * std::max<std::int64_t>(work_per_item, 1);
  const std::int64_t wanted = std::min<std::int64_t>({cpu_threads(), n, std::max<std::int64_t>(total / kMinWorkPerThread, 1)});
  if (wanted <= 1) {
    body(std::int64_t{0}, n);
    return;
  }
  const std::int64_t chunk = (n + wanted - 1) / wanted;
  std::vector<std::thread> workers;
  workers.reserve(static_cast<std::size_t>(wanted - 1));
  std::int64_t begin = chunk;
  for (; begin < n; begin += chunk) {
    try {
      workers.emplace_back([=, &body] { body(begin, std::min(n, begin + chunk)); });
    } catch (const std::system_error&) {  // no thread to be had: the caller runs the rest
      break;
    }
  }
  body(std::int64_t{0}, std::min(n, chunk));
  for (; begin < n; begin += chunk) body(begin, std::min(n, begin + chunk));
  for (std::thread& w : workers) w.join();
}

}  // namespace machmoe::ref
