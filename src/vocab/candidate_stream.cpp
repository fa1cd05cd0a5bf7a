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
}

void CandidateStream::begin(std::span<const int32_t> prompt, std::span<const int32_t> prompt_top, int32_t k) {
  const int32_t n_vocab = window_.n_vocab();
  for (int32_t t : prompt)
    if (t < 0 || t >= n_vocab) throw Error("candidate stream: prompt token " + std::to_string(t) + " out of range");
  const bool ext = params_.source == CandidateStreamParams::Source::Ext;
  const int32_t use_k = ext || k <= 0 ? 0 : std::min(k, params_.k_pre);
  if (use_k > 0 && prompt_top.size() != prompt.size() * size_t(k))
    throw Error("candidate stream: prompt top-k table has " + std::to_string(prompt_top.size()) +
                " entries, expected " + std::to_string(prompt.size() * size_t(k)));
  // The prompt part keeps repeats (S is the prompt as written); its candidates are one group.
  const int32_t n_prompt = ext ? 0 : static_cast<int32_t>(prompt.size());
  WindowState& w = window_.state_for_appends(int64_t(n_prompt) * (1 + use_k));
  stream_begin(w, stamps_, prompt.data(), n_prompt, prompt_top.data(), k, use_k);
}

void CandidateStream::step(std::span<const int32_t> tree_tokens, const float* verify_logits,
                           std::span<const int32_t> rows) {
  if (params_.source == CandidateStreamParams::Source::Ctx) return;
  const int32_t n_vocab = window_.n_vocab(), k = params_.k_ver;
  tops_.resize(rows.size() * size_t(k));
  for (size_t r = 0; r < rows.size() && k > 0; ++r)
    top_k_indices(verify_logits + size_t(rows[r]) * n_vocab, n_vocab, k, tops_.data() + r * size_t(k));
  WindowState& w = window_.state_for_appends(int64_t(tree_tokens.size()) + int64_t(tops_.size()));
  stream_step(w, stamps_, tree_tokens.data(), static_cast<int32_t>(tree_tokens.size()), tops_.data(),
              static_cast<int32_t>(tops_.size()));
}

}  // namespace microspec
