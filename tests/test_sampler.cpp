// Tests for src/sampling: argmax, the sampler's distribution against a brute-force reference, and
// the sampler's draws against that distribution (chi-square, which also rejects known-wrong ones).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <vector>

#include "math/ranked_list.h"
#include "math/select.h"
#include "sampling/sampler.h"
#include "util/error.h"

namespace microspec {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

using Dist = std::vector<std::pair<int32_t, float>>;

SamplingParams make_params(float temperature, int top_k, float top_p, uint64_t seed = 1) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.seed = seed;
  return p;
}

// First index of the largest non-NaN value; -1 if none.
int32_t scalar_argmax(const std::vector<float>& x) {
  int32_t best = -1;
  for (size_t i = 0; i < x.size(); ++i)
    if (!std::isnan(x[i]) && (best < 0 || x[i] > x[best])) best = static_cast<int32_t>(i);
  return best;
}

// Brute-force reference of the documented semantics: full sort, top-k, top-p at T=1 (keeping the
// token that reaches top_p), then softmax(logit / T). Returns id -> probability.
// top_p_shift != 0 keeps that many tokens more (or fewer) after top-p: a deliberate bug.
std::map<int32_t, double> reference_distribution(const std::vector<float>& logits, const SamplingParams& p,
                                                 int top_p_shift = 0) {
  std::map<int32_t, double> out;
  if (p.temperature == 0.0f) {
    out[scalar_argmax(logits)] = 1.0;
    return out;
  }
  std::vector<std::pair<float, int32_t>> items;
  for (size_t i = 0; i < logits.size(); ++i)
    if (logits[i] > -kInf) items.emplace_back(logits[i], static_cast<int32_t>(i));
  std::sort(items.begin(), items.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  if (p.top_k > 0 && static_cast<size_t>(p.top_k) < items.size()) items.resize(p.top_k);
  const float mx = items[0].first;
  // At T=1 (top-p), float exp as the sampler does, so both see the same cumulative sums.
  auto weight = [&](float l, double t) {
    if (mx == kInf) return l == kInf ? 1.0 : 0.0;
    if (t == 1.0) return static_cast<double>(std::exp(l - mx));
    return std::exp((static_cast<double>(l) - mx) / t);
  };
  if (p.top_p < 1.0f) {
    double total = 0;
    for (const auto& it : items) total += weight(it.first, 1.0);
    double cum = 0;
    for (size_t i = 0; i < items.size(); ++i) {
      cum += weight(items[i].first, 1.0);
      if (cum >= p.top_p * total) {
        items.resize(std::clamp<size_t>(i + 1 + top_p_shift, 1, items.size()));
        break;
      }
    }
  }
  double total = 0;
  for (const auto& it : items) total += weight(it.first, p.temperature);
  for (const auto& it : items) {
    const double w = weight(it.first, p.temperature) / total;
    if (w > 0) out[it.second] = w;
  }
  return out;
}

std::map<int32_t, double> as_map(const Dist& d) {
  std::map<int32_t, double> m;
  for (const auto& [id, prob] : d) {
    EXPECT_EQ(m.count(id), 0u) << "duplicate id " << id;
    m[id] = prob;
  }
  return m;
}

// Probabilities below kTiny may underflow to 0 in the sampler's float arithmetic (and be left
// out) while the double reference keeps them; anything larger must match.
constexpr double kTiny = 1e-30;

void expect_same_distribution(const std::map<int32_t, double>& got, const std::map<int32_t, double>& want) {
  for (const auto& [id, prob] : got) ASSERT_TRUE(want.count(id)) << "unexpected id " << id;
  for (const auto& [id, prob] : want) {
    auto it = got.find(id);
    if (prob < kTiny) {
      if (it != got.end()) {
        EXPECT_LT(it->second, 10 * kTiny) << "id " << id;
      }
      continue;
    }
    ASSERT_NE(it, got.end()) << "missing id " << id;
    EXPECT_NEAR(it->second, prob, 1e-6 + 1e-4 * prob) << "id " << id;
  }
}

// Pearson chi-square of observed counts against expected probabilities; infinite if a token with
// expected probability 0 was observed.
double chi_square(const std::map<int32_t, int64_t>& counts, const std::map<int32_t, double>& expected,
                  int64_t n) {
  double chi = 0;
  for (const auto& [id, c] : counts)
    if (!expected.count(id) || expected.at(id) == 0.0) return std::numeric_limits<double>::infinity();
  for (const auto& [id, prob] : expected) {
    const double e = prob * static_cast<double>(n);
    const double o = counts.count(id) ? static_cast<double>(counts.at(id)) : 0.0;
    chi += (o - e) * (o - e) / e;
  }
  return chi;
}

// Chi-square critical values at p = 0.001 for 1..10 degrees of freedom.
double chi_critical(size_t categories) {
  static const double table[] = {10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59};
  return table[std::clamp<size_t>(categories, 2, 11) - 2];
}

std::vector<float> random_logits(int64_t n, uint32_t seed, float scale = 3.0f, float quantum = 0.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> x(n);
  for (auto& v : x) {
    v = nd(rng);
    if (quantum > 0) v = std::round(v / quantum) * quantum;  // creates many ties
  }
  return x;
}

// ---------------------------------------------------------------- argmax

TEST(Argmax, MatchesScalarReferenceOnAllLengths) {
  // Lengths straddle the 8- and 32-lane loops and their scalar tails; coarse values make ties.
  for (int64_t n : {1, 2, 7, 8, 9, 31, 32, 33, 63, 64, 65, 100, 257, 1000, 4099}) {
    for (uint32_t seed = 0; seed < 5; ++seed) {
      auto x = random_logits(n, seed * 1000 + static_cast<uint32_t>(n), 2.0f, 1.0f);
      EXPECT_EQ(argmax(x.data(), n), scalar_argmax(x)) << "n=" << n << " seed=" << seed;
    }
  }
}

TEST(Argmax, FirstIndexOnTiesAcrossLanesAndBlocks) {
  std::vector<float> x(200, 0.0f);
  for (int64_t pos : {150, 77, 40, 33, 9, 3}) {
    x[pos] = 5.0f;
    EXPECT_EQ(argmax(x.data(), 200), pos);  // each new max position is earlier than the others
  }
  std::vector<float> tail(45, -1.0f);
  tail[44] = 2.0f;  // only in the scalar tail
  EXPECT_EQ(argmax(tail.data(), 45), 44);
  tail[0] = 2.0f;
  EXPECT_EQ(argmax(tail.data(), 45), 0);
  std::vector<float> zeros = {-0.0f, 0.0f, -0.0f};  // -0 == +0: a tie
  EXPECT_EQ(argmax(zeros.data(), 3), 0);
}

TEST(Argmax, NonFiniteAndEmpty) {
  EXPECT_EQ(argmax(nullptr, 0), -1);
  std::vector<float> x(70, kNaN);
  EXPECT_EQ(argmax(x.data(), 70), -1);  // nothing but NaN
  x[50] = -kInf;
  x[60] = -kInf;
  EXPECT_EQ(argmax(x.data(), 70), 50);  // -inf beats NaN
  x[65] = -3.0f;
  EXPECT_EQ(argmax(x.data(), 70), 65);
  x[1] = kInf;
  x[40] = kInf;
  EXPECT_EQ(argmax(x.data(), 70), 1);
  std::vector<float> all_neg_inf(19, -kInf);
  EXPECT_EQ(argmax(all_neg_inf.data(), 19), 0);
  std::vector<float> nan_first = {kNaN, 1.0f, kNaN, 3.0f, kNaN, 3.0f, kNaN, kNaN, kNaN, 2.0f};
  EXPECT_EQ(argmax(nan_first.data(), 10), 3);
}

// ---------------------------------------------------------------- parameters

TEST(Sampler, RejectsBadParameters) {
  EXPECT_THROW(Sampler(make_params(kNaN, 40, 0.9f), 10), Error);
  EXPECT_THROW(Sampler(make_params(-0.5f, 40, 0.9f), 10), Error);
  EXPECT_THROW(Sampler(make_params(kInf, 40, 0.9f), 10), Error);
  EXPECT_THROW(Sampler(make_params(1.0f, 40, kNaN), 10), Error);
  EXPECT_THROW(Sampler(make_params(1.0f, 40, -0.1f), 10), Error);
  EXPECT_THROW(Sampler(make_params(1.0f, 40, 0.9f), 0), Error);
  EXPECT_NO_THROW(Sampler(make_params(0.0f, -5, 7.0f), 10));  // k <= 0 and p >= 1 mean "off"
}

// ---------------------------------------------------------------- greedy and top-k = 1

TEST(Sampler, GreedyEqualsArgmaxAndLeavesRngAlone) {
  Sampler greedy(make_params(0.0f, 40, 0.95f, 7), 5000);
  Dist d;
  for (uint32_t seed = 0; seed < 20; ++seed) {
    auto x = random_logits(5000, seed, 3.0f, 0.5f);  // coarse: the maximum is often tied
    const int32_t want = scalar_argmax(x);
    EXPECT_EQ(greedy.sample(x.data()), want);
    greedy.distribution(x.data(), d);
    ASSERT_EQ(d.size(), 1u);
    EXPECT_EQ(d[0].first, want);
    EXPECT_EQ(d[0].second, 1.0f);
  }
  Sampler fresh(make_params(0.0f, 40, 0.95f, 7), 5000);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(greedy.uniform(), fresh.uniform());
  // A temperature whose inverse overflows float acts as 0 rather than producing NaN weights.
  auto x = random_logits(5000, 9);
  EXPECT_EQ(Sampler(make_params(1e-39f, 0, 1.0f), 5000).sample(x.data()), scalar_argmax(x));
}

TEST(Sampler, TopK1EqualsGreedyAtAnyTemperature) {
  for (float t : {0.05f, 0.7f, 1.0f, 5.0f, 100.0f}) {
    for (float top_p : {0.5f, 1.0f}) {
      Sampler s(make_params(t, 1, top_p, 3), 20000);
      for (uint32_t seed = 0; seed < 10; ++seed) {
        auto x = random_logits(20000, seed + 100, 2.0f, 0.25f);
        EXPECT_EQ(s.sample(x.data()), scalar_argmax(x)) << "T=" << t;
      }
    }
  }
}

// ---------------------------------------------------------------- reproducibility

TEST(Sampler, SameSeedSameTokensOtherSeedOtherTokens) {
  auto x = random_logits(1000, 5, 1.0f);
  auto run = [&](uint64_t seed, int top_k) {
    Sampler s(make_params(1.0f, top_k, 0.95f, seed), 1000);
    std::vector<int32_t> tokens;
    for (int i = 0; i < 2000; ++i) tokens.push_back(s.sample(x.data()));
    return tokens;
  };
  for (int top_k : {0, 40}) {
    EXPECT_EQ(run(42, top_k), run(42, top_k));
    EXPECT_NE(run(42, top_k), run(43, top_k));
  }
}

// ---------------------------------------------------------------- distribution vs reference

TEST(Sampler, DistributionMatchesBruteForceReference) {
  // Row shapes: coarse, with many ties inside top-p's buckets; flat, so top-p needs most of the
  // vocabulary and everything lands in one bucket; wide and continuous.
  const int64_t n = 20000;
  std::vector<std::vector<float>> rows = {random_logits(n, 1, 3.0f, 0.25f), random_logits(n, 2, 0.01f),
                                          random_logits(n, 3, 4.0f)};
  Dist d;
  for (const auto& x : rows)
    for (int k : {0, 1, 40, 19999, 20000, 50000})
      for (float p : {0.3f, 0.95f, 0.999f, 1.0f})
        for (float t : {0.3f, 1.0f, 2.5f}) {
          SCOPED_TRACE(testing::Message() << "k=" << k << " p=" << p << " t=" << t);
          Sampler s(make_params(t, k, p), n);
          s.distribution(x.data(), d);
          expect_same_distribution(as_map(d), reference_distribution(x, s.params()));
          double sum = 0;
          for (size_t i = 0; i < d.size(); ++i) {
            sum += d[i].second;
            // Documented order: best first (equal logits by id) when top-k is on.
            if (i > 0 && k > 0 && k < n) {
              EXPECT_GE(d[i - 1].second, d[i].second);
              if (x[d[i - 1].first] == x[d[i].first]) {
                EXPECT_LT(d[i - 1].first, d[i].first);
              }
            }
          }
          EXPECT_NEAR(sum, 1.0, 1e-5);
        }
}

// ---------------------------------------------------------------- top-p boundaries and temperature

TEST(Sampler, TopPKeepsTheTokenThatReachesTheThreshold) {
  // Four equal logits: each has probability exactly 0.25, so cumulative sums hit 0.25, 0.5, 0.75
  // exactly. Two -inf tokens make top-k = 5 take the heap path with fewer valid tokens than k.
  const std::vector<float> x = {0.0f, -kInf, 0.0f, 0.0f, -kInf, 0.0f};
  Dist d;
  for (int k : {0, 5}) {
    auto kept = [&](float p) {
      Sampler s(make_params(1.0f, k, p), 6);
      s.distribution(x.data(), d);
      return as_map(d);
    };
    EXPECT_EQ(kept(0.5f), (std::map<int32_t, double>{{0, 0.5}, {2, 0.5}}));  // exactly at 2 tokens
    EXPECT_EQ(kept(0.25f).size(), 1u);                                       // exactly at 1 token
    EXPECT_EQ(kept(0.49f).size(), 2u);  // the token crossing 0.49 is kept
    EXPECT_EQ(kept(0.51f).size(), 3u);
    EXPECT_EQ(kept(0.0f).size(), 1u);  // never fewer than one token
    EXPECT_EQ(kept(1.0f).size(), 4u);
  }
  // Unequal probabilities 0.5 / 0.3 / 0.2.
  const std::vector<float> y = {std::log(0.2f), std::log(0.5f), std::log(0.3f)};
  const std::vector<std::pair<float, std::vector<int32_t>>> cases = {
      {0.45f, {1}}, {0.6f, {1, 2}}, {0.79f, {1, 2}}, {0.85f, {0, 1, 2}}};
  for (const auto& [p, want] : cases) {
    Sampler s(make_params(1.0f, 0, p), 3);
    s.distribution(y.data(), d);
    std::vector<int32_t> ids;
    for (const auto& e : d) ids.push_back(e.first);
    std::sort(ids.begin(), ids.end());
    EXPECT_EQ(ids, want) << "top_p=" << p;
  }
}

TEST(Sampler, TemperatureScalesLogitsAndDoesNotChangeTheTopPSet) {
  const std::vector<float> x = {1.0f, 2.0f, 3.0f};
  Dist d;
  for (float t : {0.5f, 2.0f}) {
    Sampler s(make_params(t, 0, 1.0f), 3);
    s.distribution(x.data(), d);
    const double z = std::exp(1.0 / t) + std::exp(2.0 / t) + std::exp(3.0 / t);
    auto m = as_map(d);
    for (int i = 0; i < 3; ++i) EXPECT_NEAR(m[i], std::exp((i + 1.0) / t) / z, 1e-6) << "T=" << t;
  }
  // llama.cpp applies top-p before temperature. At T=1, top-p 0.9 keeps 5 of these tokens; had
  // the logits been divided by T=0.7 first, it would keep 4.
  const std::vector<float> y = {2.0f, 1.5f, 1.2f, 0.9f, 0.5f, 0.0f, -0.5f, -1.0f};
  for (float t : {0.3f, 0.7f, 1.0f, 2.0f}) {
    Sampler s(make_params(t, 0, 0.9f), 8);
    s.distribution(y.data(), d);
    EXPECT_EQ(d.size(), 5u) << "T=" << t;
  }
}

// ---------------------------------------------------------------- statistics of the draws

struct StatCase {
  float temperature;
  int top_k;
  float top_p;
  size_t expected_kept;
};

TEST(Sampler, DrawsFollowTheDistributionAndWrongOnesAreRejected) {
  // Ids are not in rank order, so index/rank mix-ups show.
  const std::vector<float> x = {0.5f, 2.0f, -1.0f, 1.2f, 0.0f, 1.5f, -0.5f, 0.9f};
  const int64_t draws = 200000;
  const std::vector<StatCase> cases = {
      {0.7f, 6, 0.9f, 5}, {1.3f, 0, 0.8f, 4}, {0.5f, 3, 1.0f, 3}, {1.0f, 0, 1.0f, 8}, {2.0f, 7, 0.97f, 6}};
  for (const auto& c : cases) {
    SCOPED_TRACE(testing::Message() << "T=" << c.temperature << " k=" << c.top_k << " p=" << c.top_p);
    const SamplingParams params = make_params(c.temperature, c.top_k, c.top_p, 12345);
    const auto expected = reference_distribution(x, params);
    ASSERT_EQ(expected.size(), c.expected_kept);  // the reference itself, checked by hand
    Sampler s(params, 8);
    std::map<int32_t, int64_t> counts;
    for (int64_t i = 0; i < draws; ++i) ++counts[s.sample(x.data())];
    const double threshold = chi_critical(expected.size());
    EXPECT_LT(chi_square(counts, expected, draws), threshold);

    // The same counts must reject plausible bugs, or the test would prove nothing.
    // 1. Temperature not applied.
    if (c.temperature != 1.0f) {
      SamplingParams bug = params;
      bug.temperature = 1.0f;
      EXPECT_GT(chi_square(counts, reference_distribution(x, bug), draws), threshold) << "T ignored";
    }
    // 2. Top-p off by one either way: drop the crossing token, or keep one more.
    if (c.top_p < 1.0f) {
      const auto fewer = reference_distribution(x, params, -1);
      const auto more = reference_distribution(x, params, +1);
      ASSERT_EQ(fewer.size() + 1, expected.size());
      ASSERT_EQ(more.size(), expected.size() + 1);
      EXPECT_GT(chi_square(counts, fewer, draws), threshold) << "top-p drops the crossing token";
      EXPECT_GT(chi_square(counts, more, draws), threshold) << "top-p keeps one token too many";
    }
    // 3. Temperature applied before top-p (changes the kept set for the first case).
    if (c.top_p < 1.0f) {
      std::vector<float> scaled = x;
      for (auto& v : scaled) v /= c.temperature;
      SamplingParams pre = params;
      pre.temperature = 1.0f;
      const auto wrong = reference_distribution(scaled, pre);
      if (wrong.size() != expected.size()) {
        EXPECT_GT(chi_square(counts, wrong, draws), threshold) << "temperature before top-p";
      }
    }
  }
}

// sample() with top-k on runs the ranked draw (ranked_draw.h, which the CUDA backend runs over
// its own ranking); it must pick exactly the token distribution() + sample_from() pick with the same
// seed, draw after draw, for every shape of row: ties, -inf and NaN entries, +inf logits, a row
// with fewer samplable tokens than k, top-p on and off, hot and cold temperatures.
TEST(Sampler, RankedDrawEqualsTheDistributionsDraw) {
  std::mt19937 gen(7);
  const int64_t n_vocab = 300;
  std::vector<float> row(n_vocab);
  int rows = 0;
  for (int k : {1, 2, 5, 40, 64, 299}) {
    for (float top_p : {1.0f, 0.95f, 0.5f, 0.0f}) {
      for (float temperature : {0.05f, 0.7f, 1.0f, 2.0f}) {
        SamplingParams p;
        p.top_k = k;
        p.top_p = top_p;
        p.temperature = temperature;
        p.seed = uint64_t(rows) * 977 + 3;
        Sampler ranked(p, n_vocab), listed(p, n_vocab);
        Dist dist;
        for (int r = 0; r < 12; ++r, ++rows) {
          std::normal_distribution<float> logit(0.0f, r % 3 == 0 ? 0.3f : 4.0f);
          for (float& v : row) v = logit(gen);
          if (r % 4 == 1)  // ties: a few values repeated across the row
            for (int64_t i = 0; i < n_vocab; ++i) row[size_t(i)] = std::round(row[size_t(i)] * 2.0f) / 2.0f;
          if (r % 5 == 2)  // fewer samplable tokens than most k
            for (int64_t i = 3; i < n_vocab; ++i) row[size_t(i)] = -std::numeric_limits<float>::infinity();
          if (r % 6 == 3) row[17] = std::numeric_limits<float>::quiet_NaN(), row[40] = -INFINITY;
          if (r % 7 == 4) row[11] = row[250] = INFINITY;
          const int32_t a = ranked.sample(row.data());
          listed.distribution(row.data(), dist);
          const int32_t b = listed.sample_from(dist);
          ASSERT_EQ(a, b) << "k " << k << ", top-p " << top_p << ", T " << temperature << ", row " << r;
        }
      }
    }
  }
  EXPECT_EQ(rows, 6 * 4 * 4 * 12);
}

TEST(Sampler, SampleFromSkipsZeroMassAndFollowsWeights) {
  Sampler s(make_params(1.0f, 0, 1.0f, 99), 16);
  const Dist d = {{5, 0.2f}, {9, 0.0f}, {2, 0.8f}, {11, 0.0f}};
  std::map<int32_t, int64_t> counts;
  const int64_t draws = 100000;
  for (int64_t i = 0; i < draws; ++i) ++counts[s.sample_from(d)];
  EXPECT_EQ(counts.count(9), 0u);
  EXPECT_EQ(counts.count(11), 0u);
  EXPECT_LT(chi_square(counts, {{5, 0.2}, {2, 0.8}}, draws), chi_critical(2));
  EXPECT_GT(chi_square(counts, {{5, 0.25}, {2, 0.75}}, draws), chi_critical(2));
  EXPECT_THROW(s.sample_from({}), Error);
  EXPECT_THROW(s.sample_from({{3, 0.0f}}), Error);

  double sum = 0;
  for (int i = 0; i < draws; ++i) {
    const float u = s.uniform();
    ASSERT_GE(u, 0.0f);
    ASSERT_LT(u, 1.0f);
    sum += u;
  }
  EXPECT_NEAR(sum / draws, 0.5, 0.005);
}

// ---------------------------------------------------------------- non-finite logits

TEST(Sampler, NonFiniteLogitsAreNeverSampled) {
  const int64_t n = 3000;
  auto x = random_logits(n, 77, 1.0f);
  std::vector<bool> bad(n, false);
  for (int64_t i = 0; i < n; i += 3) {
    x[i] = (i % 2) ? kNaN : -kInf;
    bad[i] = true;
  }
  x[0] = kNaN;  // first element, where the top-k heap fills
  Dist d;
  for (int k : {0, 3, 40}) {
    for (float p : {0.5f, 1.0f}) {
      Sampler s(make_params(1.5f, k, p, 5), n);
      s.distribution(x.data(), d);
      for (const auto& [id, prob] : d) EXPECT_FALSE(bad[id]) << id;
      for (int i = 0; i < 2000; ++i) ASSERT_FALSE(bad[s.sample(x.data())]);
    }
  }
  // A single finite token among NaN/-inf is always chosen, greedy or not.
  std::vector<float> one(100, kNaN);
  for (int i = 0; i < 100; i += 2) one[i] = -kInf;
  one[57] = -1e30f;
  for (float t : {0.0f, 1.0f})
    for (int k : {0, 40}) EXPECT_EQ(Sampler(make_params(t, k, 0.9f), 100).sample(one.data()), 57);
}

TEST(Sampler, PositiveInfinityTakesAllTheMass) {
  std::vector<float> x = {1.0f, kInf, 3.0f, kNaN, kInf, -kInf, 1e30f};
  Dist d;
  for (int k : {0, 3}) {
    Sampler s(make_params(0.8f, k, 0.95f), 7);
    s.distribution(x.data(), d);
    // top-p at 0.95 keeps both +inf tokens (0.5 each), then temperature cannot split them.
    EXPECT_EQ(as_map(d), (std::map<int32_t, double>{{1, 0.5}, {4, 0.5}}));
  }
  EXPECT_EQ(Sampler(make_params(0.0f, 40, 0.95f), 7).sample(x.data()), 1);
}

TEST(Sampler, NothingSamplableThrows) {
  const std::vector<std::vector<float>> rows = {
      std::vector<float>(50, -kInf), std::vector<float>(50, kNaN), {kNaN, -kInf, kNaN, -kInf}};
  Dist d;
  for (const auto& x : rows)
    for (float t : {0.0f, 1.0f})
      for (int k : {0, 2}) {
        Sampler s(make_params(t, k, 0.9f), static_cast<int64_t>(x.size()));
        EXPECT_THROW(s.sample(x.data()), Error);
        EXPECT_THROW(s.distribution(x.data(), d), Error);
      }
}

}  // namespace
}  // namespace microspec

namespace microspec {
namespace {

// The CUDA backend's block top-k (ops.cu, block_top_k) on the CPU: each of `lanes` threads keeps
// its own k best (ranked_insert) of the elements it reads (i = lane, lane + lanes, ...), then k
// rounds take the best of the lanes' heads and advance its owner. That must be the row's k best in
// the total order, ties to the lower index, NaN never, -inf kept or not: for rows with ties, NaN,
// +-inf, rows shorter than k and rows in rising order (every element enters its lane's list).
TEST(RankedList, LaneListsMergedByTheirHeadsAreTheTopK) {
  std::mt19937 gen(11);
  for (int64_t n : {1, 5, 63, 64, 1000, 5000}) {
    for (int32_t lanes : {1, 7, 1024}) {
      for (int32_t k : {1, 3, 40, 64}) {
        for (int variant = 0; variant < 4; ++variant) {
          std::vector<float> x(static_cast<size_t>(n));
          std::normal_distribution<float> d(0.0f, 2.0f);
          for (int64_t i = 0; i < n; ++i)
            x[size_t(i)] = variant == 3 ? float(i) : variant == 1 ? std::round(d(gen)) : d(gen);  // rising / ties
          if (variant == 2 && n > 10) x[2] = NAN, x[3] = -INFINITY, x[n - 1] = INFINITY, x[n / 2] = NAN;
          for (bool keep_neg_inf : {true, false}) {
            std::vector<float> lv(size_t(lanes) * 64);
            std::vector<int64_t> li(size_t(lanes) * 64);
            std::vector<int32_t> count(size_t(lanes), 0), head(size_t(lanes), 0);
            for (int32_t t = 0; t < lanes; ++t)
              for (int64_t i = t; i < n; i += lanes)
                if (keep_neg_inf || x[size_t(i)] > -INFINITY)
                  ranked_insert(&lv[size_t(t) * 64], &li[size_t(t) * 64], count[size_t(t)], k, x[size_t(i)], i);
            std::vector<int64_t> got;
            for (int32_t j = 0; j < k; ++j) {
              int32_t owner = -1;
              float bv = 0.0f;
              int64_t bi = -1;
              for (int32_t t = 0; t < lanes; ++t) {
                const size_t h = size_t(t) * 64 + size_t(head[size_t(t)]);
                if (head[size_t(t)] < count[size_t(t)] && ranks_before(lv[h], li[h], bv, bi))
                  bv = lv[h], bi = li[h], owner = t;
              }
              if (owner >= 0) ++head[size_t(owner)];
              got.push_back(bi);
            }
            std::vector<int64_t> want;
            for (int64_t i = 0; i < n; ++i)
              if (!std::isnan(x[size_t(i)]) && (keep_neg_inf || x[size_t(i)] > -INFINITY)) want.push_back(i);
            std::stable_sort(want.begin(), want.end(), [&](int64_t a, int64_t b) { return x[size_t(a)] > x[size_t(b)]; });
            want.resize(size_t(k), -1);
            ASSERT_EQ(got, want) << "n " << n << ", lanes " << lanes << ", k " << k << ", variant " << variant
                                 << (keep_neg_inf ? ", -inf kept" : ", -inf dropped");
          }
        }
      }
    }
  }
}

TEST(TopKIndices, MatchesFullSortWithTiesAndNaN) {
  // Lengths from below one 32-logit block to many blocks (the block-skipping filter), ties,
  // NaN, +inf and an all-NaN row.
  std::mt19937 rng(5);
  for (int trial = 0; trial < 300; ++trial) {
    const int n = trial < 200 ? 1 + int(rng() % 300) : 1 + int(rng() % 5000);
    std::vector<float> x(n);
    for (float& v : x) v = float(int(rng() % 40)) * 0.5f;  // many ties
    if (trial % 3 == 0) x[rng() % n] = std::nanf("");
    if (trial % 5 == 2) x[rng() % n] = std::numeric_limits<float>::infinity();
    if (trial == 257) std::fill(x.begin(), x.end(), std::nanf(""));
    const int32_t k = 1 + int32_t(rng() % 6);
    std::vector<int32_t> want;
    for (int i = 0; i < n; ++i)
      if (!std::isnan(x[i])) want.push_back(i);
    std::stable_sort(want.begin(), want.end(), [&](int a, int b) { return x[a] > x[b]; });
    want.resize(std::min<size_t>(want.size(), size_t(k)));
    want.resize(k, -1);
    std::vector<int32_t> got(k, 99);
    top_k_indices(x.data(), n, k, got.data());
    EXPECT_EQ(got, want) << "trial " << trial;
  }
}

}  // namespace
}  // namespace microspec
