#pragma once
// Penalties and logit bias: the history-dependent changes to the target's logits row that come
// before the sampler's filters (sampling/sampler.h). Applied in llama.cpp's order:
//   1. logit_bias   logit[t] += bias[t]                                   (OpenAI, llama.cpp)
//   2. repeat       for each distinct token t among the last repeat_last_n context tokens (prompt
//                   and generated; -1 = the whole context, 0 = off): logit[t] /= repeat_penalty
//                   when it is > 0, else logit[t] *= repeat_penalty       (llama.cpp)
//   3. presence / frequency   logit[t] -= presence * [count_t > 0] + frequency * count_t, count_t
//                   counting t among the GENERATED tokens only            (OpenAI)
// llama.cpp counts presence/frequency over the repeat window instead; this follows OpenAI's
// definition for OpenAI's fields.
//   4. grammar      with structured output, every token the grammar does not allow after the
//                   history is masked to -inf (grammar/token_constraint.h: all of them, or those
//                   ranked above the best allowed ones when only those matter)
// Then top-k, top-p, min-p and temperature (Sampler).
//
// The same transform in plain and speculative decoding keeps speculation lossless: the row a
// verified tree node produces is transformed with the committed history plus that node's own
// path from the root (its ancestors and itself), never its siblings, which is exactly the history
// plain decoding would have had at that position.
//
// All buffers are sized in begin(); accept() and apply() allocate nothing (apply touches only the
// tokens in the window, the generated set, the path and the bias list).
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

namespace microspec {

class GrammarMatcher;

struct PenaltyParams {
  float repeat_penalty = 1.0f;     // > 0; 1 = off
  int32_t repeat_last_n = 64;      // -1: the whole context, 0: off
  float presence_penalty = 0.0f;   // OpenAI: [-2, 2]
  float frequency_penalty = 0.0f;  // OpenAI: [-2, 2]
  std::vector<std::pair<int32_t, float>> logit_bias;  // (token id, bias in [-100, 100] or -inf: never)
  // Whether anything changes a row.
  bool active() const {
    return (repeat_penalty != 1.0f && repeat_last_n != 0) || presence_penalty != 0.0f ||
           frequency_penalty != 0.0f || !logit_bias.empty();
  }
  // Throws microspec::Error naming the first invalid setting (ids checked against n_vocab).
  void validate(int64_t n_vocab) const;
};

// The request field name (OpenAI's / llama.cpp's) of the first setting that is not neutral among
// the penalties, the logit bias and min_p, or null when all are: for backends that apply none of
// them (the CUDA device) and must refuse rather than ignore.
const char* first_active_penalty(const PenaltyParams& penalties, float min_p);

// One sequence's penalty state: the context so far, the generated tokens' counts and the
// grammar's state (structured output; null: none).
class Penalizer {
 public:
  Penalizer(const PenaltyParams& params, int64_t n_vocab);
  Penalizer(const PenaltyParams& params, int64_t n_vocab, std::unique_ptr<GrammarMatcher> grammar);
  ~Penalizer();
  // Starts a sequence: the prompt is the context; nothing is generated yet. `capacity`: tokens the
  // context may reach (prompt + generated), reserved so accept() allocates nothing.
  void begin(std::span<const int32_t> prompt, int64_t capacity);
  // A generated token joins the history.
  void accept(int32_t token);
  // Transforms a row of n_vocab logits in place, as if `path` (tokens after the history, oldest
  // first) had been generated too.
  void apply(float* logits, std::span<const int32_t> path = {});
  // Whether anything transforms a row (penalties, bias or a grammar).
  bool active() const { return active_ || grammar_; }
  // Whether the grammar allows every token of `path` in turn after the history (true without one).
  bool allows_path(std::span<const int32_t> path);
  bool constrained() const { return grammar_ != nullptr; }
  const PenaltyParams& params() const { return params_; }

 private:
  void penalise(float* logits, std::span<const int32_t> path);  // steps 1-3
  bool stamp(int32_t token);  // true the first time a token is seen in the current pass
  void next_pass();

  PenaltyParams params_;
  int64_t n_vocab_;
  bool active_;  // penalties or bias
  std::unique_ptr<GrammarMatcher> grammar_;
  std::vector<int32_t> context_;     // [capacity] prompt + generated tokens
  std::vector<int32_t> gen_count_;   // [n_vocab] occurrences among the generated tokens
  std::vector<int32_t> gen_distinct_;  // tokens with gen_count_ > 0, in order of first use
  std::vector<uint32_t> seen_;       // [n_vocab] pass stamp per token (deduplication)
  uint32_t pass_ = 0;
};

}  // namespace microspec
