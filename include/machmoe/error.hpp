// Errors raised by the public API. Every message names the function, the argument, what was expected and what
// was given, so a caller can fix the call without reading our source.
#pragma once

#include <stdexcept>
#include <string>

namespace machmoe {

/// Thrown for invalid arguments at a public entry point. Nothing has been written to any output when it is
/// thrown: validation happens before any work starts.
class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// Thrown when the CUDA runtime or cuBLAS reports a failure (an invalid launch, a sticky device error, ...).
class RuntimeError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Builds the standard message "machmoe::<where>: argument '<arg>': expected <expected>, got <got>".
[[noreturn]] void throw_argument_error(const std::string& where, const std::string& arg,
                                       const std::string& expected, const std::string& got);

}  // namespace machmoe
