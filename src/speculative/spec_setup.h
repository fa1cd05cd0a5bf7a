#pragma once
// Everything a speculative run needs, built from one SpecConfig: the drafter (with its own model
// for `draft`), its draft vocabulary and the SpeculativeGenerator. The CLI, the server and the
// benchmark all build their speculative side here, so a setting means the same in each.
#include <cstdint>
#include <memory>
#include <string>

#include "engine/generator.h"
#include "gguf/gguf.h"
#include "speculative/drafter.h"
#include "speculative/spec_generator.h"
#include "speculative/tree.h"

namespace microspec {

struct SpecConfig {
  std::string mode = "none";  // none | self | draft
  int32_t draft_layers = 0;   // self: target layers the draft runs; 0 = all but the last eighth
  std::string draft_model;    // draft: GGUF file with the target's vocabulary
  TreeParams tree;
  // Draft vocabulary (see spec/draft_vocab.h).
  std::string draft_vocab = "dynamic";  // full | freq | dynamic | hybrid (MicroSpec by default)
  std::string freq_file;             // freq / hybrid: ranking from `microspec vocab-freq`; empty =
                                     // the target's path with .freq.bin for .gguf, if it exists
  int32_t freq_top = 32768;          // freq: the K most frequent tokens
  int32_t hybrid_top = 512;          // hybrid: most frequent tokens always in the window's set
  int32_t vocab_window = 3072;       // dynamic / hybrid: W_max, candidate-stream entries kept
  int32_t vocab_kpre = 3;            // dynamic / hybrid: target top-k per prompt position
  int32_t vocab_kver = 3;            // dynamic / hybrid: target top-k per verification
  std::string vocab_source = "both";  // ctx (prompt part only) | ext (per-step only) | both
  bool async_gather = true;          // gather new LM-head rows on a helper thread

  bool enabled() const { return mode != "none"; }
  // Throws Error for inconsistent settings (e.g. --draft-model without --spec draft).
  void validate() const;
};

// Sets one field by its command-line name without dashes ("draft-vocab", "vocab-window",
// "tree-tokens", ...), for benchmark sweeps. Throws Error for an unknown key or a bad value.
void apply_spec_setting(SpecConfig& config, const std::string& key, const std::string& value);

// Self-draft layers the default (draft_layers = 0) picks for a model of n_layer layers.
int32_t default_draft_layers(int32_t n_layer);

class SpecSetup {
 public:
  // target_file / target / gen must outlive the setup; gen's cache is shared with a self-drafter.
  SpecSetup(const SpecConfig& config, const GgufFile& target_file, Model& target, Generator& gen,
            const Tokenizer& tokenizer);
  SpecResult generate(const std::vector<int32_t>& prompt, const GenerateParams& params,
                      const TextCallback& on_text = nullptr) {
    return gen_->generate(prompt, params, on_text);
  }
  const SpecConfig& config() const { return config_; }
  // One line describing drafter and tree, for statistics lines and reports.
  const std::string& describe() const { return describe_; }

 private:
  // The draft vocabulary config_ asks for, over model's LM head (sets vocab_describe_).
  DraftVocabulary make_vocabulary(const Model& model, const Tokenizer& tokenizer);

  SpecConfig config_;
  std::string target_file_name_;  // the target's GGUF path: the default frequency file sits beside it
  std::string vocab_describe_;
  std::unique_ptr<GgufFile> draft_file_;  // draft only
  std::unique_ptr<Model> draft_model_;    // draft only
  std::unique_ptr<Drafter> drafter_;
  std::unique_ptr<SpeculativeGenerator> gen_;
  std::string describe_;
};

}  // namespace microspec
