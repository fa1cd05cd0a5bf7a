#pragma once
// Everything a speculative run needs, built from one SpecConfig: the drafter (with its own model
// for `draft`), its draft vocabulary and the SpeculativeGenerator. The CLI, the server and the
// benchmark all build their speculative side here, so a setting means the same in each.
#include <cstdint>
#include <memory>
#include <string>

#include "engine/generator.h"
#include "gguf/gguf.h"
#include "spec/drafter.h"
#include "spec/spec_generator.h"
#include "spec/tree.h"

namespace microspec {

struct SpecConfig {
  std::string mode = "none";  // none | self | draft
  int32_t draft_layers = 0;   // self: target layers the draft runs; 0 = all but the last eighth
  std::string draft_model;    // draft: GGUF file with the target's vocabulary
  TreeParams tree;

  bool enabled() const { return mode != "none"; }
  // Throws Error for inconsistent settings (e.g. --draft-model without --spec draft).
  void validate() const;
};

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
  SpecConfig config_;
  std::unique_ptr<GgufFile> draft_file_;  // draft only
  std::unique_ptr<Model> draft_model_;    // draft only
  std::unique_ptr<Drafter> drafter_;
  std::unique_ptr<SpeculativeGenerator> gen_;
  std::string describe_;
};

}  // namespace microspec
