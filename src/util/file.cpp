#include "util/file.h"

#include <fstream>
#include <sstream>

#include "util/error.h"

namespace microspec {

std::string read_file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path + ": cannot open file");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace microspec
