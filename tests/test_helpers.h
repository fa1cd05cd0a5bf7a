#pragma once
// Shared helpers for the test suite: where the repository and the real models are.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>

#include "util/error.h"

namespace microspec::test {

inline std::string source_dir() {
  const char* env = std::getenv("MICROSPEC_SOURCE_DIR");
  return env ? env : MICROSPEC_SOURCE_DIR;
}

inline std::string gemma_path() {
  return source_dir() + "/models/gemma-3-270m-q4_k_m.gguf";
}
inline std::string smollm_path() {
  return source_dir() + "/models/smollm2-135m-instruct-q4_1.gguf";
}

// The real models are part of the setup (scripts/fetch_models.sh): a missing file is a failure.
inline void require_file(const std::string& path) {
  ASSERT_TRUE(std::filesystem::exists(path))
      << path << " is missing: run scripts/setup.sh (or scripts/fetch_models.sh)";
}

// The message of the Error that f throws, or "(no error)".
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace microspec::test
