#pragma once
// Drafters propose a token tree after the last accepted token (the root); the target verifies it.
//
// The interface is small so that other drafters (an EAGLE-style head reading the target's hidden
// states) fit it: begin() once the prompt is in the target's cache, propose() a tree for a root,
// accepted() with the path the target kept.
//   SelfDrafter:  the target's own first N layers, then its final norm and LM head. It shares the
//                 target's weights and KV cache: draft nodes go into the target's pending region
//                 with only N layers written, and the verification pass overwrites those slots
//                 with all layers, so nothing needs undoing.
//   ModelDrafter: a separate model with the same vocabulary and its own KV cache, kept in step
//                 with the target's committed tokens.
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "model/kv_cache.h"
#include "model/model.h"
#include "vocab/draft_vocab.h"
#include "speculative/tree.h"

namespace microspec {

class GgufFile;

class Drafter {
 public:
  virtual ~Drafter() = default;
  // Target top tokens per prompt position the drafter wants at begin() (0 = none): the
  // context-aware draft vocabulary seeds itself from them (K_pre).
  virtual int32_t prompt_top_k() const { return 0; }
  // The prompt has just been committed to the target's cache. prompt_top holds the target's
  // prompt_top_k() best token ids at each prompt position, best first ([prompt.size()][k]; empty
  // when prompt_top_k() is 0).
  virtual void begin(const std::vector<int32_t>& prompt, std::span<const int32_t> prompt_top) = 0;
  // Builds the draft tree for `root`, the newest token (not yet in the target's cache), which goes
  // at position `position`.
  virtual void propose(int32_t root, int32_t position, const TreeParams& params, DraftTree& tree) = 0;
  // The target committed root and then the nodes `path` of `tree` (root to leaf).
  // verify_logits: the verification pass's target logits, [1 + tree.size()][n_vocab], row 0 at
  // the root and row i + 1 at node i (raw logits, before any sampling filter).
  virtual void accepted(int32_t root, const DraftTree& tree, std::span<const int32_t> path,
                        const float* verify_logits) = 0;
  // Most slots of the target's pending region propose() writes (0 when it uses its own cache).
  virtual int32_t target_pending_slots(const TreeParams& params) const = 0;
  // Whether propose() can run with `room` free slots left in the context.
  virtual bool fits(const TreeParams& params, int32_t room) const = 0;
  // Time spent in the draft LM head (DraftVocabulary::logits) since the drafter was made.
  virtual double lm_head_seconds() const = 0;
  // Speculative sampling: propose() draws children from the draft distribution and records it in
  // the tree (see DraftSampling). nullptr returns to greedy trees. The object must outlive its use.
  virtual void set_sampling(DraftSampling* sampling) = 0;
  // Self-drafters: the draft's layers are the target's first layers, so verification can resume
  // the rows the draft already ran. Returns how many leading verification rows (the root, then
  // tree nodes in order) the last propose() ran at the pending slots verification gives them
  // (root at 0, node i at i + 1), and writes their residual streams after reuse_layers() layers
  // to x ([rows][n_embd], room for 1 + tree.size() rows). 0: verify every row from the start.
  virtual int32_t reusable_rows(const DraftTree& tree, float* x) const { return 0; }
  virtual int32_t reuse_layers() const { return 0; }
  // Size of the draft vocabulary the last propose() scored.
  virtual int32_t active_vocab_size() const = 0;
};

// Runs tree candidates through a model (or its first N layers) writing into a KV cache's pending
// region, and scores their children with a DraftVocabulary. Shared by both drafters.
class ModelTreeExpander : public TreeExpander {
 public:
  ModelTreeExpander(Model& model, KVCache& kv, int32_t n_layers, DraftVocabulary vocab);
  // Starts a tree: `prefix` tokens (sequential, not yet in the cache, may be empty) then the root,
  // written at pending slots 0.. from position `position0`.
  void start(std::span<const int32_t> prefix, int32_t root, int32_t position0);
  void expand(std::span<const int32_t> frontier, std::span<const TreeNode> cand, int32_t k,
              Proposal* out) override;
  // Pending slot where a candidate was run, -1 if it was not; the root's is root_slot().
  int32_t slot_of(int32_t candidate) const {
    return candidate < static_cast<int32_t>(slot_of_.size()) ? slot_of_[candidate] : -1;
  }
  int32_t root_slot() const { return root_slot_; }
  Model& model() { return model_; }
  const Model& model() const { return model_; }
  int32_t n_layers() const { return n_layers_; }
  double lm_head_seconds() const { return lm_head_seconds_; }
  // Residual stream after n_layers() layers of the row run at pending slot `slot` (slot < slots
  // run since start()).
  const float* residual_of(int32_t slot) const {
    return slot_residual_.data() + size_t(slot) * size_t(model_.config().n_embd);
  }
  const DraftVocabulary& vocab() const { return vocab_; }
  DraftVocabulary& vocab() { return vocab_; }
  void set_sampling(DraftSampling* sampling) { sampling_ = sampling; }

 private:
  Model& model_;
  KVCache& kv_;
  int32_t n_layers_;
  DraftVocabulary vocab_;
  std::vector<int32_t> prefix_;  // tokens to run before the root at the next expand
  int32_t root_ = 0, root_pos_ = 0, root_slot_ = 0;
  int32_t next_slot_ = 0;         // next free pending slot
  std::vector<int32_t> slot_of_;  // [candidates] pending slot, -1 = not run
  Batch batch_;
  ForwardOutput out_;
  std::vector<float> logits_;  // [rows][vocab size] draft logits of one expansion
  double lm_head_seconds_ = 0.0;
  DraftSampling* sampling_ = nullptr;  // non-null: children are drawn, not taken best-first
  std::vector<float> slot_residual_;   // [slots run][n_embd] residual stream per pending slot
};

class SelfDrafter final : public Drafter {
 public:
  // n_layers: the target layers the draft runs (1..n_layer).
  SelfDrafter(Model& target, KVCache& target_kv, int32_t n_layers, DraftVocabulary vocab);
  int32_t prompt_top_k() const override { return expander_.vocab().prompt_top_k(); }
  void begin(const std::vector<int32_t>& prompt, std::span<const int32_t> prompt_top) override {
    expander_.vocab().begin(prompt, prompt_top);
  }
  void propose(int32_t root, int32_t position, const TreeParams& params, DraftTree& tree) override;
  void accepted(int32_t root, const DraftTree& tree, std::span<const int32_t> path,
                const float* verify_logits) override {
    expander_.vocab().accepted(root, tree, path, verify_logits);
  }
  int32_t target_pending_slots(const TreeParams& params) const override { return params.max_draft_rows(); }
  int32_t reusable_rows(const DraftTree& tree, float* x) const override;
  int32_t reuse_layers() const override { return expander_.n_layers(); }
  bool fits(const TreeParams& params, int32_t room) const override { return params.max_draft_rows() <= room; }
  double lm_head_seconds() const override { return expander_.lm_head_seconds(); }
  int32_t active_vocab_size() const override { return expander_.vocab().size(); }
  void set_sampling(DraftSampling* sampling) override {
    sampling_ = sampling;
    expander_.set_sampling(sampling);
  }

 private:
  ModelTreeExpander expander_;
  TreeBuilder builder_;
  DraftSampling* sampling_ = nullptr;
};

class ModelDrafter final : public Drafter {
 public:
  // draft and target must share a vocabulary (check_same_vocabulary). n_ctx: as the target's.
  ModelDrafter(Model& draft, int32_t n_ctx, DraftVocabulary vocab);
  int32_t prompt_top_k() const override { return expander_.vocab().prompt_top_k(); }
  void begin(const std::vector<int32_t>& prompt, std::span<const int32_t> prompt_top) override;
  void propose(int32_t root, int32_t position, const TreeParams& params, DraftTree& tree) override;
  void accepted(int32_t root, const DraftTree& tree, std::span<const int32_t> path,
                const float* verify_logits) override;
  int32_t target_pending_slots(const TreeParams& params) const override { return 0; }
  bool fits(const TreeParams& params, int32_t room) const override;
  double lm_head_seconds() const override { return expander_.lm_head_seconds(); }
  int32_t active_vocab_size() const override { return expander_.vocab().size(); }
  void set_sampling(DraftSampling* sampling) override {
    sampling_ = sampling;
    expander_.set_sampling(sampling);
  }

 private:
  Model& model_;
  DraftSampling* sampling_ = nullptr;
  KVCache kv_;
  ModelTreeExpander expander_;
  TreeBuilder builder_;
  std::vector<int32_t> tokens_;  // the target's committed sequence, as told by begin/accepted
  std::vector<int32_t> commit_;  // scratch: pending slots to commit
  Batch batch_;                  // catch-up runs
  ForwardOutput out_;
  // Runs committed tokens the cache has not seen until at most `keep` are left unseen.
  void catch_up(int32_t keep);
};

// Throws Error unless the two files have identical token lists (and so identical ids).
void check_same_vocabulary(const GgufFile& target, const GgufFile& draft);

}  // namespace microspec
