#include "speculative/tree.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "sampling/sampler.h"
#include "util/error.h"

namespace microspec {

void TreeParams::validate() const {
  if (depth < 0 || depth > 64) throw Error("tree depth must be in [0, 64], got " + std::to_string(depth));
  if (top_k < 1 || top_k > 64) throw Error("tree top-k must be in [1, 64], got " + std::to_string(top_k));
  if (total_tokens < 0 || total_tokens > 1024)
    throw Error("tree tokens must be in [0, 1024], got " + std::to_string(total_tokens));
  if (!(p_min >= 0.0 && p_min <= 1.0))
    throw Error("draft p-min must be a probability in [0, 1], got " + std::to_string(p_min));
}

TreeShape TreeParams::fixed_shape() const {
  validate();
  if (p_min != 0) throw Error("a fixed-shape tree step has no p-min cut: draft p-min must be 0, got " + std::to_string(p_min));
  if (total_tokens == 0) throw Error("a fixed-shape tree step needs at least one tree token");
  TreeShape shape{.top_k = top_k, .depth = depth, .total = total_tokens};
  shape.total = std::min(total_tokens, shape.candidates());
  return shape;  // valid(): validate() bounds top-k and depth, total is in 1..candidates()
}

namespace {
// Rank order of candidates: higher score first, then the earlier candidate.
struct RanksBefore {
  const std::vector<TreeNode>* cand;
  bool operator()(int32_t a, int32_t b) const {
    const float sa = (*cand)[a].score, sb = (*cand)[b].score;
    return sa > sb || (sa == sb && a < b);
  }
};
}  // namespace

int32_t pick_children(const float* logits, int32_t n, const int32_t* ids, int32_t k, DraftSampling* sampling,
                      int32_t row, Proposal* out) {
  int32_t got = 0;
  if (!sampling) {
    got = top_k_logprobs(logits, n, k, out);
    if (ids)
      for (int32_t j = 0; j < got; ++j) out[j].token = ids[out[j].token];
  } else {
    if (sampling->row_q.size() <= size_t(row)) sampling->row_q.resize(size_t(row) + 1);
    TokenDistribution& q = sampling->row_q[row];
    sampling->sampler->distribution(logits, n, q);
    if (ids)
      for (auto& e : q) e.first = ids[e.first];
    // Without replacement: each draw comes from q restricted to the tokens not drawn yet
    // (sample_from normalises by the remaining mass).
    TokenDistribution& left = sampling->scratch;
    left.assign(q.begin(), q.end());
    while (got < k && !left.empty()) {
      const int32_t token = sampling->sampler->sample_from(left);
      size_t at = 0;
      while (left[at].first != token) ++at;
      out[got++] = {token, std::log(left[at].second)};
      left[at] = left.back();
      left.pop_back();
    }
  }
  for (int32_t j = got; j < k; ++j) out[j] = {-1, 0.0f};
  return got;
}

void TreeBuilder::build(const TreeParams& params, TreeExpander& expander, DraftTree& tree,
                        DraftSampling* sampling) {
  begin(params, sampling);
  grow(expander, tree);
}

void TreeBuilder::grow(TreeExpander& expander, DraftTree& tree) {
  while (!done()) {
    expander.expand(frontier_, cand_, params_.top_k, sampling_, proposals_.data());
    absorb();
  }
  finish(tree);
}

void TreeBuilder::begin(const TreeParams& params, DraftSampling* sampling) {
  params.validate();
  params_ = params;
  sampling_ = sampling;
  rounds_ = 0;
  cand_.clear();
  frontier_.clear();
  if (params.total_tokens == 0) return;  // nothing to draft: done at once
  proposals_.resize(size_t(params.top_k) * params.top_k);
  frontier_.push_back(-1);  // the root level
}

void TreeBuilder::take_q() {
  if (!sampling_) return;
  if (cand_q_.size() < cand_.size()) cand_q_.resize(cand_.size());
  for (size_t i = 0; i < frontier_.size(); ++i) {
    TokenDistribution& dst = frontier_[i] < 0 ? root_q_ : cand_q_[frontier_[i]];
    dst.swap(sampling_->row_q[i]);  // swaps keep capacity
  }
}

void TreeBuilder::absorb() {
  take_q();
  const int32_t k = params_.top_k;
  // The p-min cut on path log-probabilities: below it a candidate is not expanded, and a greedy
  // tree does not make it at all.
  const float min_score = std::log(float(params_.p_min));
  auto passes = [&](float score) { return params_.p_min == 0 || score >= min_score; };
  auto add_candidate = [&](int32_t token, int32_t parent, int32_t depth, float score) {
    if (!sampling_ && !passes(score)) return;
    cand_.push_back({token, parent, depth, score, static_cast<int32_t>(cand_.size())});
  };
  const int32_t first_new = static_cast<int32_t>(cand_.size());
  const bool root_level = frontier_.size() == 1 && frontier_[0] < 0;
  if (root_level) {
    // Root level: the root's top-k tokens.
    for (int32_t j = 0; j < k; ++j) {
      const Proposal& p = proposals_[j];
      if (p.token >= 0) add_candidate(p.token, -1, 1, p.logprob);
    }
  } else {
    ++rounds_;
    for (size_t i = 0; i < frontier_.size(); ++i) {
      const TreeNode parent = cand_[frontier_[i]];
      for (int32_t j = 0; j < k; ++j) {
        const Proposal& p = proposals_[i * k + j];
        if (p.token >= 0) add_candidate(p.token, frontier_[i], parent.depth + 1, parent.score + p.logprob);
      }
    }
  }
  // Next frontier: of the new candidates that pass the cut, the root level's all (at most k, in
  // proposal order), a deeper level's global top-k.
  order_.clear();
  for (int32_t c = first_new; c < static_cast<int32_t>(cand_.size()); ++c)
    if (passes(cand_[c].score)) order_.push_back(c);
  const size_t keep = std::min(order_.size(), size_t(k));
  if (!root_level) std::partial_sort(order_.begin(), order_.begin() + keep, order_.end(), RanksBefore{&cand_});
  frontier_.assign(order_.begin(), order_.begin() + keep);
  if (rounds_ >= params_.depth) frontier_.clear();  // every round after the root level is done
}

void TreeBuilder::finish(DraftTree& tree) {
  tree.clear();
  if (params_.total_tokens == 0) return;
  const RanksBefore ranks{&cand_};
  const int32_t n_cand = static_cast<int32_t>(cand_.size());
  node_of_.assign(n_cand, -1);
  if (sampling_) {
    // The first total_tokens candidates in creation order (see the class comment).
    for (int32_t c = 0; c < std::min(n_cand, params_.total_tokens); ++c) node_of_[c] = 0;
  } else {
    // Keep the total_tokens best candidates. A parent ranks before its children (score order,
    // ties to the earlier candidate), so taking candidates in rank order whose parent is already
    // kept loses nothing and yields a connected tree.
    order_.resize(n_cand);
    for (int32_t c = 0; c < n_cand; ++c) order_[c] = c;
    std::sort(order_.begin(), order_.end(), ranks);
    int32_t kept = 0;
    for (int32_t c : order_) {
      if (kept == params_.total_tokens) break;
      const int32_t parent = cand_[c].parent;
      if (parent >= 0 && node_of_[parent] < 0) continue;
      node_of_[c] = 0;  // marked kept; real indices are assigned in candidate order below
      ++kept;
    }
  }
  for (int32_t c = 0; c < n_cand; ++c) {
    if (node_of_[c] < 0) continue;
    node_of_[c] = tree.size();
    TreeNode node = cand_[c];
    node.parent = node.parent < 0 ? -1 : node_of_[node.parent];
    tree.nodes.push_back(node);
  }
  if (sampling_) {
    tree.q.resize(size_t(tree.size()) + 1);
    tree.q[0].swap(root_q_);
    for (int32_t c = 0; c < n_cand; ++c)
      if (node_of_[c] >= 0) {
        if (size_t(c) < cand_q_.size())
          tree.q[size_t(node_of_[c]) + 1].swap(cand_q_[c]);
        else
          tree.q[size_t(node_of_[c]) + 1].clear();
      }
    for (auto& q : cand_q_) q.clear();  // stale rows of dropped candidates
  }
}

std::span<const int32_t> node_tokens(const DraftTree& tree, std::vector<int32_t>& out) {
  out.clear();
  for (const TreeNode& node : tree.nodes) out.push_back(node.token);
  return out;
}

void accept_greedy(const DraftTree& tree, std::span<const int32_t> target_argmax, std::vector<int32_t>& path,
                   std::vector<int32_t>& emitted) {
  if (target_argmax.size() != size_t(tree.size()) + 1)
    throw Error("accept_greedy: need one target argmax per tree node plus the root");
  path.clear();
  emitted.clear();
  int32_t cur = -1;
  for (;;) {
    const int32_t want = target_argmax[size_t(cur + 1)];
    emitted.push_back(want);
    int32_t next = -1;
    // Children have larger indices than their parent.
    for (int32_t i = cur + 1; i < tree.size(); ++i)
      if (tree.nodes[i].parent == cur && tree.nodes[i].token == want) {
        next = i;
        break;
      }
    if (next < 0) return;
    path.push_back(next);
    cur = next;
  }
}

// Why TreeSamplingVerifier::accept is lossless (recursive rejection sampling; Chen et al. 2023 for
// one draft, SpecInfer / Jeon et al. 2024 for several drafts drawn without replacement).
//
// Claim: at a node whose kept children x_1..x_m were drawn in that order without replacement from
// q, with m decided without looking at the children's own tokens, the token this procedure emits
// at that position is distributed exactly as p, the target's sampling distribution there.
// Procedure, with p_1 = p and q_1 = q: for i = 1..m, accept x_i with probability
// min(1, p_i(x_i) / q_i(x_i)); on rejection set p_{i+1} = norm(max(0, p_i - q_i)) and q_{i+1} =
// q_i with x_i removed, renormalised. If all are rejected, draw from p_{m+1}.
// Proof by induction from the last sibling: suppose that given the history up to sibling i
// rejected, the rest emits y with probability p_{i+1}(y). Note p_{i+1} depends on p_i and q_i
// only, not on which token x_i was, and x_i given the history is a draw from q_i (that is what
// drawing without replacement means). Then
//   P(emit y) = q_i(y) min(1, p_i(y)/q_i(y)) + P(reject) p_{i+1}(y)
//             = min(p_i, q_i)(y) + (1 - sum_z min(p_i, q_i)(z)) p_{i+1}(y)
//             = min(p_i, q_i)(y) + sum_z max(0, p_i - q_i)(z) * norm(max(0, p_i - q_i))(y)
//             = min(p_i, q_i)(y) + max(0, p_i - q_i)(y) = p_i(y).
// The base case (no sibling left, draw from p_{m+1}) holds trivially; at i = 1 it gives p.
// An accepted x_i moves to its child node, where the same holds with the target's distribution
// after the longer prefix, because that node's children were drawn from the draft's distribution
// after the same prefix. So every emitted token has the plain sampler's distribution given the
// tokens before it, and the whole output has the distribution of plain sampling.
// (The q = 1 shortcut, treating a best-first draft as certain, is only right for greedy drafts;
// here the draft tokens are real draws from q, so the accepted-token rate benefits from q ~ p.)
TreeSamplingVerifier::TreeSamplingVerifier(int32_t n_vocab)
    : p_(size_t(n_vocab), 0.0f), q_(size_t(n_vocab), 0.0f) {}

void TreeSamplingVerifier::accept(const DraftTree& tree, const float* target_logits, int32_t n_vocab,
                                  Sampler& target_sampler, std::vector<int32_t>& path,
                                  std::vector<int32_t>& emitted) {
  if (size_t(n_vocab) != p_.size()) throw Error("tree sampling: vocabulary size mismatch");
  if (!tree.nodes.empty() && tree.q.size() != size_t(tree.size()) + 1)
    throw Error("tree sampling: the draft tree has no draft distributions (built without sampling)");
  path.clear();
  emitted.clear();
  int32_t cur = -1;
  for (;;) {
    target_sampler.distribution(target_logits + size_t(cur + 1) * n_vocab, p_list_);
    for (const auto& [id, prob] : p_list_) p_[id] = prob;
    children_.clear();
    for (int32_t i = cur + 1; i < tree.size(); ++i)
      if (tree.nodes[i].parent == cur) children_.push_back(i);
    int32_t next = -1;
    if (!children_.empty()) {
      q_list_ = tree.q[size_t(cur + 1)];
      for (const auto& [id, prob] : q_list_) q_[id] = prob;
      for (int32_t c : children_) {
        const int32_t x = tree.nodes[c].token;
        const float px = p_[x], qx = q_[x];
        // Accept with probability min(1, px / qx).
        if (qx > 0.0f && target_sampler.uniform() * qx < px) {
          next = c;
          break;
        }
        // Rejected: p <- norm(max(0, p - q)), which lives on p's support.
        double residual = 0.0;
        for (const auto& e : p_list_) residual += std::max(0.0f, p_[e.first] - q_[e.first]);
        // residual == 0 means p == q, where a rejection can only come from rounding: keep p.
        if (residual > 0.0) {
          const double inv = 1.0 / residual;
          for (const auto& e : p_list_) p_[e.first] = float(std::max(0.0f, p_[e.first] - q_[e.first]) * inv);
        }
        // q <- q without x, renormalised.
        const double rest = 1.0 - double(qx);
        q_[x] = 0.0f;
        if (rest > 0.0) {
          const double inv = 1.0 / rest;
          for (const auto& e : q_list_) q_[e.first] = float(q_[e.first] * inv);
        }
      }
      for (const auto& e : q_list_) q_[e.first] = 0.0f;
    }
    if (next >= 0) {
      for (const auto& e : p_list_) p_[e.first] = 0.0f;
      path.push_back(next);
      emitted.push_back(tree.nodes[next].token);
      cur = next;
      continue;
    }
    // The bonus token: a draw from the (residual) target distribution at this node.
    bonus_.clear();
    for (const auto& e : p_list_) {
      if (p_[e.first] > 0.0f) bonus_.emplace_back(e.first, p_[e.first]);
      p_[e.first] = 0.0f;
    }
    emitted.push_back(target_sampler.sample_from(bonus_));
    return;
  }
}

int32_t top_k_logprobs(const float* logits, int32_t n, int32_t k, Proposal* out) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  float max_logit = kNegInf;
  for (int32_t i = 0; i < n; ++i)
    if (logits[i] > max_logit) max_logit = logits[i];
  int32_t count = 0;
  if (!(max_logit > kNegInf)) return 0;  // nothing finite (or all NaN)
  const bool has_inf = std::isinf(max_logit);
  double sum = 0.0;
  for (int32_t i = 0; i < n; ++i) {
    const float l = logits[i];
    if (has_inf)
      sum += l == max_logit ? 1.0 : 0.0;
    else if (l > kNegInf)
      sum += std::exp(double(l - max_logit));
  }
  const float log_sum = static_cast<float>(std::log(sum));
  // Insertion into a sorted list of at most k entries; a later index replaces only a strictly
  // larger logit, so ties keep the lower index.
  for (int32_t i = 0; i < n; ++i) {
    const float l = logits[i];
    if (!(l > kNegInf)) continue;
    if (count == k && !(l > out[k - 1].logprob)) continue;
    int32_t at = count < k ? count++ : k - 1;
    while (at > 0 && l > out[at - 1].logprob) {
      out[at] = out[at - 1];
      --at;
    }
    out[at] = {i, l};
  }
  for (int32_t j = 0; j < count; ++j) {
    const float l = out[j].logprob;
    // log-softmax; <= 0 because log_sum >= 0 and l <= max_logit.
    out[j].logprob =
        has_inf ? (l == max_logit ? -log_sum : kNegInf) : std::min(0.0f, (l - max_logit) - log_sum);
  }
  return count;
}

}  // namespace microspec
