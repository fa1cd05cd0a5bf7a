// Log-probabilities of generated tokens (sampling/logprobs.h): the values against a float64
// reference log-softmax, the alternatives against a full sort, non-finite rows; sampled tokens'
// values from the distribution they were drawn from.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "sampling/logprobs.h"
#include "sampling/sampler.h"

namespace microspec {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// float64 log-softmax of one element, NaN and -inf excluded from the sum.
double reference_logprob(const std::vector<float>& row, int32_t id) {
  double mx = -INFINITY;
  for (float x : row)
    if (!std::isnan(x)) mx = std::max(mx, double(x));
  double sum = 0.0;
  for (float x : row)
    if (x > -kInf) sum += std::exp(double(x) - mx);
  return double(row[size_t(id)]) - mx - std::log(sum);
}

std::vector<float> random_row(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 4.0f);
  std::vector<float> row(static_cast<size_t>(n));
  for (float& x : row) x = dist(rng);
  return row;
}

TEST(Logprobs, MatchTheFloat64LogSoftmaxAndTheBestAlternatives) {
  for (int64_t n : {1, 7, 8, 33, 1000, 49152}) {
    std::vector<float> row = random_row(n, uint64_t(n));
    if (n > 40) {
      row[3] = -kInf;
      row[5] = std::numeric_limits<float>::quiet_NaN();
      row[17] = row[16];  // a tie: the lower id ranks first
    }
    const int32_t top = int32_t(std::min<int64_t>(n, 5));
    LogprobRows rows;
    rows.reset(top, 2);
    const int32_t chosen = int32_t(n / 2);
    append_logprob_row(row.data(), n, chosen, rows);
    append_logprob_row(row.data(), n, 0, rows);
    ASSERT_EQ(rows.rows(), 2u);
    EXPECT_EQ(rows.row(0)[0].token, chosen);
    EXPECT_NEAR(rows.row(0)[0].logprob, reference_logprob(row, chosen), 2e-5);
    EXPECT_EQ(rows.row(1)[0].token, 0);
    // The alternatives: the best `top` ids by logit, best first, ties to the lower id.
    std::vector<int32_t> order(static_cast<size_t>(n));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      const float x = std::isnan(row[size_t(a)]) ? -kInf : row[size_t(a)];
      const float y = std::isnan(row[size_t(b)]) ? -kInf : row[size_t(b)];
      return x > y;
    });
    for (int32_t j = 0; j < top; ++j) {
      const TokenLogprob alt = rows.row(0)[size_t(j) + 1];
      EXPECT_EQ(alt.token, order[size_t(j)]) << "n=" << n << " rank " << j;
      EXPECT_NEAR(alt.logprob, reference_logprob(row, alt.token), 2e-5);
      if (j > 0) {
        EXPECT_LE(alt.logprob, rows.row(0)[size_t(j)].logprob);
      }
    }
    if (n > 40) {
      LogprobRows excluded;
      excluded.reset(0, 2);
      append_logprob_row(row.data(), n, 3, excluded);
      append_logprob_row(row.data(), n, 5, excluded);
      EXPECT_EQ(excluded.row(0)[0].logprob, -kInf);
      EXPECT_EQ(excluded.row(1)[0].logprob, -kInf);
    }
  }
}

TEST(Logprobs, TheSameRowGivesBitwiseTheSameValues) {
  const std::vector<float> row = random_row(4099, 7);
  std::vector<float> copy = row;
  LogprobRows a, b;
  a.reset(20, 1);
  b.reset(20, 1);
  append_logprob_row(row.data(), int64_t(row.size()), 11, a);
  append_logprob_row(copy.data(), int64_t(copy.size()), 11, b);
  for (size_t i = 0; i < a.entries.size(); ++i) {
    EXPECT_EQ(a.entries[i].token, b.entries[i].token);
    EXPECT_EQ(std::bit_cast<uint32_t>(a.entries[i].logprob), std::bit_cast<uint32_t>(b.entries[i].logprob));
  }
}

TEST(Logprobs, InfiniteLogitsShareTheMassAndMissingAlternativesAreMarked) {
  std::vector<float> row = {1.0f, kInf, 2.0f, kInf, std::numeric_limits<float>::quiet_NaN()};
  LogprobRows rows;
  rows.reset(2, 3);
  append_logprob_row(row.data(), 5, 1, rows);
  append_logprob_row(row.data(), 5, 2, rows);
  EXPECT_FLOAT_EQ(rows.row(0)[0].logprob, -std::log(2.0f));
  EXPECT_EQ(rows.row(1)[0].logprob, -kInf);
  EXPECT_EQ(rows.row(0)[1].token, 1);
  EXPECT_EQ(rows.row(0)[2].token, 3);
  // A row of NaNs but one: a single alternative exists, the others are marked -1 with -inf.
  std::vector<float> nans(4, std::numeric_limits<float>::quiet_NaN());
  nans[2] = 0.5f;
  append_logprob_row(nans.data(), 4, 2, rows);
  EXPECT_FLOAT_EQ(rows.row(2)[0].logprob, 0.0f);
  EXPECT_EQ(rows.row(2)[1].token, 2);
  EXPECT_EQ(rows.row(2)[2].token, -1);
  EXPECT_EQ(rows.row(2)[2].logprob, -kInf);
}

TEST(Logprobs, SampledTokensReportTheDistributionTheyWereDrawnFrom) {
  const std::vector<float> row = random_row(4099, 3);
  SamplingParams params;
  params.temperature = 0.7f;
  params.top_k = 12;
  params.top_p = 1.0f;
  Sampler sampler(params, int64_t(row.size()));
  std::vector<std::pair<int32_t, float>> dist, reference;
  sampler.distribution(row.data(), reference);
  ASSERT_EQ(reference.size(), 12u);
  const int32_t drawn = reference[5].first;
  LogprobRows rows;
  rows.reset(20, 1);
  dist = reference;
  append_drawn_logprob_row(dist, drawn, rows);
  EXPECT_EQ(rows.row(0)[0].token, drawn);
  EXPECT_EQ(rows.row(0)[0].logprob, std::log(reference[5].second));
  // The alternatives are the whole kept distribution, best first, then -1 markers.
  double mass = 0.0;
  for (size_t j = 1; j <= 12; ++j) {
    const TokenLogprob e = rows.row(0)[j];
    const auto it = std::find_if(reference.begin(), reference.end(), [&](const auto& r) { return r.first == e.token; });
    ASSERT_NE(it, reference.end());
    EXPECT_EQ(e.logprob, std::log(it->second));
    if (j > 1) EXPECT_GE(rows.row(0)[j - 1].logprob, e.logprob);
    mass += std::exp(double(e.logprob));
  }
  EXPECT_NEAR(mass, 1.0, 1e-5);
  for (size_t j = 13; j <= 20; ++j) EXPECT_EQ(rows.row(0)[j].token, -1);
  // The raw row's value for the same token is another number: temperature and top-k matter.
  LogprobRows raw;
  raw.reset(0, 1);
  append_logprob_row(row.data(), int64_t(row.size()), drawn, raw);
  EXPECT_GT(std::fabs(raw.row(0)[0].logprob - rows.row(0)[0].logprob), 0.1f);
}

}  // namespace
}  // namespace microspec
