#pragma once
// Speculative sampling on a device-resident tree (tree_state.h's step at temperature > 0), as
// plain arrays and functions that one device thread runs and the host tests drive, as
// chain_sampling.h does for a chain. It is the CPU decoder's own procedure (tree.h), so from equal
// logits and a seed it gives the CPU's tokens:
//   - after draft forward f, each expanded row's k children are k draws without replacement from
//     the draft's sampling distribution q over its row, as pick_children draws them: each from q
//     restricted to the tokens not drawn yet (the list of q's positive entries in rank order, a
//     drawn entry replaced by the list's last), with log q(token) as the proposal's
//     log-probability (tree_draw); tree_absorb then makes them candidates and picks the next
//     frontier by score, as for a greedy tree;
//   - the tree keeps the first `total` candidates in the order made (tree_keep_first:
//     TreeBuilder::finish with sampling, since which children a node keeps must not depend on
//     their own draws);
//   - the verification walks the tree as TreeSamplingVerifier does (tree_sample_accept): at a
//     node, its children in order, child x accepted with probability min(1, p(x) / q(x)); after a
//     rejection p <- norm(max(0, p - q)) and q <- q without x, renormalised; with every child
//     rejected (or none) the emitted token is a draw from p. The proof that this emits plain
//     sampling's distribution is tree.cpp's.
// Distributions are kept as ranked rows (top_k_rows' output: ids best first, -1 or -inf past the
// samplable values), from which p and q are recomputed as Sampler::distribution() computes them:
// each draft row's, indexed by the pending slot its forward ran in, and each verification row's.
//
// The random bits are the two samplers' mt19937_64 outputs, read through counters in device
// memory, so each is consumed as the CPU consumes its RNG: the target's (the request's seed) one
// uniform per child tried (none where q(x) is 0) and one draw of the emitted token per step; the
// draft's (sampler.h's draft_sampler_seed) one per child drawn, forward by forward, row by row.
#include <cmath>
#include <cstdint>

#include "sampling/ranked_draw.h"
#include "speculative/chain_sampling.h"
#include "speculative/tree_state.h"
#include "util/host_device.h"

namespace microspec {

struct TreeSampling {
  const DrawSettings* settings = nullptr;  // [1] temperature and top-p (both samplers')
  int32_t k = 0;                           // entries per ranked row: the request's top-k, 1..64
  const int32_t* draft_ids = nullptr;      // [draft_slots()][k] the draft row in pending slot i: its k best ids
  const float* draft_values = nullptr;     // [draft_slots()][k] their logits
  const int32_t* target_ids = nullptr;     // [verify_rows()][k] verification row i's k best
  const float* target_values = nullptr;    // [verify_rows()][k]
  const uint64_t* draft_bits = nullptr;    // the draft sampler's outputs
  int32_t* draft_drawn = nullptr;          // [1] of them consumed
  const uint64_t* target_bits = nullptr;   // the target sampler's outputs
  int32_t* target_drawn = nullptr;         // [1] of them consumed (1 after the first token's draw)
};

// Most draft draws one step of this shape takes: top_k per row of every draft forward.
MS_HOST_DEVICE inline int32_t tree_draft_draws(const TreeShape& shape) { return shape.draft_slots() * shape.top_k; }

// Most draft-sampler draws a device-resident sampling step may take (the device holds them for
// every step of a generation): a chain's, its CPU tree depth + 1 (at most 65); a tree's,
// tree_draft_draws (top-k 8 and depth 7 take 456).
constexpr int32_t kMaxDraftDrawsPerStep = 512;

// Draft forward `forward`'s proposals: for each of its rows that expands a candidate (every row of
// forward 0; a frontier entry of a later one, not a placeholder), top_k draws without replacement
// from q at the row's pending slot, in draw order; token -1 past the draws there were.
MS_HOST_DEVICE inline void tree_draw(const TreeState& s, const TreeSampling& m, int32_t forward) {
  const int32_t k = s.shape.top_k, start = s.shape.draft_start(forward);
  for (int32_t i = 0; i < s.shape.draft_rows(forward); ++i) {
    int32_t* tokens = s.prop_token + i * k;
    float* logprobs = s.prop_logprob + i * k;
    int32_t got = 0;
    if (forward == 0 || s.frontier[i] >= 0) {
      const int32_t slot = start + i;
      const RankedRowProbs q(m.draft_ids + slot * m.k, m.draft_values + slot * m.k, m.k, *m.settings);
      int32_t left[64];  // q's positive entries not drawn yet (Sampler::distribution's list)
      int32_t n_left = 0;
      for (int32_t j = 0; j < q.n; ++j)
        if (q.probs[j] > 0.0f) left[n_left++] = j;
      while (got < k && n_left > 0) {
        const int32_t at =
            draw_from(n_left, [&](int32_t e) { return q.probs[left[e]]; }, m.draft_bits[*m.draft_drawn]);
        *m.draft_drawn += 1;
        tokens[got] = q.ids[left[at]];
        logprobs[got] = logf(q.probs[left[at]]);
        ++got;
        left[at] = left[--n_left];
      }
    }
    for (int32_t j = got; j < k; ++j) {
      tokens[j] = -1;
      logprobs[j] = 0.0f;
    }
  }
}

// After the last draft forward: marks the first `total` candidates in the order made as kept
// (cand_node 1; the rest -1), for tree_lay_out_verification. A parent is made before its children,
// so they form a connected tree.
MS_HOST_DEVICE inline void tree_keep_first(const TreeState& s) {
  int32_t kept = 0;
  for (int32_t c = 0; c < s.shape.candidates(); ++c) {
    const bool keep = s.cand_token[c] >= 0 && kept < s.shape.total;
    s.cand_node[c] = keep ? 1 : -1;
    kept += keep;
  }
}

// After the verification's ranked rows: accepts nodes by recursive rejection sampling (see the top
// of this file), emits the accepted tokens and the drawn one, records the kept rows, the next root
// and the vocabulary's update (tree_commit). Returns the drafts accepted; the drawn token is -1
// when its row has nothing samplable (the host reports it).
MS_HOST_DEVICE inline int32_t tree_sample_accept(const TreeState& s, const TreeSampling& m) {
  const DrawSettings settings = *m.settings;
  int32_t drawn = *m.target_drawn;
  int32_t count = *s.counter, row = 0, a = 0, token = -1;
  s.keep[0] = 0;
  for (;;) {
    RankedRowProbs p(m.target_ids + row * m.k, m.target_values + row * m.k, m.k, settings);
    if (p.n == 0) break;  // nothing samplable: token -1
    int32_t next = 0;     // children come after their parent
    const int32_t first_child = [&] {
      for (int32_t i = row + 1; i <= *s.n_nodes; ++i)
        if (s.parents[i] == row) return i;
      return 0;
    }();
    if (first_child > 0) {
      const int32_t slot = s.row_slot[row];
      RankedRowProbs q(m.draft_ids + slot * m.k, m.draft_values + slot * m.k, m.k, settings);
      for (int32_t i = first_child; i <= *s.n_nodes; ++i) {
        if (s.parents[i] != row) continue;
        const int32_t x = s.tokens[i];
        const float px = p.of(x), qx = q.of(x);
        // Accept with probability min(1, px / qx).
        if (qx > 0.0f && uniform_of(m.target_bits[drawn++]) * qx < px) {
          next = i;
          break;
        }
        // Rejected: p <- norm(max(0, p - q)), and q <- q without x, renormalised.
        p.take_residual(q);
        const double left = 1.0 - static_cast<double>(qx);
        for (int32_t j = 0; j < q.n; ++j)
          if (q.ids[j] == x) q.probs[j] = 0.0f;
        if (left > 0.0) {
          const double inv = 1.0 / left;
          for (int32_t j = 0; j < q.n; ++j) q.probs[j] = static_cast<float>(q.probs[j] * inv);
        }
      }
    }
    if (next == 0) {
      // The emitted token: a draw from p (the residual after the rejections).
      token = p.ids[draw_from(p.n, [&p](int32_t j) { return p.probs[j]; }, m.target_bits[drawn++])];
      break;
    }
    s.out_ids[count++] = s.tokens[next];
    s.keep[++a] = next;
    row = next;
  }
  s.out_ids[count++] = token;
  *m.target_drawn = drawn;
  return tree_commit(s, a, count, token);
}

}  // namespace microspec
