// Penalties and logit bias (sampling/penalties.h) and the min-p filter (sampling/sampler.h):
// each rule against values worked out by hand.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "sampling/penalties.h"
#include "sampling/sampler.h"
#include "util/error.h"

namespace microspec {
namespace {

constexpr int32_t V = 8;

std::vector<float> row() { return {2.0f, -1.0f, 0.5f, 3.0f, -2.0f, 0.0f, 1.0f, 4.0f}; }

TEST(Penalizer, LogitBiasAddsToItsTokensOnly) {
  PenaltyParams p;
  p.logit_bias = {{1, 5.0f}, {7, -100.0f}};
  Penalizer pen(p, V);
  pen.begin(std::vector<int32_t>{3, 3}, 16);
  std::vector<float> r = row();
  pen.apply(r.data());
  std::vector<float> want = row();
  want[1] += 5.0f;
  want[7] -= 100.0f;
  EXPECT_EQ(r, want);
}

TEST(Penalizer, RepeatPenaltyDividesPositiveMultipliesNegativeOncePerDistinctToken) {
  PenaltyParams p;
  p.repeat_penalty = 2.0f;
  p.repeat_last_n = 3;
  Penalizer pen(p, V);
  pen.begin(std::vector<int32_t>{0, 1, 3, 3}, 16);  // window: 1, 3, 3 (token 0 fell out)
  std::vector<float> r = row();
  pen.apply(r.data());
  std::vector<float> want = row();
  want[1] = -2.0f;  // negative: multiplied
  want[3] = 1.5f;   // positive: divided once, though it occurs twice
  EXPECT_EQ(r, want);
  // A path after the history shifts the window: 3, then the path 4, 5.
  r = row();
  pen.apply(r.data(), std::vector<int32_t>{4, 5});
  want = row();
  want[3] = 1.5f;
  want[4] = -4.0f;
  want[5] = 0.0f;  // zero counts as non-positive: multiplied (stays 0)
  EXPECT_EQ(r, want);
  // -1: the whole context; 0: off.
  p.repeat_last_n = -1;
  Penalizer whole(p, V);
  whole.begin(std::vector<int32_t>{0, 1, 3, 3}, 16);
  r = row();
  whole.apply(r.data());
  EXPECT_EQ(r[0], 1.0f);
  p.repeat_last_n = 0;
  Penalizer off(p, V);
  EXPECT_FALSE(off.active());
}

TEST(Penalizer, PresenceAndFrequencyCountGeneratedTokensOnly) {
  PenaltyParams p;
  p.presence_penalty = 0.5f;
  p.frequency_penalty = 0.25f;
  Penalizer pen(p, V);
  pen.begin(std::vector<int32_t>{6, 6, 6}, 16);  // prompt tokens are not counted
  pen.accept(2);
  pen.accept(2);
  pen.accept(7);
  std::vector<float> r = row();
  pen.apply(r.data());
  std::vector<float> want = row();
  want[2] -= 0.5f + 2 * 0.25f;
  want[7] -= 0.5f + 0.25f;
  EXPECT_EQ(r, want);
  // A path counts as generated, and leaves the counts as they were.
  r = row();
  pen.apply(r.data(), std::vector<int32_t>{7, 1});
  want = row();
  want[2] -= 0.5f + 2 * 0.25f;
  want[7] -= 0.5f + 2 * 0.25f;
  want[1] -= 0.5f + 0.25f;
  EXPECT_EQ(r, want);
  r = row();
  pen.apply(r.data());
  EXPECT_EQ(r[1], row()[1]);
  // Starting again forgets the generated tokens.
  pen.begin(std::vector<int32_t>{2}, 16);
  r = row();
  pen.apply(r.data());
  EXPECT_EQ(r, row());
}

TEST(Penalizer, PathEqualsAcceptingItsTokens) {
  PenaltyParams p;
  p.repeat_penalty = 1.3f;
  p.repeat_last_n = 4;
  p.presence_penalty = -0.4f;
  p.frequency_penalty = 0.9f;
  p.logit_bias = {{5, 2.0f}};
  const std::vector<int32_t> prompt = {1, 2, 3}, path = {4, 2, 4};
  Penalizer a(p, V), b(p, V);
  a.begin(prompt, 16);
  b.begin(prompt, 16);
  a.accept(6);
  b.accept(6);
  for (int32_t t : path) b.accept(t);
  std::vector<float> ra = row(), rb = row();
  a.apply(ra.data(), path);
  b.apply(rb.data());
  EXPECT_EQ(ra, rb);
}

TEST(Penalizer, RejectsInvalidSettings) {
  auto make = [](auto edit) {
    PenaltyParams p;
    edit(p);
    Penalizer pen(p, V);
  };
  EXPECT_THROW(make([](PenaltyParams& p) { p.repeat_penalty = 0.0f; }), Error);
  EXPECT_THROW(make([](PenaltyParams& p) { p.repeat_last_n = -2; }), Error);
  EXPECT_THROW(make([](PenaltyParams& p) { p.presence_penalty = 2.5f; }), Error);
  EXPECT_THROW(make([](PenaltyParams& p) { p.frequency_penalty = -2.5f; }), Error);
  EXPECT_THROW(make([](PenaltyParams& p) { p.logit_bias = {{V, 1.0f}}; }), Error);
  EXPECT_THROW(make([](PenaltyParams& p) { p.logit_bias = {{0, 101.0f}}; }), Error);
  EXPECT_NO_THROW(make([](PenaltyParams& p) { p.logit_bias = {{V - 1, -100.0f}}; }));
}

TEST(Penalizer, NamesTheFirstActiveSetting) {
  PenaltyParams p;
  EXPECT_EQ(first_active_penalty(p, 0.0f), nullptr);
  EXPECT_STREQ(first_active_penalty(p, 0.1f), "min_p");
  p.repeat_penalty = 1.1f;
  EXPECT_STREQ(first_active_penalty(p, 0.0f), "repeat_penalty");
  p.frequency_penalty = 0.1f;
  EXPECT_STREQ(first_active_penalty(p, 0.0f), "frequency_penalty");
}

TEST(SamplerMinP, KeepsTokensWithAtLeastMinPTimesTheTopProbability) {
  // At temperature 1, p_i / p_max = exp(l_i - l_max): 1, e^-1 = 0.37, e^-2 = 0.14, e^-3 = 0.05.
  const std::vector<float> logits = {0.0f, -1.0f, -2.0f, -3.0f};
  for (const auto& [min_p, kept] : std::vector<std::pair<float, size_t>>{{0.0f, 4}, {0.1f, 3}, {0.3f, 2}, {0.5f, 1}}) {
    for (int top_k : {0, 3, 4}) {
      SamplingParams sp;
      sp.temperature = 2.0f;  // min-p runs before temperature: the kept set does not change
      sp.top_k = top_k;
      sp.top_p = 1.0f;
      sp.min_p = min_p;
      Sampler s(sp, 4);
      std::vector<std::pair<int32_t, float>> dist;
      s.distribution(logits.data(), dist);
      EXPECT_EQ(dist.size(), std::min(kept, size_t(top_k > 0 ? top_k : 4))) << "min_p " << min_p << " top_k " << top_k;
      for (const auto& [id, prob] : dist) EXPECT_LT(size_t(id), kept);
      // sample() draws from that set only.
      for (int i = 0; i < 200; ++i) EXPECT_LT(size_t(s.sample(logits.data())), kept);
    }
  }
  SamplingParams bad;
  bad.min_p = 1.5f;
  EXPECT_THROW(Sampler(bad, 4), Error);
}

}  // namespace
}  // namespace microspec
