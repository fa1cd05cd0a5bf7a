#pragma once
// The draw of a top-k sampler (sampler.h's chain: top-k -> top-p -> temperature -> draw) once
// the k best tokens are ranked, written once for the CPU's Sampler and the CUDA backend's sampled
// decoding (a device thread runs it over top_k_rows' output), so both turn the same ranked logits
// and the same random bits into the same token:
//   1. top-p: softmax at temperature 1 over the ranked logits (weights expf(l - max), summed in
//      double in rank order) keeps the shortest prefix whose mass reaches top_p * total;
//   2. the kept tokens' weights at the temperature, expf((l - max) / T) as floats, are normalised
//      in double to float probabilities (a weight or probability of 0 drops out);
//   3. u = (bits >> 11) * 2^-53 * (sum of the probabilities) picks the first token whose
//      cumulative probability exceeds u (the last one if rounding leaves u at the very top).
// +inf logits share all the mass equally (the limit of softmax).
#include <cmath>
#include <cstdint>

#include "util/host_device.h"

namespace microspec {

// Top-p over ranked entries (as below: best first, no NaN or -inf, n >= 1): softmax at
// temperature 1 (weights expf(l - max), summed in double in rank order) keeps the shortest prefix
// whose mass reaches top_p * total, the entry that reaches it included; all n when top_p >= 1, when
// n == 1, or when rounding leaves the sum a hair short. The CPU Sampler's top-p with top-k on.
template <class LogitOf>
MS_HOST_DEVICE inline int32_t ranked_top_p(int32_t n, const LogitOf& logit_of, float top_p) {
  if (!(top_p < 1.0f) || n <= 1) return n;
  const float mx = logit_of(0);
  const bool inf_max = mx == INFINITY;  // +inf tokens hold all the mass
  auto weight = [&](float logit) -> double { return inf_max ? (logit == INFINITY ? 1.0 : 0.0) : expf(logit - mx); };
  double total = 0.0;
  for (int32_t i = 0; i < n; ++i) total += weight(logit_of(i));
  const double target = static_cast<double>(top_p) * total;
  double cum = 0.0;
  for (int32_t i = 0; i < n; ++i) {
    cum += weight(logit_of(i));
    if (cum >= target) return i + 1;
  }
  return n;
}

// A sampler's settings past top-k, as plain data a device kernel reads (SamplingParams's
// temperature and top_p).
struct DrawSettings {
  float temperature = 1.0f;  // > 0 with 1 / temperature finite
  float top_p = 1.0f;        // >= 1: off
};

// Steps 1 and 2 over ranked entries (as draw_ranked's below): `kept`, the entries top-p keeps, and
// prob(i) for i < kept, the probability Sampler::distribution() gives the entry (0 where it drops
// one out). Each prob(i) recomputes its weight, so nothing is stored (n may exceed 64 on the CPU).
template <class LogitOf>
struct RankedProbs {
  MS_HOST_DEVICE RankedProbs(int32_t n, const LogitOf& logit_of_, DrawSettings settings)
      : logit_of(logit_of_), mx(logit_of_(0)), inf_max(mx == INFINITY), inv_t(1.0f / settings.temperature) {
    kept = ranked_top_p(n, logit_of, settings.top_p);
    // The best token's weight is 1, so the total is positive.
    double total = 0.0;
    for (int32_t i = 0; i < kept; ++i) total += weight(i);
    inv_total = 1.0 / total;
  }
  // The weight at the temperature; +inf tokens hold all the mass.
  MS_HOST_DEVICE float weight(int32_t i) const {
    const float l = logit_of(i);
    return inf_max ? (l == INFINITY ? 1.0f : 0.0f) : expf((l - mx) * inv_t);
  }
  MS_HOST_DEVICE float prob(int32_t i) const {
    return static_cast<float>(static_cast<double>(weight(i)) * inv_total);
  }

  const LogitOf& logit_of;
  float mx;
  bool inf_max;
  float inv_t;
  int32_t kept = 0;
  double inv_total = 0.0;
};

// Sampler::sample_from over prob_of(i), i in [0, n): u = (bits >> 11) * 2^-53 * (the sum of the
// positive probabilities, in double) picks the first entry whose cumulative probability exceeds u
// (the last positive one if rounding leaves u at the very top; 0 if none is positive).
template <class ProbOf>
MS_HOST_DEVICE inline int32_t draw_from(int32_t n, const ProbOf& prob_of, uint64_t bits) {
  double mass = 0.0;
  for (int32_t i = 0; i < n; ++i) {
    const float p = prob_of(i);
    if (p > 0.0f) mass += p;
  }
  const double u = static_cast<double>(bits >> 11) * 0x1.0p-53 * mass;
  double cum = 0.0;
  int32_t last = 0;
  for (int32_t i = 0; i < n; ++i) {
    const float p = prob_of(i);
    if (!(p > 0.0f)) continue;
    cum += p;
    last = i;
    if (u < cum) return i;
  }
  return last;
}

// The samplable entries of a ranked row as the device's top_k_rows leaves it (ids[k], values[k]:
// best first, then id -1 past the non-NaN values; -inf is never sampled): up to the first id -1 or
// -inf value.
MS_HOST_DEVICE inline int32_t ranked_count(const int32_t* ids, const float* values, int32_t k) {
  int32_t n = 0;
  while (n < k && ids[n] >= 0 && values[n] > -INFINITY) ++n;
  return n;
}

// Sampler::uniform: 24 random bits as a float in [0, 1).
MS_HOST_DEVICE inline float uniform_of(uint64_t bits) { return static_cast<float>(bits >> 40) * 0x1.0p-24f; }

// Ranked entries: logit_of(i) for i in [0, n), best first (ties: lower token id first), every
// one finite or +inf (no NaN, no -inf), n >= 1. settings: temperature > 0 with 1 / temperature
// finite; top_p >= 1 is off. bits: one 64-bit draw of the sampler's RNG. Returns the rank drawn,
// in [0, n).
template <class LogitOf>
MS_HOST_DEVICE inline int32_t draw_ranked(int32_t n, const LogitOf& logit_of, DrawSettings settings, uint64_t bits) {
  const RankedProbs<LogitOf> probs(n, logit_of, settings);
  return draw_from(probs.kept, [&](int32_t i) { return probs.prob(i); }, bits);
}

}  // namespace microspec
