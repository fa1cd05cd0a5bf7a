#pragma once
// A drafter over an EAGLE-3 head (draft_head/eagle3_head.h): the target's features at the three
// layers the head names, captured during prefill and verification (Drafter::feature_layers), feed
// the head's first level; deeper levels feed the head its own previous output, as EAGLE does. The
// head keeps its own KV cache: one row per committed position i (the target's features at i with
// the token at i + 1), then the draft tree in the pending region. Logits come from the target's LM
// head rows through a DraftVocabulary, so full/freq/dynamic/hybrid apply unchanged; a head with
// its own (reduced) LM head scores its own rows whose target ids the vocabulary holds (see
// draft_head/eagle3_head.h: the active set intersected with the head's vocabulary).
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "draft_head/eagle3_head.h"
#include "speculative/drafter.h"
#include "speculative/tree.h"
#include "vocab/draft_vocab.h"

namespace microspec {

class HeadDrafter final : public Drafter, private TreeExpander {
 public:
  // target: the model verifying the drafts (its LM head scores the head's rows); n_ctx: its
  // context size. vocab is over the target's LM head.
  HeadDrafter(std::unique_ptr<Eagle3Head> head, Model& target, int32_t n_ctx, DraftVocabulary vocab);

  int32_t prompt_top_k() const override { return vocab_.prompt_top_k(); }
  std::span<const int32_t> feature_layers() const override { return head_->config().target_layers; }
  void target_features(const float* features, int32_t rows) override;
  void begin(const std::vector<int32_t>& prompt, std::span<const int32_t> prompt_top) override;
  void propose(int32_t root, int32_t position, const TreeParams& params, DraftSampling* sampling,
               DraftTree& tree) override;
  void accepted(int32_t root, const DraftTree& tree, std::span<const int32_t> path,
                const float* verify_logits) override;
  bool fits(const TreeParams& params, int32_t room) const override;
  double lm_head_seconds() const override { return lm_head_seconds_; }
  // The committed rows waiting for the next proposal (the prompt's, then those of steps it did not draft).
  int32_t pending_rows() const override { return static_cast<int32_t>(pair_tokens_.size()); }
  int32_t active_vocab_size() const override {
    return head_->config().n_draft_vocab ? static_cast<int32_t>(own_rows_.size()) : vocab_.size();
  }
  const Eagle3Head& head() const { return *head_; }

 private:
  void expand(std::span<const int32_t> frontier, std::span<const TreeNode> cand, int32_t k, DraftSampling* sampling,
              Proposal* out) override;
  // Runs rows (features [n][3][H_t] with tokens [n], at the next committed positions) through the
  // head and commits them: they hold the target's own features, so they never change.
  void run_committed(std::span<const int32_t> tokens, const float* features);
  const float* feature_row(int32_t row) const;  // row of the last target_features() call
  // Own LM head: this step's rows, the vocabulary's active ids that the head has, in its order.
  void select_own_rows();
  void score_own_rows(int32_t rows, int32_t k, DraftSampling* sampling, Proposal* out);

  std::unique_ptr<Eagle3Head> head_;
  Model& target_;
  KVCache kv_;  // the head's cache: [committed rows][kv_dim], then the draft tree
  DraftVocabulary vocab_;
  TreeBuilder builder_;
  int32_t feature_size_;  // 3 * H_t floats per row

  // From target_features(), read by the next begin() / accepted().
  const float* features_ = nullptr;  // [feature_rows_][feature_size_]
  int32_t feature_rows_ = 0;

  // Committed positions the head has not run yet, and the features that pair with the next root.
  std::vector<int32_t> pair_tokens_;   // [pairs] the token after each position
  std::vector<float> pair_features_;   // [pairs][feature_size_] the target's features there
  std::vector<float> root_features_;   // [feature_size_] the features at the position before the root

  // The tree being drafted: the root's row at pending slot 0, expanded candidates after it.
  int32_t root_ = 0, root_pos_ = 0, next_slot_ = 0;
  bool root_run_ = false;              // this step's root row is in the cache's pending slot 0
  std::vector<int32_t> slot_of_;       // [candidates] pending slot, -1 = not run
  std::vector<float> slot_hidden_;     // [slots][H] the head's prenorm output per pending slot
  Batch batch_;
  std::vector<float> g_;               // [n_batch][H] hidden inputs of one head pass
  std::vector<float> prenorm_;         // [n_batch][H]
  std::vector<float> normed_;          // [n_batch][H]
  std::vector<float> logits_;          // [rows][vocab size] draft logits of one expansion
  std::vector<int32_t> own_row_of_;    // [target n_vocab] own LM-head row of a target id, -1 if none
  std::vector<int32_t> own_rows_;      // [<= n_draft] own rows scored this step
  std::vector<int32_t> own_ids_;       // [<= n_draft] their target ids
  bool own_rows_are_all_ = false;      // own_rows_ holds every own row (the full vocabulary, built once)
  std::vector<int32_t> tree_tokens_;   // [tree nodes] the last accepted tree's tokens, for the vocabulary
  double lm_head_seconds_ = 0.0;
};

// Where `--spec head` looks for a head when no --draft-head is given: heads/<stem>.eagle3.gguf
// beside the model file (models/x.gguf -> models/heads/x.eagle3.gguf).
std::string default_draft_head_path(const std::string& model_path);

}  // namespace microspec
