// Umbrella header of the torch-free sonicmoe C++ API.
#pragma once

#include "sonicmoe/device.hpp"
#include "sonicmoe/error.hpp"
#include "sonicmoe/layer.hpp"
#include "sonicmoe/losses.hpp"
#include "sonicmoe/memory.hpp"
#include "sonicmoe/problem.hpp"
#include "sonicmoe/profiling.hpp"
#include "sonicmoe/tensor.hpp"
#include "sonicmoe/version.hpp"
