// Speculative sampling's output distribution, with drafts close to the target and enough samples
// that the test rejects each of four plausible mistakes.
//
// The harness is the library's tree construction (TreeBuilder, pick_children: draws without
// replacement from the draft's q) and a verifier function, on a Markov "model": the target's and
// the draft's logits depend only on the previous token (target[prev][V], draft[prev][V]), so the
// exact distribution of plain sampling over L-token continuations is a product of rows and many
// thousands of speculative samples take well under a second. The draft is the target plus
// Gaussian noise of scale sigma: small sigma, high acceptance. The request's filters are active
// on both sides (temperature 0.9, top-k 4 of 6 tokens, top-p 0.9), so p and q have different
// supports at times.
//
// Verifiers: the library's TreeSamplingVerifier, and a written-out one in this file whose
// Mutation switches one rule off. Mutation::none must pass (it is the same algorithm); each other
// mutation must FAIL the same chi-square test:
//   - no_q_renormalisation: after a sibling is rejected, q keeps the rejected token (q is not
//     renormalised over the remaining siblings);
//   - bonus_from_p: the bonus token is drawn from p instead of the last residual;
//   - accept_q_over_p: a child is accepted with probability min(1, q/p) instead of min(1, p/q);
//   - score-ranked pruning: the tree keeps its best nodes by cumulative draft score instead of
//     the first ones in creation order (verified by the library's verifier);
//   - the p-min cut applied to a sampled tree as to a greedy one: nodes whose path probability is
//     under p-min dropped instead of kept unexpanded (verified by the library's verifier).
// N-gram drafting (speculative/ngram.h) proposes deterministic chains: its q is a point mass. A
// case runs the real NgramDrafter over a context that repeats the target's likely continuation,
// so its drafts are accepted at times and rejected at times; the library verifier must pass and
// drawing the bonus from p instead of the residual (p without the rejected token) must fail.
//
// Power (the calculation behind kSamples). Under the null the statistic is chi-square with df =
// bins - 1 = 29 here (L = 3 tokens; bins with an expected count under 5 pooled); the critical
// value is its 1 - 1e-4 quantile, 54.2. Under a mutant the statistic is approximately noncentral
// chi-square with noncentrality lambda = N * w2, where w2 = sum (m - e)^2 / e over the bins (m the
// mutant's probabilities, e the exact ones). w2 was estimated as (statistic - df) / N from a run
// of this test with N = 40,000: q not renormalised 0.0130, bonus from p 0.177, score-ranked
// pruning 0.083; min(1, q/p) accepts tokens outside p's support, which the exact distribution
// gives probability 0, so its statistic is astronomical. The weakest, 0.0130, sets N: with N =
// 20,000, lambda = 260, the statistic has mean df + lambda = 289 and standard deviation
// sqrt(2 (df + 2 lambda)) = 33, so falling under 54.2 is a 7-sigma event (probability < 1e-11).
// The correct verifiers fail with probability 1e-4 per case, and the seeds are fixed, so every
// run gives the same statistics.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "grammar/token_constraint.h"
#include "sampling/penalties.h"
#include "sampling/sampler.h"
#include "speculative/ngram.h"
#include "speculative/tree.h"
#include "util/error.h"

namespace microspec {
namespace {

constexpr int32_t V = 6;            // vocabulary
constexpr int32_t kLength = 3;      // tokens per sample
constexpr int32_t kStart = 0;       // the token before the first sampled one
constexpr int kSamples = 20000;     // per case; see the power calculation above

SamplingParams filters() {
  SamplingParams sp;
  sp.temperature = 0.9f;
  sp.top_k = 4;
  sp.top_p = 0.9f;
  return sp;
}

// Logits rows [prev][V]: the target random, the draft the target plus sigma * N(0, 1) noise.
struct MarkovPair {
  std::vector<float> target, draft;
};

MarkovPair make_pair(float sigma) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  MarkovPair m{std::vector<float>(V * V), std::vector<float>(V * V)};
  for (float& x : m.target) x = 1.5f * normal(rng);
  std::mt19937 noise_rng(11);
  for (int32_t i = 0; i < V * V; ++i) m.draft[i] = m.target[i] + sigma * normal(noise_rng);
  return m;
}

// Children of a candidate are drawn from the draft's row for the candidate's token.
class MarkovExpander : public TreeExpander {
 public:
  explicit MarkovExpander(const std::vector<float>& draft) : draft_(draft) {}
  int32_t context = kStart;  // the last committed token: the root's

  void expand(std::span<const int32_t> frontier, std::span<const TreeNode> cand, int32_t k, DraftSampling* sampling,
              Proposal* out) override {
    for (size_t i = 0; i < frontier.size(); ++i) {
      const int32_t prev = frontier[i] < 0 ? context : cand[frontier[i]].token;
      pick_children(draft_.data() + size_t(prev) * V, V, nullptr, k, sampling, int32_t(i), out + i * k);
    }
  }

 private:
  const std::vector<float>& draft_;
};

using Verifier = std::function<void(const DraftTree&, const float*, Sampler&, std::vector<int32_t>& path,
                                    std::vector<int32_t>& emitted)>;

enum class Mutation { none, no_q_renormalisation, bonus_from_p, accept_q_over_p };

// Recursive rejection sampling written out densely in double precision; `m` breaks one rule.
void verify_written_out(const DraftTree& tree, const float* rows, Sampler& s, Mutation m, std::vector<int32_t>& path,
                        std::vector<int32_t>& emitted) {
  path.clear();
  emitted.clear();
  TokenDistribution dist;
  for (int32_t cur = -1;;) {
    s.distribution(rows + size_t(cur + 1) * V, dist);
    std::vector<double> p(V, 0.0), q(V, 0.0);
    for (const auto& [id, prob] : dist) p[id] = prob;
    const std::vector<double> p_plain = p;
    if (size_t(cur + 1) < tree.q.size())  // an empty tree (a drafter with nothing to propose) has no q
      for (const auto& [id, prob] : tree.q[size_t(cur + 1)]) q[id] = prob;
    int32_t next = -1;
    for (int32_t c = cur + 1; c < tree.size() && next < 0; ++c) {
      if (tree.nodes[c].parent != cur) continue;
      const int32_t x = tree.nodes[c].token;
      const double ratio = m == Mutation::accept_q_over_p ? q[x] / p[x] : p[x] / q[x];
      if (s.uniform() < ratio) {
        next = c;
        break;
      }
      double residual = 0.0;
      for (int32_t y = 0; y < V; ++y) residual += std::max(0.0, p[y] - q[y]);
      if (residual > 0.0)
        for (int32_t y = 0; y < V; ++y) p[y] = std::max(0.0, p[y] - q[y]) / residual;
      if (m != Mutation::no_q_renormalisation) {
        const double rest = 1.0 - q[x];
        q[x] = 0.0;
        if (rest > 0.0)
          for (double& v : q) v /= rest;
      }
    }
    if (next >= 0) {
      path.push_back(next);
      emitted.push_back(tree.nodes[next].token);
      cur = next;
      continue;
    }
    const std::vector<double>& bonus = m == Mutation::bonus_from_p ? p_plain : p;
    TokenDistribution b;
    for (int32_t y = 0; y < V; ++y)
      if (bonus[y] > 0.0) b.emplace_back(y, float(bonus[y]));
    emitted.push_back(s.sample_from(b));
    return;
  }
}

// The mutant pruning: keeps the `keep` best nodes of a fully built tree by cumulative draft score
// (ties to the earlier node, so parents stay before their children and the tree stays connected).
DraftTree prune_by_score(const DraftTree& full, int32_t keep) {
  std::vector<int32_t> order(size_t(full.size()));
  for (int32_t i = 0; i < full.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return full.nodes[a].score > full.nodes[b].score; });
  order.resize(size_t(std::min(keep, full.size())));
  std::sort(order.begin(), order.end());  // back to creation order: parents first
  std::vector<int32_t> new_index(size_t(full.size()), -1);
  DraftTree t;
  t.q.push_back(full.q[0]);
  for (int32_t old : order) {
    TreeNode n = full.nodes[old];
    n.parent = n.parent < 0 ? -1 : new_index[n.parent];
    EXPECT_TRUE(full.nodes[old].parent < 0 || n.parent >= 0) << "pruned tree must stay connected";
    new_index[old] = t.size();
    t.nodes.push_back(n);
    t.q.push_back(full.q[size_t(old) + 1]);
  }
  return t;
}

// The mutant cut: drops the nodes whose path log-probability is under min_score (and so their
// subtrees), as a greedy tree does; a sampled node's fate then depends on its own draw.
DraftTree drop_below(const DraftTree& full, float min_score) {
  std::vector<int32_t> new_index(size_t(full.size()), -1);
  DraftTree t;
  t.q.push_back(full.q[0]);
  for (int32_t old = 0; old < full.size(); ++old) {
    TreeNode n = full.nodes[old];
    if (n.score < min_score || (n.parent >= 0 && new_index[n.parent] < 0)) continue;
    n.parent = n.parent < 0 ? -1 : new_index[n.parent];
    new_index[old] = t.size();
    t.nodes.push_back(n);
    t.q.push_back(full.q[size_t(old) + 1]);
  }
  return t;
}

struct Outcome {
  std::map<std::vector<int32_t>, int> observed;
  int64_t drafted = 0, accepted = 0;
  int64_t later_sibling_accepted = 0;  // accepted nodes that were not their parent's first child
};

struct Case {
  std::string name;
  float sigma;        // draft noise: acceptance falls as it grows
  TreeParams tree;
  bool prune_by_score = false;  // build every candidate, keep the best tree.total_tokens by score
  bool drop_below_p_min = false;  // the mutant cut: sampled nodes under tree.p_min dropped, as greedy trees do
};

Outcome run_case(const Case& c, const Verifier& verify, int n_samples, uint64_t seed) {
  const MarkovPair m = make_pair(c.sigma);
  Sampler target_sampler([&] { SamplingParams sp = filters(); sp.seed = seed; return sp; }(), V);
  Sampler draft_sampler([&] { SamplingParams sp = filters(); sp.seed = seed + 1; return sp; }(), V);
  DraftSampling sampling;
  sampling.sampler = &draft_sampler;
  MarkovExpander expander(m.draft);
  TreeBuilder builder;
  TreeParams build_params = c.tree;
  if (c.prune_by_score) build_params.total_tokens = c.tree.top_k * (1 + c.tree.depth * c.tree.top_k);
  DraftTree tree;
  std::vector<float> rows;
  std::vector<int32_t> path, emitted, tokens;
  Outcome out;
  for (int i = 0; i < n_samples; ++i) {
    tokens.clear();
    while (int32_t(tokens.size()) < kLength) {
      expander.context = tokens.empty() ? kStart : tokens.back();
      builder.build(build_params, expander, tree, &sampling);
      if (c.prune_by_score) tree = prune_by_score(tree, c.tree.total_tokens);
      if (c.drop_below_p_min) tree = drop_below(tree, std::log(float(c.tree.p_min)));
      rows.assign(m.target.begin() + size_t(expander.context) * V, m.target.begin() + size_t(expander.context + 1) * V);
      for (const TreeNode& n : tree.nodes)
        rows.insert(rows.end(), m.target.begin() + size_t(n.token) * V, m.target.begin() + size_t(n.token + 1) * V);
      verify(tree, rows.data(), target_sampler, path, emitted);
      out.drafted += tree.size();
      out.accepted += int64_t(path.size());
      for (int32_t node : path) {
        const int32_t parent = tree.nodes[node].parent;
        for (int32_t j = parent + 1; j < node; ++j)
          if (tree.nodes[j].parent == parent) {
            ++out.later_sibling_accepted;
            break;
          }
      }
      tokens.insert(tokens.end(), emitted.begin(), emitted.end());
    }
    tokens.resize(kLength);
    ++out.observed[tokens];
  }
  return out;
}

// Exact plain-sampling probability of every kLength-token continuation of kStart; with penalties,
// each prefix's row is transformed with kStart and the prefix as history.
// grammar: structured output's constraint on top of the penalties (null: none).
std::unique_ptr<GrammarMatcher> matcher_for(const std::shared_ptr<const TokenConstraint>& grammar,
                                            const SamplingParams& sampling) {
  return grammar ? std::make_unique<GrammarMatcher>(grammar, sampling.top_k) : nullptr;  // keep top-k (0: the whole row)
}

std::map<std::vector<int32_t>, double> exact_sequences(const std::vector<float>& target, const SamplingParams& sampling,
                                                       const PenaltyParams& penalties = {},
                                                       const std::shared_ptr<const TokenConstraint>& grammar = nullptr) {
  Sampler s(sampling, V);
  Penalizer pen(penalties, V, matcher_for(grammar, sampling));
  std::map<std::vector<int32_t>, double> frontier = {{{}, 1.0}};
  TokenDistribution dist;
  std::vector<float> row(V);
  const std::vector<int32_t> prompt = {kStart};
  for (int32_t depth = 0; depth < kLength; ++depth) {
    std::map<std::vector<int32_t>, double> next;
    for (const auto& [seq, prob] : frontier) {
      const int32_t prev = seq.empty() ? kStart : seq.back();
      std::copy(target.begin() + size_t(prev) * V, target.begin() + size_t(prev + 1) * V, row.begin());
      if (pen.active()) {
        pen.begin(prompt, kLength + 2);
        for (int32_t t : seq) pen.accept(t);
        pen.apply(row.data());
      }
      s.distribution(row.data(), dist);
      for (const auto& [id, p] : dist) {
        std::vector<int32_t> longer = seq;
        longer.push_back(id);
        next[longer] += prob * p;
      }
    }
    frontier.swap(next);
  }
  return frontier;
}

// Pearson's statistic (bins with expected count < 5 pooled; sequences of zero exact probability
// count into the pooled bin) and the 1 - 1e-4 quantile of chi-square (Wilson-Hilferty).
std::pair<double, double> chi_square(const std::map<std::vector<int32_t>, double>& exact,
                                     const std::map<std::vector<int32_t>, int>& observed, int n) {
  double stat = 0.0, pooled_e = 0.0;
  int64_t pooled_o = 0, seen = 0;
  int bins = 0;
  for (const auto& [seq, prob] : exact) {
    const double e = prob * n;
    const auto it = observed.find(seq);
    const int o = it == observed.end() ? 0 : it->second;
    seen += o;
    if (e < 5.0) {
      pooled_e += e;
      pooled_o += o;
      continue;
    }
    stat += (o - e) * (o - e) / e;
    ++bins;
  }
  pooled_o += n - seen;
  if (pooled_e > 0.0 || pooled_o > 0) {
    const double e = std::max(pooled_e, 1e-9);
    stat += (pooled_o - e) * (pooled_o - e) / e;
    ++bins;
  }
  const double df = std::max(1, bins - 1), z = 3.719, a = 2.0 / (9.0 * df);
  return {stat, df * std::pow(1.0 - a + z * std::sqrt(a), 3.0)};
}

Verifier library_verifier() {
  auto v = std::make_shared<TreeSamplingVerifier>(V);
  return [v](const DraftTree& t, const float* rows, Sampler& s, std::vector<int32_t>& path,
             std::vector<int32_t>& emitted) { v->accept(t, rows, V, s, path, emitted); };
}

Verifier written_out(Mutation m) {
  return [m](const DraftTree& t, const float* rows, Sampler& s, std::vector<int32_t>& path,
             std::vector<int32_t>& emitted) { verify_written_out(t, rows, s, m, path, emitted); };
}

// Draft noise levels and tree shapes. Acceptance (accepted / drafted) is asserted in a band for
// each, so the cases keep exercising what they claim to.
const TreeParams kWideTree{2, 2, 5};  // depth 2 (3 levels), width 2, 5 of 10 candidates kept
const TreeParams kBushy{1, 3, 12};    // every candidate kept: 3 children, 9 grandchildren
const TreeParams kChain{3, 1, 4};
const TreeParams kCutTree{2, 2, 5, /*p_min=*/0.3};  // the wide tree, nodes under 0.3 not expanded

struct Band {
  Case c;
  double min_accept, max_accept;
};

const std::vector<Band>& bands() {
  static const std::vector<Band> b = {
      {{"close draft (sigma 0.15), chain", 0.15f, kChain}, 0.75, 0.98},
      {{"medium draft (sigma 1), chain", 1.0f, kChain}, 0.4, 0.7},
      // In a tree, accepted / drafted counts the rejected siblings too: width 2 caps it near 1/2.
      {{"close draft (sigma 0.3), wide tree", 0.3f, kWideTree}, 0.3, 0.5},
      {{"medium draft (sigma 1), wide tree", 1.0f, kWideTree}, 0.25, 0.45},
      {{"far draft (sigma 2.5), bushy tree", 2.5f, kBushy}, 0.05, 0.25},
      {{"medium draft (sigma 1), wide tree, p-min 0.3", 1.0f, kCutTree}, 0.2, 0.4},
  };
  return b;
}

TEST(SpecSamplingPower, LibraryVerifierMatchesPlainSamplingAtEveryAcceptanceLevel) {
  for (const Band& b : bands()) {
    const Outcome o = run_case(b.c, library_verifier(), kSamples, 100);
    const auto [stat, crit] = chi_square(exact_sequences(make_pair(b.c.sigma).target, filters()), o.observed, kSamples);
    const double rate = double(o.accepted) / double(o.drafted);
    std::printf("%s: chi-square %.1f (critical %.1f), acceptance %.3f, later siblings accepted %lld\n",
                b.c.name.c_str(), stat, crit, rate, (long long)o.later_sibling_accepted);
    EXPECT_LT(stat, crit) << b.c.name;
    EXPECT_GE(rate, b.min_accept) << b.c.name;
    EXPECT_LE(rate, b.max_accept) << b.c.name;
    // Wide trees: a second sibling is accepted after the first was rejected, often enough that
    // the renormalisation of q over the remaining siblings carries weight in the statistic.
    if (b.c.tree.top_k >= 2) EXPECT_GE(o.later_sibling_accepted, kSamples / 50) << b.c.name;
  }
}

TEST(SpecSamplingPower, WrittenOutVerifierPassesAndEachBrokenRuleFails) {
  const Case wide = bands()[3].c;  // medium draft, wide tree
  const auto exact = exact_sequences(make_pair(wide.sigma).target, filters());
  struct Mutant {
    std::string name;
    Mutation m;
    Case c;
  };
  const std::vector<Mutant> mutants = {
      {"correct (written out)", Mutation::none, wide},
      {"q not renormalised over remaining siblings", Mutation::no_q_renormalisation, wide},
      {"bonus drawn from p, not the residual", Mutation::bonus_from_p, wide},
      {"accept with min(1, q/p)", Mutation::accept_q_over_p, wide},
  };
  for (const Mutant& mu : mutants) {
    const Outcome o = run_case(mu.c, written_out(mu.m), kSamples, 200);
    const auto [stat, crit] = chi_square(exact, o.observed, kSamples);
    std::printf("%s: chi-square %.1f (critical %.1f), statistic / N %.4f\n", mu.name.c_str(), stat, crit,
                stat / kSamples);
    if (mu.m == Mutation::none)
      EXPECT_LT(stat, crit) << mu.name << ": the written-out verifier must pass";
    else
      EXPECT_GT(stat, crit) << mu.name << ": a broken verifier must fail the test";
  }
}

// A sampled-tree mutant, verified by the library's verifier, must fail the chi-square test.
void expect_biased(const Case& c, uint64_t seed, const char* why) {
  const Outcome o = run_case(c, library_verifier(), kSamples, seed);
  const auto [stat, crit] = chi_square(exact_sequences(make_pair(c.sigma).target, filters()), o.observed, kSamples);
  std::printf("%s: chi-square %.1f (critical %.1f), statistic / N %.4f\n", c.name.c_str(), stat, crit, stat / kSamples);
  EXPECT_GT(stat, crit) << why;
}

TEST(SpecSamplingPower, ScoreRankedPruningOfASampledTreeFails) {
  Case c = bands()[2].c;  // close draft, wide tree: pruning drops 5 of 10 candidates
  c.name = "score-ranked pruning";
  c.prune_by_score = true;
  expect_biased(c, 300, "keeping the best nodes by score must bias the output");
}

TEST(SpecSamplingPower, DroppingSampledNodesUnderPMinFails) {
  Case c = bands()[5].c;  // medium draft, wide tree, p-min 0.3
  c.name = "sampled nodes under p-min dropped";
  c.drop_below_p_min = true;
  expect_biased(c, 400, "dropping a sampled node for its own draw must bias the output");
}

// Samples kLength tokens after kStart with the NgramDrafter drafting from `prompt` + the tokens so
// far (kStart is each sample's first root), verified by `verify`.
Outcome run_ngram_case(const std::vector<int32_t>& prompt, const TreeParams& tree_params, const Verifier& verify,
                       const std::vector<float>& target, int n_samples, uint64_t seed) {
  Sampler target_sampler([&] { SamplingParams sp = filters(); sp.seed = seed; return sp; }(), V);
  Sampler draft_sampler([&] { SamplingParams sp = filters(); sp.seed = seed + 1; return sp; }(), V);
  DraftSampling sampling;
  sampling.sampler = &draft_sampler;
  NgramDrafter drafter({1, 3}, 64);
  DraftTree tree;
  std::vector<float> rows;
  std::vector<int32_t> path, emitted, tokens;
  Outcome out;
  for (int i = 0; i < n_samples; ++i) {
    drafter.begin(prompt, {});
    tokens.clear();
    int32_t root = kStart;
    while (int32_t(tokens.size()) < kLength) {
      drafter.propose(root, 0, tree_params, &sampling, tree);
      rows.assign(target.begin() + size_t(root) * V, target.begin() + size_t(root + 1) * V);
      for (const TreeNode& n : tree.nodes)
        rows.insert(rows.end(), target.begin() + size_t(n.token) * V, target.begin() + size_t(n.token + 1) * V);
      verify(tree, rows.data(), target_sampler, path, emitted);
      drafter.accepted(root, tree, path, nullptr);
      out.drafted += tree.size();
      out.accepted += int64_t(path.size());
      tokens.insert(tokens.end(), emitted.begin(), emitted.end());
      root = emitted.back();
    }
    tokens.resize(kLength);
    ++out.observed[tokens];
  }
  return out;
}

TEST(SpecSamplingPower, NgramPointMassDraftsKeepPlainSamplingExact) {
  const std::vector<float> target = make_pair(0.0f).target;
  // The prompt holds kStart followed by the target's most likely continuation, then one more
  // token: the root kStart matches and the chain proposes that continuation.
  std::vector<int32_t> prompt = {kStart};
  for (int32_t i = 0; i < 4; ++i) {
    const float* row = target.data() + size_t(prompt.back()) * V;
    prompt.push_back(int32_t(std::max_element(row, row + V) - row));
  }
  const auto exact = exact_sequences(target, filters());
  const TreeParams chain{3, 1, 4};
  const Outcome o = run_ngram_case(prompt, chain, library_verifier(), target, kSamples, 400);
  const auto [stat, crit] = chi_square(exact, o.observed, kSamples);
  const double rate = double(o.accepted) / double(o.drafted);
  std::printf("ngram chain: chi-square %.1f (critical %.1f), acceptance %.3f of %lld drafted\n", stat, crit, rate,
              (long long)o.drafted);
  EXPECT_LT(stat, crit) << "n-gram drafts verified by the library";
  // Both branches of the rejection sampler ran often.
  EXPECT_GE(o.drafted, int64_t(kSamples));
  EXPECT_GT(rate, 0.15);
  EXPECT_LT(rate, 0.85);
  const Outcome bad = run_ngram_case(prompt, chain, written_out(Mutation::bonus_from_p), target, kSamples, 500);
  const auto [bstat, bcrit] = chi_square(exact, bad.observed, kSamples);
  std::printf("ngram chain, bonus from p: chi-square %.1f (critical %.1f)\n", bstat, bcrit);
  EXPECT_GT(bstat, bcrit) << "redrawing a rejected point-mass draft's token must bias the output";
}

// --- Penalties: the target's rows transformed with each node's own history ------------------
//
// The same Markov target, but every row is transformed by a Penalizer (logit bias, repeat,
// presence and frequency penalties) with the sequence's history: kStart (the prompt), the tokens
// generated so far and, for a tree node's row, the node's path from the root (its ancestors and
// itself). The filters add min-p. Plain sampling's exact distribution over kLength tokens is
// enumerated with the same Penalizer. The drafts stay unpenalised (q is the raw draft row).
// Broken variants, verified by the same library verifier, must FAIL: the history without the
// path's own tokens (every row penalised with the committed tokens only), and the history of the
// tree's flattened order (every node before it, siblings and cousins included).
// Power: N = kSamples = 20,000 as above, two filter settings. With top-k 4, top-p 0.9 and min-p
// 0.12 the mutants move tokens across the cuts and emit sequences that penalised plain sampling
// gives probability 0, so their statistic is astronomical (> 1e14 in this test's runs). With
// temperature alone (no cuts: df about 100, critical value 156) the wrong histories change
// probabilities only; (statistic - df) / N estimated w2 at 0.64 and 1.2 (path left out, chain and
// tree) and 0.068 (siblings included, the weakest). With w2 = 0.068, lambda = N w2 = 1360: the
// statistic has mean df + lambda = 1460 and standard deviation sqrt(2 (df + 2 lambda)) = 75, so
// falling under 156 is a 17-sigma event. The correct history passed with 19 and 12 (critical 62)
// and 98 and 108 (critical 156).
enum class PenaltyHistory { node_path, committed_only, tree_order };

PenaltyParams strong_penalties() {
  PenaltyParams p;
  p.repeat_penalty = 1.6f;
  p.repeat_last_n = 3;
  p.presence_penalty = 0.6f;
  p.frequency_penalty = 0.8f;
  p.logit_bias = {{1, 0.7f}, {4, -0.5f}};
  return p;
}

SamplingParams penalised_filters() {
  SamplingParams sp = filters();
  sp.min_p = 0.12f;
  return sp;
}

// Temperature alone: no cut, so a wrong history changes probabilities without changing the
// support, and the test must see that too.
SamplingParams no_cuts() {
  SamplingParams sp = filters();
  sp.top_k = 0;
  sp.top_p = 1.0f;
  return sp;
}

// The tokens a node's row is penalised with after the committed history (see PenaltyHistory).
void history_of(const DraftTree& tree, int32_t node, PenaltyHistory h, std::vector<int32_t>& out) {
  out.clear();
  if (h == PenaltyHistory::committed_only) return;
  if (h == PenaltyHistory::tree_order) {
    for (int32_t j = 0; j <= node; ++j) out.push_back(tree.nodes[j].token);
    return;
  }
  for (int32_t i = node; i >= 0; i = tree.nodes[i].parent) out.push_back(tree.nodes[i].token);
  std::reverse(out.begin(), out.end());
}

Outcome run_penalised_case(const Case& c, PenaltyHistory h, const SamplingParams& sp, int n_samples, uint64_t seed,
                           const PenaltyParams& penalties = strong_penalties(),
                           const std::shared_ptr<const TokenConstraint>& grammar = nullptr) {
  const MarkovPair m = make_pair(c.sigma);
  Sampler target_sampler([&] { SamplingParams t = sp; t.seed = seed; return t; }(), V);
  Sampler draft_sampler([&] { SamplingParams d = sp; d.seed = seed + 1; return d; }(), V);
  DraftSampling sampling;
  sampling.sampler = &draft_sampler;
  MarkovExpander expander(m.draft);
  TreeBuilder builder;
  TreeSamplingVerifier verifier(V);
  Penalizer pen(penalties, V, matcher_for(grammar, sp));
  const std::vector<int32_t> prompt = {kStart};
  DraftTree tree;
  std::vector<float> rows;
  std::vector<int32_t> path, emitted, tokens, history;
  Outcome out;
  for (int i = 0; i < n_samples; ++i) {
    tokens.clear();
    pen.begin(prompt, kLength + 8);
    while (int32_t(tokens.size()) < kLength) {
      expander.context = tokens.empty() ? kStart : tokens.back();
      builder.build(c.tree, expander, tree, &sampling);
      rows.assign(m.target.begin() + size_t(expander.context) * V, m.target.begin() + size_t(expander.context + 1) * V);
      for (const TreeNode& n : tree.nodes)
        rows.insert(rows.end(), m.target.begin() + size_t(n.token) * V, m.target.begin() + size_t(n.token + 1) * V);
      pen.apply(rows.data());
      for (int32_t k = 0; k < tree.size(); ++k) {
        history_of(tree, k, h, history);
        pen.apply(rows.data() + size_t(k + 1) * V, history);
      }
      verifier.accept(tree, rows.data(), V, target_sampler, path, emitted);
      out.drafted += tree.size();
      out.accepted += int64_t(path.size());
      bool refused = false;  // a wrong grammar state let through a token the grammar refuses
      for (int32_t t : emitted) {
        try {
          pen.accept(t);
        } catch (const Error&) {
          refused = true;
        }
      }
      tokens.insert(tokens.end(), emitted.begin(), emitted.end());
      if (refused) break;  // a sequence of exact probability 0, whatever follows
    }
    tokens.resize(kLength);
    ++out.observed[tokens];
  }
  return out;
}

// One speculative history rule verified under transformed target rows (penalties, a grammar or
// both), against the exact transformed plain distribution.
struct HistoryRun {
  const Case& c;
  PenaltyHistory h;
  bool must_pass;
  const char* what;
};
using FilterSetting = std::pair<const char*, SamplingParams>;

// Each run under each filter setting must pass (or, a broken rule, fail) the chi-square test, and
// the transform must move the exact distribution far from the untransformed one (else a passing
// run would prove nothing).
void check_transformed_sampling(std::span<const HistoryRun> runs, std::span<const FilterSetting> settings,
                                const PenaltyParams& penalties, const std::shared_ptr<const TokenConstraint>& grammar,
                                uint64_t seed) {
  for (const auto& [filter_name, sp] : settings) {
    const auto exact = exact_sequences(make_pair(1.0f).target, sp, penalties, grammar);
    const auto plain = exact_sequences(make_pair(1.0f).target, sp);
    double tv = 0.0;
    for (const auto& [seq, p] : exact) tv += std::abs(p - (plain.count(seq) ? plain.at(seq) : 0.0));
    for (const auto& [seq, p] : plain) tv += exact.count(seq) ? 0.0 : p;
    EXPECT_GT(tv / 2, 0.2) << filter_name << ": total variation between transformed and untransformed sampling";
    for (const HistoryRun& r : runs) {
      const Outcome o = run_penalised_case(r.c, r.h, sp, kSamples, seed += 10, penalties, grammar);
      const auto [stat, crit] = chi_square(exact, o.observed, kSamples);
      const double rate = double(o.accepted) / double(o.drafted);
      std::printf("%s, %s, %s: chi-square %.1f (critical %.1f), statistic / N %.4f, acceptance %.3f\n",
                  r.c.name.c_str(), filter_name, r.what, stat, crit, stat / kSamples, rate);
      if (r.must_pass)
        EXPECT_LT(stat, crit) << r.c.name << ", " << filter_name << ", " << r.what;
      else
        EXPECT_GT(stat, crit) << r.c.name << ", " << filter_name << ", " << r.what << ": a wrong history must fail";
      EXPECT_GT(rate, 0.1) << r.c.name;  // drafts are accepted at times and rejected at times
      EXPECT_LT(rate, 0.9) << r.c.name;
    }
  }
}

TEST(SpecSamplingPower, PenalisedSpeculativeSamplingMatchesPenalisedPlainAndBrokenHistoriesFail) {
  const Case chain{"penalties, medium draft (sigma 1), chain", 1.0f, kChain};
  const Case tree{"penalties, medium draft (sigma 1), wide tree", 1.0f, kWideTree};
  const HistoryRun runs[] = {
      {chain, PenaltyHistory::node_path, true, "node path (correct)"},
      {tree, PenaltyHistory::node_path, true, "node path (correct)"},
      {chain, PenaltyHistory::committed_only, false, "committed history only (path left out)"},
      {tree, PenaltyHistory::committed_only, false, "committed history only (path left out)"},
      {tree, PenaltyHistory::tree_order, false, "flattened tree order (siblings included)"},
  };
  const FilterSetting settings[] = {{"top-k 4, top-p 0.9, min-p 0.12", penalised_filters()}, {"no cuts", no_cuts()}};
  check_transformed_sampling(runs, settings, strong_penalties(), nullptr, 600);
}

// --- Structured output: the target's rows masked by a grammar, each for its node's own path ---
//
// The six tokens spell the letters a-f; the grammar allows after a only b or c, after b only a, d
// or e, after c anything but c, and anything after the others (a regular language written as one
// rule per last letter). Every target row is masked by a GrammarMatcher for its history, as
// Penalizer applies it in the decoder: the committed tokens plus the node's path. The drafts stay
// unmasked (q is the raw draft row), so the verifier meets drafts the grammar refuses. The exact
// distribution of masked plain sampling is enumerated with the same matcher. Masking with the
// committed history only (the path left out) must FAIL: it lets a node's row allow what its own
// path forbids. Both mask depths run: top-k 4 masks only the tokens ranked above the 4th allowed
// one, top-k off the whole row. Power: as for the penalties, the wrong history emits sequences of
// exact probability 0, so its statistic is astronomical; the correct one must pass at 1e-4.
std::shared_ptr<const TokenConstraint> letter_grammar() {
  Grammar::Builder b;
  const char* letters = "abcdef";
  std::vector<Symbol> after(6);
  for (int i = 0; i < 6; ++i) after[size_t(i)] = b.rule(std::string("after-") + letters[i]);
  auto allowed_after = [](int prev, int next) {
    if (prev == 0) return next == 1 || next == 2;
    if (prev == 1) return next == 0 || next == 3 || next == 4;
    if (prev == 2) return next != 2;
    return true;
  };
  for (int prev = 0; prev < 6; ++prev) {
    b.add(after[size_t(prev)], {});
    for (int next = 0; next < 6; ++next)
      if (allowed_after(prev, next))
        b.add(after[size_t(prev)], b.lit(std::string(1, letters[next])) + Sequence{after[size_t(next)]});
  }
  // The sampled sequence follows kStart (token 0, a): the grammar starts after an a.
  static_assert(kStart == 0);
  const Grammar g = std::move(b).build(after[0]);
  std::vector<std::string> pieces;
  for (int i = 0; i < V; ++i) pieces.push_back(std::string(1, letters[i]));
  return std::make_shared<TokenConstraint>(g, std::make_shared<GrammarVocabulary>(pieces, std::vector<int32_t>{}));
}

TEST(SpecSamplingPower, GrammarMaskedSpeculativeSamplingMatchesMaskedPlainAndTheCommittedStateFails) {
  const Case chain{"grammar, medium draft (sigma 1), chain", 1.0f, kChain};
  const Case tree{"grammar, medium draft (sigma 1), wide tree", 1.0f, kWideTree};
  const HistoryRun runs[] = {
      {chain, PenaltyHistory::node_path, true, "node path (correct)"},
      {tree, PenaltyHistory::node_path, true, "node path (correct)"},
      {tree, PenaltyHistory::committed_only, false, "committed state only (path left out)"},
  };
  const FilterSetting settings[] = {{"top-k 4, top-p 0.9", filters()}, {"no cuts", no_cuts()}};
  check_transformed_sampling(runs, settings, {}, letter_grammar(), 900);
}

}  // namespace
}  // namespace microspec
