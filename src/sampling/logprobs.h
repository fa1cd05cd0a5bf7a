#pragma once
// Log-probabilities of generated tokens, for the server's `logprobs` / `top_logprobs`.
//
// What is reported depends on how the token was chosen:
// - greedy: the log-softmax of the target's raw logits row (temperature 1, no filters):
//   log p(token) = logit[token] - max - log(sum exp(logit - max)), summed in double. The point mass
//   greedy decoding draws from would say 0 for every token; this is the model's own distribution
//   (vLLM's and OpenAI's values at temperature 0). NaN and -inf logits have log-probability -inf
//   and are never among the alternatives; a row whose maximum is +inf gives its +inf tokens
//   -log(their count) and every other token -inf.
// - sampled: the log of the probability the token was drawn with, in the distribution sampling
//   drew it from (Sampler::distribution: top-k, top-p, min-p, then temperature); the alternatives are
//   that distribution's most likely tokens, so there are at most as many as it keeps.
// With penalties or logit bias (sampling/penalties.h), "the row" is the transformed row the token
// was chosen from, so both report the penalised distribution's values.
// Both depend on the row alone, so plain and speculative decoding, whose rows are bitwise equal
// (and whose sampled tokens follow the same distribution), report bitwise equal values.
//
// Computed only when asked for, with no allocation per token: the rows go into a LogprobRows whose
// storage the caller reserves up front.
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace microspec {

// Most alternatives a request may ask for (OpenAI's limit for top_logprobs).
constexpr int32_t kMaxTopLogprobs = 20;

struct TokenLogprob {
  int32_t token = -1;
  float logprob = 0.0f;
};

// What a generation records: off, or the chosen token and `top` alternatives (0..kMaxTopLogprobs).
struct LogprobSettings {
  bool enabled = false;
  int32_t top = 0;
};

// One row per generated token: the chosen token first, then its `top` most likely alternatives
// (best first, ties to the lower id). Flat storage, `1 + top` entries a row.
struct LogprobRows {
  int32_t top = 0;
  std::vector<TokenLogprob> entries;
  size_t stride() const { return size_t(top) + 1; }
  size_t rows() const { return entries.size() / stride(); }
  std::span<const TokenLogprob> row(size_t i) const { return {entries.data() + i * stride(), stride()}; }
  // Empties the rows and reserves room for `rows` of them with `top` alternatives each.
  void reset(int32_t top_alternatives, size_t rows);
};

// Log of the softmax denominator relative to the maximum: log(sum over finite-or-not x > -inf of
// exp(x[i] - max)), max the largest non-NaN element (finite). AVX2, sums in double.
double log_sum_exp_below(const float* x, int64_t n, float max);

// Appends one row for `token` chosen from logits[0, n) with `top` alternatives to rows.entries.
void append_logprob_row(const float* logits, int64_t n, int32_t token, LogprobRows& rows);

// Appends one row for `token` drawn from `dist`, a sampling distribution as Sampler::distribution
// gives it ((id, probability) pairs, zero-probability tokens left out): log p(token) and the `top`
// most likely entries, best first (ties to the lower id), id -1 where dist has fewer. Reorders dist.
void append_drawn_logprob_row(std::vector<std::pair<int32_t, float>>& dist, int32_t token, LogprobRows& rows);

}  // namespace microspec
