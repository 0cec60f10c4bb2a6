// Umbrella header of the torch-free machmoe C++ API.
#pragma once

#include "machmoe/combine.hpp"
#include "machmoe/device.hpp"
#include "machmoe/error.hpp"
#include "machmoe/fallback.hpp"
#include "machmoe/index_checking.hpp"
#include "machmoe/layer.hpp"
#include "machmoe/losses.hpp"
#include "machmoe/memory.hpp"
#include "machmoe/problem.hpp"
#include "machmoe/profiling.hpp"
#include "machmoe/sm_margin.hpp"
#include "machmoe/tensor.hpp"
#include "machmoe/version.hpp"
