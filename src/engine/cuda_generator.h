#pragma once
// Generation with the CUDA backend (src/cuda), the one entry point `generate --device cuda` and
// `serve --device cuda` share: decoding on the GPU, sampled (top-k) or greedy, and greedy decoding
// speculative too (a chain drafted
// by the target's first layers, a draft model or an EAGLE-3 head, or a tree drafted by the
// target's first layers). The models are loaded on the device once for every generation; each
// generation ends as the CPU path's does (end-of-generation tokens, stop strings, the token limit:
// engine/generator.h's TokenSink) and reports what the CPU decoder reports (engine/speculative_decoder.h's
// SpecResult: the device times no parts of a step, so only its counts are filled in). Compiled in
// every build: without MICROSPEC_CUDA the constructor throws.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/generator.h"
#include "engine/speculative_decoder.h"
#include "gguf/gguf.h"
#include "speculative/settings.h"
#include "speculative/tree_state.h"
#include "tokenizer/tokenizer.h"
#include "vocab/draft_vocab.h"

namespace microspec {

struct CudaGeneratorOptions {
  int32_t n_predict = 128;  // the most tokens any generation asks for (sizes the device's buffers)
  int32_t n_ctx = 4096;
  int32_t n_batch = 512;
  int32_t spec_chain = 0;              // > 0: speculative decoding with a drafted chain of this length
  int32_t spec_draft_draws = 0;        // a sampled chain's draft draws per step: the CPU's (tree depth + 1)
  std::optional<TreeShape> spec_tree;  // or with a self-drafted tree of this shape (--tree-topk > 1)
  int32_t spec_draft_layers = 0;       // self-draft layers; 0 = the CPU path's default for the model
  std::optional<PrunedVocabSpec> vocab;  // --draft-vocab dynamic / hybrid / freq; none: the full head
  std::string vocab_describe;            // its name for the statistics line
  std::string draft_model;  // --spec draft: the draft model's file (GGUF or Hugging Face folder)
  std::string draft_head;   // --spec head: the EAGLE-3 head's file
};

// Why the device cannot speculate with these settings, naming what it supports; "" when it can
// (or when speculation is off). Reads no file.
std::string cuda_spec_unsupported(const SpecConfig& spec);

// Why the device cannot sample speculatively with these settings ("" when it can, or when
// speculation is off): a chain always; a tree whose draft rows take at most kMaxDraftDrawsPerStep
// draws a step (speculative/tree_sampling.h).
std::string cuda_spec_sampling_unsupported(const SpecConfig& spec);

// Fills o's speculative fields from the settings the CLI and the server parse: the chain or tree
// shape, the draft model, the EAGLE-3 head (its file read and checked against the target's shapes
// here, before any device is asked for) and the draft vocabulary (its frequency file read).
// Throws Error for what the device cannot run (cuda_spec_unsupported) or a file that does not fit.
void set_cuda_speculation(const SpecConfig& spec, const GgufFile& target, const Tokenizer& tokenizer,
                          CudaGeneratorOptions& o);

// Why the device cannot run a generation with these parameters ("" when it can): it samples with
// top-k on only (the CPU Sampler's draw from the top_k best, top_k 1..64).
std::string cuda_params_unsupported(const SamplingParams& sampling);

// Whether a generation of a speculative generator drafts (the output is the same either way).
enum class Drafting { Speculative, Plain };

class CudaGenerator {
 public:
  // Loads the target (and the draft model or head) on the device. target and tokenizer: the
  // target's file (only its metadata is read on the CPU) and its tokenizer; both must outlive the
  // generator.
  CudaGenerator(const GgufFile& target, const Tokenizer& tokenizer, const CudaGeneratorOptions& options);
  ~CudaGenerator();
  CudaGenerator(const CudaGenerator&) = delete;
  CudaGenerator& operator=(const CudaGenerator&) = delete;

  // Generation after `prompt`, greedy or sampled by params.sampling (params.max_new_tokens at
  // most options.n_predict; Error when cuda_params_unsupported); on_text takes the text as it
  // becomes final, every few device steps. A speculative generator with a chain samples
  // speculatively (the CPU decoder's tokens for a seed, from equal logits); one with a tree drafts
  // greedy generations only, so a sampled one must ask for Drafting::Plain (Error otherwise; plain
  // sampling draws from the same distribution).
  // prefill_seconds: up to the first token; decode_seconds: from it to the last. One generation
  // at a time: the device holds one sequence's cache.
  SpecResult generate(const std::vector<int32_t>& prompt, const GenerateParams& params, const TextCallback& on_text,
                      Drafting drafting = Drafting::Speculative) const;
  bool speculative() const;
  // The path for statistics lines: "device: NAME" and, speculative, the drafter and vocabulary.
  std::string describe() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace microspec
