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
#include <utility>
#include <vector>

#include "speculative/tree_state.h"

namespace microspec {

class Sampler;

// A sparse probability distribution over token ids: (id, probability) pairs.
using TokenDistribution = std::vector<std::pair<int32_t, float>>;

// Defaults measured on 2 cores. The model drafters' shape (5 SpecBench chat prompts, 128 tokens,
// self-drafting with n_layer - n_layer/8 layers): a chain of 4 beat every tree tried. A tree's
// extra frontier rows cost a draft LM head each (Gemma: 262144 rows) and extra verification rows,
// while the second-best branches rarely win: Gemma 16/18 layers: chain 3/4 tokens 95 tok/s
// (acceptance 4.3), k2 d3 t6 79 tok/s (4.4); SmolLM2 27/30 layers: chain 88 tok/s (1.8), k2 d3 t6
// 74 tok/s (2.0). A chain's nodes are capped by its depth, so total_tokens is the n-gram chains'
// length (ngram, X+ngram, auto): 8 against 4 and 6 on SpecBench at 512 tokens, Zen 3 (docs/RESULTS.md,
// "Chain length under auto"): Gemma auto 2.42x / 2.40x / 2.34x, SmolLM2 1.31x / 1.30x / 1.30x.
struct TreeParams {
  int32_t depth = 3;         // expansion rounds after the root level: nodes have depth 1..depth+1
  int32_t top_k = 1;         // children proposed per frontier node, and frontier width
  int32_t total_tokens = 8;  // draft nodes kept (the root is not counted)
  // A probability in [0, 1]. A candidate whose path probability (the draft's probabilities from the
  // root's child down to it, multiplied: its estimated chance of being accepted) is below p_min is not
  // expanded, and a greedy tree does not keep it at all (so it costs no verification row). A
  // sampled tree keeps it, unexpanded: which children a node keeps must not depend on their own
  // draws. 0 = off.
  double p_min = 0.0;

  void validate() const;  // throws Error on values outside 0 <= depth, 1 <= top_k, 0 <= total_tokens, 0 <= p_min <= 1
  // Most nodes a drafter runs through its model for one tree: the root plus `depth` frontiers.
  int32_t max_draft_rows() const { return 1 + depth * top_k; }
  // The fixed shape of a device-resident tree step (speculative/tree_state.h): these values with
  // total_tokens cut to the candidates there are. Throws Error for p_min > 0 or total_tokens 0,
  // whose trees have no fixed shape.
  TreeShape fixed_shape() const;
};

struct TreeNode {
  int32_t token = 0;
  int32_t parent = -1;     // index of the parent node, -1 = the root
  int32_t depth = 1;       // 1 = child of the root
  float score = 0.0f;      // cumulative draft log-probability of the path root -> node
  int32_t candidate = -1;  // the builder's candidate id (drafters map it to their cache slots)
};

// Nodes in candidate order: parents come before their children, and siblings come in the order
// they were proposed (best first for greedy trees, draw order for sampled ones).
struct DraftTree {
  std::vector<TreeNode> nodes;
  // Sampled trees only: q[0] is the draft distribution the root's children were drawn from,
  // q[i + 1] node i's (empty when the node was not expanded). [1 + nodes] while sampling, else empty.
  std::vector<TokenDistribution> q;
  int32_t size() const { return static_cast<int32_t>(nodes.size()); }
  void clear() {
    nodes.clear();
    q.clear();
  }
};

// Speculative sampling's draft side. Children are drawn without replacement from the draft's own
// sampling distribution q (the request's temperature / top-k / top-p applied to the draft logits)
// instead of taken best-first, and every expanded row keeps its q for verification.
struct DraftSampling {
  Sampler* sampler = nullptr;            // draft-side filters and RNG; n_vocab >= any draft row
  std::vector<TokenDistribution> row_q;  // [frontier rows] q of the last expand(), token ids
  TokenDistribution scratch;             // draws without replacement
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
  // `cand` gives every candidate's token, parent candidate and depth so far. sampling: null for
  // the k best; otherwise k draws without replacement, each row's q kept (see pick_children).
  virtual void expand(std::span<const int32_t> frontier, std::span<const TreeNode> cand, int32_t k,
                      DraftSampling* sampling, Proposal* out) = 0;
};

// Chooses one frontier row's k children from its draft logits over draft-vocabulary positions
// [0, n) (ids maps a position to its token id; nullptr = the identity). Greedy (sampling ==
// nullptr): the k best by log-probability. Sampling: k draws without replacement from the row's
// q, which is stored in sampling->row_q[row]; Proposal::logprob is then log q(token). Unused
// entries of out get token -1. Returns how many children were written.
int32_t pick_children(const float* logits, int32_t n, const int32_t* ids, int32_t k, DraftSampling* sampling,
                      int32_t row, Proposal* out);

// Builds the EAGLE-2 tree. Allocates only on growth: keep one builder per generation.
//
// With sampling the tree keeps the first total_tokens candidates in the order they were made
// (level by level, children in draw order) instead of the best by score. Speculative sampling is
// lossless only if, given everything outside a node's subtree, the node's children are a plain
// draw from its q; ranking by score would keep or drop a child depending on its own value and
// bias the output. The creation order depends only on the frontier structure, never on a child's
// own token, and still yields a connected tree with each node's kept children a prefix of its
// draws. (Choosing the frontier by score is fine: it decides whether a node gets children from
// that node's own value and its relatives', never from the children's.)
//
// build() runs every level through one expander. A caller that runs the draft forwards of several
// trees together (draft_together, drafter.h) drives the same steps itself, level by level:
//   begin      starts a tree (frontier: the root, candidate id -1);
//   frontier / candidates / proposals: the level to expand, and where its k children per row go;
//   absorb     takes the proposals (and with sampling the rows' q) of the frontier just expanded
//              and picks the next frontier; done() once no level is left;
//   finish     keeps the tree's nodes (into `tree`).
class TreeBuilder {
 public:
  // sampling: nullptr for greedy trees; otherwise the same object the expander was given.
  void build(const TreeParams& params, TreeExpander& expander, DraftTree& tree,
             DraftSampling* sampling = nullptr);

  void begin(const TreeParams& params, DraftSampling* sampling);
  bool done() const { return frontier_.empty(); }
  std::span<const int32_t> frontier() const { return frontier_; }
  std::span<const TreeNode> candidates() const { return cand_; }
  int32_t top_k() const { return params_.top_k; }
  DraftSampling* sampling() const { return sampling_; }
  Proposal* proposals() { return proposals_.data(); }  // [frontier][top_k] written by the expansion
  void absorb();
  void finish(DraftTree& tree);
  // The levels left through `expander`, then finish.
  void grow(TreeExpander& expander, DraftTree& tree);

 private:
  void take_q();  // moves the q of the frontier rows just expanded to their candidates
  TreeParams params_;
  DraftSampling* sampling_ = nullptr;
  int32_t rounds_ = 0;                     // expansion rounds absorbed after the root level
  std::vector<TokenDistribution> cand_q_;  // [candidates] q of each expanded candidate (sampling)
  TokenDistribution root_q_;               // q of the root (sampling)
  std::vector<TreeNode> cand_;             // all candidates; .parent is a candidate id here
  std::vector<int32_t> frontier_;          // [top_k] candidate ids to expand next
  std::vector<Proposal> proposals_;        // [top_k * top_k]
  std::vector<int32_t> order_;             // candidate ids by rank
  std::vector<int32_t> node_of_;           // [candidates] node index in the tree, -1 = not kept
};

// The tree's node tokens in node order ([nodes]), written into out, whose capacity is reused: the
// form the draft vocabulary's accepted() reads.
std::span<const int32_t> node_tokens(const DraftTree& tree, std::vector<int32_t>& out);

// Greedy verification. target_argmax[0] is the target's argmax at the root, target_argmax[i + 1]
// at node i. Walks from the root, each time to the child whose token equals the target's argmax
// (the first such child if several), and stops where none matches. Fills `path` with the accepted
// node indices and `emitted` with the tokens this step produces: the accepted tokens followed by
// the bonus token (the argmax at the last accepted node, or at the root).
void accept_greedy(const DraftTree& tree, std::span<const int32_t> target_argmax, std::vector<int32_t>& path,
                   std::vector<int32_t>& emitted);

// Lossless tree speculative sampling: recursive rejection sampling over each node's children.
// target_logits holds the target's raw logits, [1 + tree.size()][n_vocab] (row 0 at the root),
// and target_sampler the request's filters and RNG; p at a node is target_sampler's distribution
// of that row. Fills path and emitted as accept_greedy does. The argument is in tree.cpp.
class TreeSamplingVerifier {
 public:
  explicit TreeSamplingVerifier(int32_t n_vocab);
  void accept(const DraftTree& tree, const float* target_logits, int32_t n_vocab, Sampler& target_sampler,
              std::vector<int32_t>& path, std::vector<int32_t>& emitted);

 private:
  std::vector<float> p_;      // [n_vocab] current (residual) target distribution, dense
  std::vector<float> q_;      // [n_vocab] current draft distribution with drawn siblings removed, dense
  TokenDistribution p_list_;  // support of p_
  TokenDistribution q_list_;  // support of q_
  TokenDistribution bonus_;   // residual distribution to draw the bonus token from
  std::vector<int32_t> children_;
};

// The k best entries of logits[0, n) as (index, log-softmax value), best first; ties go to the
// lower index. Non-finite logits other than +inf are never chosen; fewer than k entries are
// returned when fewer are finite. Returns how many were written.
int32_t top_k_logprobs(const float* logits, int32_t n, int32_t k, Proposal* out);

}  // namespace microspec
