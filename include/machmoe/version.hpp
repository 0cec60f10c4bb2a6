#pragma once

#define MACHMOE_VERSION_MAJOR 0
#define MACHMOE_VERSION_MINOR 1
#define MACHMOE_VERSION_PATCH 0

namespace machmoe {
inline constexpr const char* kVersion = "0.1.0";
}  // namespace machmoe
