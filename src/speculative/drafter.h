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
//   HeadDrafter:  an EAGLE-3 head fed the target's hidden states (speculative/head_drafter.h); it
//                 asks for them through feature_layers() / target_features().
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "model/kv_cache.h"
#include "model/model.h"
#include "speculative/tree.h"
#include "vocab/draft_vocab.h"

namespace microspec {

class GgufFile;

// Verification rows a drafter already ran through the target's first layers: the leading `rows`
// verification rows (the root at pending slot 0, then tree node i at slot i + 1) went through
// layers [0, layer) at those slots, and `activations` holds their residual streams after them.
struct VerifyResume {
  int32_t rows = 0;                    // 0: verify every row from the embeddings
  int32_t layer = 0;                   // the layer verification resumes at
  const float* activations = nullptr;  // [rows][n_embd], valid until the drafter's next call
};

class ModelTreeExpander;

// A draft tree in growth (Drafter::begin_propose): the builder that picks each level's frontier
// and the expander that runs it through the drafter's model. Empty (null builder): the tree is
// already complete.
struct TreeGrowth {
  TreeBuilder* builder = nullptr;
  ModelTreeExpander* expander = nullptr;
  explicit operator bool() const { return builder != nullptr; }
  // A sequence drafting alone: grows the tree's remaining levels into `tree` (nothing if empty).
  void grow_alone(DraftTree& tree) const;
};

// Who drafted a step's tree: nobody (a plain step: the root alone), an n-gram match, or a model
// (the self-draft, a draft model or a head).
enum class DraftSource { None, Ngram, Model };
constexpr int kDraftSources = 3;
const char* name_of(DraftSource source);  // "plain", "n-gram", "model"

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
  // at position `position`. sampling: null for a greedy tree (children best first); otherwise
  // children are drawn from the draft distribution and recorded in the tree (see DraftSampling).
  virtual void propose(int32_t root, int32_t position, const TreeParams& params, DraftSampling* sampling,
                       DraftTree& tree) = 0;
  // propose() in two halves, so that the draft forwards of several sequences' trees can run
  // together (draft_together). Sets up the tree for `root` as propose() does; when the tree grows
  // through the drafter's model level by level, returns its builder (begun) and expander, and the
  // caller grows it into `tree` (TreeBuilder::grow, or draft_together); otherwise proposes the whole
  // tree here and returns an empty growth (the default: drafters without such a backbone).
  virtual TreeGrowth begin_propose(int32_t root, int32_t position, const TreeParams& params,
                                   DraftSampling* sampling, DraftTree& tree) {
    propose(root, position, params, sampling, tree);
    return {};
  }
  // The target committed root and then the nodes `path` of `tree` (root to leaf).
  // verify_logits: the verification pass's target logits, [1 + tree.size()][n_vocab], row 0 at
  // the root and row i + 1 at node i (raw logits, before any sampling filter).
  virtual void accepted(int32_t root, const DraftTree& tree, std::span<const int32_t> path,
                        const float* verify_logits) = 0;
  // Whether propose() can run with `room` free slots left in the context.
  virtual bool fits(const TreeParams& params, int32_t room) const = 0;
  // Time spent in the draft LM head (DraftVocabulary::logits) since the drafter was made.
  virtual double lm_head_seconds() const = 0;
  // What verification of the last propose()'s tree may resume instead of recomputing (see
  // VerifyResume). A self-drafter's layers are the target's first layers, run at the very pending
  // slots verification uses; every other drafter has nothing to hand over (rows = 0).
  virtual VerifyResume resume_for(const DraftTree& tree) const { return {}; }
  // Size of the draft vocabulary the last propose() scored.
  virtual int32_t active_vocab_size() const = 0;
  // Target layers whose input residual streams the drafter reads (an EAGLE-3 head's features; see
  // ForwardOptions::capture_layers): the decoder captures them during prefill and verification, at
  // no extra forward pass. Empty (the default): none.
  virtual std::span<const int32_t> feature_layers() const { return {}; }
  // Called only when feature_layers() is not empty, right before begin() (the prompt's positions)
  // and before accepted() (the verification rows: root, then tree node i at row i + 1), with those
  // rows' features, [rows][feature_layers().size()][n_embd]; valid until that call returns.
  virtual void target_features(const float* features, int32_t rows) {}
  // Who drafted the last propose()'s tree, when it is not empty (the decoder counts an empty tree
  // as DraftSource::None).
  virtual DraftSource last_source() const { return DraftSource::Model; }
  // Committed rows the drafter has not run yet and will run before its next tree (a head or a
  // separate draft model catches up lazily, so steps it does not draft cost it nothing): --spec auto
  // counts them into the model's cost. 0 (the default): the drafter keeps up as it goes.
  virtual int32_t pending_rows() const { return 0; }
  // Rows of other sequences that will share this step's verification pass (the batching server sets
  // it before each step; 0 alone). A drafter that weighs the cost of its rows (--spec auto) reads it.
  virtual void set_shared_rows(int32_t rows) {}
};

// The draft LM-head step every drafter shares: scores `rows` normed hidden states
// ([rows][n_embd]) with `vocab` through `model`'s LM-head rows into `logits` ([rows][vocab.size()],
// resized; capacity kept across calls), adds the LM head's wall time to `lm_head_seconds`, and
// picks each row's k children into out[r * k ..] (pick_children).
void score_and_pick(DraftVocabulary& vocab, Model& model, const float* hidden, int32_t rows, int32_t k,
                    DraftSampling* sampling, std::vector<float>& logits, double& lm_head_seconds, Proposal* out);

// Runs tree candidates through a model (or its first N layers) writing into a KV cache's pending
// region, and scores their children with a DraftVocabulary. Shared by both drafters.
class ModelTreeExpander : public TreeExpander {
 public:
  ModelTreeExpander(Model& model, KVCache& kv, int32_t n_layers, DraftVocabulary vocab);
  // Starts a tree: `prefix` tokens (sequential, not yet in the cache, may be empty) then the root,
  // written at pending slots 0.. from position `position0`.
  void start(std::span<const int32_t> prefix, int32_t root, int32_t position0);
  // expand() is stage, the model's forward over the staged rows (forward_options()), score. A caller
  // that runs several sequences' rows in one forward call (draft_together) stages each, runs them
  // together, and scores each.
  void expand(std::span<const int32_t> frontier, std::span<const TreeNode> cand, int32_t k,
              DraftSampling* sampling, Proposal* out) override;
  // Lays out the frontier's rows at the next pending slots; returns this sequence's part of the
  // forward call (its rows, its cache, its output), valid until the next stage.
  SequenceForward stage(std::span<const int32_t> frontier, std::span<const TreeNode> cand);
  // The layers the forward of the staged rows runs: the expander's first n_layers().
  ForwardOptions forward_options() const { return {.end_layer = n_layers_}; }
  // After that forward: keeps the rows' residual streams by slot and writes each row's k children
  // (scored with this expander's own draft vocabulary) to out[i * k ..].
  void score(int32_t k, DraftSampling* sampling, Proposal* out);
  // The rows stage() lays out for `frontier`: its candidates, or at the root level the tokens the
  // draft cache has not seen yet and the root.
  int32_t rows_to_stage(std::span<const int32_t> frontier) const {
    return frontier.size() == 1 && frontier[0] < 0 ? static_cast<int32_t>(prefix_.size()) + 1
                                                   : static_cast<int32_t>(frontier.size());
  }
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
  std::vector<float> slot_residual_;  // [slots run][n_embd] residual stream per pending slot
};

class SelfDrafter final : public Drafter {
 public:
  // n_layers: the target layers the draft runs (1..n_layer).
  SelfDrafter(Model& target, KVCache& target_kv, int32_t n_layers, DraftVocabulary vocab);
  int32_t prompt_top_k() const override { return expander_.vocab().prompt_top_k(); }
  void begin(const std::vector<int32_t>& prompt, std::span<const int32_t> prompt_top) override {
    expander_.vocab().begin(prompt, prompt_top);
  }
  void propose(int32_t root, int32_t position, const TreeParams& params, DraftSampling* sampling,
               DraftTree& tree) override;
  TreeGrowth begin_propose(int32_t root, int32_t position, const TreeParams& params, DraftSampling* sampling,
                           DraftTree& tree) override;
  void accepted(int32_t root, const DraftTree& tree, std::span<const int32_t> path,
                const float* verify_logits) override {
    expander_.vocab().accepted(node_tokens(tree, tree_tokens_), path, verify_logits);
  }
  VerifyResume resume_for(const DraftTree& tree) const override;
  bool fits(const TreeParams& params, int32_t room) const override { return params.max_draft_rows() <= room; }
  double lm_head_seconds() const override { return expander_.lm_head_seconds(); }
  int32_t active_vocab_size() const override { return expander_.vocab().size(); }

 private:
  ModelTreeExpander expander_;
  TreeBuilder builder_;
  std::vector<int32_t> tree_tokens_;  // [tree nodes] the last accepted tree's tokens, for the vocabulary
};

class ModelDrafter final : public Drafter {
 public:
  // draft and target must share a vocabulary (check_same_vocabulary). n_ctx: as the target's.
  ModelDrafter(Model& draft, int32_t n_ctx, DraftVocabulary vocab);
  int32_t prompt_top_k() const override { return expander_.vocab().prompt_top_k(); }
  void begin(const std::vector<int32_t>& prompt, std::span<const int32_t> prompt_top) override;
  void propose(int32_t root, int32_t position, const TreeParams& params, DraftSampling* sampling,
               DraftTree& tree) override;
  TreeGrowth begin_propose(int32_t root, int32_t position, const TreeParams& params, DraftSampling* sampling,
                           DraftTree& tree) override;
  void accepted(int32_t root, const DraftTree& tree, std::span<const int32_t> path,
                const float* verify_logits) override;
  bool fits(const TreeParams& params, int32_t room) const override;
  double lm_head_seconds() const override { return expander_.lm_head_seconds(); }
  // The committed tokens its cache has not seen (caught up at the next proposal).
  int32_t pending_rows() const override { return static_cast<int32_t>(tokens_.size()) - kv_.n_past(); }
  int32_t active_vocab_size() const override { return expander_.vocab().size(); }
  const Model& model() const { return model_; }

 private:
  Model& model_;
  KVCache kv_;
  ModelTreeExpander expander_;
  TreeBuilder builder_;
  std::vector<int32_t> tokens_;  // the target's committed sequence, as told by begin/accepted
  std::vector<int32_t> commit_;  // scratch: pending slots to commit
  std::vector<int32_t> tree_tokens_;  // [tree nodes] the last accepted tree's tokens, for the vocabulary
  Batch batch_;                       // catch-up runs
  ForwardOutput out_;
  // Runs committed tokens the cache has not seen until at most `keep` are left unseen.
  void catch_up(int32_t keep);
};

// One sequence's tree in a draft_together call.
struct DraftJob {
  TreeGrowth growth;              // from the sequence's Drafter::begin_propose (empty: nothing to grow)
  DraftTree* tree = nullptr;      // where the finished tree goes
  int32_t levels = 0;             // out: draft forwards this tree ran (its levels)
  int32_t shared_forwards = 0;    // out: those of them shared with other sequences' rows
};

// Grows several sequences' trees level by level. At each level, the trees still growing whose
// expanders run the same model's same layers (the self-drafters of one server: the target's first
// layers) stage their frontier rows, and ONE forward call runs all of them (each sequence with its
// own cache and positions: Model::forward over several sequences; the weights are read once), split
// only where the rows would exceed the model's batch size; then each tree scores its own rows with
// its own draft vocabulary and picks its next frontier. Every tree is bitwise the one
// TreeBuilder::grow gives it alone (the forward is per row, the scoring per sequence).
void draft_together(std::span<DraftJob> jobs);

// Throws Error unless the two files have identical token lists (and so identical ids).
void check_same_vocabulary(const GgufFile& target, const GgufFile& draft);

}  // namespace microspec
