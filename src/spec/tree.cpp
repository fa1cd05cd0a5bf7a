#include "spec/tree.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "util/error.h"

namespace microspec {

void TreeParams::validate() const {
  if (depth < 0 || depth > 64) throw Error("tree depth must be in [0, 64], got " + std::to_string(depth));
  if (top_k < 1 || top_k > 64) throw Error("tree top-k must be in [1, 64], got " + std::to_string(top_k));
  if (total_tokens < 0 || total_tokens > 1024)
    throw Error("tree tokens must be in [0, 1024], got " + std::to_string(total_tokens));
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

void TreeBuilder::build(const TreeParams& params, TreeExpander& expander, DraftTree& tree) {
  params.validate();
  tree.clear();
  cand_.clear();
  if (params.total_tokens == 0) return;
  const int32_t k = params.top_k;
  proposals_.resize(size_t(k) * k);
  const RanksBefore ranks{&cand_};

  // Root level: the root's top-k tokens.
  const int32_t root = -1;
  expander.expand(std::span<const int32_t>(&root, 1), cand_, k, proposals_.data());
  frontier_.clear();
  for (int32_t j = 0; j < k; ++j) {
    const Proposal& p = proposals_[j];
    if (p.token < 0) continue;
    cand_.push_back({p.token, -1, 1, p.logprob, static_cast<int32_t>(cand_.size())});
    frontier_.push_back(cand_.back().candidate);
  }

  for (int32_t round = 0; round < params.depth && !frontier_.empty(); ++round) {
    expander.expand(frontier_, cand_, k, proposals_.data());
    const int32_t first_child = static_cast<int32_t>(cand_.size());
    for (size_t i = 0; i < frontier_.size(); ++i) {
      const TreeNode parent = cand_[frontier_[i]];
      for (int32_t j = 0; j < k; ++j) {
        const Proposal& p = proposals_[i * k + j];
        if (p.token < 0) continue;
        cand_.push_back({p.token, frontier_[i], parent.depth + 1, parent.score + p.logprob,
                         static_cast<int32_t>(cand_.size())});
      }
    }
    // Next frontier: the global top-k of this round's children.
    order_.clear();
    for (int32_t c = first_child; c < static_cast<int32_t>(cand_.size()); ++c) order_.push_back(c);
    const size_t keep = std::min(order_.size(), size_t(k));
    std::partial_sort(order_.begin(), order_.begin() + keep, order_.end(), ranks);
    frontier_.assign(order_.begin(), order_.begin() + keep);
  }

  // Keep the total_tokens best candidates. A parent ranks before its children (score order, ties
  // to the earlier candidate), so taking candidates in rank order whose parent is already kept
  // loses nothing and yields a connected tree.
  const int32_t n_cand = static_cast<int32_t>(cand_.size());
  order_.resize(n_cand);
  for (int32_t c = 0; c < n_cand; ++c) order_[c] = c;
  std::sort(order_.begin(), order_.end(), ranks);
  node_of_.assign(n_cand, -1);
  int32_t kept = 0;
  for (int32_t c : order_) {
    if (kept == params.total_tokens) break;
    const int32_t parent = cand_[c].parent;
    if (parent >= 0 && node_of_[parent] < 0) continue;
    node_of_[c] = 0;  // marked kept; real indices are assigned in candidate order below
    ++kept;
  }
  for (int32_t c = 0; c < n_cand; ++c) {
    if (node_of_[c] < 0) continue;
    node_of_[c] = tree.size();
    TreeNode node = cand_[c];
    node.parent = node.parent < 0 ? -1 : node_of_[node.parent];
    tree.nodes.push_back(node);
  }
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
