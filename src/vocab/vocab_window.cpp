#include "vocab/vocab_window.h"

#include <algorithm>
#include <string>

#include "util/error.h"

namespace microspec {

VocabWindow::VocabWindow(int32_t n_vocab, int32_t w_max, std::span<const int32_t> pinned) {
  if (n_vocab <= 0) throw Error("vocabulary window: empty vocabulary");
  if (w_max < 1) throw Error("vocabulary window: W_max must be >= 1, got " + std::to_string(w_max));
  count_.assign(size_t(n_vocab), 0);
  touched_flag_.assign(size_t(n_vocab), 0);
  touched_.assign(size_t(n_vocab), 0);
  // The ring grows to w_max as entries arrive (W_max may be far above what a generation pushes).
  ring_.resize(size_t(std::min(w_max, 1 << 12)));
  state_.count = count_.data();
  state_.touched_flag = touched_flag_.data();
  state_.touched = touched_.data();
  state_.ring = ring_.data();
  state_.n_vocab = n_vocab;
  state_.w_max = w_max;
  for (int32_t id : pinned) {
    if (id < 0 || id >= n_vocab)
      throw Error("vocabulary window: pinned token " + std::to_string(id) + " is outside the vocabulary");
    if (count_[id]) throw Error("vocabulary window: pinned token " + std::to_string(id) + " appears twice");
    window_pin(state_, id);
  }
  n_pinned_ = static_cast<int32_t>(pinned.size());
}

int32_t VocabWindow::capacity() const {
  return static_cast<int32_t>(std::min<int64_t>(int64_t(state_.w_max) + n_pinned_, n_vocab()));
}

WindowState& VocabWindow::state_for_appends(int64_t n) {
  const int64_t need = std::min<int64_t>(int64_t(state_.entries) + n, state_.w_max);
  if (need > int64_t(ring_.size())) {
    ring_.resize(size_t(std::max<int64_t>(need, std::min<int64_t>(2 * int64_t(ring_.size()), state_.w_max))));
    state_.ring = ring_.data();
  }
  return state_;
}

void VocabWindow::push(int32_t token) {
  if (token < 0 || token >= n_vocab())
    throw Error("vocabulary window: token " + std::to_string(token) + " is outside the vocabulary");
  window_push(state_for_appends(1), token);
}

void VocabWindow::clear() { window_clear(state_); }

void VocabWindow::take_changes(std::vector<int32_t>& entered, std::vector<int32_t>& left) {
  // Each list holds at most the touched tokens (no allocation within the capacity the caller reserved).
  entered.resize(size_t(state_.n_touched));
  left.resize(size_t(state_.n_touched));
  int32_t n_entered = 0, n_left = 0;
  window_take_changes(state_, entered.data(), &n_entered, left.data(), &n_left);
  entered.resize(size_t(n_entered));
  left.resize(size_t(n_left));
}

std::vector<int32_t> VocabWindow::active_tokens() const {
  std::vector<int32_t> out;
  out.reserve(size_t(state_.active));
  for (int32_t t = 0; t < n_vocab(); ++t)
    if (count_[t] > 0) out.push_back(t);
  return out;
}

}  // namespace microspec
