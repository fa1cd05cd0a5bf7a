#include "vocab/candidate_stream.h"

#include <algorithm>
#include <limits>
#include <string>

#include "math/select.h"
#include "util/error.h"

namespace microspec {

CandidateStreamParams::Source CandidateStreamParams::parse_source(const std::string& name) {
  if (name == "both") return Source::Both;
  if (name == "ctx") return Source::Ctx;
  if (name == "ext") return Source::Ext;
  throw Error("vocabulary source must be ctx, ext or both, got '" + name + "'");
}

CandidateStream::CandidateStream(int32_t n_vocab, const CandidateStreamParams& params,
                                 std::span<const int32_t> pinned)
    : params_(params), window_(n_vocab, params.w_max, pinned), stamp_(size_t(n_vocab), 0) {
  if (params.k_pre < 0 || params.k_ver < 0) throw Error("candidate stream: K_pre and K_ver must be >= 0");
  stamps_ = StreamStamps{stamp_.data(), n_vocab, 0};
  top_.resize(size_t(params.k_ver));
}

void CandidateStream::begin(std::span<const int32_t> prompt, std::span<const int32_t> prompt_top, int32_t k) {
  window_.clear();
  if (params_.source == CandidateStreamParams::Source::Ext) return;
  const int32_t n_vocab = window_.n_vocab();
  for (int32_t t : prompt) {
    if (t < 0 || t >= n_vocab)
      throw Error("candidate stream: prompt token " + std::to_string(t) + " out of range");
    window_.push(t);  // the prompt part keeps repeats: S is the prompt as written
  }
  if (k <= 0) return;
  if (prompt_top.size() != prompt.size() * size_t(k))
    throw Error("candidate stream: prompt top-k table has " + std::to_string(prompt_top.size()) +
                " entries, expected " + std::to_string(prompt.size() * size_t(k)));
  stamps_next_group(stamps_);
  const int32_t use = std::min(k, params_.k_pre);
  for (size_t p = 0; p < prompt.size(); ++p)
    for (int32_t j = 0; j < use; ++j) {
      const int32_t t = prompt_top[p * size_t(k) + size_t(j)];
      if (t >= 0 && t < n_vocab) window_.push_once(stamps_, t);
    }
}

void CandidateStream::step(std::span<const int32_t> tree_tokens, const float* verify_logits,
                           std::span<const int32_t> rows) {
  if (params_.source == CandidateStreamParams::Source::Ctx) return;
  stamps_next_group(stamps_);
  const int32_t n_vocab = window_.n_vocab();
  for (int32_t t : tree_tokens)
    if (t >= 0 && t < n_vocab) window_.push_once(stamps_, t);
  if (params_.k_ver == 0) return;
  for (int32_t r : rows) {
    top_k_indices(verify_logits + size_t(r) * n_vocab, n_vocab, params_.k_ver, top_.data());
    for (int32_t t : top_)
      if (t >= 0) window_.push_once(stamps_, t);
  }
}

}  // namespace microspec
