#pragma once
// MicroSpec's candidate stream S, fed into a VocabWindow (the active draft vocabulary is
// Unique(last W_max entries of S)):
//   begin: S = the prompt tokens, then the union of the target's top-K_pre tokens at every prompt
//          position (from the prefill logits);
//   step:  after each verification, the distinct tokens of the whole draft tree (accepted or
//          not), then the target's top-K_ver tokens of the verification logits.
//
// Choices where the paper leaves room (measured in the README's "Draft vocabularies" section):
// - The prompt union is ordered by first occurrence (position by position, best first inside a
//   position), so when W_max is smaller than S_init the window keeps the candidates of the latest
//   positions, the ones closest to the reply.
// - One step appends each token at most once: tree tokens in tree order, then the K_ver tokens of
//   the verification rows that are not already in this step's part (a token in both only refreshes
//   its recency once, so a duplicate does not take a second window entry).
// - K_ver rows: the target's rows at every accepted position (the root's row and each accepted
//   node's), i.e. the target's next-token candidates at each position that made it into the text,
//   not only at the last one (KverRows::Last, the alternative, is kept for measurement).
//
// Ablations (the paper's Table 2): Source::Ctx keeps S_init and ignores steps; Source::Ext starts
// from an empty stream (no prompt part) and only appends per step.
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "vocab/vocab_window.h"

namespace microspec {

struct CandidateStreamParams {
  enum class Source { Both, Ctx, Ext };
  enum class KverRows { Accepted, Last };
  int32_t w_max = 3072;
  int32_t k_pre = 3;
  int32_t k_ver = 3;
  Source source = Source::Both;
  KverRows kver_rows = KverRows::Accepted;

  bool operator==(const CandidateStreamParams&) const = default;
  // "ctx", "ext" or "both"; throws Error otherwise.
  static Source parse_source(const std::string& name);
  // Target top tokens per prompt position that begin() consumes (0 for Source::Ext).
  int32_t prompt_top_k() const { return source == Source::Ext ? 0 : k_pre; }
};

class CandidateStream {
 public:
  // pinned: ids always active (hybrid); see VocabWindow.
  CandidateStream(int32_t n_vocab, const CandidateStreamParams& params, std::span<const int32_t> pinned = {});
  // stamps_ points into stamp_ (and the window into its arrays): moves keep them, copies would not.
  CandidateStream(const CandidateStream&) = delete;
  CandidateStream& operator=(const CandidateStream&) = delete;
  CandidateStream(CandidateStream&&) = default;
  CandidateStream& operator=(CandidateStream&&) = default;

  // Restarts S for a new prompt. prompt_top: [prompt.size()][k] target top ids per position (-1
  // entries are skipped); ignored for Source::Ext.
  void begin(std::span<const int32_t> prompt, std::span<const int32_t> prompt_top, int32_t k);
  // One verification step. tree_tokens: every draft tree node's token in tree order (may be empty).
  // verify_logits: the target's logits rows [rows][n_vocab]; rows lists the row indices whose top-
  // K_ver to append, in order (the caller picks them per params().kver_rows). No-op for Ctx.
  void step(std::span<const int32_t> tree_tokens, const float* verify_logits, std::span<const int32_t> rows);

  VocabWindow& window() { return window_; }
  const VocabWindow& window() const { return window_; }
  const CandidateStreamParams& params() const { return params_; }

 private:
  CandidateStreamParams params_;
  VocabWindow window_;
  std::vector<uint32_t> stamp_;  // [n_vocab] last append group a token was appended in
  StreamStamps stamps_;          // over stamp_ (window_state.h)
  std::vector<int32_t> tops_;    // [verification rows][k_ver] scratch of a step (grows to the most rows)
};

}  // namespace microspec
