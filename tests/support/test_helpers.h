#pragma once
// Shared helpers for the test suite: where the repository and the real models are, and the
// kernel tables this CPU runs.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "kernels/kernels.h"
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

// The SIMD tables this CPU runs; the reference is what they are compared with.
inline std::vector<const KernelTable*> simd_tables() {
  std::vector<const KernelTable*> v{&avx2_kernels()};
  if (const KernelTable* t = avx512_kernels()) v.push_back(t);
  if (const KernelTable* t = amx_kernels()) v.push_back(t);
  return v;
}

}  // namespace microspec::test
