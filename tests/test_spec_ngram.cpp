// N-gram (prompt-lookup) drafting: the matcher against a brute-force search, its edge cases
// (empty context, a match at the very end, repeated tokens, the context limit), the drafter's
// chain and point-mass draft distributions, and the "n-gram first, else a fallback" combination's
// hand-over rules (which drafter drafts, whose verification resume applies, who learns the
// committed tokens). Lossless decoding with these drafters: test_spec_tiny.cpp (tiny models),
// tests/python/test_spec_ngram.py (real models); exact sampling: test_spec_sampling_power.cpp.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "sampling/sampler.h"
#include "speculative/ngram.h"
#include "test_helpers.h"

namespace microspec {
namespace {

using test::error_of;

NgramIndex index_of(std::vector<int32_t> tokens, NgramParams p, int32_t capacity = 64) {
  NgramIndex ix(p, capacity);
  ix.reset(tokens);
  return ix;
}

std::vector<int32_t> continuation(const NgramIndex& ix, int32_t n) {
  std::vector<int32_t> out;
  ix.continuation(ix.longest_match(), n, out);
  return out;
}

// The reference: the longest n in [min_n, max_n] whose suffix occurs ending earlier, at its most
// recent earlier end.
NgramMatch brute_force(const std::vector<int32_t>& t, NgramParams p) {
  const int32_t len = int32_t(t.size());
  for (int32_t n = std::min(p.max_n, len - 1); n >= p.min_n; --n)
    for (int32_t end = len - 2; end - n + 1 >= 0; --end)
      if (std::equal(t.begin() + (end - n + 1), t.begin() + end + 1, t.begin() + (len - n))) return {n, end + 1};
  return {};
}

TEST(NgramIndex, EmptyContextAndNoEarlierOccurrence) {
  NgramIndex ix = index_of({}, {1, 4});
  EXPECT_EQ(ix.longest_match().length, 0);
  ix.push(7);  // one token: nothing earlier to match
  EXPECT_EQ(ix.longest_match().length, 0);
  ix.push(8);
  ix.push(9);
  EXPECT_EQ(ix.longest_match().length, 0);
  std::vector<int32_t> out = {1, 2};
  EXPECT_EQ(ix.continuation(ix.longest_match(), 4, out), 0);
  EXPECT_TRUE(out.empty());
}

TEST(NgramIndex, MatchAtTheVeryEndCopiesWithOverlap) {
  // Suffix [5, 6] occurred at the start, followed by 7; the continuation runs into the suffix
  // itself and then repeats what it just drafted.
  NgramIndex ix = index_of({5, 6, 7, 5, 6}, {1, 4});
  const NgramMatch m = ix.longest_match();
  EXPECT_EQ(m.length, 2);
  EXPECT_EQ(m.next, 2);
  EXPECT_EQ(continuation(ix, 6), (std::vector<int32_t>{7, 5, 6, 7, 5, 6}));
  EXPECT_EQ(continuation(ix, 1), (std::vector<int32_t>{7}));
  EXPECT_EQ(continuation(ix, 0), (std::vector<int32_t>{}));
}

TEST(NgramIndex, RepeatedTokensPredictTheRepetition) {
  NgramIndex ix = index_of({7, 7, 7, 7}, {1, 4});
  const NgramMatch m = ix.longest_match();
  EXPECT_EQ(m.length, 3);  // [7 7 7] ends at index 2; the suffix itself does not count
  EXPECT_EQ(m.next, 3);
  EXPECT_EQ(continuation(ix, 5), (std::vector<int32_t>(5, 7)));
  // Two tokens: the only earlier occurrence of [7] ends at 0.
  NgramIndex two = index_of({7, 7}, {1, 4});
  EXPECT_EQ(two.longest_match().length, 1);
  EXPECT_EQ(two.longest_match().next, 1);
}

TEST(NgramIndex, LongestMatchWinsThenTheMostRecent) {
  // [1 2] last occurred before 8, but [3 1 2] occurred (once) before 9: the longer match wins.
  NgramIndex ix = index_of({3, 1, 2, 9, 4, 1, 2, 8, 3, 1, 2}, {1, 4});
  EXPECT_EQ(ix.longest_match().length, 3);
  EXPECT_EQ(continuation(ix, 1), (std::vector<int32_t>{9}));
  // Same length twice: the most recent occurrence.
  NgramIndex recent = index_of({1, 2, 9, 1, 2, 8, 1, 2}, {1, 4});
  EXPECT_EQ(recent.longest_match().length, 2);
  EXPECT_EQ(continuation(recent, 1), (std::vector<int32_t>{8}));
  // max_n caps the length tried; min_n is the shortest.
  NgramIndex capped = index_of({3, 1, 2, 9, 4, 1, 2, 8, 3, 1, 2}, {1, 2});
  EXPECT_EQ(capped.longest_match().length, 2);
  EXPECT_EQ(continuation(capped, 1), (std::vector<int32_t>{8}));
  EXPECT_EQ(index_of({1, 5, 2, 5}, {2, 4}).longest_match().length, 0);
  EXPECT_EQ(index_of({1, 5, 2, 5}, {1, 4}).longest_match().length, 1);
}

TEST(NgramIndex, AgreesWithBruteForceOnRandomContexts) {
  // A 3-token alphabet makes every length match often; incremental pushes and resets alike.
  std::mt19937 rng(5);
  for (const NgramParams p : {NgramParams{1, 1}, NgramParams{1, 4}, NgramParams{2, 6}, NgramParams{3, 3}}) {
    for (int32_t alphabet : {2, 3, 50}) {
      std::uniform_int_distribution<int32_t> tok(0, alphabet - 1);
      std::vector<int32_t> ctx;
      NgramIndex ix(p, 400);
      ix.reset(ctx);
      for (int32_t i = 0; i < 400; ++i) {
        ctx.push_back(tok(rng));
        ix.push(ctx.back());
        const NgramMatch want = brute_force(ctx, p), got = ix.longest_match();
        ASSERT_EQ(got.length, want.length) << "at " << i << " alphabet " << alphabet << " n " << p.min_n << ".." << p.max_n;
        ASSERT_EQ(got.next, want.next) << "at " << i;
      }
      // reset() forgets the old context and indexes the new one in one go.
      std::vector<int32_t> fresh(ctx.begin() + 100, ctx.begin() + 220);
      ix.reset(fresh);
      EXPECT_EQ(ix.longest_match().length, brute_force(fresh, p).length);
      EXPECT_EQ(ix.longest_match().next, brute_force(fresh, p).next);
    }
  }
}

TEST(NgramIndex, ContextLimitAndBadParameters) {
  NgramIndex ix({1, 3}, 4);
  EXPECT_NE(error_of([&] { ix.reset(std::vector<int32_t>{1, 2, 3, 4, 5}); }).find("exceed the capacity 4"),
            std::string::npos);
  ix.reset(std::vector<int32_t>{1, 2, 1});
  ix.push(2);  // full now, and still matches
  EXPECT_EQ(ix.size(), 4);
  EXPECT_EQ(ix.longest_match().length, 2);
  EXPECT_EQ(continuation(ix, 3), (std::vector<int32_t>{1, 2, 1}));
  EXPECT_NE(error_of([&] { ix.push(3); }).find("the context is full (4 tokens)"), std::string::npos);
  EXPECT_NE(error_of([] { NgramIndex bad({3, 2}, 10); }).find("ngram-min 3, ngram-max 2"), std::string::npos);
  EXPECT_NE(error_of([] { NgramIndex bad({0, 2}, 10); }).find("1 <= ngram-min"), std::string::npos);
  EXPECT_NE(error_of([] { NgramIndex bad({1, 2}, 0); }).find("capacity"), std::string::npos);
}

TEST(NgramDrafter, DraftsAChainWithPointMassesAndFollowsTheCommittedTokens) {
  NgramDrafter d({2, 4}, 64);
  d.begin({10, 11, 12, 13, 14, 10}, {});
  DraftTree tree;
  // Context 10 11 12 13 14 10 | root 11: [10 11] matches, 12 13 14 10 follow.
  d.propose(11, 6, TreeParams{3, 1, 4}, nullptr, tree);
  ASSERT_EQ(tree.size(), 4);
  const int32_t want[] = {12, 13, 14, 10};
  for (int32_t i = 0; i < 4; ++i) {
    EXPECT_EQ(tree.nodes[i].token, want[i]);
    EXPECT_EQ(tree.nodes[i].parent, i - 1);
    EXPECT_EQ(tree.nodes[i].depth, i + 1);
  }
  EXPECT_TRUE(tree.q.empty()) << "greedy trees carry no draft distributions";
  // The target kept 12 and 13 (bonus 99): the context is now ... 10 11 12 13 and the root is 99.
  const std::vector<int32_t> path = {0, 1};
  d.accepted(11, tree, path, nullptr);
  EXPECT_EQ(d.index().size(), 9);
  // No match of >= 2 tokens for [13 99]: nothing drafted, the root still joins the context.
  d.propose(99, 9, TreeParams{3, 1, 4}, nullptr, tree);
  EXPECT_EQ(tree.size(), 0);
  d.accepted(99, tree, {}, nullptr);
  EXPECT_EQ(d.index().size(), 10);
  // A step that did not draft at all (no room): accepted() alone adds the root.
  d.accepted(12, tree, {}, nullptr);
  EXPECT_EQ(d.index().tokens().back(), 12);

  // Sampling: every expanded node's q is the point mass on its child; the leaf has none. The
  // chain stops at tree-tokens.
  d.begin({1, 2, 3, 4, 5, 6, 1}, {});
  Sampler sampler(SamplingParams{}, 16);
  DraftSampling sampling;
  sampling.sampler = &sampler;
  d.propose(2, 7, TreeParams{0, 1, 3}, &sampling, tree);
  ASSERT_EQ(tree.size(), 3);
  ASSERT_EQ(tree.q.size(), 4u);
  for (int32_t i = 0; i < 3; ++i) EXPECT_EQ(tree.q[i], (TokenDistribution{{3 + i, 1.0f}}));
  EXPECT_TRUE(tree.q[3].empty());
  EXPECT_TRUE(d.fits(TreeParams{0, 1, 3}, 4));
  EXPECT_FALSE(d.fits(TreeParams{0, 1, 3}, 3));
}

// A fallback that records what it is told and drafts one fixed token.
class RecordingDrafter final : public Drafter {
 public:
  int32_t proposes = 0;
  std::vector<int32_t> committed;  // roots and accepted tokens, as told
  std::vector<int32_t> seen_tree_sizes;
  int32_t prompt_top_k() const override { return 3; }
  void begin(const std::vector<int32_t>& prompt, std::span<const int32_t>) override { committed = prompt; }
  void propose(int32_t, int32_t, const TreeParams&, DraftSampling*, DraftTree& tree) override {
    ++proposes;
    tree.clear();
    tree.nodes.push_back({42, -1, 1, 0.0f, 0});
  }
  void accepted(int32_t root, const DraftTree& tree, std::span<const int32_t> path, const float*) override {
    committed.push_back(root);
    for (int32_t p : path) committed.push_back(tree.nodes[p].token);
    seen_tree_sizes.push_back(tree.size());
  }
  bool fits(const TreeParams&, int32_t room) const override { return room > 8; }
  double lm_head_seconds() const override { return 1.5; }
  VerifyResume resume_for(const DraftTree&) const override { return {2, 5, &kActivation}; }
  int32_t active_vocab_size() const override { return 77; }
  static constexpr float kActivation = 0.0f;
};

TEST(NgramFirstDrafter, LongMatchesDraftElseTheFallbackAndOnlyItsTreeResumes) {
  auto fallback = std::make_unique<RecordingDrafter>();
  RecordingDrafter& fb = *fallback;
  NgramFirstDrafter d({1, 4}, 3, 64, std::move(fallback));
  EXPECT_EQ(d.prompt_top_k(), 3);
  const std::vector<int32_t> prompt = {5, 6, 7, 8, 9, 5, 6};
  d.begin(prompt, {});
  EXPECT_EQ(fb.committed, prompt);
  DraftTree tree;
  const TreeParams chain{3, 1, 4};
  // Root 7: [5 6 7] matches 3 tokens (>= ngram-first 3): the n-gram side drafts 8 9 5 6.
  d.propose(7, 7, chain, nullptr, tree);
  EXPECT_EQ(fb.proposes, 0);
  ASSERT_EQ(tree.size(), 4);
  EXPECT_EQ(tree.nodes[0].token, 8);
  EXPECT_EQ(d.resume_for(tree).rows, 0) << "an n-gram tree has nothing to resume";
  EXPECT_EQ(d.active_vocab_size(), 0);
  // The target kept 8; the bonus is 1. Both sides learn root + path.
  const std::vector<int32_t> path = {0};
  d.accepted(7, tree, path, nullptr);
  EXPECT_EQ(fb.committed, (std::vector<int32_t>{5, 6, 7, 8, 9, 5, 6, 7, 8}));
  EXPECT_EQ(fb.seen_tree_sizes, (std::vector<int32_t>{4}));
  // Root 1: [8 1] has no earlier occurrence, [1] neither: the fallback drafts, and its resume applies.
  d.propose(1, 9, chain, nullptr, tree);
  EXPECT_EQ(fb.proposes, 1);
  ASSERT_EQ(tree.size(), 1);
  EXPECT_EQ(tree.nodes[0].token, 42);
  EXPECT_EQ(d.resume_for(tree).rows, 2);
  EXPECT_EQ(d.resume_for(tree).layer, 5);
  EXPECT_EQ(d.active_vocab_size(), 77);
  d.accepted(1, tree, {}, nullptr);
  EXPECT_EQ(d.resume_for(tree).rows, 0) << "a later step must not reuse the fallback's resume";
  // Root 9: [9] matches but only 1 token (< 3): the fallback again.
  d.propose(9, 10, chain, nullptr, tree);
  EXPECT_EQ(fb.proposes, 2);
  EXPECT_EQ(d.ngram_steps(), 1);
  EXPECT_EQ(d.fallback_steps(), 2);
  EXPECT_DOUBLE_EQ(d.lm_head_seconds(), 1.5);
  EXPECT_FALSE(d.fits(chain, 8)) << "the fallback's room rule holds";
  EXPECT_NE(error_of([] { NgramFirstDrafter bad({2, 4}, 5, 64, std::make_unique<RecordingDrafter>()); })
                .find("--ngram-first must be in [ngram-min, ngram-max] = [2, 4], got 5"),
            std::string::npos);
  EXPECT_NE(error_of([] { NgramFirstDrafter bad({2, 4}, 3, 64, nullptr); }).find("fallback"), std::string::npos);
}

}  // namespace
}  // namespace microspec
