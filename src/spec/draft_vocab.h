#pragma once
// The vocabulary a drafter scores: a list of LM-head rows (token ids). Drafting only needs the
// likely next tokens, so a drafter may score a pruned subset of the vocabulary; the target always
// verifies against its full head, so pruning never changes the output, only the acceptance rate.
// Drafters never index the full head themselves: they ask this object for the logits of its rows
// and map row positions back to token ids.
#include <cstdint>
#include <vector>

namespace microspec {

class Model;

class DraftVocabulary {
 public:
  // All n_vocab rows, in id order (the head is computed whole, the fastest way for every row).
  static DraftVocabulary full(int32_t n_vocab);
  // A subset: token_ids are distinct ids in [0, n_vocab). Throws Error otherwise.
  static DraftVocabulary subset(std::vector<int32_t> token_ids, int32_t n_vocab);

  int32_t size() const { return size_; }
  bool is_full() const { return rows_.empty(); }
  // Token id of position j of the active rows.
  int32_t token(int32_t j) const { return rows_.empty() ? j : rows_[j]; }

  // logits[i][j] = head row token(j) applied to hidden[i]: hidden is [n][n_embd], logits [n][size()].
  void logits(Model& model, const float* hidden, int32_t n, float* logits) const;

 private:
  int32_t size_ = 0;
  std::vector<int32_t> rows_;  // [size_] token ids; empty = the full vocabulary in id order
};

}  // namespace microspec
