#pragma once
// `microspec --version`.
#include <string>

namespace microspec::cli {

// The version, the git commit it was built from, the kernel table `--kernels auto` chooses on this
// CPU and whether the CUDA backend is built in (and, when it is, whether a device is usable), one
// "name: value" per line after the first.
std::string version_text();

}  // namespace microspec::cli
