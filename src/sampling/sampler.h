#pragma once
// Token sampling from one row of logits: greedy, or temperature with top-k / top-p filtering.
//
// The flags mean what llama.cpp's do, applied in llama.cpp's default chain order
// (top-k -> top-p -> min-p -> temperature -> draw), which is also what llama-cpp-python builds:
//   1. top-k keeps the k largest logits (k <= 0 or k >= n_vocab: off).
//   2. top-p takes softmax(logits) over the survivors at temperature 1 and keeps the smallest
//      prefix (by descending probability) whose cumulative probability reaches top_p; the token
//      that reaches or crosses the threshold is kept (top_p >= 1: off).
//   3. min-p keeps the survivors whose probability at temperature 1 is >= min_p times the best
//      one's (logit >= max logit + log(min_p)); min_p <= 0: off. llama.cpp's default chain runs it
//      after top-p and before temperature, so it too does not depend on the temperature.
//   4. the survivors are weighted by softmax(logit / temperature) and one is drawn.
// Before all of these, penalties and logit bias transform the row (sampling/penalties.h: logit
// bias, repeat penalty, presence/frequency penalties, llama.cpp's order); the sampler sees the
// transformed row.
// temperature 0 means greedy (argmax, no RNG use). Negative temperatures are rejected: llama.cpp's
// CLI reads them as greedy but llama-cpp-python as "T=1, no filters", so there is no one meaning.
// Because top-p runs before temperature, the kept set does not depend on the temperature.
//
// Non-finite logits: NaN and -inf are never sampled. +inf logits take all the probability mass,
// shared equally (the limit of softmax). A row with nothing samplable throws microspec::Error.
// Ties are broken towards the lower token id everywhere, so results are deterministic.
#include <cstdint>
#include <limits>
#include <random>
#include <utility>
#include <vector>

namespace microspec {

struct SamplingParams {
  float temperature = 0.0f;  // 0 (or < ~3e-39): greedy; > 0: divides logits; < 0, NaN, inf: rejected
  int top_k = 40;            // <= 0: off
  float top_p = 0.95f;       // >= 1: off; NaN: rejected
  uint64_t seed = 0;         // seeds the RNG; equal seeds and logits give equal tokens
  float min_p = 0.0f;        // [0, 1]; 0: off (llama.cpp's min-p, after top-p)
  // Whether these settings decode greedily: a temperature whose inverse overflows (0 among them)
  // would turn the best logit into NaN, so it means the argmax.
  bool greedy() const { return !(1.0f / temperature < std::numeric_limits<float>::infinity()); }
};

// The seed of a speculative decoder's draft sampler (its own RNG, derived from the request's seed):
// the CPU decoder's and the device's, so both draw the same drafts.
inline uint64_t draft_sampler_seed(uint64_t seed) { return seed ^ 0x9e3779b97f4a7c15ull; }

// Softmax sampler over a fixed vocabulary size. All buffers are allocated in the constructor;
// sample() allocates nothing. Not thread-safe: one Sampler per sequence.
class Sampler {
 public:
  Sampler(const SamplingParams& params, int64_t n_vocab);

  // Draws one token from a row of n_vocab logits. Greedy does not advance the RNG.
  int32_t sample(const float* logits);

  // The final sampling distribution as (token id, probability) pairs summing to 1 (to rounding),
  // after top-k, top-p and temperature; zero-probability tokens are left out. Greedy: one entry
  // with probability 1.
  // The order is deterministic: best first when top-k is on (a top-k=0/top-p run is only
  // partially ordered, to avoid sorting the vocabulary); ascending id when both are off.
  // `out` is cleared and refilled; its capacity is reused between calls.
  void distribution(const float* logits, std::vector<std::pair<int32_t, float>>& out) {
    distribution(logits, n_vocab_, out);
  }
  // The same over a row of n <= n_vocab logits (a pruned draft vocabulary); ids are positions.
  void distribution(const float* logits, int64_t n, std::vector<std::pair<int32_t, float>>& out);

  // Draws one token id from a distribution (as produced by distribution(); probabilities need
  // not sum exactly to 1) with this sampler's RNG. Zero-probability entries are never drawn.
  int32_t sample_from(const std::vector<std::pair<int32_t, float>>& dist);

  // Uniform draw in [0, 1) from this sampler's RNG (24 random bits).
  float uniform();

  const SamplingParams& params() const { return params_; }
  int64_t n_vocab() const { return n_vocab_; }

 private:
  struct Candidate {
    float logit;
    int32_t id;
    int32_t bucket;  // top-p's bucket by distance below the maximum logit (top-k off only)
  };
  // Strict total order: a ranks before b (higher logit, then lower id).
  static bool ranks_before(const Candidate& a, const Candidate& b) {
    return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
  }
  // Fills cand_ with the top-k tokens (sorted, best first) or, with top-k off, every samplable
  // token in id order; returns how many and sets max_logit_. Throws if no token is samplable.
  int64_t select_candidates(const float* logits, int64_t n);
  // Applies top-p to cand_[0, n), reordering it so the kept tokens come first; returns how many.
  int64_t apply_top_p(int64_t n);
  // Applies min-p to cand_[0, n) (max_logit_ set), keeping the survivors' order; returns how many.
  int64_t apply_min_p(int64_t n);

  SamplingParams params_;
  int64_t n_vocab_;
  bool greedy_;
  int64_t top_k_;      // effective k: 0 when top-k is off
  float max_logit_{};  // largest candidate logit of the row being processed
  std::mt19937_64 rng_;
  // Both buffers stay empty for greedy sampling, which needs neither. During top-k selection the
  // first top_k_ candidates double as the heap.
  std::vector<Candidate> cand_;                     // [n_vocab] candidates, front part used
  std::vector<std::pair<int32_t, float>> scratch_;  // [n_vocab] capacity: sample()'s distribution
};

}  // namespace microspec
