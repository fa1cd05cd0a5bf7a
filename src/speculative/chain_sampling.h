#pragma once
// Speculative sampling on a device-resident chain (chain_state.h's step at temperature > 0), as
// plain arrays and functions that one device thread runs and the host tests drive, like
// chain_state.h's. It is the CPU decoder's own procedure on a chain, so from equal logits and a
// seed it gives the CPU's tokens:
//   - each draft is a draw from the draft's sampling distribution q over its row (the request's
//     top-k, top-p and temperature; sampling/ranked_draw.h), as tree.h's pick_children draws a
//     chain's one child (chain_draw);
//   - the verification walks the chain as tree.h's TreeSamplingVerifier does: draft i is accepted
//     with probability min(1, p(x) / q(x)), p the target's distribution at row i; the first
//     rejection draws the emitted token from norm(max(0, p - q)), and a chain accepted whole
//     draws it from p at the last row (chain_sample_accept). The proof that this emits plain
//     sampling's distribution is tree.cpp's.
// The distributions are kept as each row's ranked k best (top_k_rows' output on the device: ids
// best first, -1 or -inf past the samplable values), from which p and q are recomputed exactly
// as Sampler::distribution() computes them.
//
// The random bits are the two samplers' mt19937_64 outputs, made on the host in order and read
// through counters in device memory, so each is consumed as the CPU consumes its RNG:
//   - the target's (the request's seed): the first token's draw (draw 0), then per step one
//     uniform per draft tried and one draw of the emitted token;
//   - the draft's (sampler.h's draft_sampler_seed, the CPU decoder's): draws_per_step per step whose
//     drafts are real, none for placeholders. The CPU's chain is a top-k 1 tree of depth D whose
//     builder draws a child for every expanded row, D + 1 per step, and keeps the first `depth`,
//     so draws_per_step may exceed depth (the draws past it are skipped, not made).
#include <cmath>
#include <cstdint>

#include "sampling/ranked_draw.h"
#include "speculative/chain_state.h"
#include "util/host_device.h"

namespace microspec {

struct ChainSampling {
  const DrawSettings* settings = nullptr;  // [1] temperature and top-p (both samplers')
  int32_t k = 0;                           // entries per ranked row: the top-k, 1..64
  const int32_t* draft_ids = nullptr;      // [depth][k] draft row d's k best as token ids, best first
  const float* draft_values = nullptr;     // [depth][k] their logits
  const int32_t* target_ids = nullptr;     // [depth + 1][k] verification row i's k best
  const float* target_values = nullptr;    // [depth + 1][k]
  const uint64_t* draft_bits = nullptr;    // the draft sampler's outputs, draws_per_step per real step
  int32_t* draft_drawn = nullptr;          // [1] of them consumed
  int32_t draws_per_step = 0;              // >= depth
  const uint64_t* target_bits = nullptr;   // the target sampler's outputs
  int32_t* target_drawn = nullptr;         // [1] of them consumed (1 after the first token's draw)
};

// One ranked row's sampling distribution, kept: probs[i] for ids[i], i < n (0 past top-p's cut).
struct RankedRowProbs {
  const int32_t* ids = nullptr;
  int32_t n = 0;
  float probs[64];

  MS_HOST_DEVICE RankedRowProbs(const int32_t* ids_, const float* values, int32_t k, DrawSettings settings)
      : ids(ids_), n(ranked_count(ids_, values, k)) {
    if (n == 0) return;
    const auto logit_of = [values](int32_t i) { return values[i]; };
    const RankedProbs<decltype(logit_of)> p(n, logit_of, settings);
    for (int32_t i = 0; i < n; ++i) probs[i] = i < p.kept ? p.prob(i) : 0.0f;
  }
  // The probability of token id (0 when the row does not keep it).
  MS_HOST_DEVICE float of(int32_t id) const {
    for (int32_t i = 0; i < n; ++i)
      if (ids[i] == id) return probs[i];
    return 0.0f;
  }
  // After a draft from q is rejected: this (p) <- norm(max(0, p - q)), on p's support; a residual
  // of 0 (p == q, a rejection only rounding allows) keeps p. TreeSamplingVerifier's step.
  MS_HOST_DEVICE void take_residual(const RankedRowProbs& q) {
    float rest[64];  // max(0, p - q) per entry of p
    double residual = 0.0;
    for (int32_t i = 0; i < n; ++i) {
      rest[i] = fmaxf(0.0f, probs[i] - q.of(ids[i]));
      residual += rest[i];
    }
    if (residual > 0.0) {
      const double inv = 1.0 / residual;
      for (int32_t i = 0; i < n; ++i) probs[i] = static_cast<float>(rest[i] * inv);
    }
  }
};

// Draft d (d < depth): tokens[1 + d] = a draw from q at draft row d with the step's draw d of the
// draft sampler. Placeholders (token 0) when the drafts are not real or the row has nothing
// samplable (every logit NaN or -inf: q is then empty, and acceptance rejects the token without a
// draw, emitting a draw from p).
MS_HOST_DEVICE inline void chain_draw(const ChainState& s, const ChainSampling& m, int32_t d) {
  const int32_t* ids = m.draft_ids + d * m.k;
  const float* values = m.draft_values + d * m.k;
  const int32_t n = chain_drafts_real(s) ? ranked_count(ids, values, m.k) : 0;
  if (n == 0) {
    s.tokens[1 + d] = 0;
    return;
  }
  const auto logit_of = [values](int32_t i) { return values[i]; };
  s.tokens[1 + d] = ids[draw_ranked(n, logit_of, *m.settings, m.draft_bits[*m.draft_drawn + d])];
}

// After the verification's ranked rows: accepts drafts by rejection sampling (see the top of this
// file), writes the accepted drafts and the drawn token into pred[0..a], then emits, commits and
// lays out the next batch (chain_commit). Returns a; the drawn token is -1 when its row has nothing
// samplable (the host reports it).
MS_HOST_DEVICE inline int32_t chain_sample_accept(const ChainState& s, const ChainSampling& m) {
  const bool real = chain_drafts_real(s);
  const int32_t n_drafts = real ? s.depth : 0;
  const DrawSettings settings = *m.settings;
  int32_t drawn = *m.target_drawn;
  int32_t a = 0;
  int32_t token = -1;
  for (;; ++a) {
    RankedRowProbs p(m.target_ids + a * m.k, m.target_values + a * m.k, m.k, settings);
    if (p.n == 0) break;  // nothing samplable: token -1
    if (a < n_drafts) {
      const int32_t x = s.tokens[1 + a];
      const RankedRowProbs q(m.draft_ids + a * m.k, m.draft_values + a * m.k, m.k, settings);
      const float px = p.of(x), qx = q.of(x);
      // Accept with probability min(1, px / qx).
      if (qx > 0.0f && uniform_of(m.target_bits[drawn++]) * qx < px) {
        s.pred[a] = x;
        continue;
      }
      p.take_residual(q);  // rejected: p <- norm(max(0, p - q))
    }
    // The emitted token: a draw from p (the residual after a rejection).
    token = p.ids[draw_from(p.n, [&p](int32_t i) { return p.probs[i]; }, m.target_bits[drawn++])];
    break;
  }
  s.pred[a] = token;
  *m.target_drawn = drawn;
  if (real) *m.draft_drawn += m.draws_per_step;
  return chain_commit(s, a, n_drafts);
}

}  // namespace microspec
