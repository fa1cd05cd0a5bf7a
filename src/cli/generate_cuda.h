#pragma once
// `generate --device cuda`: greedy decoding with the CUDA backend (src/cuda), plain or speculative
// (a chain drafted by the target's first layers, a draft model or an EAGLE-3 head), streaming text and printing a statistics line like the CPU path. In a
// build without MICROSPEC_CUDA it throws.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cli/common.h"
#include "vocab/draft_vocab.h"

namespace microspec::cli {

struct CudaGenerateArgs {
  int32_t n_predict = 128;
  int32_t n_ctx = 4096;
  int32_t n_batch = 512;
  bool ignore_eos = false;
  bool quiet = false;
  int32_t spec_chain = 0;         // > 0: speculative decoding with a self-drafted chain of this length
  int32_t spec_draft_layers = 0;  // self-draft layers; 0 = the CPU path's default for the model
  std::optional<PrunedVocabSpec> vocab;  // --draft-vocab dynamic / hybrid / freq; none: the full head
  std::string vocab_describe;            // its name for the statistics line
  std::string draft_model;  // --spec draft: the draft model's file (GGUF or Hugging Face folder)
  std::string draft_head;   // --spec head: the EAGLE-3 head's file
};

void generate_greedy_cuda(const LoadedModel& m, const CudaGenerateArgs& args, const std::vector<int32_t>& prompt);

}  // namespace microspec::cli
