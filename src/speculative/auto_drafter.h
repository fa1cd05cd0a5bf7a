#pragma once
// --spec auto: each step takes whichever option promises the most tokens per unit of time:
//   an n-gram chain  the context's longest earlier match, its continuation cut where the n-gram
//                    confidence cuts it (--ngram-min-accept, as --spec ngram drafts it);
//   the model        the model drafter (a head found for the model, else the self-draft) as a chain
//                    of its best length;
//   a plain step     the root alone.
//
// Expected tokens come from this generation's own counts, each starting from a prior of one hit in
// two trials: the n-gram side's per match length and depth (NgramConfidence, observed every step a
// match exists, whoever drafts), the model's per depth (observed on the steps it drafts). A chain
// of L tokens whose depth d is accepted, the earlier ones being, at rate r_d is worth
// 1 + sum_{d<=L} prod_{i<=d} r_i tokens.
//
// Costs come from StepCosts (a target forward per row count, measured once and cached) and the
// model drafter's cost per level, in seconds:
//   plain            F(B + 1) - F(B)
//   n-gram, L        F(B + 1 + L) - F(B)
//   model, L         L * level + F(B + 1 + L) - F(B) - resumed * (body(B + L) - body(B))
//                    + pending * catch_up
// where F is the forward's cost, body its part outside the LM head, B the other sequences' rows
// in the same pass (the batching server; 0 alone), `level` one draft forward of one row,
// `resumed` the share of the target's layers a self-draft already ran for the rows it hands to
// verification, and `pending` the committed rows a head or draft model has not run yet (it
// catches up when it next drafts), `catch_up` the cost of one. Nothing reads a clock while
// generating, so a fixed seed gives the same text.
//
// The model's counts move only when it drafts, so while another option wins it still drafts a
// probe now and then (its best chain and one token more, so each probe also measures a depth its
// chains do not reach): a model that got better comes back. The first probe comes kProbeInterval
// steps after the model last drafted; each probe that leaves the model losing doubles the wait
// (up to kMaxProbeInterval), since a head's probe pays the catch-up of every row since the last
// one; a step the model wins on its own resets it. No probe runs where the model's chain would
// lose even with every token accepted. Its prior at depth 1 is one hit in three trials (it must
// show it beats the n-gram side's chains).
//
// Lossless as every drafter: the choice at a step depends only on earlier steps, never on this
// step's draws, and each option's tree is verified exactly as alone.
#include <array>
#include <cstdint>
#include <memory>

#include "speculative/drafter.h"
#include "speculative/ngram.h"
#include "speculative/step_costs.h"

namespace microspec {

// What one draft level of the model drafter costs, and what its rows save verification.
struct ModelDraftCost {
  double level_seconds = 0.0;   // one draft forward of one row, its draft LM head included
  double resumed_share = 0.0;   // share of the target's layers a drafted row skips in verification
  double catch_up_row_seconds = 0.0;  // one pending committed row (Drafter::pending_rows), run in a batch
};

class AutoDrafter final : public NgramAndModelDrafter {
 public:
  static constexpr int32_t kProbeInterval = 32;
  static constexpr int32_t kMaxProbeInterval = 512;

  // model: the model drafter (never null); costs: the target's (StepCosts::validate'd).
  AutoDrafter(const NgramParams& ngram, int32_t n_ctx, std::unique_ptr<Drafter> model, const ModelDraftCost& model_cost,
              StepCosts costs);
  // No prompt pass (K_pre = 0): the target's top tokens at every prompt position cost a full LM
  // head per position, which auto's model drafter, one option of three, does not repay (SpecBench,
  // 128 tokens: the pass cost SmolLM2 12% and Gemma 24% of the whole generation for at most 1% of
  // decode speed; docs/speculative.md). The window still starts with the prompt's tokens.
  int32_t prompt_top_k() const override { return 0; }
  void begin(const std::vector<int32_t>& prompt, std::span<const int32_t> prompt_top) override;
  TreeGrowth begin_propose(int32_t root, int32_t position, const TreeParams& params, DraftSampling* sampling,
                           DraftTree& tree) override;
  // The model's counts learn from its own chains; then both sides learn the committed tokens.
  void accepted(int32_t root, const DraftTree& tree, std::span<const int32_t> path,
                const float* verify_logits) override;
  void set_shared_rows(int32_t rows) override { shared_rows_ = rows; }

  // One option's worth: expected tokens per second, and the chain length that gets it.
  struct Choice {
    DraftSource source = DraftSource::None;
    int32_t tokens = 0;       // chain length (0: a plain step)
    double value = 0.0;       // (1 + expected accepted tokens) / seconds
  };
  // What the next step would choose for an n-gram chain of `ngram_tokens` tokens found by a match of
  // `match_length` (0: none), with up to max_model_tokens from the model: for tests.
  Choice choose(int32_t match_length, int32_t ngram_tokens, int32_t max_model_tokens) const;
  const NgramConfidence& model_confidence() const { return model_rates_; }
  const StepCosts& costs() const { return costs_; }

 private:
  // Seconds of a step verifying `rows` rows of this sequence; the model's drafting added for `drafted`.
  double verify_seconds(int32_t rows) const;
  double model_seconds(int32_t tokens) const;
  // The model's chain of 1..max_tokens tokens worth most (tokens 0 when max_tokens is 0).
  Choice best_model_chain(int32_t max_tokens) const;
  // The most a model chain of 1..max_tokens could be worth, every token accepted.
  double model_ceiling(int32_t max_tokens) const;

  ModelDraftCost model_cost_;
  StepCosts costs_;
  NgramConfidence model_rates_;  // the model's acceptance per depth (match length 1)
  int32_t shared_rows_ = 0;
  int32_t steps_since_model_ = 0;
  int32_t probe_interval_ = kProbeInterval;  // steps from the model's last tree to the next probe
};

}  // namespace microspec
