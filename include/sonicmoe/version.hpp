#pragma once

#define SONICMOE_VERSION_MAJOR 0
#define SONICMOE_VERSION_MINOR 1
#define SONICMOE_VERSION_PATCH 0

namespace sonicmoe {
inline constexpr const char* kVersion = "0.1.0";
}  // namespace sonicmoe
