#include "math/select.h"

#include <immintrin.h>

#include <limits>

namespace microspec {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

float horizontal_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

}  // namespace

// _mm256_max_ps(a, b) returns b when either is NaN, so the data goes first and NaNs never reach
// the accumulators; four accumulators hide the max latency.
float max_ignoring_nan(const float* x, int64_t n) {
  __m256 m0 = _mm256_set1_ps(kNegInf), m1 = m0, m2 = m0, m3 = m0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    m0 = _mm256_max_ps(_mm256_loadu_ps(x + i), m0);
    m1 = _mm256_max_ps(_mm256_loadu_ps(x + i + 8), m1);
    m2 = _mm256_max_ps(_mm256_loadu_ps(x + i + 16), m2);
    m3 = _mm256_max_ps(_mm256_loadu_ps(x + i + 24), m3);
  }
  for (; i + 8 <= n; i += 8) m0 = _mm256_max_ps(_mm256_loadu_ps(x + i), m0);
  float best = horizontal_max(_mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
  for (; i < n; ++i) best = x[i] > best ? x[i] : best;
  return best;
}

int32_t argmax(const float* x, int64_t n) {
  if (n <= 0) return -1;
  // Two passes: the maximum, then the first index holding it (which usually stops early).
  const float best = max_ignoring_nan(x, n);
  const __m256 vb = _mm256_set1_ps(best);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256 c0 = _mm256_cmp_ps(_mm256_loadu_ps(x + i), vb, _CMP_EQ_OQ);
    const __m256 c1 = _mm256_cmp_ps(_mm256_loadu_ps(x + i + 8), vb, _CMP_EQ_OQ);
    const __m256 c2 = _mm256_cmp_ps(_mm256_loadu_ps(x + i + 16), vb, _CMP_EQ_OQ);
    const __m256 c3 = _mm256_cmp_ps(_mm256_loadu_ps(x + i + 24), vb, _CMP_EQ_OQ);
    const uint32_t mask = static_cast<uint32_t>(_mm256_movemask_ps(c0)) |
                          static_cast<uint32_t>(_mm256_movemask_ps(c1)) << 8 |
                          static_cast<uint32_t>(_mm256_movemask_ps(c2)) << 16 |
                          static_cast<uint32_t>(_mm256_movemask_ps(c3)) << 24;
    if (mask) return static_cast<int32_t>(i + __builtin_ctz(mask));
  }
  for (; i < n; ++i)
    if (x[i] == best) return static_cast<int32_t>(i);
  return -1;  // every element is NaN: best stayed -inf and no element equals it
}

void top_k_indices(const float* x, int64_t n, int32_t k, int32_t* out) {
  if (k <= 0) return;
  for (int32_t j = 0; j < k; ++j) out[j] = -1;
  int32_t count = 0;
  float worst = kNegInf;  // value of out[k - 1] once count == k
  auto consider = [&](int64_t i) {
    const float v = x[i];
    if (v != v) return;  // NaN
    if (count == k && !(v > worst)) return;
    int32_t at = count < k ? count++ : k - 1;
    // Shift worse entries down; an equal value keeps its earlier (lower) index ahead.
    while (at > 0 && v > x[out[at - 1]]) {
      out[at] = out[at - 1];
      --at;
    }
    out[at] = static_cast<int32_t>(i);
    if (count == k) worst = x[out[k - 1]];
  };
  int64_t i = 0;
  for (; i < n && count < k; ++i) consider(i);
  // Once k are held, a 32-element block matters only if some element is > worst (NaN compares
  // false, and an element equal to worst loses the tie to the earlier index): most blocks of a
  // logits row are skipped with four vector compares.
  for (; i + 32 <= n; i += 32) {
    const __m256 w = _mm256_set1_ps(worst);
    const __m256 m0 = _mm256_cmp_ps(_mm256_loadu_ps(x + i), w, _CMP_GT_OQ);
    const __m256 m1 = _mm256_cmp_ps(_mm256_loadu_ps(x + i + 8), w, _CMP_GT_OQ);
    const __m256 m2 = _mm256_cmp_ps(_mm256_loadu_ps(x + i + 16), w, _CMP_GT_OQ);
    const __m256 m3 = _mm256_cmp_ps(_mm256_loadu_ps(x + i + 24), w, _CMP_GT_OQ);
    if (_mm256_testz_ps(_mm256_or_ps(_mm256_or_ps(m0, m1), _mm256_or_ps(m2, m3)),
                        _mm256_castsi256_ps(_mm256_set1_epi32(-1))))
      continue;
    for (int64_t j = i; j < i + 32; ++j) consider(j);
  }
  for (; i < n; ++i) consider(i);
}

}  // namespace microspec
