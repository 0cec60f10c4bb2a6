#include "sonicmoe/error.hpp"

namespace sonicmoe {

void throw_argument_error(const std::string& where, const std::string& arg, const std::string& expected,
                          const std::string& got) {
  throw Error("sonicmoe::" + where + ": argument '" + arg + "': expected " + expected + ", got " + got);
}

}  // namespace sonicmoe
