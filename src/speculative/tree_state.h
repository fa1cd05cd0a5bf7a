#pragma once
// The bookkeeping of a greedy EAGLE-2 tree step (speculative/tree.h) as plain arrays and functions
// with one fixed shape per tree, so that a device-resident step (the chain's design,
// speculative/chain_state.h, widened to a tree) can run it between its forwards and be replayed as
// a CUDA graph; the host runs the same functions in tests, with the CPU model doing the forwards.
//
// Shape (TreeShape, from TreeParams with p-min 0): k = top_k children per frontier node, `depth`
// expansion rounds after the root level, `total` kept nodes. A step runs depth + 1 draft forwards
// of the self-drafter (the target's first layers, writing its pending cache slots):
//   - forward 0: the root alone (tokens[0], the last emitted token) at pending slot 0;
//   - forward l (1..depth): the k frontier candidates of level l - 1 at pending slots
//     1 + (l - 1) k + i, each with its parent's slot as its parent (the root's: 0).
// After forward l the caller writes each row's k best draft tokens with their log-probabilities
// (tree.h's top_k_logprobs over the row's draft logits, mapped to token ids; token -1 where the
// row had fewer than k) to prop_token / prop_logprob [row][k], and tree_absorb(l) makes them
// candidates: level 0 the root's k, level l >= 1 k x k (candidate ids in the order made, as
// TreeBuilder makes them; a proposal of a placeholder row or with token -1 is an empty candidate),
// with cumulative scores; the next frontier is level 0's candidates in proposal order, a deeper
// level's k best by score (ties to the earlier id). Frontier entries past the candidates there are
// are placeholders: their rows run token 0 at position n_past + 1 under the root and are ignored.
//
// After the last forward, tree_rank (one call per candidate, independent: one device thread each)
// marks the `total` best candidates by score; tree_lay_out_verification (one thread) numbers them
// in candidate order as the tree's nodes and lays out the verification batch: row 0 the root,
// row 1 + i node i at position n_past + its depth with its parent's row as parent; rows past the
// nodes there are are placeholders never accepted. A greedy tree's child never outranks its parent
// (log-probabilities are <= 0, and a tie goes to the parent's smaller id), so the best `total`
// are a connected tree: exactly TreeBuilder::finish's nodes for the same proposals.
//
// One forward of the target over the 1 + total rows gives pred[i], its argmax at row i;
// tree_accept walks from the root to the first child whose token is the argmax (accept_greedy),
// emits the accepted tokens and the bonus token (tokens[0], the next root), writes the pending
// slots the cache keeps (keep: 0, then 1 + each accepted node, strictly increasing: also the
// accepted verification rows), records the draft vocabulary's update (the tree's tokens,
// verification rows 1..n_nodes, then the target's top K_ver at keep[first_row, + n_rows): every
// accepted row, or the last alone) and the count of tokens after the step (step_counts, as
// chain_accept). The caller then compacts the cache to the kept slots, which
// advances n_past by n_keep (the device's kv_compact; n_past is the cache's own counter), and
// tree_lay_out_root places the next root at the new n_past: draft forward 0's row and
// verification row 0, which is also a plain decode step's batch (the context's end).
//
// An EAGLE-3 head (draft_head/eagle3_head.h) drafts the tree instead of the self-draft with
// TreeHeadBatch's arrays (chain_state.h's head design, widened to a tree). Its cache keeps one row
// per committed position i (the target's features at i with the token at i + 1). A step starts
// with a catch-up forward of max_emitted() rows over the previous verification: row i pairs the
// features of verification row keep[i] with the token emitted after it (the accepted nodes'
// tokens, then the bonus token at row a; rows past a are placeholders: features of row 0, token
// 0), so rows 0..a-1 are the accepted text's rows and row a is the new root row, which proposes
// the root's children (draft forward 0). tree_head_caught_up commits rows 0..a-1, leaving the root
// row as the head's pending slot 0, its parent cleared; draft forward f >= 1 then runs the
// frontier's rows in the head's pending slots draft_start(f) + i with the same parents as the
// self-draft's rows, each fed its parent row's pre-norm output, at the head's positions (the
// target's - 1). tree_commit keeps the root row and lays out the next catch-up. After the prompt
// the first catch-up is row 0 alone (the prompt's last features with the first token).
//
// A separate draft model drafts the tree with TreeDraftModel's arrays (the chain's design,
// chain_state.h: its cache one token behind the target's, so every step has one shape). Its
// pending slots are the self-draft's shifted by one: draft forward 0 runs two rows, the newest
// committed token at position n_past - 1 (slot 0) and the root at n_past (slot 1, its output
// proposing level 0); draft forward f >= 1 runs the frontier's rows at the self-draft's positions
// in slots draft_start(f) + 1 + i, each row's parent the self-draft's + 1. After the acceptance
// of a nodes p_1..p_a its cache keeps a + 1 slots, the target's count: 0, 1, then 1 + the slot of
// each of p_1..p_{a-1} (each was expanded: its child was accepted), which leaves its n_past at
// the target's - 1 again, the newest accepted token (p_a's, or the root's) to run first next step.
#include <cstdint>

#include "speculative/chain_state.h"
#include "util/host_device.h"

namespace microspec {

struct TreeShape {
  int32_t top_k = 1;
  int32_t depth = 0;  // expansion rounds after the root level
  int32_t total = 1;  // nodes kept, at most candidates()

  MS_HOST_DEVICE int32_t candidates() const { return top_k + depth * top_k * top_k; }
  MS_HOST_DEVICE int32_t draft_rows(int32_t forward) const { return forward == 0 ? 1 : top_k; }
  // Pending slot of draft forward `forward`'s first row.
  MS_HOST_DEVICE int32_t draft_start(int32_t forward) const { return forward == 0 ? 0 : 1 + (forward - 1) * top_k; }
  MS_HOST_DEVICE int32_t draft_slots() const { return 1 + depth * top_k; }  // pending slots the drafts use
  MS_HOST_DEVICE int32_t verify_rows() const { return 1 + total; }
  // Pending slots a step uses: the drafts', then the verification's over them.
  MS_HOST_DEVICE int32_t pending_slots() const { return draft_slots() > verify_rows() ? draft_slots() : verify_rows(); }
  MS_HOST_DEVICE int32_t max_emitted() const { return depth + 2; }  // the longest accepted path and the bonus token
  // Whether this is a shape the step takes: top-k 1..64, depth 0..64 (TreeParams' bounds), 1..candidates() nodes.
  MS_HOST_DEVICE bool valid() const {
    return top_k >= 1 && top_k <= 64 && depth >= 0 && depth <= 64 && total >= 1 && total <= candidates();
  }
  bool operator==(const TreeShape& o) const { return top_k == o.top_k && depth == o.depth && total == o.total; }
};

// An EAGLE-3 head's arrays when it drafts the tree (see the top of this file); all null for the
// self-draft.
struct TreeHeadBatch {
  int32_t* catch_tokens = nullptr;     // [max_emitted] the token emitted after each catch-up row, 0: placeholder
  int32_t* catch_rows = nullptr;       // [max_emitted] the verification row whose features it pairs (0: placeholder)
  int32_t* catch_positions = nullptr;  // [max_emitted] the head's n_past + i
  int32_t* catch_parents = nullptr;    // [max_emitted] i - 1
  int32_t* draft_positions = nullptr;  // [top_k] the next draft forward's rows at the head's positions
  int32_t* root_row = nullptr;         // [1] a: the catch-up row that is the step's root
  int32_t* n_past = nullptr;           // [1] its committed cache rows
  int32_t* slot_parents = nullptr;     // [n_ctx] its cache's parent of each slot (the root row's is cleared)
};

// A separate draft model's arrays when it drafts the tree (see the top of this file); all null for
// the other drafters (first tells them apart).
struct TreeDraftModel {
  int32_t* first = nullptr;            // [2] draft forward 0's tokens: the newest committed token, then the root
  int32_t* first_positions = nullptr;  // [2] n_past - 1, n_past (the target's n_past)
  int32_t* first_parents = nullptr;    // [2] -1, 0
  int32_t* first_output = nullptr;     // [1] 1: the root's row
  int32_t* parents = nullptr;          // [top_k] a level forward's rows: their parents' pending slots in its cache
  int32_t* keep = nullptr;             // [max_emitted] pending slots its cache keeps (n_keep of them, as the target's;
                                       // its cache's compaction moves its n_past to the target's - 1)
};

struct TreeState {
  // The next draft forward's rows (forward 0: row 0 only).
  int32_t* draft_tokens = nullptr;     // [top_k]
  int32_t* draft_positions = nullptr;  // [top_k]
  int32_t* draft_parents = nullptr;    // [top_k] pending index of the parent, -1 = the prefix only
  // The last draft forward's proposals: each row's k best, best first (or, sampling, its k draws:
  // tree_sampling.h's tree_draw).
  int32_t* prop_token = nullptr;   // [top_k][top_k] token ids, -1 = none
  float* prop_logprob = nullptr;   // [top_k][top_k] <= 0
  // Every candidate of the step, in the order made.
  int32_t* cand_token = nullptr;   // [candidates] -1 = empty
  int32_t* cand_parent = nullptr;  // [candidates] candidate id, -1 = the root
  int32_t* cand_depth = nullptr;   // [candidates] 1 = a child of the root
  float* cand_score = nullptr;     // [candidates] cumulative draft log-probability
  int32_t* cand_slot = nullptr;    // [candidates] pending slot of its draft row once expanded
  int32_t* cand_node = nullptr;    // [candidates] node index, -1 = not kept (tree_rank: 1 = kept)
  int32_t* frontier = nullptr;     // [top_k] candidates the next forward expands, -1 = placeholder
  // The verification batch: the root, then the nodes in candidate order.
  int32_t* tokens = nullptr;       // [1 + total]
  int32_t* positions = nullptr;    // [1 + total]
  int32_t* parents = nullptr;      // [1 + total] pending index (row) of the parent
  int32_t* output_rows = nullptr;  // [1 + total] i
  int32_t* n_nodes = nullptr;      // [1] nodes in the tree (rows past 1 + n_nodes are placeholders)
  int32_t* row_slot = nullptr;     // [1 + total] pending slot of the draft row that expanded row i (the root's: 0), -1: none
  const int32_t* pred = nullptr;   // [1 + total] the target's argmax per verification row
  int32_t* keep = nullptr;         // [depth + 2] pending slots the cache keeps, in order (= the accepted rows)
  int32_t* n_keep = nullptr;       // [1]
  int32_t* n_past = nullptr;       // [1] committed cache slots
  int32_t* out_ids = nullptr;      // [capacity] emitted tokens
  int32_t* counter = nullptr;      // [1] entries of out_ids
  VocabUpdate* update = nullptr;   // [1] n_tree tree tokens (tokens[1..]), K_ver rows keep[first_row, + n_rows)
  int32_t* steps = nullptr;        // [1]
  int32_t* step_counts = nullptr;  // [capacity] *counter after each step
  TreeShape shape;
  int32_t kver_last_only = 0;  // 1: K_ver of the last accepted row only
  TreeHeadBatch head;          // an EAGLE-3 head's; all null for the self-draft
  TreeDraftModel draft;        // a separate draft model's; all null for the other drafters
};

// An EAGLE-3 head's next catch-up, after a step that kept rows keep[0..a] and emitted their next
// tokens into out_ids[count - a - 1, count): the root row committed, rows 0..a pairing the kept
// rows' features with those tokens, placeholders past them.
MS_HOST_DEVICE inline void tree_head_lay_out_catch_up(const TreeState& s, int32_t a, int32_t count) {
  const TreeHeadBatch& h = s.head;
  *h.root_row = a;
  for (int32_t i = 0; i < s.shape.max_emitted(); ++i) {
    const bool real = i <= a;
    h.catch_rows[i] = real ? s.keep[i] : 0;
    h.catch_tokens[i] = real ? s.out_ids[count - a - 1 + i] : 0;
    h.catch_positions[i] = *h.n_past + i;
  }
}

// After an EAGLE-3 head's catch-up forward of a tree step: head_commit_before_root (chain_state.h).
MS_HOST_DEVICE inline void tree_head_caught_up(const TreeState& s) {
  head_commit_before_root(s.head.n_past, *s.head.root_row, s.head.slot_parents);
}

// The root (tokens[0]) at n_past: draft forward 0's row and verification row 0 (a draft model's
// forward 0: the newest committed token, which tree_commit left in draft.first[0], then the root).
MS_HOST_DEVICE inline void tree_lay_out_root(const TreeState& s) {
  s.draft_tokens[0] = s.tokens[0];
  s.draft_positions[0] = *s.n_past;
  s.draft_parents[0] = -1;
  s.positions[0] = *s.n_past;
  s.parents[0] = -1;
  const TreeDraftModel& d = s.draft;
  if (d.first) {
    d.first[1] = s.tokens[0];
    d.first_positions[0] = *s.n_past - 1;
    d.first_positions[1] = *s.n_past;
  }
}

// After the prompt (tokens[0], out_ids[0] and *counter are the prompt's argmax, already emitted):
// what never moves (output rows), the root, no update pending.
// With a head, its cache holds the prompt's rows but the last, and the first catch-up is the root
// row alone (the caller leaves the prompt's last features at verification row 0's). With a draft
// model, its cache holds the prompt but the last token, which the caller left in draft.first[0].
MS_HOST_DEVICE inline void tree_begin(const TreeState& s) {
  for (int32_t i = 0; i < s.shape.verify_rows(); ++i) s.output_rows[i] = i;
  const TreeDraftModel& d = s.draft;
  if (d.first) {
    d.first_parents[0] = -1;
    d.first_parents[1] = 0;
    *d.first_output = 1;
  }
  tree_lay_out_root(s);
  *s.update = VocabUpdate{};
  *s.n_keep = 0;
  *s.steps = 0;
  if (s.head.n_past) {
    for (int32_t i = 0; i < s.shape.max_emitted(); ++i) s.head.catch_parents[i] = i - 1;
    s.keep[0] = 0;
    tree_head_lay_out_catch_up(s, 0, *s.counter);
  }
}

// Whether candidate a ranks before candidate b: a higher score, then the earlier id.
MS_HOST_DEVICE inline bool tree_ranks_before(const TreeState& s, int32_t a, int32_t b) {
  const float sa = s.cand_score[a], sb = s.cand_score[b];
  return sa > sb || (sa == sb && a < b);
}

// Takes draft forward `forward`'s proposals as candidates, picks the next frontier and lays out
// the next forward's rows (none after the last).
MS_HOST_DEVICE inline void tree_absorb(const TreeState& s, int32_t forward) {
  const int32_t k = s.shape.top_k;
  // 1. The candidates: the root's k, or k per frontier row.
  const int32_t first = forward == 0 ? 0 : k + (forward - 1) * k * k;
  const int32_t n_new = forward == 0 ? k : k * k;
  for (int32_t c = first; c < first + n_new; ++c) {
    const int32_t row = (c - first) / k, parent = forward == 0 ? -1 : s.frontier[row];
    const int32_t token = forward > 0 && parent < 0 ? -1 : s.prop_token[c - first];
    s.cand_token[c] = token;
    s.cand_parent[c] = parent;
    s.cand_depth[c] = parent < 0 ? 1 : s.cand_depth[parent] + 1;
    s.cand_score[c] = (parent < 0 ? 0.0f : s.cand_score[parent]) + (token < 0 ? 0.0f : s.prop_logprob[c - first]);
    s.cand_slot[c] = -1;
  }
  // 2. The next frontier: level 0's candidates in order, a deeper level's k best (an insertion
  //    into a list of at most k, best first).
  int32_t n_front = 0;
  for (int32_t c = first; c < first + n_new; ++c) {
    if (s.cand_token[c] < 0) continue;
    if (forward == 0) {
      s.frontier[n_front++] = c;
      continue;
    }
    if (n_front == k && !tree_ranks_before(s, c, s.frontier[k - 1])) continue;
    int32_t at = n_front < k ? n_front++ : k - 1;
    while (at > 0 && tree_ranks_before(s, c, s.frontier[at - 1])) {
      s.frontier[at] = s.frontier[at - 1];
      --at;
    }
    s.frontier[at] = c;
  }
  for (int32_t i = n_front; i < k; ++i) s.frontier[i] = -1;
  if (forward == s.shape.depth) return;
  // 3. The next forward: frontier row i in pending slot draft_start(forward + 1) + i.
  const int32_t start = s.shape.draft_start(forward + 1), n_past = *s.n_past;
  for (int32_t i = 0; i < k; ++i) {
    const int32_t c = s.frontier[i];
    if (c < 0) {
      s.draft_tokens[i] = 0;
      s.draft_positions[i] = n_past + 1;
      s.draft_parents[i] = 0;
      continue;
    }
    s.cand_slot[c] = start + i;
    const int32_t parent = s.cand_parent[c];
    s.draft_tokens[i] = s.cand_token[c];
    s.draft_positions[i] = n_past + s.cand_depth[c];
    s.draft_parents[i] = parent < 0 ? 0 : s.cand_slot[parent];
  }
  if (s.head.n_past)  // the head's rows: one position behind the target's
    for (int32_t i = 0; i < k; ++i) s.head.draft_positions[i] = s.draft_positions[i] - 1;
  if (s.draft.first)  // a draft model's slots: the self-draft's behind its newest committed token
    for (int32_t i = 0; i < k; ++i) s.draft.parents[i] = s.draft_parents[i] + 1;
}

// Marks candidate c kept (cand_node[c] = 1) when it is among the `total` best, else -1.
MS_HOST_DEVICE inline void tree_rank(const TreeState& s, int32_t c) {
  int32_t before = 0;
  if (s.cand_token[c] >= 0)
    for (int32_t o = 0; o < s.shape.candidates(); ++o) before += s.cand_token[o] >= 0 && tree_ranks_before(s, o, c);
  s.cand_node[c] = s.cand_token[c] >= 0 && before < s.shape.total ? 1 : -1;
}

// Numbers the kept candidates (tree_rank) as nodes in candidate order and lays out the
// verification batch, with the draft slot that expanded each row (row_slot).
MS_HOST_DEVICE inline void tree_lay_out_verification(const TreeState& s) {
  const int32_t n_past = *s.n_past;
  int32_t n = 0;
  for (int32_t c = 0; c < s.shape.candidates(); ++c) {
    if (s.cand_node[c] < 0) continue;
    const int32_t parent = s.cand_parent[c];
    s.cand_node[c] = n;
    s.tokens[1 + n] = s.cand_token[c];
    s.positions[1 + n] = n_past + s.cand_depth[c];
    s.parents[1 + n] = parent < 0 ? 0 : 1 + s.cand_node[parent];
    s.row_slot[1 + n] = s.cand_slot[c];
    ++n;
  }
  *s.n_nodes = n;
  s.row_slot[0] = 0;
  for (int32_t i = 1 + n; i < s.shape.verify_rows(); ++i) {
    s.tokens[i] = 0;
    s.positions[i] = n_past + 1;
    s.parents[i] = 0;
    s.row_slot[i] = -1;
  }
}

// After an acceptance that kept rows keep[0..a] (the root and the accepted path) and emitted
// out_ids up to `count` (the accepted tokens, then next_root): records the keep list's length, the
// next root, a draft model's slots to keep and its next first token, the vocabulary's update and
// the step's count. Returns a.
MS_HOST_DEVICE inline int32_t tree_commit(const TreeState& s, int32_t a, int32_t count, int32_t next_root) {
  *s.n_keep = a + 1;
  *s.counter = count;
  const TreeDraftModel& d = s.draft;
  if (d.first) {  // a + 1 slots: the newest committed token's, then the root's and p_1..p_{a-1}'s, one further on
    for (int32_t i = 0; i <= a; ++i) d.keep[i] = i == 0 ? 0 : 1 + s.row_slot[s.keep[i - 1]];
    d.first[0] = s.tokens[s.keep[a]];  // the newest accepted token (the root's when a = 0)
  }
  s.tokens[0] = next_root;
  if (s.head.n_past) {  // the root row is kept; the next catch-up follows it
    *s.head.n_past += 1;
    tree_head_lay_out_catch_up(s, a, count);
  }
  s.update->n_tree = *s.n_nodes;
  s.update->first_row = s.kver_last_only ? a : 0;
  s.update->n_rows = s.kver_last_only ? 1 : a + 1;
  s.step_counts[*s.steps] = count;
  *s.steps += 1;
  return a;
}

// After the verification: accepts, emits, records the slots to keep and the vocabulary's update
// (see the top of this file for what the caller does next). Returns the drafts accepted. out_ids
// must have room for max_emitted() more entries.
MS_HOST_DEVICE inline int32_t tree_accept(const TreeState& s) {
  int32_t count = *s.counter, row = 0, a = 0;
  s.keep[0] = 0;
  for (;;) {
    const int32_t want = s.pred[row];
    s.out_ids[count++] = want;
    int32_t next = 0;  // children come after their parent
    for (int32_t i = row + 1; i <= *s.n_nodes && next == 0; ++i)
      if (s.parents[i] == row && s.tokens[i] == want) next = i;
    if (next == 0) break;
    s.keep[++a] = next;
    row = next;
  }
  return tree_commit(s, a, count, s.pred[row]);
}

}  // namespace microspec
