#include "vocab/vocab_window.h"

#include <algorithm>
#include <string>

#include "util/error.h"

namespace microspec {

VocabWindow::VocabWindow(int32_t n_vocab, int32_t w_max, std::span<const int32_t> pinned)
    : w_max_(w_max), count_(size_t(std::max(n_vocab, 0)), 0), touched_flag_(size_t(std::max(n_vocab, 0)), 0) {
  if (n_vocab <= 0) throw Error("vocabulary window: empty vocabulary");
  if (w_max < 1) throw Error("vocabulary window: W_max must be >= 1, got " + std::to_string(w_max));
  // The ring grows to w_max as entries arrive; reserve what a typical window needs up front.
  ring_.reserve(size_t(std::min(w_max, 1 << 16)));
  touched_.reserve(size_t(std::min(n_vocab, 1 << 16)));
  for (int32_t id : pinned) {
    if (id < 0 || id >= n_vocab)
      throw Error("vocabulary window: pinned token " + std::to_string(id) + " is outside the vocabulary");
    if (count_[id]) throw Error("vocabulary window: pinned token " + std::to_string(id) + " appears twice");
    touch(id);
    count_[id] = 1;
    ++active_;
  }
  n_pinned_ = static_cast<int32_t>(pinned.size());
}

int32_t VocabWindow::capacity() const {
  return static_cast<int32_t>(std::min<int64_t>(int64_t(w_max_) + n_pinned_, n_vocab()));
}

void VocabWindow::touch(int32_t token) {
  if (touched_flag_[token]) return;
  touched_flag_[token] = uint8_t(1 + (count_[token] > 0));
  touched_.push_back(token);
}

void VocabWindow::push(int32_t token) {
  if (token < 0 || token >= n_vocab())
    throw Error("vocabulary window: token " + std::to_string(token) + " is outside the vocabulary");
  if (static_cast<int32_t>(ring_.size()) == w_max_) {
    int32_t& slot = ring_[head_];
    const int32_t old = slot;
    if (count_[old] == 1) {
      touch(old);  // before the change: records "was active"
      --active_;
    }
    --count_[old];
    slot = token;
    head_ = head_ + 1 == w_max_ ? 0 : head_ + 1;
  } else {
    ring_.push_back(token);
  }
  if (count_[token] == 0) {
    touch(token);  // before the change: records "was inactive"
    ++active_;
  }
  ++count_[token];
}

void VocabWindow::clear() {
  for (int32_t t : ring_) {
    if (count_[t] == 1) {
      touch(t);
      --active_;
    }
    --count_[t];
  }
  ring_.clear();
  head_ = 0;
}

void VocabWindow::take_changes(std::vector<int32_t>& entered, std::vector<int32_t>& left) {
  entered.clear();
  left.clear();
  for (int32_t t : touched_) {
    const bool was = touched_flag_[t] == 2, now = count_[t] > 0;
    if (now && !was) entered.push_back(t);
    if (was && !now) left.push_back(t);
    touched_flag_[t] = 0;
  }
  touched_.clear();
}

std::vector<int32_t> VocabWindow::active_tokens() const {
  std::vector<int32_t> out;
  out.reserve(size_t(active_));
  for (int32_t t = 0; t < n_vocab(); ++t)
    if (count_[t] > 0) out.push_back(t);
  return out;
}

}  // namespace microspec
