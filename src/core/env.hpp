// Reading the process environment's MACHMOE_* settings, one convention for all of them. Host code only, no CUDA:
// the library's switches (core/, gpu/) read through it once each, and the CPU tests exercise it directly.
#pragma once

namespace machmoe::detail {

/// A switch from the environment: `unset_value` where `name` is unset or empty; otherwise on unless its value starts
/// with '0' ("1", "yes" and "on" are on; "0" is off).
bool env_switch(const char* name, bool unset_value);

/// A non-negative decimal integer from the environment: `unset_value` where `name` is unset or empty. Any other value
/// that is not a whole decimal number in [0, INT_MAX] is reported on stderr, naming the variable and its value, and
/// gives `unset_value`: a typo in a tuning variable is never taken silently as some other number.
int env_nonnegative_int(const char* name, int unset_value);

}  // namespace machmoe::detail
