// EAGLE-2 tree construction, greedy tree acceptance and the draft's top-k log-probabilities, on
// hand-worked examples (log-probabilities are powers of two so every sum is exact).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <vector>

#include "math/select.h"
#include "sampling/sampler.h"
#include "speculative/tree.h"
#include "util/error.h"

namespace microspec {
namespace {

// Proposes children from a table keyed by the candidate's token (-1: the root) and records calls.
class TableExpander : public TreeExpander {
 public:
  std::map<int32_t, std::vector<Proposal>> table;
  std::vector<std::vector<int32_t>> calls;  // frontier candidate ids of each call
  void expand(std::span<const int32_t> frontier, std::span<const TreeNode> cand, int32_t k, DraftSampling*,
              Proposal* out) override {
    calls.emplace_back(frontier.begin(), frontier.end());
    for (size_t i = 0; i < frontier.size(); ++i) {
      const int32_t key = frontier[i] < 0 ? -1 : cand[frontier[i]].token;
      const std::vector<Proposal>& p = table.at(key);
      for (int32_t j = 0; j < k; ++j) out[i * k + j] = j < int32_t(p.size()) ? p[j] : Proposal{-1, 0.0f};
    }
  }
};

TableExpander example() {
  TableExpander e;
  e.table[-1] = {{10, -0.25f}, {11, -0.5f}};
  e.table[10] = {{20, -0.25f}, {21, -1.0f}};
  e.table[11] = {{22, -0.125f}, {23, -2.0f}};
  e.table[20] = {{30, -0.5f}, {31, -0.75f}};
  e.table[22] = {{32, -0.0625f}, {33, -3.0f}};
  return e;
}

struct Expect {
  int32_t token, parent, depth;
  float score;
};

void expect_tree(const DraftTree& t, const std::vector<Expect>& want) {
  ASSERT_EQ(t.size(), int32_t(want.size()));
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(t.nodes[i].token, want[i].token) << "node " << i;
    EXPECT_EQ(t.nodes[i].parent, want[i].parent) << "node " << i;
    EXPECT_EQ(t.nodes[i].depth, want[i].depth) << "node " << i;
    EXPECT_EQ(t.nodes[i].score, want[i].score) << "node " << i;
  }
}

// Candidates (id: token score parent):
//   0: 10 -0.25 root   1: 11 -0.5 root                     frontier after the root: {0, 1}
//   2: 20 -0.5 (0)   3: 21 -1.25 (0)   4: 22 -0.625 (1)   5: 23 -2.5 (1)   frontier: {2, 4}
//   6: 30 -1.0 (2)   7: 31 -1.25 (2)   8: 32 -0.6875 (4)   9: 33 -3.625 (4)
// Rank: 0, 1, 2 (tie with 1 at -0.5: earlier first), 4, 8, 6, 3, 7 (tie at -1.25), 5, 9.
TEST(SpecTree, HandWorkedEagle2Tree) {
  TableExpander e = example();
  TreeBuilder b;
  DraftTree t;
  b.build({/*depth=*/2, /*top_k=*/2, /*total_tokens=*/5}, e, t);
  ASSERT_EQ(e.calls.size(), 3u);
  EXPECT_EQ(e.calls[0], (std::vector<int32_t>{-1}));
  EXPECT_EQ(e.calls[1], (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(e.calls[2], (std::vector<int32_t>{2, 4}));
  expect_tree(t, {{10, -1, 1, -0.25f},
                  {11, -1, 1, -0.5f},
                  {20, 0, 2, -0.5f},
                  {22, 1, 2, -0.625f},
                  {32, 3, 3, -0.6875f}});

  // Two more: candidates 6 (30 under 20) and 3 (21 under 10, which wins its tie with 7).
  e.calls.clear();
  b.build({2, 2, 7}, e, t);
  expect_tree(t, {{10, -1, 1, -0.25f},
                  {11, -1, 1, -0.5f},
                  {20, 0, 2, -0.5f},
                  {21, 0, 2, -1.25f},
                  {22, 1, 2, -0.625f},
                  {30, 2, 3, -1.0f},
                  {32, 4, 3, -0.6875f}});

  // More tokens than candidates: all ten.
  b.build({2, 2, 50}, e, t);
  EXPECT_EQ(t.size(), 10);
}

TEST(SpecTree, ChainDepthZeroAndEmpty) {
  TableExpander e = example();
  TreeBuilder b;
  DraftTree t;
  b.build({/*depth=*/2, /*top_k=*/1, /*total_tokens=*/10}, e, t);  // chain: top-1 each round
  expect_tree(t, {{10, -1, 1, -0.25f}, {20, 0, 2, -0.5f}, {30, 1, 3, -1.0f}});
  b.build({2, 1, 2}, e, t);
  expect_tree(t, {{10, -1, 1, -0.25f}, {20, 0, 2, -0.5f}});

  e.calls.clear();
  b.build({/*depth=*/0, 2, 5}, e, t);  // the root level only
  expect_tree(t, {{10, -1, 1, -0.25f}, {11, -1, 1, -0.5f}});
  EXPECT_EQ(e.calls.size(), 1u);

  e.calls.clear();
  b.build({3, 2, 0}, e, t);  // no draft tokens: the drafter is not even run
  EXPECT_EQ(t.size(), 0);
  EXPECT_TRUE(e.calls.empty());

  EXPECT_THROW(b.build({-1, 2, 5}, e, t), Error);
  EXPECT_THROW(b.build({2, 0, 5}, e, t), Error);
}

// The p-min cut on the example's path log-probabilities (log 0.5 = -0.693, log 0.6 = -0.511):
// a greedy tree drops the candidates below it and does not expand them; a sampled tree keeps
// them but expands only the ones above.
TEST(SpecTree, PathProbabilityCut) {
  TableExpander e = example();
  TreeBuilder b;
  DraftTree t;
  b.build({/*depth=*/2, /*top_k=*/2, /*total_tokens=*/50, /*p_min=*/0.5}, e, t);
  EXPECT_EQ(e.calls[1], (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(e.calls[2], (std::vector<int32_t>{2, 3}));  // 20 and 22; 21 (-1.25) and 23 were not made
  expect_tree(t, {{10, -1, 1, -0.25f},
                  {11, -1, 1, -0.5f},
                  {20, 0, 2, -0.5f},
                  {22, 1, 2, -0.625f},
                  {32, 3, 3, -0.6875f}});  // 30 (-1.0) and 31 fall below it

  e.calls.clear();
  b.build({2, 2, 50, /*p_min=*/0.6}, e, t);
  EXPECT_EQ(e.calls.size(), 3u);
  EXPECT_EQ(e.calls[2], (std::vector<int32_t>{2}));
  expect_tree(t, {{10, -1, 1, -0.25f}, {11, -1, 1, -0.5f}, {20, 0, 2, -0.5f}});

  e.calls.clear();
  b.build({2, 2, 50, /*p_min=*/0.8}, e, t);  // even the root's best child is below: one draft pass
  EXPECT_EQ(t.size(), 0);
  EXPECT_EQ(e.calls.size(), 1u);

  b.build({/*depth=*/5, /*top_k=*/1, 50, /*p_min=*/0.5}, e, t);  // a chain stops at the cut
  expect_tree(t, {{10, -1, 1, -0.25f}, {20, 0, 2, -0.5f}});

  // Sampled: every draw is kept (children in draw order), only 20 is expanded at p-min 0.6.
  DraftSampling sampling;
  sampling.row_q.resize(4);
  e.calls.clear();
  b.build({2, 2, 50, /*p_min=*/0.6}, e, t, &sampling);
  EXPECT_EQ(e.calls.size(), 3u);
  EXPECT_EQ(e.calls[2], (std::vector<int32_t>{2}));
  expect_tree(t, {{10, -1, 1, -0.25f},
                  {11, -1, 1, -0.5f},
                  {20, 0, 2, -0.5f},
                  {21, 0, 2, -1.25f},
                  {22, 1, 2, -0.625f},
                  {23, 1, 2, -2.5f},
                  {30, 2, 3, -1.0f},
                  {31, 2, 3, -1.25f}});
  e.calls.clear();
  b.build({2, 2, 50}, e, t, &sampling);  // off: 20 and 22 are expanded
  EXPECT_EQ(e.calls[2], (std::vector<int32_t>{2, 4}));
  EXPECT_EQ(t.size(), 10);

  EXPECT_THROW(b.build({2, 2, 5, 101}, e, t), Error);
  EXPECT_THROW(b.build({2, 2, 5, -1}, e, t), Error);
}

// All log-probabilities 0: every score ties, and the kept set must still be a connected tree
// (ties rank the earlier candidate, so parents come first).
TEST(SpecTree, TiedScoresKeepTreeConnected) {
  TableExpander e;
  for (int32_t key : {-1, 10, 11, 20, 21, 22, 23})
    e.table[key] = {{key < 0 ? 10 : key + 10, 0.0f}, {key < 0 ? 11 : key + 11, 0.0f}};
  e.table[20] = {{30, 0.0f}, {31, 0.0f}};
  e.table[21] = {{32, 0.0f}, {33, 0.0f}};
  TreeBuilder b;
  DraftTree t;
  b.build({2, 2, 4}, e, t);
  // Rank by id: 10, 11 (root level), then 20, 21 (children of 10).
  expect_tree(t, {{10, -1, 1, 0.0f}, {11, -1, 1, 0.0f}, {20, 0, 2, 0.0f}, {21, 0, 2, 0.0f}});
  for (int32_t total = 1; total <= 10; ++total) {
    b.build({2, 2, total}, e, t);
    for (int32_t i = 0; i < t.size(); ++i) {
      EXPECT_LT(t.nodes[i].parent, i);
      if (t.nodes[i].parent >= 0) EXPECT_EQ(t.nodes[t.nodes[i].parent].depth + 1, t.nodes[i].depth);
    }
  }
}

// Tree for acceptance:  root -> 0 (5) -> 2 (7)
//                             -> 0 (5) -> 3 (8) -> 5 (10)
//                       root -> 1 (6) -> 4 (9)
DraftTree acceptance_tree() {
  DraftTree t;
  const int32_t tok[] = {5, 6, 7, 8, 9, 10}, par[] = {-1, -1, 0, 0, 1, 3};
  for (int i = 0; i < 6; ++i)
    t.nodes.push_back({tok[i], par[i], par[i] < 0 ? 1 : t.nodes[par[i]].depth + 1, 0.0f, i});
  return t;
}

void check_accept(const DraftTree& t, std::vector<int32_t> argmax_rows, std::vector<int32_t> want_path,
                  std::vector<int32_t> want_emitted) {
  std::vector<int32_t> path, emitted;
  accept_greedy(t, argmax_rows, path, emitted);
  EXPECT_EQ(path, want_path);
  EXPECT_EQ(emitted, want_emitted);
}

TEST(SpecAccept, AllBranches) {
  const DraftTree t = acceptance_tree();
  // Rows: root, then nodes 0..5 (row i + 1 is node i). 99 and 98 match nothing.
  check_accept(t, {99, 1, 1, 1, 1, 1, 1}, {}, {99});                       // nothing accepted: bonus only
  check_accept(t, {5, 8, 99, 99, 99, 99, 99}, {0, 3}, {5, 8, 99});         // partial path
  check_accept(t, {5, 8, 99, 99, 10, 99, 42}, {0, 3, 5}, {5, 8, 10, 42});  // full path to a leaf
  check_accept(t, {5, 7, 99, 99, 99, 99, 99}, {0, 2}, {5, 7, 99});         // the other child of node 0
  check_accept(t, {6, 99, 9, 99, 99, 98, 99}, {1, 4}, {6, 9, 98});         // second sibling at the root
  check_accept(t, {6, 99, 10, 99, 99, 99, 99}, {1}, {6, 10});              // 10 exists, but not under node 1

  DraftTree empty;
  check_accept(empty, {17}, {}, {17});
  std::vector<int32_t> path, emitted;
  EXPECT_THROW(accept_greedy(t, std::vector<int32_t>{5, 8}, path, emitted), Error);
}

TEST(SpecAccept, DuplicateSiblingsTakeTheFirst) {
  DraftTree t;
  t.nodes = {{4, -1, 1, 0, 0}, {4, -1, 1, 0, 1}, {6, 1, 2, 0, 2}};
  check_accept(t, {4, 6, 6, 0}, {0}, {4, 6});
}

// Ties in the target's logits: argmax takes the lower id, and acceptance follows it.
TEST(SpecAccept, TargetTiesGoToLowerId) {
  const std::vector<float> row = {0.0f, 2.0f, 1.0f, 2.0f, 2.0f, 2.0f, -1.0f, 0.5f};
  const int32_t a = argmax(row.data(), int64_t(row.size()));
  EXPECT_EQ(a, 1);
  DraftTree t;
  t.nodes = {{5, -1, 1, 0, 0}, {1, -1, 1, 0, 1}};
  check_accept(t, {a, 0, 0}, {1}, {1, 0});
}

TEST(SpecTopK, LogSoftmaxValuesAndTies) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const std::vector<float> logits = {1.0f, 3.0f, ninf, 3.0f, 0.0f, 2.5f};
  Proposal out[4];
  ASSERT_EQ(top_k_logprobs(logits.data(), 6, 3, out), 3);
  const double lse = std::log(std::exp(1.0) + 2 * std::exp(3.0) + std::exp(0.0) + std::exp(2.5));
  EXPECT_EQ(out[0].token, 1);  // tie at 3.0: the lower index first
  EXPECT_EQ(out[1].token, 3);
  EXPECT_EQ(out[2].token, 5);
  EXPECT_NEAR(out[0].logprob, 3.0 - lse, 1e-6);
  EXPECT_EQ(out[0].logprob, out[1].logprob);
  EXPECT_NEAR(out[2].logprob, 2.5 - lse, 1e-6);
  // More than the finite entries: only those, in order.
  Proposal all[6];
  ASSERT_EQ(top_k_logprobs(logits.data(), 6, 6, all), 5);
  EXPECT_EQ(all[3].token, 0);
  EXPECT_EQ(all[4].token, 4);
  for (int j = 0; j < 5; ++j) EXPECT_LE(all[j].logprob, 0.0f);
  const std::vector<float> dead = {ninf, ninf};
  EXPECT_EQ(top_k_logprobs(dead.data(), 2, 2, out), 0);
}

}  // namespace
}  // namespace microspec
