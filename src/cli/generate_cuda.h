#pragma once
// `generate --device cuda`: greedy decoding with the CUDA backend (src/cuda), streaming text and
// printing the statistics line like the CPU path. In a build without MICROSPEC_CUDA it throws.
#include <cstdint>
#include <vector>

#include "cli/common.h"

namespace microspec::cli {

struct CudaGenerateArgs {
  int32_t n_predict = 128;
  int32_t n_ctx = 4096;
  int32_t n_batch = 512;
  bool ignore_eos = false;
  bool quiet = false;
};

void generate_greedy_cuda(const LoadedModel& m, const CudaGenerateArgs& args, const std::vector<int32_t>& prompt);

}  // namespace microspec::cli
