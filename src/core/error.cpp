#include "machmoe/error.hpp"

namespace machmoe {

void throw_argument_error(const std::string& where, const std::string& arg, const std::string& expected,
                          const std::string& got) {
  throw Error("machmoe::" + where + ": argument '" + arg + "': expected " + expected + ", got " + got);
}

}  // namespace machmoe
