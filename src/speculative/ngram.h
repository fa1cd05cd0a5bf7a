#pragma once
// N-gram (prompt-lookup) drafting: no weights, no LM head. The context (prompt and every committed
// token, then the step's root) is indexed as it grows; the longest suffix of it that occurred
// earlier proposes the tokens that followed that occurrence.
//
//   NgramIndex:        the matcher. Every n-gram of length [min_n, max_n] that has a following
//                      token is kept in an open-addressing table (allocated once, for the context
//                      limit) mapping it to its most recent end position. A push indexes the
//                      max_n - min_n + 1 n-grams ending one token earlier; a lookup hashes the
//                      suffix for each length, longest first. Nothing is O(context) per token.
//   NgramDrafter:      drafts a chain with the match's continuation (see below why a chain),
//                      cut where NgramConfidence says its tokens stop paying.
//   NgramConfidence:   per generation, how often the j-th token of a continuation found by a
//                      match of L tokens was the token the target produced (given tokens 1..j-1
//                      were). A chain stops before the token whose estimated probability of being
//                      accepted, all earlier ones with it, falls below --ngram-min-accept percent.
//                      Every step observes one depth past what it accepted (the target's own
//                      next token, the next step's root), so a depth that stopped being drafted
//                      keeps being measured and comes back when the text starts repeating.
//   NgramFirstDrafter: "n-gram first, else a fallback drafter" (--spec self+ngram, draft+ngram;
//                      any Drafter composes): a match of at least `first_min` tokens drafts,
//                      otherwise the fallback does.
//
// Why a chain and not a tree of the distinct continuations of several matches: under sampling a
// deterministic proposal's draft distribution is a point mass (q(x) = 1), and recursive rejection
// sampling is exact only when a node's children are draws without replacement from its q; after
// x is drawn a point mass has nothing left to draw, so a second child would need a made-up q with
// a random draw order. A chain keeps q honest under sampling and greedy alike, and on a CPU every
// extra verified row costs target time, while a second continuation of the same suffix rarely
// wins. Why a cut: a verified row is not free. On SmolLM2 (small matrices, compute-bound at a few
// tokens) 5 rows cost ~1.8x one row, so a chain whose tail is rarely accepted slows decoding; on
// Gemma (its 262k-row LM head dominates) the same rows cost ~1.2x, and long chains pay. The
// statistics depend only on the tokens, so drafting stays deterministic. (The verifier accepts a point-mass child with probability p(x) and otherwise moves on to
// the residual norm(max(0, p - q)) = p without x: plain sampling's distribution exactly, tested
// in tests/test_spec_sampling_power.cpp.)
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "speculative/drafter.h"

namespace microspec {

struct NgramParams {
  int32_t min_n = 2;  // shortest suffix match that drafts (and is indexed)
  int32_t max_n = 5;  // longest suffix tried
  // A chain keeps its j-th token while the estimated probability that tokens 1..j are all
  // accepted is at least this many percent (0: the whole continuation, up to tree-tokens).
  int32_t min_accept_percent = 10;
  void validate() const;  // throws Error unless 1 <= min_n <= max_n <= 64 and 0 <= percent <= 100
};

// The longest earlier occurrence of the context's suffix.
struct NgramMatch {
  int32_t length = 0;  // tokens matched, 0 = none
  int32_t next = -1;   // context index of the token that followed the occurrence
};

class NgramIndex {
 public:
  // capacity: most tokens the context can hold (the context limit).
  NgramIndex(const NgramParams& params, int32_t capacity);
  // Starts a new context with `tokens`; throws Error if they exceed the capacity.
  void reset(std::span<const int32_t> tokens);
  // Appends one token; throws Error at the capacity.
  void push(int32_t token);
  // The longest suffix (min_n <= length <= max_n) that also ends earlier in the context, at its
  // most recent earlier occurrence.
  NgramMatch longest_match() const;
  // Writes up to `max_tokens` tokens that continue the context after `m` (m.length > 0) to out,
  // copying with overlap: a continuation that runs into the suffix itself continues with the
  // tokens just drafted (a repeated pattern keeps repeating). Returns how many were written.
  int32_t continuation(const NgramMatch& m, int32_t max_tokens, std::vector<int32_t>& out) const;
  std::span<const int32_t> tokens() const { return tokens_; }
  int32_t size() const { return static_cast<int32_t>(tokens_.size()); }
  int32_t capacity() const { return capacity_; }
  const NgramParams& params() const { return params_; }

 private:
  struct Slot {
    uint64_t key = 0;  // hash of (length, tokens); 0 = empty
    int32_t end = -1;  // context index of the n-gram's last token, most recent occurrence
  };
  uint64_t hash(int32_t start, int32_t n) const;
  // The slot holding `key`, or the empty slot where it goes.
  size_t find(uint64_t key) const;

  NgramParams params_;
  int32_t capacity_;
  std::vector<int32_t> tokens_;  // [<= capacity] the context
  std::vector<Slot> table_;      // [power of two >= 2 * capacity * lengths] open addressing, linear probes
  size_t mask_ = 0;
};

// Acceptance counts per (match length, depth), reset for every generation. Counts start at one
// hit in two trials, so a depth never seen is estimated at 1/2 and gets tried.
class NgramConfidence {
 public:
  static constexpr int32_t kDepths = 16;  // depths past it share the last one's counts
  explicit NgramConfidence(int32_t max_n);
  void reset();
  // How many leading tokens of a continuation of `available` tokens, found by a match of `length`
  // tokens, to draft: the most j such that the product of the estimated per-depth acceptance
  // rates over depths 1..j is at least min_accept_percent / 100.
  int32_t tokens_worth_drafting(int32_t length, int32_t available, int32_t min_accept_percent) const;
  // One observation: the continuation's token at `depth` was (hit) or was not the target's, the
  // tokens before it having been.
  void record(int32_t length, int32_t depth, bool hit);
  // The estimated acceptance rate at `depth` given the earlier ones were accepted.
  double rate(int32_t length, int32_t depth) const;

 private:
  struct Count {
    int32_t hits = 1, trials = 2;
  };
  // The counts' index; Error for a length outside [1, max_n] or a depth < 1.
  size_t slot(int32_t length, int32_t depth) const;
  int32_t max_n_;
  std::vector<Count> counts_;  // [(max_n + 1) * kDepths], row = match length
};

class NgramDrafter final : public Drafter {
 public:
  // n_ctx: the target's context limit (the index's capacity).
  NgramDrafter(const NgramParams& params, int32_t n_ctx);
  void begin(const std::vector<int32_t>& prompt, std::span<const int32_t> prompt_top) override;
  // A chain of up to params.total_tokens tokens when the match has at least min_n tokens.
  void propose(int32_t root, int32_t position, const TreeParams& params, DraftSampling* sampling,
               DraftTree& tree) override;
  void accepted(int32_t root, const DraftTree& tree, std::span<const int32_t> path,
                const float* verify_logits) override;
  bool fits(const TreeParams& params, int32_t room) const override { return params.total_tokens < room; }
  double lm_head_seconds() const override { return 0.0; }
  int32_t active_vocab_size() const override { return 0; }  // no LM head: nothing is scored
  DraftSource last_source() const override { return DraftSource::Ngram; }

  // The step's root joins the context (once per step) and the longest suffix match is returned.
  NgramMatch match_with_root(int32_t root);
  // The step's continuation of `m` (up to params.total_tokens tokens) and how many of its tokens
  // the confidence keeps (0: not worth a draft). The step then observes the continuation against
  // what the target commits, whoever drafts.
  int32_t plan_chain(const NgramMatch& m, const TreeParams& params);
  // Fills `tree` with the first `tokens` tokens of the planned continuation; with sampling, every
  // node's draft distribution is the point mass on its token.
  void draft_chain(int32_t tokens, DraftSampling* sampling, DraftTree& tree);
  const NgramIndex& index() const { return index_; }
  const NgramConfidence& confidence() const { return confidence_; }

 private:
  // The step's root joins the context; it settles the observation the last step left open.
  void push_root(int32_t root);

  NgramIndex index_;
  NgramConfidence confidence_;
  bool root_pushed_ = false;      // the current step's root is already in the index
  std::vector<int32_t> chain_;    // [<= total_tokens] the step's planned continuation
  int32_t chain_length_ = 0;      // the match length that found chain_; 0 = no continuation this step
  // An observation waiting for the next root: the continuation's token at `depth` against the
  // target's next token.
  struct Open {
    int32_t length = 0, depth = 0, token = -1;  // length 0 = none
  } open_;
};

// An n-gram drafter and a model drafter side by side; each step one of them drafts, or neither (a
// plain step). Subclasses choose who (begin_propose, setting chosen_). Both learn every committed
// token (the model's cache and draft vocabulary stay in step), a draft head model reads the
// target's features of every row whoever drafted, and only a tree the model built hands rows to
// verification (a self-drafter's resume applies to its own tree).
class NgramAndModelDrafter : public Drafter {
 public:
  int32_t prompt_top_k() const override { return model_->prompt_top_k(); }
  std::span<const int32_t> feature_layers() const override { return model_->feature_layers(); }
  void target_features(const float* features, int32_t rows) override { model_->target_features(features, rows); }
  void begin(const std::vector<int32_t>& prompt, std::span<const int32_t> prompt_top) override;
  void propose(int32_t root, int32_t position, const TreeParams& params, DraftSampling* sampling,
               DraftTree& tree) override {
    begin_propose(root, position, params, sampling, tree).grow_alone(tree);
  }
  void accepted(int32_t root, const DraftTree& tree, std::span<const int32_t> path,
                const float* verify_logits) override;
  bool fits(const TreeParams& params, int32_t room) const override {
    return ngram_.fits(params, room) && model_->fits(params, room);
  }
  double lm_head_seconds() const override { return model_->lm_head_seconds(); }
  VerifyResume resume_for(const DraftTree& tree) const override {
    return chosen_ == DraftSource::Model ? model_->resume_for(tree) : VerifyResume{};
  }
  int32_t active_vocab_size() const override { return chosen_ == DraftSource::Model ? model_->active_vocab_size() : 0; }
  DraftSource last_source() const override { return chosen_; }

 protected:
  // n_ctx as NgramDrafter's; model never null.
  NgramAndModelDrafter(const NgramParams& params, int32_t n_ctx, std::unique_ptr<Drafter> model);
  NgramDrafter ngram_;
  std::unique_ptr<Drafter> model_;
  DraftSource chosen_ = DraftSource::None;  // who drafts this step's tree
};

class NgramFirstDrafter final : public NgramAndModelDrafter {
 public:
  // A match of at least first_min tokens drafts; otherwise `fallback` does. n_ctx as NgramDrafter's.
  NgramFirstDrafter(const NgramParams& params, int32_t first_min, int32_t n_ctx, std::unique_ptr<Drafter> fallback);
  // The n-gram chain at once, or the fallback's growth (its tree then grows with other sequences').
  TreeGrowth begin_propose(int32_t root, int32_t position, const TreeParams& params, DraftSampling* sampling,
                           DraftTree& tree) override;
  // Steps drafted by the n-gram side and by the fallback since the drafter was made.
  int64_t ngram_steps() const { return ngram_steps_; }
  int64_t fallback_steps() const { return fallback_steps_; }

 private:
  int32_t first_min_;
  int64_t ngram_steps_ = 0, fallback_steps_ = 0;
};

}  // namespace microspec
