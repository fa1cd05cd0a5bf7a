#pragma once
// MicroSpec's context-aware draft vocabulary as a data structure: a candidate stream S of token
// ids, of which the last W_max entries form a FIFO window; the active set is Unique(window). A
// per-token occupancy count (how many window entries hold the token) makes each append O(1): the
// entry pushed in and the entry pushed out each move one count, and a token enters or leaves the
// active set exactly when its count crosses zero. Nothing is ever O(W_max) or O(n_vocab) per step.
//
// Pinned tokens (the hybrid vocabulary's frequent tokens) hold one extra count that no eviction
// removes, so they are always active without occupying window entries.
//
// Set changes are reported net: take_changes() lists the tokens whose membership differs from the
// last take_changes() (a token that left and came back in between is in neither list). That is
// what the packed LM head needs: one row gather per token that newly entered, one freed slot per
// token that left.
#include <cstdint>
#include <span>
#include <vector>

#include "vocab/window_state.h"

namespace microspec {

class VocabWindow {
 public:
  // w_max >= 1 entries; pinned: distinct ids in [0, n_vocab). Throws Error otherwise.
  VocabWindow(int32_t n_vocab, int32_t w_max, std::span<const int32_t> pinned = {});
  // state_ points into the arrays: moves keep them, copies would not.
  VocabWindow(const VocabWindow&) = delete;
  VocabWindow& operator=(const VocabWindow&) = delete;
  VocabWindow(VocabWindow&&) = default;
  VocabWindow& operator=(VocabWindow&&) = default;

  // Appends one token to S (evicting the oldest entry when the window is full).
  void push(int32_t token);
  // Grows the ring so that n more appends fit, then the state for window_state.h's functions
  // (CandidateStream appends through them).
  WindowState& state_for_appends(int64_t n);
  // Empties the stream (pinned tokens stay). O(entries in the window): once per generation.
  void clear();
  // Net membership changes since the last call (or construction: the pinned tokens enter then).
  // Both lists are cleared and refilled.
  void take_changes(std::vector<int32_t>& entered, std::vector<int32_t>& left);

  bool contains(int32_t token) const { return count_[token] > 0; }
  int32_t active_size() const { return state_.active; }
  // Entries in the window (<= w_max).
  int32_t entries() const { return state_.entries; }
  int32_t w_max() const { return state_.w_max; }
  int32_t n_vocab() const { return state_.n_vocab; }
  // Upper bound of active_size(): min(n_vocab, w_max + pinned).
  int32_t capacity() const;
  // The active set in ascending id order: O(n_vocab), for tests and tools.
  std::vector<int32_t> active_tokens() const;

 private:
  // The arrays behind state_ (window_state.h has the algorithm, shared with the CUDA backend).
  int32_t n_pinned_ = 0;
  std::vector<int32_t> count_;         // [n_vocab] window entries holding the token (+1 if pinned)
  std::vector<uint8_t> touched_flag_;  // [n_vocab] 0 untouched; 1 + (was active) otherwise
  std::vector<int32_t> touched_;       // [n_vocab] tokens whose count crossed zero since take_changes
  std::vector<int32_t> ring_;          // [min(w_max, entries ever pushed)]: grows until full, then a ring
  WindowState state_;
};

}  // namespace microspec
