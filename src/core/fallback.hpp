// Reporting a fall back to the GPU reference GEMM under the process-wide policy (include/machmoe/fallback.hpp).
// Host code only, no CUDA: the GPU dispatcher calls it, and the CPU tests exercise it directly.
#pragma once

#include <string>

namespace machmoe::detail {

/// The one message of a fallback: "machmoe: <stage> (<shape>) runs on the slow GPU reference GEMM: <reason>".
std::string fallback_message(const std::string& stage, const std::string& shape, const std::string& reason);

/// Under FallbackPolicy::kError, and unless `deliberate` (the reference path asked for by a switch), throws
/// machmoe::Error with fallback_message(...). Otherwise prints it (as a warning; deliberate: as a note) to stderr the
/// first time this process meets the (stage, reason) pair, and returns. Thread-safe.
void report_reference_fallback(const std::string& stage, const std::string& shape, const std::string& reason,
                               bool deliberate);

}  // namespace machmoe::detail
