#include "sampling/penalties.h"

#include "grammar/token_constraint.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "util/error.h"

namespace microspec {

void PenaltyParams::validate(int64_t n_vocab) const {
  if (!(repeat_penalty > 0.0f) || std::isinf(repeat_penalty))
    throw Error("repeat_penalty must be a finite number > 0 (1 = off), got " + std::to_string(repeat_penalty));
  if (repeat_last_n < -1)
    throw Error("repeat_last_n must be >= -1 (-1 = the whole context, 0 = off), got " +
                std::to_string(repeat_last_n));
  if (!(presence_penalty >= -2.0f && presence_penalty <= 2.0f))
    throw Error("presence_penalty must be in [-2, 2], got " + std::to_string(presence_penalty));
  if (!(frequency_penalty >= -2.0f && frequency_penalty <= 2.0f))
    throw Error("frequency_penalty must be in [-2, 2], got " + std::to_string(frequency_penalty));
  for (const auto& [token, bias] : logit_bias) {
    if (token < 0 || token >= n_vocab)
      throw Error("logit_bias: token id " + std::to_string(token) + " is not in the vocabulary (0 to " +
                  std::to_string(n_vocab - 1) + ")");
    if (!(bias >= -100.0f && bias <= 100.0f) && bias != -std::numeric_limits<float>::infinity())
      throw Error("logit_bias: the bias of token " + std::to_string(token) +
                  " must be in [-100, 100] or -infinity (never), got " + std::to_string(bias));
  }
}

const char* first_active_penalty(const PenaltyParams& p, float min_p) {
  if (p.presence_penalty != 0.0f) return "presence_penalty";
  if (p.frequency_penalty != 0.0f) return "frequency_penalty";
  if (p.repeat_penalty != 1.0f && p.repeat_last_n != 0) return "repeat_penalty";
  if (!p.logit_bias.empty()) return "logit_bias";
  if (min_p != 0.0f) return "min_p";
  return nullptr;
}

Penalizer::Penalizer(const PenaltyParams& params, int64_t n_vocab) : Penalizer(params, n_vocab, nullptr) {}

Penalizer::Penalizer(const PenaltyParams& params, int64_t n_vocab, std::unique_ptr<GrammarMatcher> grammar)
    : params_(params), n_vocab_(n_vocab), active_(params.active()), grammar_(std::move(grammar)) {
  params_.validate(n_vocab);
  if (!active_) return;
  seen_.assign(size_t(n_vocab), 0u);
  if (params_.presence_penalty != 0.0f || params_.frequency_penalty != 0.0f) gen_count_.assign(size_t(n_vocab), 0);
}

Penalizer::~Penalizer() = default;

bool Penalizer::allows_path(std::span<const int32_t> path) { return !grammar_ || grammar_->allows_path(path); }

void Penalizer::begin(std::span<const int32_t> prompt, int64_t capacity) {
  if (grammar_) grammar_->begin();
  if (!active_) return;
  for (int32_t t : gen_distinct_) gen_count_[size_t(t)] = 0;
  gen_distinct_.clear();
  context_.clear();
  const int64_t cap = std::max<int64_t>(capacity, int64_t(prompt.size()) + 1);
  context_.reserve(size_t(cap));
  if (!gen_count_.empty()) gen_distinct_.reserve(size_t(std::min<int64_t>(cap, n_vocab_)));
  context_.assign(prompt.begin(), prompt.end());
}

void Penalizer::accept(int32_t token) {
  if (grammar_) grammar_->accept(token);
  if (!active_) return;
  context_.push_back(token);
  if (!gen_count_.empty() && gen_count_[size_t(token)]++ == 0) gen_distinct_.push_back(token);
}

void Penalizer::next_pass() {
  if (++pass_ == 0) {  // the stamps wrapped: forget them all
    std::fill(seen_.begin(), seen_.end(), 0u);
    pass_ = 1;
  }
}

bool Penalizer::stamp(int32_t token) {
  uint32_t& s = seen_[size_t(token)];
  if (s == pass_) return false;
  s = pass_;
  return true;
}

void Penalizer::apply(float* logits, std::span<const int32_t> path) {
  penalise(logits, path);
  if (grammar_) grammar_->mask_row(logits, path);  // last: it ranks the penalised row
}

void Penalizer::penalise(float* logits, std::span<const int32_t> path) {
  if (!active_) return;
  for (const auto& [token, bias] : params_.logit_bias) logits[token] += bias;

  const float rp = params_.repeat_penalty;
  if (rp != 1.0f && params_.repeat_last_n != 0) {
    // The window: the last repeat_last_n tokens of context + path, each distinct token once.
    next_pass();
    const int64_t total = int64_t(context_.size() + path.size());
    const int64_t n = params_.repeat_last_n < 0 ? total : std::min<int64_t>(total, params_.repeat_last_n);
    const int64_t from_path = std::min<int64_t>(n, int64_t(path.size()));
    auto penalise = [&](int32_t t) {
      if (!stamp(t)) return;
      float& l = logits[t];
      l = l <= 0.0f ? l * rp : l / rp;
    };
    for (size_t i = path.size() - size_t(from_path); i < path.size(); ++i) penalise(path[i]);
    for (size_t i = context_.size() - size_t(n - from_path); i < context_.size(); ++i) penalise(context_[i]);
  }

  if (!gen_count_.empty()) {
    for (int32_t t : path) ++gen_count_[size_t(t)];
    next_pass();
    const float presence = params_.presence_penalty, frequency = params_.frequency_penalty;
    auto subtract = [&](int32_t t) {
      if (!stamp(t)) return;
      const int32_t count = gen_count_[size_t(t)];
      logits[t] -= presence * float(count > 0) + frequency * float(count);
    };
    for (int32_t t : gen_distinct_) subtract(t);
    for (int32_t t : path) subtract(t);
    for (int32_t t : path) --gen_count_[size_t(t)];
  }
}

}  // namespace microspec
