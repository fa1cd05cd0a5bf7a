#pragma once
// The bookkeeping of a speculative chain step as plain arrays and functions (no allocation,
// exceptions or standard library), so that one piece of code runs inside one device thread after
// each verification (src/cuda's device-resident speculative step: the drafts, the acceptance and
// the next batch never visit the host, so the step can be replayed as a CUDA graph) and on the
// host, where tests drive it.
//
// A step's batch is a chain: tokens[0] is the last token emitted (the target's own prediction, not
// yet in the cache), tokens[1 + i] is draft i (i < depth); token i sits at position n_past + i with
// token i - 1 as its parent. One forward of the target over the batch gives pred[i], its argmax
// after tokens[0..i]. chain_accept then:
//   - accepts a = the longest prefix of drafts equal to pred (none when the drafts were
//     placeholders: a draft vocabulary with no rows yet);
//   - emits drafts 0..a-1 and pred[a] into out_ids (greedy decoding would have produced exactly
//     these, since pred[i] is the target's token after a prefix it accepted);
//   - keeps the batch's first a + 1 cache slots: *n_past += a + 1 (a prefix of the pending
//     slots, so nothing moves);
//   - starts the next batch: tokens[0] = pred[a], positions from the new n_past;
//   - records the dynamic vocabulary's next update: the chain's drafts (when real) and the
//     verification rows whose top K_ver the candidate stream appends (rows 0..a, or row a only);
//   - with a separate draft model, lays out its next batch too (DraftModelBatch).
//
// A separate draft model keeps its own cache one token behind the target's: each chain starts
// with a fixed two-token forward of the drafter, [the last committed token, tokens[0]] at
// positions n_past - 1 and n_past, so a step has the same shape whatever the previous one
// accepted (the drafter has run every accepted token but the newest; re-running one token is
// cheaper than a shape that depends on the acceptance). Drafts d >= 1 then run tokens[d] at the
// drafter's pending slot d + 1. After acceptance the drafter keeps its slots for the accepted
// text but the newest token: its n_past is the target's minus one.
//
// An EAGLE-3 draft head (draft_head/eagle3_head.h) keeps one cache row per committed position i
// (the target's features at i with the token at i + 1). Its step has one shape too: it starts with
// a catch-up forward of depth + 1 rows over the previous verification, row i pairing the features
// of verification row i with pred[i]. With a the drafts that verification accepted, pred[i] is the
// token at the row's next position for every i <= a (accepted drafts for i < a, the target's own
// token at a), so rows 0..a-1 are the accepted text's rows and row a is this step's root row (the
// features before the newest token, with it): it drafts the first token. The catch-up commits
// rows 0..a-1 (chain_head_caught_up), leaving the root row as the head's first pending slot, its
// parent cleared; draft d >= 1 runs tokens[d] in pending slot d, fed the previous row's output.
// chain_accept then commits the root row (its features were the target's) and drops the others.
// After the prompt the first catch-up is the root row alone (row 0: the prompt's last features
// with the first generated token; the other rows finite placeholders), with a = 0.
//
// The host looks at the emitted tokens only every few steps, so steps may run after the one that
// emitted the text's last token (a stop token, the last one wanted, where a stop string ends). Each
// step records the count of tokens after it (step_counts); chain_totals_until turns that log and the
// count of tokens the host kept into the counts of the steps that emitted them, as the CPU decoder
// counts them, wherever the text ended. The steps after it only write past what the host kept.
#include <cstdint>

#include "util/host_device.h"

namespace microspec {

// What the draft vocabulary's next step appends (vocab/candidate_stream.h's step): the chain's
// first n_tree drafts, then the target's top K_ver at verification rows [first_row, first_row + n_rows).
struct VocabUpdate {
  int32_t n_tree = 0;
  int32_t first_row = 0;
  int32_t n_rows = 0;
};

// The counts of a generation's steps (chain_totals_until).
struct ChainTotals {
  int32_t steps = 0;     // verifications
  int32_t accepted = 0;  // drafts accepted in all
};

// A separate draft model's batch arrays and cache counter (see the top of this file).
struct DraftModelBatch {
  int32_t* first = nullptr;        // [2] its first forward: the last committed token, then tokens[0]
  int32_t* positions = nullptr;    // [depth + 1] n_past - 1 + i (the target's n_past)
  int32_t* parents = nullptr;      // [depth + 1] i - 1
  int32_t* output_rows = nullptr;  // [2] 1 (the first forward's row of tokens[0]), then 0 (one-token forwards)
  int32_t* n_past = nullptr;       // [1] its committed cache slots: the target's n_past - 1
};

// An EAGLE-3 head's batch arrays and cache counter (see the top of this file).
struct HeadBatch {
  int32_t* catch_positions = nullptr;  // [depth + 1] the catch-up rows: the head's n_past + i
  int32_t* catch_parents = nullptr;    // [depth + 1] i - 1
  int32_t* draft_positions = nullptr;  // [depth + 1] draft d's row (d >= 1) at index d: n_past + d after the catch-up
  int32_t* draft_parents = nullptr;    // [depth + 1] d - 1 at index d
  int32_t* root_row = nullptr;         // [1] a: the catch-up row that is the step's root
  int32_t* n_past = nullptr;           // [1] its committed cache rows
  int32_t* slot_parents = nullptr;     // [n_ctx] its cache's parent of each slot (the root row's is cleared)
};

struct ChainState {
  int32_t* tokens = nullptr;       // [depth + 1] the batch: last emitted token, then the drafts
  int32_t* positions = nullptr;    // [depth + 1] n_past + i
  int32_t* parents = nullptr;      // [depth + 1] i - 1 (pending index of the parent)
  int32_t* output_rows = nullptr;  // [depth + 1] i (every row is verified)
  // [depth + 1] the token that follows each batch row: the target's argmax (chain_accept reads it),
  // or the accepted drafts and the drawn token chain_sample_accept writes (chain_sampling.h).
  int32_t* pred = nullptr;
  // The draft vocabulary's rows in use while the chain was drafted; null for the full head. When
  // it is 0 the drafts are placeholders (the draft head had nothing to choose from).
  const int32_t* draft_rows = nullptr;
  int32_t* n_past = nullptr;   // [1] committed cache slots
  int32_t* out_ids = nullptr;  // [capacity] emitted tokens
  int32_t* counter = nullptr;  // [1] entries of out_ids
  VocabUpdate* update = nullptr;  // [1]
  int32_t* steps = nullptr;        // [1] steps accepted so far
  int32_t* step_counts = nullptr;  // [capacity] *counter after each step; capacity: one per emitted token
  DraftModelBatch draft;  // a separate draft model's; all null for the self-draft
  HeadBatch head;         // an EAGLE-3 head's; all null for the other drafters
  int32_t depth = 0;
  int32_t kver_last_only = 0;  // 1: K_ver of the last accepted row only (KverRows::Last); 0: of every accepted row
};

// What moves in the batches when the target's n_past moves to n_past: the positions, and the
// draft model's second token, positions and cache (its first token is the caller's: the one at
// n_past - 1).
MS_HOST_DEVICE inline void chain_move_to(const ChainState& s, int32_t n_past) {
  for (int32_t i = 0; i <= s.depth; ++i) s.positions[i] = n_past + i;
  const DraftModelBatch& d = s.draft;
  if (!d.n_past) return;
  d.first[1] = s.tokens[0];
  for (int32_t i = 0; i <= s.depth; ++i) d.positions[i] = n_past - 1 + i;
  *d.n_past = n_past - 1;
}

// Lays out the first batch after the prompt (tokens[0], out_ids[0] and *counter are the prompt's
// argmax, already emitted): positions, parents and output rows, and the draft model's (whose cache
// holds the prompt but its last token, which the caller left in draft.first[0]); no vocabulary
// update pending.
MS_HOST_DEVICE inline void chain_begin(const ChainState& s) {
  // What never moves: each token the parent of the next, every row verified; the draft model's
  // first forward outputs its second row, its one-token forwards their only one.
  for (int32_t i = 0; i <= s.depth; ++i) {
    s.parents[i] = i - 1;
    s.output_rows[i] = i;
  }
  if (s.draft.n_past) {
    for (int32_t i = 0; i <= s.depth; ++i) s.draft.parents[i] = i - 1;
    s.draft.output_rows[0] = 1;
    s.draft.output_rows[1] = 0;
  }
  const HeadBatch& h = s.head;
  if (h.n_past) {  // its cache holds the prompt's rows but the last (the caller's), the root row is catch-up row 0
    for (int32_t i = 0; i <= s.depth; ++i) {
      h.catch_parents[i] = i - 1;
      h.catch_positions[i] = *h.n_past + i;
      h.draft_parents[i] = i - 1;
    }
    *h.root_row = 0;
  }
  chain_move_to(s, *s.n_past);
  *s.update = VocabUpdate{};
  *s.steps = 0;
}

// Emits and commits a step that accepted a of n_drafts drafts (the drafts real: n_drafts = depth;
// placeholders: 0), with pred[0..a] the tokens that follow batch rows 0..a (pred[i] = draft i for
// i < a, pred[a] the target's own token): emits drafts 0..a-1 and pred[a], commits the batch's
// first a + 1 slots, lays out the next batch and records the vocabulary's update (see the top of
// this file). Returns a.
MS_HOST_DEVICE inline int32_t chain_commit(const ChainState& s, int32_t a, int32_t n_drafts) {
  int32_t count = *s.counter;
  for (int32_t i = 0; i < a; ++i) s.out_ids[count++] = s.tokens[1 + i];
  s.out_ids[count++] = s.pred[a];
  *s.counter = count;
  const int32_t n_past = *s.n_past + a + 1;
  *s.n_past = n_past;
  if (s.draft.n_past) s.draft.first[0] = s.tokens[a];  // the newest accepted token: tokens[0] or draft a - 1
  const HeadBatch& h = s.head;
  if (h.n_past) {  // the root row is kept; the next catch-up follows it
    *h.n_past += 1;
    *h.root_row = a;
    for (int32_t i = 0; i <= s.depth; ++i) h.catch_positions[i] = *h.n_past + i;
  }
  s.tokens[0] = s.pred[a];
  chain_move_to(s, n_past);
  s.update->n_tree = n_drafts;
  s.update->first_row = s.kver_last_only ? a : 0;
  s.update->n_rows = s.kver_last_only ? 1 : a + 1;
  s.step_counts[*s.steps] = count;
  *s.steps += 1;
  return a;
}

// Whether the chain's drafts are real: not placeholders from a draft vocabulary with no rows.
MS_HOST_DEVICE inline bool chain_drafts_real(const ChainState& s) { return s.draft_rows == nullptr || *s.draft_rows > 0; }

// After the verification of the batch: accepts the longest prefix of drafts equal to the target's
// argmax, then emits, commits and lays out the next batch (chain_commit). Returns a, the drafts
// accepted. out_ids must have room for depth + 1 more entries and the context for the next batch:
// the caller sizes the steps it runs.
MS_HOST_DEVICE inline int32_t chain_accept(const ChainState& s) {
  const int32_t n_drafts = chain_drafts_real(s) ? s.depth : 0;
  int32_t a = 0;
  while (a < n_drafts && s.tokens[1 + a] == s.pred[a]) ++a;
  return chain_commit(s, a, n_drafts);
}

// The counts of the steps that emitted the first n_kept tokens of out_ids (the prompt's argmax
// and what the steps emitted: the text the host kept), from step_counts[0, n_steps): the steps up
// to the first whose count reaches n_kept, and their accepted drafts (each step emits its accepted
// drafts and one token more).
MS_HOST_DEVICE inline ChainTotals chain_totals_until(const int32_t* step_counts, int32_t n_steps, int32_t n_kept) {
  ChainTotals t;
  for (int32_t i = 0; i < n_steps && (i == 0 ? 1 : step_counts[i - 1]) < n_kept; ++i) {
    t.steps = i + 1;
    t.accepted = step_counts[i] - 1 - t.steps;
  }
  return t;
}

// An EAGLE-3 head's catch-up forward done (the chain's and the tree's): commits its rows before
// the root row (root_row of them), so the root row is the first pending slot, and clears that
// slot's parent (it was row root_row - 1 of the catch-up, now committed). Returns the new n_past.
MS_HOST_DEVICE inline int32_t head_commit_before_root(int32_t* n_past, int32_t root_row, int32_t* slot_parents) {
  *n_past += root_row;
  slot_parents[*n_past] = -1;
  return *n_past;
}

// After an EAGLE-3 head's catch-up forward: head_commit_before_root, then the drafts' rows laid out
// behind the root row.
MS_HOST_DEVICE inline void chain_head_caught_up(const ChainState& s) {
  const HeadBatch& h = s.head;
  const int32_t n_past = head_commit_before_root(h.n_past, *h.root_row, h.slot_parents);
  for (int32_t d = 1; d <= s.depth; ++d) h.draft_positions[d] = n_past + d;
}

}  // namespace microspec
