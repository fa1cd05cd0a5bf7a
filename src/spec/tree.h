#pragma once
// EAGLE-2 dynamic draft trees and greedy tree verification.
//
// Tree construction (as EAGLE-2's authors implement it): the root's top-k draft tokens form the
// first level; then for `depth` rounds every frontier node proposes its top-k children, scored by
// cumulative draft log-probability (parent's score + own log-probability), and the next frontier
// is the global top-k of those k*k children. Every proposed node is a candidate; the tree keeps
// the `total_tokens` best candidates by score. A child's score never exceeds its parent's (log
// probabilities are <= 0) and ties rank the earlier candidate first, so a parent always ranks
// before its children and the kept set is a connected tree. top_k = 1 gives a chain.
#include <cstdint>
#include <span>
#include <vector>

namespace microspec {

// Defaults measured on 2 cores (5 SpecBench chat prompts, 128 tokens, self-drafting with
// n_layer - n_layer/8 layers): a chain of 4 beat every tree tried. A tree's extra frontier rows
// cost a draft LM head each (Gemma: 262144 rows) and extra verification rows, while the second-
// best branches rarely win: Gemma 16/18 layers: chain 3/4 tokens 95 tok/s (acceptance 4.3),
// k2 d3 t6 79 tok/s (4.4); SmolLM2 27/30 layers: chain 88 tok/s (1.8), k2 d3 t6 74 tok/s (2.0).
struct TreeParams {
  int32_t depth = 3;         // expansion rounds after the root level: nodes have depth 1..depth+1
  int32_t top_k = 1;         // children proposed per frontier node, and frontier width
  int32_t total_tokens = 4;  // draft nodes kept (the root is not counted)

  void validate() const;  // throws Error on values outside 0 <= depth, 1 <= top_k, 0 <= total_tokens
  // Most nodes a drafter runs through its model for one tree: the root plus `depth` frontiers.
  int32_t max_draft_rows() const { return 1 + depth * top_k; }
};

struct TreeNode {
  int32_t token = 0;
  int32_t parent = -1;     // index of the parent node, -1 = the root
  int32_t depth = 1;       // 1 = child of the root
  float score = 0.0f;      // cumulative draft log-probability of the path root -> node
  int32_t candidate = -1;  // the builder's candidate id (drafters map it to their cache slots)
};

// Nodes in candidate order: parents come before their children.
struct DraftTree {
  std::vector<TreeNode> nodes;
  int32_t size() const { return static_cast<int32_t>(nodes.size()); }
  void clear() { nodes.clear(); }
};

struct Proposal {
  int32_t token;
  float logprob;  // draft log-probability given the path to its parent, <= 0
};

// The drafter's side of tree construction: runs candidates through its draft model and proposes
// their children.
class TreeExpander {
 public:
  virtual ~TreeExpander() = default;
  // Runs the candidates `frontier` (ids from the builder, -1 = the root) through the draft in one
  // pass and writes each one's k best next tokens, best first, to out[i * k, i * k + k).
  // `cand` gives every candidate's token, parent candidate and depth so far.
  virtual void expand(std::span<const int32_t> frontier, std::span<const TreeNode> cand, int32_t k,
                      Proposal* out) = 0;
};

// Builds the EAGLE-2 tree. Allocates only on growth: keep one builder per generation.
class TreeBuilder {
 public:
  void build(const TreeParams& params, TreeExpander& expander, DraftTree& tree);

 private:
  std::vector<TreeNode> cand_;       // all candidates; .parent is a candidate id here
  std::vector<int32_t> frontier_;    // [top_k] candidate ids to expand next
  std::vector<Proposal> proposals_;  // [top_k * top_k]
  std::vector<int32_t> order_;       // candidate ids by rank
  std::vector<int32_t> node_of_;     // [candidates] node index in the tree, -1 = not kept
};

// Greedy verification. target_argmax[0] is the target's argmax at the root, target_argmax[i + 1]
// at node i. Walks from the root, each time to the child whose token equals the target's argmax
// (the first such child if several), and stops where none matches. Fills `path` with the accepted
// node indices and `emitted` with the tokens this step produces: the accepted tokens followed by
// the bonus token (the argmax at the last accepted node, or at the root).
void accept_greedy(const DraftTree& tree, std::span<const int32_t> target_argmax, std::vector<int32_t>& path,
                   std::vector<int32_t>& emitted);

// The k best entries of logits[0, n) as (index, log-softmax value), best first; ties go to the
// lower index. Non-finite logits other than +inf are never chosen; fewer than k entries are
// returned when fewer are finite. Returns how many were written.
int32_t top_k_logprobs(const float* logits, int32_t n, int32_t k, Proposal* out);

}  // namespace microspec
