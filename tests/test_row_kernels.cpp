// The row kernels (kernels.h, RowKernels): e^x, the gated activations, RMSNorm and the attention
// softmax. The reference against double-precision truth (how close), every SIMD table against the
// reference bit for bit (lengths 1..70 so every tail shape is covered, special values, rows at
// any offset), and the cases that must stay exact (e^0 = 1, the unseen entries 0).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/kernels.h"
#include "support/test_helpers.h"

namespace microspec {
namespace {

using test::simd_tables;

std::vector<const KernelTable*> all_tables() {
  std::vector<const KernelTable*> v = simd_tables();
  v.push_back(&reference_kernels());
  return v;
}

std::vector<float> uniform_floats(std::mt19937& rng, int64_t n, float lo, float hi) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = d(rng);
  return v;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), sizeof(float) * a.size()) == 0;
}

float ulp_at(double x) {
  const float f = float(x);
  return std::nextafter(f, std::numeric_limits<float>::infinity()) - f;
}

TEST(RowKernels, ExpIsWithinOneUlpOfTheTruth) {
  const RowKernels& ref = reference_kernels().rows;
  std::vector<float> x;
  for (float v = -86.5f; v <= 88.72f; v += 0.00371f) x.push_back(v);
  for (float v = -1.0f; v <= 1.0f; v += 1.0f / 4096) x.push_back(v);  // where softmax and GELU live
  std::vector<float> y(x.size());
  ref.exp(x.data(), y.data(), int64_t(x.size()));
  double worst = 0.0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double truth = std::exp(double(x[i]));
    const double err = std::fabs(double(y[i]) - truth) / ulp_at(truth);
    worst = std::max(worst, err);
    ASSERT_LT(err, 1.0) << "x=" << x[i] << " got " << y[i] << " truth " << truth;
  }
  std::printf("exp: %zu inputs, worst error %.2f ulp\n", x.size(), worst);
}

TEST(RowKernels, ExpAtTheEdgesOfItsRange) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> x = {0.0f, -0.0f, -inf, inf, nan, -86.5f, -86.51f, -1000.0f, 88.7228317f,
                                88.7228394f, 1000.0f, 88.0f, -86.0f, 1e-30f, -1e-30f, 1.0f, -1.0f};
  for (const KernelTable* k : all_tables()) {
    std::vector<float> y(x.size());
    k->rows.exp(x.data(), y.data(), int64_t(x.size()));
    EXPECT_EQ(y[0], 1.0f) << k->name;
    EXPECT_EQ(y[1], 1.0f) << k->name;
    EXPECT_EQ(y[2], 0.0f) << k->name;
    EXPECT_EQ(y[3], inf) << k->name;
    EXPECT_TRUE(std::isnan(y[4])) << k->name;
    EXPECT_GT(y[5], 0.0f) << k->name;
    EXPECT_TRUE(std::isnormal(y[5])) << k->name;
    EXPECT_EQ(y[6], 0.0f) << k->name;
    EXPECT_EQ(y[7], 0.0f) << k->name;
    EXPECT_TRUE(std::isfinite(y[8]) && y[8] > 3.4e38f) << k->name << " " << y[8];
    EXPECT_EQ(y[9], inf) << k->name;
    EXPECT_EQ(y[10], inf) << k->name;
    for (size_t i = 11; i < x.size(); ++i)
      EXPECT_NEAR(y[i], std::exp(double(x[i])), 3.0 * ulp_at(std::exp(double(x[i])))) << k->name << " x=" << x[i];
  }
}

TEST(RowKernels, ActivationsAndNormAreCloseToDoublePrecision) {
  std::mt19937 rng(31);
  const RowKernels& ref = reference_kernels().rows;
  const int64_t n = 4096;
  const std::vector<float> g = uniform_floats(rng, n, -12.0f, 12.0f), u = uniform_floats(rng, n, -2.0f, 2.0f);
  std::vector<float> silu = g, gelu = g;
  ref.silu_mul(silu.data(), u.data(), n);
  ref.gelu_tanh_mul(gelu.data(), u.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    const double x = g[i];
    const double want_silu = x / (1.0 + std::exp(-x)) * u[i];
    const double want_gelu = 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x))) * u[i];
    ASSERT_NEAR(silu[i], want_silu, 1e-6 * (1.0 + std::fabs(want_silu))) << "x=" << x;
    ASSERT_NEAR(gelu[i], want_gelu, 1e-6 * (1.0 + std::fabs(want_gelu))) << "x=" << x;
  }
  const std::vector<float> x = uniform_floats(rng, 640, -3.0f, 3.0f), w = uniform_floats(rng, 640, 0.5f, 1.5f);
  std::vector<float> y(640);
  ref.rms_norm(x.data(), w.data(), 640, 1e-6f, y.data());
  double ss = 0.0;
  for (float v : x) ss += double(v) * v;
  const double s = 1.0 / std::sqrt(ss / 640 + 1e-6);
  for (int i = 0; i < 640; ++i) ASSERT_NEAR(y[i], x[i] * s * w[i], 1e-6 * (1.0 + std::fabs(x[i] * s * w[i])));
}

TEST(RowKernels, SoftmaxIsTheNormalisedExponentialOfTheSeenEntries) {
  std::mt19937 rng(32);
  const int64_t n = 77;
  std::vector<float> x = uniform_floats(rng, n, -20.0f, 20.0f);
  std::vector<uint8_t> seen(static_cast<size_t>(n));
  for (auto& b : seen) b = rng() % 3 != 0;
  const float scale = 0.125f;
  double mx = -1e300, sum = 0.0;
  for (int64_t j = 0; j < n; ++j)
    if (seen[j]) mx = std::max(mx, double(x[j]) * scale);
  for (int64_t j = 0; j < n; ++j)
    if (seen[j]) sum += std::exp(double(x[j]) * scale - mx);
  std::vector<float> got = x;
  reference_kernels().rows.softmax(got.data(), seen.data(), n, scale);
  for (int64_t j = 0; j < n; ++j) {
    if (!seen[j]) {
      ASSERT_EQ(got[j], 0.0f);
      continue;
    }
    const double want = std::exp(double(x[j]) * scale - mx) / sum;
    ASSERT_NEAR(got[j], want, 4e-7 * want + 1e-30) << j;
  }
}

// What batched verification relies on: a drafted token's row sees its ancestors among other
// branches' entries (unseen for it), a plain decoding step the same keys side by side. The
// softmax's values on the seen entries must not depend on where the unseen ones lie.
TEST(RowKernels, SoftmaxDependsOnlyOnTheSequenceOfSeenEntries) {
  std::mt19937 rng(34);
  for (const KernelTable* k : all_tables()) {
    for (int64_t n_seen : {1, 5, 16, 17, 40, 100}) {
      const std::vector<float> values = uniform_floats(rng, n_seen, -30.0f, 30.0f);
      std::vector<float> side_by_side = values;
      const std::vector<uint8_t> all(static_cast<size_t>(n_seen), 1);
      k->rows.softmax(side_by_side.data(), all.data(), n_seen, 0.125f);
      for (int rep = 0; rep < 10; ++rep) {
        std::vector<float> spread;
        std::vector<uint8_t> seen;
        for (float v : values) {
          for (int gap = int(rng() % 4); gap > 0; --gap) {  // unseen entries, any value
            spread.push_back(uniform_floats(rng, 1, -30.0f, 30.0f)[0]);
            seen.push_back(0);
          }
          spread.push_back(v);
          seen.push_back(1);
        }
        k->rows.softmax(spread.data(), seen.data(), int64_t(spread.size()), 0.125f);
        std::vector<float> on_seen;
        for (size_t j = 0; j < spread.size(); ++j)
          if (seen[j]) on_seen.push_back(spread[j]);
        ASSERT_TRUE(same_bits(side_by_side, on_seen)) << k->name << " " << n_seen << " seen entries, round " << rep;
      }
    }
  }
}

// Every SIMD table gives the reference's bits, for every length (each tail), rows at any offset
// in memory, inputs and outputs in the same or separate buffers.
TEST(RowKernels, SimdTablesMatchReferenceBitForBit) {
  std::mt19937 rng(33);
  const RowKernels& ref = reference_kernels().rows;
  for (const KernelTable* k : simd_tables()) {
    const RowKernels& got = k->rows;
    ASSERT_TRUE(got.exp && got.silu_mul && got.gelu_tanh_mul && got.rms_norm && got.softmax) << k->name;
    for (int64_t n = 1; n <= 70; ++n) {
      for (int rep = 0; rep < 4; ++rep) {
        const int64_t off = rng() % 8;  // an element offset: any alignment
        std::vector<float> buf = uniform_floats(rng, n + off, -100.0f, 100.0f);
        const std::vector<float> x(buf.begin() + off, buf.end());
        std::vector<float> want(static_cast<size_t>(n)), have(static_cast<size_t>(n));
        ref.exp(x.data(), want.data(), n);
        got.exp(x.data(), have.data(), n);
        ASSERT_TRUE(same_bits(want, have)) << k->name << " exp n=" << n;
        got.exp(buf.data() + off, buf.data() + off, n);  // in place
        ASSERT_TRUE(same_bits(want, std::vector<float>(buf.begin() + off, buf.end()))) << k->name << " exp in place";

        const std::vector<float> g = uniform_floats(rng, n, -15.0f, 15.0f), u = uniform_floats(rng, n, -3.0f, 3.0f);
        std::vector<float> want_g = g, have_g = g;
        ref.silu_mul(want_g.data(), u.data(), n);
        got.silu_mul(have_g.data(), u.data(), n);
        ASSERT_TRUE(same_bits(want_g, have_g)) << k->name << " silu n=" << n;
        want_g = have_g = g;
        ref.gelu_tanh_mul(want_g.data(), u.data(), n);
        got.gelu_tanh_mul(have_g.data(), u.data(), n);
        ASSERT_TRUE(same_bits(want_g, have_g)) << k->name << " gelu n=" << n;

        const std::vector<float> w = uniform_floats(rng, n, -2.0f, 2.0f), r = uniform_floats(rng, n, -50.0f, 50.0f);
        ref.rms_norm(r.data(), w.data(), n, 1e-6f, want.data());
        got.rms_norm(r.data(), w.data(), n, 1e-6f, have.data());
        ASSERT_TRUE(same_bits(want, have)) << k->name << " rms_norm n=" << n;
        std::vector<float> in_place = r;
        got.rms_norm(in_place.data(), w.data(), n, 1e-6f, in_place.data());
        ASSERT_TRUE(same_bits(want, in_place)) << k->name << " rms_norm in place n=" << n;

        std::vector<uint8_t> seen(static_cast<size_t>(n));
        for (auto& b : seen) b = uint8_t(rng() % 4 == 0 ? 0 : 1 + rng() % 255);  // any non-zero byte is seen
        seen[rng() % n] = 1;
        std::vector<float> s = uniform_floats(rng, n, -400.0f, 400.0f);
        for (int64_t j = 0; j < n; ++j)
          if (!seen[j] && rng() % 2) s[j] = rep % 2 ? std::numeric_limits<float>::quiet_NaN() : -1e30f;
        std::vector<float> want_s = s, have_s = s;
        ref.softmax(want_s.data(), seen.data(), n, 0.0625f);
        got.softmax(have_s.data(), seen.data(), n, 0.0625f);
        ASSERT_TRUE(same_bits(want_s, have_s)) << k->name << " softmax n=" << n;
        for (int64_t j = 0; j < n; ++j)
          if (!seen[j]) ASSERT_EQ(have_s[j], 0.0f) << k->name << " unseen entry " << j;
      }
    }
  }
}

}  // namespace
}  // namespace microspec
