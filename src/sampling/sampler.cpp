#include "sampling/sampler.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "math/select.h"
#include "sampling/ranked_draw.h"
#include "util/error.h"

namespace microspec {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kPosInf = std::numeric_limits<float>::infinity();

[[noreturn]] void throw_nothing_samplable() {
  throw Error("sampler: no token can be sampled (every logit is NaN or -inf)");
}

}  // namespace

Sampler::Sampler(const SamplingParams& params, int64_t n_vocab) : params_(params), n_vocab_(n_vocab) {
  if (n_vocab <= 0 || n_vocab > std::numeric_limits<int32_t>::max())
    throw Error("sampler: invalid vocabulary size " + std::to_string(n_vocab));
  if (!(params.temperature >= 0.0f) || std::isinf(params.temperature))
    throw Error("sampler: temperature must be a finite number >= 0, got " +
                std::to_string(params.temperature));
  if (!(params.top_p >= 0.0f))
    throw Error("sampler: top_p must be >= 0 (1 = off), got " + std::to_string(params.top_p));
  if (!(params.min_p >= 0.0f && params.min_p <= 1.0f))
    throw Error("sampler: min_p must be in [0, 1] (0 = off), got " + std::to_string(params.min_p));
  greedy_ = params.greedy();
  top_k_ = params.top_k > 0 && params.top_k < n_vocab ? params.top_k : 0;
  rng_.seed(params.seed);
  if (!greedy_) {
    cand_.resize(static_cast<size_t>(n_vocab));
    scratch_.reserve(static_cast<size_t>(n_vocab));
  }
}

float Sampler::uniform() {
  return static_cast<float>(rng_() >> 40) * 0x1.0p-24f;
}

int64_t Sampler::select_candidates(const float* logits, int64_t n) {
  int64_t count = 0;
  if (top_k_ == 0) {
    // Every samplable token, in id order. Branchless: write always, advance only when kept.
    for (int64_t i = 0; i < n; ++i) {
      cand_[count] = {logits[i], static_cast<int32_t>(i), 0};
      count += logits[i] > kNegInf;  // false for NaN too
    }
    if (count == 0) throw_nothing_samplable();
    max_logit_ = max_ignoring_nan(logits, n);
    return count;
  }

  // Top-k: a heap in cand_[0, k) whose front is the worst kept token. A token enters only if it
  // ranks before that front; scanning in id order, a later token with an equal logit never does,
  // so comparing logits strictly is the whole test. Most of the row is rejected eight at a time.
  const int64_t k = top_k_;
  Candidate* heap = cand_.data();
  int64_t i = 0;
  for (; i < n && count < k; ++i) {
    if (!(logits[i] > kNegInf)) continue;
    heap[count++] = {logits[i], static_cast<int32_t>(i), 0};
    std::push_heap(heap, heap + count, ranks_before);
  }
  if (count == 0) throw_nothing_samplable();
  if (count == k) {
    float threshold = heap[0].logit;
    auto offer = [&](int64_t j) {
      if (logits[j] > threshold) {
        std::pop_heap(heap, heap + k, ranks_before);
        heap[k - 1] = {logits[j], static_cast<int32_t>(j), 0};
        std::push_heap(heap, heap + k, ranks_before);
        threshold = heap[0].logit;
      }
    };
    for (; i + 8 <= n; i += 8) {
      uint32_t mask = static_cast<uint32_t>(_mm256_movemask_ps(
          _mm256_cmp_ps(_mm256_loadu_ps(logits + i), _mm256_set1_ps(threshold), _CMP_GT_OQ)));
      for (; mask != 0; mask &= mask - 1) offer(i + __builtin_ctz(mask));
    }
    for (; i < n; ++i) offer(i);
  }
  std::sort_heap(heap, heap + count, ranks_before);  // best first
  max_logit_ = heap[0].logit;
  return count;
}

int64_t Sampler::apply_top_p(int64_t n) {
  if (params_.top_p >= 1.0f || n == 1) return n;
  Candidate* c = cand_.data();
  if (top_k_ > 0)  // at most k candidates, already ranked best first: the ranked draw's own top-p
    return ranked_top_p(static_cast<int32_t>(n), [&](int32_t i) { return c[i].logit; }, params_.top_p);
  // Softmax at temperature 1 over the candidates (llama.cpp runs top-p before temperature):
  // unnormalised weights, summed in double, against top_p * total.
  const float mx = max_logit_;
  const bool inf_max = mx == kPosInf;  // +inf tokens hold all the mass
  auto weight_of = [&](float logit) -> double {
    return inf_max ? (logit == kPosInf ? 1.0 : 0.0) : std::exp(logit - mx);
  };

  // Whole vocabulary, in id order: sorting 262k entries per token is what this avoids. Bucket
  // the candidates by distance below the maximum logit (a monotone map, so every token of a
  // lower bucket ranks before every token of a higher one) and add up each bucket's mass. The
  // bucket where the running mass reaches the target is the only one that needs sorting.
  constexpr int kBuckets = 512;
  constexpr float kBucketsPerNat = 16.0f;  // 32 nats; the last bucket takes everything below
  constexpr int kLanes = 4;                // interleaved histograms: runs of tokens falling in
                                           // one bucket do not serialise on one memory slot
  double mass[kLanes][kBuckets] = {};      // [kLanes][kBuckets] summed weights per bucket
  for (int64_t i = 0; i < n; ++i) {
    int bucket;
    if (inf_max) {
      bucket = c[i].logit == kPosInf ? 0 : kBuckets - 1;
    } else {
      const float d = (mx - c[i].logit) * kBucketsPerNat;  // >= 0; +inf if the difference overflows
      bucket = d < static_cast<float>(kBuckets - 1) ? static_cast<int>(d) : kBuckets - 1;
    }
    c[i].bucket = bucket;
    mass[i % kLanes][bucket] += weight_of(c[i].logit);
  }
  double bucket_mass[kBuckets];  // [kBuckets]
  double total = 0.0;
  for (int b = 0; b < kBuckets; ++b) {
    bucket_mass[b] = 0.0;
    for (int l = 0; l < kLanes; ++l) bucket_mass[b] += mass[l][b];
    total += bucket_mass[b];
  }
  const double target = static_cast<double>(params_.top_p) * total;
  int crossing = 0;
  double cum = 0.0;  // mass of the buckets before `crossing`
  while (crossing < kBuckets - 1 && cum + bucket_mass[crossing] < target) cum += bucket_mass[crossing++];

  // Front: the buckets before the crossing one (kept whole, unordered), then the crossing bucket.
  Candidate* end = std::partition(c, c + n, [&](const Candidate& a) { return a.bucket <= crossing; });
  Candidate* mid = std::partition(c, end, [&](const Candidate& a) { return a.bucket < crossing; });
  std::sort(mid, end, ranks_before);
  for (Candidate* it = mid; it != end; ++it) {
    cum += weight_of(it->logit);
    if (cum >= target) return it - c + 1;  // keep the token that reaches the threshold
  }
  return end - c;  // rounding left the sum a hair short of the target: keep the whole bucket
}

int64_t Sampler::apply_min_p(int64_t n) {
  if (!(params_.min_p > 0.0f) || max_logit_ == kPosInf) return n;
  const float threshold = max_logit_ + std::log(params_.min_p);  // p >= min_p * p_max at T = 1
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i)
    if (cand_[i].logit >= threshold) cand_[kept++] = cand_[i];
  return kept;  // the maximum itself always stays
}

void Sampler::distribution(const float* logits, int64_t n_logits, std::vector<std::pair<int32_t, float>>& out) {
  if (n_logits <= 0 || n_logits > n_vocab_)
    throw Error("sampler: row of " + std::to_string(n_logits) + " logits for a vocabulary of " +
                std::to_string(n_vocab_));
  out.clear();
  if (greedy_) {
    const int32_t id = argmax(logits, n_logits);
    if (id < 0 || logits[id] == kNegInf) throw_nothing_samplable();
    out.emplace_back(id, 1.0f);
    return;
  }
  const int64_t n = apply_min_p(apply_top_p(select_candidates(logits, n_logits)));
  const float mx = max_logit_;  // the best token always survives top-p
  if (mx == kPosInf) {
    // The limit of softmax: +inf tokens share the mass equally, everything else gets none.
    for (int64_t i = 0; i < n; ++i)
      if (cand_[i].logit == kPosInf) out.emplace_back(cand_[i].id, 1.0f);
  } else {
    const float inv_t = 1.0f / params_.temperature;
    for (int64_t i = 0; i < n; ++i) {
      const float w = std::exp((cand_[i].logit - mx) * inv_t);
      if (w > 0.0f) out.emplace_back(cand_[i].id, w);  // the maximum has w = 1, so out is not empty
    }
  }
  double total = 0.0;
  for (const auto& e : out) total += e.second;
  const double inv_total = 1.0 / total;
  size_t kept = 0;  // normalising can underflow a tiny weight to 0: drop it, as promised
  for (const auto& e : out) {
    const float prob = static_cast<float>(e.second * inv_total);
    if (prob > 0.0f) out[kept++] = {e.first, prob};
  }
  out.resize(kept);
}

int32_t Sampler::sample_from(const std::vector<std::pair<int32_t, float>>& dist) {
  double total = 0.0;
  for (const auto& e : dist)
    if (e.second > 0.0f) total += e.second;
  if (!(total > 0.0) || std::isinf(total))
    throw Error("sampler: distribution has no positive finite probability mass");
  // 53 random bits: the draw is finer than any float probability in the list.
  const double u = static_cast<double>(rng_() >> 11) * 0x1.0p-53 * total;
  double cum = 0.0;
  int32_t last = -1;
  for (const auto& e : dist) {
    if (!(e.second > 0.0f)) continue;
    cum += e.second;
    last = e.first;
    if (u < cum) return e.first;
  }
  return last;  // u fell in the rounding gap at the very top
}

int32_t Sampler::sample(const float* logits) {
  if (greedy_) {
    const int32_t id = argmax(logits, n_vocab_);
    if (id < 0 || logits[id] == kNegInf) throw_nothing_samplable();
    return id;
  }
  if (top_k_ > 0 && !(params_.min_p > 0.0f)) {  // the k best ranked: the draw the CUDA backend runs too (ranked_draw.h)
    const int64_t n = select_candidates(logits, n_vocab_);
    const int32_t rank = draw_ranked(
        static_cast<int32_t>(n), [&](int32_t i) { return cand_[i].logit; }, DrawSettings{params_.temperature, params_.top_p}, rng_());
    return cand_[rank].id;
  }
  distribution(logits, scratch_);
  return sample_from(scratch_);
}

}  // namespace microspec
