#pragma once
// Speculative generation: each step a drafter proposes a token tree after the newest token (the
// root), the target verifies root + tree in one forward pass, and the longest path the target
// agrees with is committed, plus the target's own next token (the bonus). Every emitted token is
// the target's greedy choice, and they go through the same TokenSink as plain decoding, so the
// output (tokens, text, finish reason) equals Generator::generate's exactly.
// With temperature > 0 the draft tree is sampled and verified by recursive rejection sampling
// (tree.h, TreeSamplingVerifier): the output has exactly plain sampling's distribution, though
// not the same tokens for a seed.
#include <cstdint>
#include <vector>

#include "engine/generator.h"
#include "speculative/drafter.h"
#include "speculative/tree.h"

namespace microspec {

struct SpecStats {
  int32_t steps = 0;             // verification passes
  int64_t accepted_draft = 0;    // draft tokens accepted over all steps
  int64_t drafted = 0;           // draft tree nodes proposed over all steps
  int64_t decode_tokens = 0;     // tokens produced by the steps (bonus tokens included)
  double draft_seconds = 0.0;          // in Drafter::propose/accepted (backbone + draft LM head)
  double draft_lm_head_seconds = 0.0;  // the draft LM head (part of draft_seconds)
  double verify_seconds = 0.0;         // the target's verification forward (its LM head included)
  double verify_lm_head_seconds = 0.0;  // the target's LM head (part of verify_seconds)
  double bookkeeping_seconds = 0.0;    // acceptance, KV commit, draft-vocabulary updates, emitting
  int64_t active_vocab_sum = 0;        // draft vocabulary size summed over steps that drafted
  int32_t drafting_steps = 0;          // steps with a draft tree
  double draft_backbone_seconds() const { return draft_seconds - draft_lm_head_seconds; }
  double lm_head_seconds() const { return draft_lm_head_seconds + verify_lm_head_seconds; }
  double mean_active_vocab() const { return drafting_steps ? double(active_vocab_sum) / drafting_steps : 0.0; }
  // Accepted draft tokens + 1 per step: tokens per target pass.
  double mean_acceptance_length() const { return steps ? double(accepted_draft + steps) / steps : 0.0; }
};

// The result of a generation, plain (stats left empty) or speculative, and the speeds every front
// end reports from it.
struct SpecResult {
  GenerateResult gen;
  SpecStats stats;
  // Tokens produced after the prefill: one per forward for plain decoding, the steps' tokens
  // (accepted drafts and bonus tokens) for speculative decoding.
  int64_t decode_tokens() const { return stats.steps > 0 ? stats.decode_tokens : gen.decode_forwards; }
  double decode_tokens_per_second() const {
    return gen.decode_seconds > 0 ? double(decode_tokens()) / gen.decode_seconds : 0.0;
  }
  double prefill_tokens_per_second() const {
    return gen.prefill_seconds > 0 ? gen.prompt_tokens / gen.prefill_seconds : 0.0;
  }
};

class SpeculativeGenerator {
 public:
  // gen provides the target, its cache (shared with a self-drafter) and prefill.
  SpeculativeGenerator(Generator& gen, const Tokenizer& tokenizer, Drafter& drafter, const TreeParams& tree);
  SpecResult generate(const std::vector<int32_t>& prompt, const GenerateParams& params,
                      const TextCallback& on_text = nullptr);

 private:
  Generator& gen_;
  const Tokenizer& tokenizer_;
  Drafter& drafter_;
  TreeParams params_;
  DraftTree tree_;
  Batch batch_;
  ForwardOutput out_;
  std::vector<int32_t> argmax_;   // [1 + tree nodes] target argmax per verified row
  std::vector<int32_t> path_;     // accepted node indices
  std::vector<int32_t> emitted_;  // tokens of one step
  std::vector<int32_t> commit_;   // pending slots to commit
  std::vector<float> resume_x_;  // [1 + tree nodes][n_embd] residuals verification resumes from
  Batch tail_;                   // verification rows the draft did not run
  ForwardOutput tail_out_;
  TreeSamplingVerifier verifier_;
  DraftSampling draft_sampling_;
  std::vector<int32_t> prompt_top_;  // [prompt][drafter's K_pre] target top ids per prompt position
};

}  // namespace microspec
