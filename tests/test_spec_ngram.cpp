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
#include "support/test_helpers.h"

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
  NgramDrafter d({2, 4, 0}, 64);  // min-accept 0: the whole continuation
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

TEST(NgramConfidence, UnseenDepthsAreAHalfAndTheCutFollowsTheCounts) {
  NgramConfidence c(4);
  EXPECT_DOUBLE_EQ(c.rate(2, 1), 0.5);
  // 1/2, 1/4, 1/8 >= 10%, 1/16 is not.
  EXPECT_EQ(c.tokens_worth_drafting(2, 8, 10), 3);
  EXPECT_EQ(c.tokens_worth_drafting(2, 2, 10), 2) << "never more than the continuation has";
  EXPECT_EQ(c.tokens_worth_drafting(2, 8, 0), 8) << "0 percent: the whole continuation";
  EXPECT_EQ(c.tokens_worth_drafting(2, 8, 51), 0);
  // Depth 1 of length-2 matches always held, depth 2 never: one token, whatever the floor.
  for (int i = 0; i < 20; ++i) {
    c.record(2, 1, true);
    c.record(2, 2, false);
  }
  EXPECT_DOUBLE_EQ(c.rate(2, 1), 21.0 / 22.0);
  EXPECT_DOUBLE_EQ(c.rate(2, 2), 1.0 / 22.0);
  EXPECT_EQ(c.tokens_worth_drafting(2, 8, 10), 1);
  EXPECT_EQ(c.tokens_worth_drafting(2, 8, 96), 0);
  EXPECT_EQ(c.tokens_worth_drafting(3, 8, 10), 3) << "each match length counts on its own";
  // Depths past kDepths share the last one's counts.
  c.record(4, NgramConfidence::kDepths + 5, false);
  EXPECT_DOUBLE_EQ(c.rate(4, NgramConfidence::kDepths), 1.0 / 3.0);
  c.reset();
  EXPECT_DOUBLE_EQ(c.rate(2, 2), 0.5);
  EXPECT_NE(error_of([&] { c.rate(5, 1); }).find("match length 5"), std::string::npos);
  EXPECT_NE(error_of([&] { c.record(0, 1, true); }).find("match length 0"), std::string::npos);
  EXPECT_NE(error_of([&] { c.rate(2, 0); }).find("depth 0"), std::string::npos);
  EXPECT_NE(error_of([] { NgramIndex bad({1, 2, 101}, 10); }).find("[0, 100], got 101"), std::string::npos);
}

// A context that repeats one phrase: the chain grows as its tokens keep being accepted, shrinks to
// nothing when the target stops following it, and comes back when the target follows it again,
// because the token after what was committed is observed even when nothing was drafted.
TEST(NgramDrafter, TheCutGrowsShrinksAndRecoversWithTheCommittedTokens) {
  NgramDrafter d({2, 2, 40}, 512);
  const std::vector<int32_t> phrase = {1, 2, 3, 4, 5, 6, 7, 8};
  std::vector<int32_t> prompt;
  for (int r = 0; r < 3; ++r) prompt.insert(prompt.end(), phrase.begin(), phrase.end());
  d.begin(prompt, {});
  DraftTree tree;
  const TreeParams chain{7, 1, 8};
  int32_t pos = int32_t(prompt.size());
  // One step: propose after `root`, the target accepts the first `accept` drafted tokens (all of
  // them when accept < 0). Returns how many were drafted.
  auto step = [&](int32_t root, int32_t accept) {
    d.propose(root, pos, chain, nullptr, tree);
    std::vector<int32_t> path;
    for (int32_t i = 0; i < tree.size() && (accept < 0 || i < accept); ++i) path.push_back(i);
    d.accepted(root, tree, path, nullptr);
    pos += int32_t(path.size()) + 1;
    return std::make_pair(tree.size(), int32_t(path.size()));
  };
  auto next_in_phrase = [&](int32_t token, int32_t ahead) { return phrase[size_t((token - 1 + ahead) % 8)]; };

  // 1. The target follows the phrase: everything drafted is accepted and its next token (the next
  // root) continues the phrase. At 40%, with every count starting at 1 of 2: 1/2 -> one token;
  // then 2/3 * 2/3 -> two; 3/4 * 3/4 * 2/3 -> two; 4/5 * 4/5 * 3/4 -> three; ...
  int32_t root = 1;
  std::vector<int32_t> sizes;
  for (int i = 0; i < 6; ++i) {
    const auto [drafted, accepted] = step(root, -1);
    sizes.push_back(drafted);
    root = next_in_phrase(root, accepted + 1);
  }
  EXPECT_EQ(sizes, (std::vector<int32_t>{1, 2, 2, 3, 3, 4}));
  EXPECT_DOUBLE_EQ(d.confidence().rate(2, 1), 7.0 / 8.0);

  // 2. The target stops following it: after [1 2] it answers a new token every time. Depth 1
  // misses until nothing is drafted any more; it is still observed, so its rate keeps falling.
  int32_t fresh = 100;
  sizes.clear();
  for (int i = 0; i < 12; ++i) {
    step(fresh++, 0);  // no earlier [x fresh]: nothing drafted
    step(1, 0);        // no earlier [fresh 1] either
    sizes.push_back(step(2, 0).first);  // [1 2] matches; its chain 3 4 ... is rejected
  }
  EXPECT_GE(sizes.front(), 1);
  EXPECT_EQ(sizes.back(), 0);
  EXPECT_LT(d.confidence().rate(2, 1), 0.4);

  // 3. The target follows the phrase again: with nothing drafted, each next root still counts as
  // a hit at depth 1, and drafting comes back.
  step(fresh++, 0);
  step(1, 0);
  root = 2;
  sizes.clear();
  for (int i = 0; i < 6; ++i) {
    const auto [drafted, accepted] = step(root, -1);
    sizes.push_back(drafted);
    root = next_in_phrase(root, accepted + 1);
  }
  EXPECT_EQ(sizes.front(), 0);
  EXPECT_GE(sizes.back(), 1);
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
  NgramFirstDrafter d({1, 4, 0}, 3, 64, std::move(fallback));
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
