#pragma once
// Whole-file reads for the front ends and experiments (prompt files, datasets, CSVs).
#include <string>

namespace microspec {

// The bytes of the file at path; throws Error("PATH: cannot open file") when it cannot be opened.
std::string read_file_bytes(const std::string& path);

}  // namespace microspec
