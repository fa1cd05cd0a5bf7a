#pragma once
// `generate --device cuda`: greedy decoding with the CUDA backend (src/cuda), plain or speculative
// (a chain drafted by the target's first layers, a draft model or an EAGLE-3 head, or a tree drafted
// by the target's first layers). The models are
// loaded on the device once for every prompt of a run; each generation ends as the CPU path's does
// (end-of-generation tokens, stop strings, the token limit: engine/generator.h's TokenSink), and
// the CLI prints its text, statistics and JSON like the CPU path's. In a build without
// MICROSPEC_CUDA the constructor throws.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cli/common.h"
#include "engine/generator.h"
#include "speculative/tree_state.h"
#include "vocab/draft_vocab.h"

namespace microspec::cli {

struct CudaGenerateArgs {
  int32_t n_predict = 128;  // the most tokens any generation of the run asks for (sizes the device's buffers)
  int32_t n_ctx = 4096;
  int32_t n_batch = 512;
  int32_t spec_chain = 0;         // > 0: speculative decoding with a drafted chain of this length
  std::optional<TreeShape> spec_tree;  // or with a self-drafted tree of this shape (--tree-topk > 1)
  int32_t spec_draft_layers = 0;  // self-draft layers; 0 = the CPU path's default for the model
  std::optional<PrunedVocabSpec> vocab;  // --draft-vocab dynamic / hybrid / freq; none: the full head
  std::string vocab_describe;            // its name for the statistics line
  std::string draft_model;  // --spec draft: the draft model's file (GGUF or Hugging Face folder)
  std::string draft_head;   // --spec head: the EAGLE-3 head's file
};

// One generation on the device.
struct CudaGeneration {
  GenerateResult gen;  // prefill_seconds: up to the first token; decode_seconds: from it to the last
  int32_t decode_tokens = 0;    // tokens after the first that the text's end took (its last included)
  int32_t steps = 0;            // speculative: verification steps (as the CPU decoder counts them)
  int32_t accepted_drafts = 0;  // speculative: draft tokens kept
  double mean_acceptance_length() const { return steps ? 1.0 + double(accepted_drafts) / steps : 0.0; }
};

class CudaGenerator {
 public:
  // Loads the target (and the draft model or head) on the device. m: the model as the CPU loaded
  // it (its file and tokenizer).
  CudaGenerator(const LoadedModel& m, const CudaGenerateArgs& args);
  ~CudaGenerator();
  CudaGenerator(const CudaGenerator&) = delete;
  CudaGenerator& operator=(const CudaGenerator&) = delete;

  // Greedy generation after `prompt` (params.sampling is not read: the device decodes greedily;
  // params.max_new_tokens at most args.n_predict); on_text takes the text as it becomes final,
  // every few device steps.
  CudaGeneration generate(const std::vector<int32_t>& prompt, const GenerateParams& params,
                          const TextCallback& on_text) const;
  bool speculative() const;
  // The path for the statistics line: "device: NAME" and, speculative, the drafter and vocabulary.
  std::string describe() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace microspec::cli
