#include "spec/draft_vocab.h"

#include <string>

#include "model/model.h"
#include "util/error.h"

namespace microspec {

DraftVocabulary DraftVocabulary::full(int32_t n_vocab) {
  if (n_vocab <= 0) throw Error("draft vocabulary: empty vocabulary");
  DraftVocabulary v;
  v.size_ = n_vocab;
  return v;
}

DraftVocabulary DraftVocabulary::subset(std::vector<int32_t> token_ids, int32_t n_vocab) {
  if (token_ids.empty()) throw Error("draft vocabulary: empty token set");
  std::vector<uint8_t> seen(size_t(n_vocab), 0);
  for (int32_t id : token_ids) {
    if (id < 0 || id >= n_vocab)
      throw Error("draft vocabulary: token id " + std::to_string(id) + " is outside the vocabulary");
    if (seen[id]) throw Error("draft vocabulary: token id " + std::to_string(id) + " appears twice");
    seen[id] = 1;
  }
  DraftVocabulary v;
  v.size_ = static_cast<int32_t>(token_ids.size());
  v.rows_ = std::move(token_ids);
  return v;
}

void DraftVocabulary::logits(Model& model, const float* hidden, int32_t n, float* logits) const {
  if (rows_.empty()) {
    if (size_ != model.config().n_vocab) throw Error("draft vocabulary: made for another model");
    model.lm_head(hidden, n, logits);
  } else {
    model.lm_head_rows(hidden, n, rows_.data(), size_, logits);
  }
}

}  // namespace microspec
