#pragma once
// One exception type for everything a user can trigger (bad files, bad flags, bad input).
// Library code throws it; the CLI and server catch it at their boundary and report it.
#include <stdexcept>
#include <string>

namespace microspec {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace microspec
