#include "sampling/logprobs.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "math/select.h"

namespace microspec {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 (8 lanes): 2^n * p(r), x = n ln2 + r, |r| <= ln2/2, p the degree-6 Taylor
// polynomial (relative error below 2e-7). Lanes below -87 (exp under FLT_MIN) and NaN give 0.
__m256 exp_nonpositive(__m256 x) {
  const __m256 valid = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);  // ln2 split in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), valid);
}

}  // namespace

void LogprobRows::reset(int32_t top_alternatives, size_t n_rows) {
  top = top_alternatives;
  entries.clear();
  entries.reserve(n_rows * stride());
}

double log_sum_exp_below(const float* x, int64_t n, float max) {
  const __m256 m = _mm256_set1_ps(max);
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x + i), m));
    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(lo, hi));
  double sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (; i < n; ++i)
    if (x[i] - max >= -87.0f) sum += std::exp(double(x[i] - max));
  return std::log(sum);
}

void append_logprob_row(const float* logits, int64_t n, int32_t token, LogprobRows& rows) {
  const float mx = max_ignoring_nan(logits, n);
  double offset = 0.0;    // log p = x - offset for finite max
  float inf_logprob = kNegInf;  // what a +inf logit gets when the maximum is +inf
  if (std::isfinite(mx)) {
    offset = double(mx) + log_sum_exp_below(logits, n, mx);
  } else if (mx > 0.0f) {
    int64_t count = 0;
    for (int64_t i = 0; i < n; ++i) count += std::isinf(logits[i]) && logits[i] > 0.0f;
    inf_logprob = static_cast<float>(-std::log(double(count)));
  }
  auto logprob = [&](int32_t id) -> float {
    if (id < 0 || id >= n) return kNegInf;
    const float x = logits[id];
    if (!(x > kNegInf)) return kNegInf;  // NaN and -inf
    if (!std::isfinite(mx)) return std::isinf(x) ? inf_logprob : kNegInf;
    return static_cast<float>(double(x) - offset);
  };
  rows.entries.push_back({token, logprob(token)});
  int32_t ids[kMaxTopLogprobs];  // [top] best first
  const int32_t k = rows.top < kMaxTopLogprobs ? rows.top : kMaxTopLogprobs;
  top_k_indices(logits, n, k, ids);
  for (int32_t j = 0; j < rows.top; ++j) {
    const int32_t id = j < k ? ids[j] : -1;
    rows.entries.push_back({id, logprob(id)});
  }
}

void append_drawn_logprob_row(std::vector<std::pair<int32_t, float>>& dist, int32_t token, LogprobRows& rows) {
  float p_token = 0.0f;
  for (const auto& [id, p] : dist)
    if (id == token) p_token = p;
  rows.entries.push_back({token, p_token > 0.0f ? std::log(p_token) : kNegInf});
  const size_t k = std::min(size_t(rows.top), dist.size());
  std::partial_sort(dist.begin(), dist.begin() + ptrdiff_t(k), dist.end(), [](const auto& a, const auto& b) {
    return a.second > b.second || (a.second == b.second && a.first < b.first);
  });
  for (size_t j = 0; j < size_t(rows.top); ++j)
    rows.entries.push_back(j < k ? TokenLogprob{dist[j].first, std::log(dist[j].second)} : TokenLogprob{-1, kNegInf});
}

}  // namespace microspec
