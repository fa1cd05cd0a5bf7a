#include "vocab/draft_vocab.h"

#include <string>

#include "model/model.h"
#include "util/error.h"
#include "vocab/packed_head.h"

namespace microspec {

namespace {
void check_ids(const std::vector<int32_t>& token_ids, int32_t n_vocab) {
  if (token_ids.empty()) throw Error("draft vocabulary: empty token set");
  std::vector<uint8_t> seen(size_t(n_vocab), 0);
  for (int32_t id : token_ids) {
    if (id < 0 || id >= n_vocab)
      throw Error("draft vocabulary: token id " + std::to_string(id) + " is outside the vocabulary");
    if (seen[id]) throw Error("draft vocabulary: token id " + std::to_string(id) + " appears twice");
    seen[id] = 1;
  }
}
}  // namespace

DraftVocabulary::DraftVocabulary(DraftVocabulary&&) noexcept = default;
DraftVocabulary& DraftVocabulary::operator=(DraftVocabulary&&) noexcept = default;
DraftVocabulary::~DraftVocabulary() = default;

DraftVocabulary DraftVocabulary::full(int32_t n_vocab) {
  if (n_vocab <= 0) throw Error("draft vocabulary: empty vocabulary");
  DraftVocabulary v;
  v.n_vocab_ = n_vocab;
  return v;
}

DraftVocabulary DraftVocabulary::subset(std::vector<int32_t> token_ids, int32_t n_vocab) {
  check_ids(token_ids, n_vocab);
  DraftVocabulary v;
  v.kind_ = Kind::Subset;
  v.n_vocab_ = n_vocab;
  v.rows_ = std::move(token_ids);
  v.ids_ = v.rows_.data();
  return v;
}

DraftVocabulary DraftVocabulary::packed(const Model& model, std::vector<int32_t> token_ids) {
  const QMatrix& head = model.output_matrix();
  check_ids(token_ids, static_cast<int32_t>(head.rows));
  DraftVocabulary v;
  v.kind_ = Kind::Packed;
  v.n_vocab_ = static_cast<int32_t>(head.rows);
  v.head_ = std::make_unique<PackedHead>(head, static_cast<int32_t>(token_ids.size()), false);
  v.head_->update({}, token_ids);
  // Slots were handed out in order, so row j holds token_ids[j].
  v.ids_ = v.head_->tokens();
  return v;
}

DraftVocabulary DraftVocabulary::dynamic(const Model& model, const DynamicVocabParams& params,
                                         std::vector<int32_t> pinned) {
  const QMatrix& head = model.output_matrix();
  DraftVocabulary v;
  v.kind_ = Kind::Dynamic;
  v.n_vocab_ = static_cast<int32_t>(head.rows);
  v.stream_ = std::make_unique<CandidateStream>(v.n_vocab_, params.stream, pinned);
  v.head_ = std::make_unique<PackedHead>(head, v.stream_->window().capacity(), params.async_gather);
  v.ids_ = v.head_->tokens();
  v.entered_.reserve(size_t(v.head_->capacity()));
  v.left_.reserve(size_t(v.head_->capacity()));
  v.apply_window_changes();  // the pinned rows
  return v;
}

int32_t DraftVocabulary::size() const {
  switch (kind_) {
    case Kind::Full:
      return n_vocab_;
    case Kind::Subset:
      return static_cast<int32_t>(rows_.size());
    case Kind::Packed:
    case Kind::Dynamic:
      return head_->size();
  }
  return 0;
}

void DraftVocabulary::logits(Model& model, const float* hidden, int32_t n, float* logits) {
  switch (kind_) {
    case Kind::Full:
      if (n_vocab_ != model.config().n_vocab) throw Error("draft vocabulary: made for another model");
      model.lm_head(hidden, n, logits);
      return;
    case Kind::Subset:
      model.lm_head_rows(hidden, n, rows_.data(), static_cast<int32_t>(rows_.size()), logits);
      return;
    case Kind::Packed:
    case Kind::Dynamic: {
      if (n_vocab_ != model.config().n_vocab) throw Error("draft vocabulary: made for another model");
      const QMatrix& m = head_->matrix();  // waits for pending row copies
      if (m.rows > 0) model.lm_head_packed(hidden, n, m, logits);
      return;
    }
  }
}

int32_t DraftVocabulary::prompt_top_k() const {
  return kind_ == Kind::Dynamic ? stream_->params().prompt_top_k() : 0;
}

void DraftVocabulary::apply_window_changes() {
  stream_->window().take_changes(entered_, left_);
  if (!entered_.empty() || !left_.empty()) head_->update(left_, entered_);
}

void DraftVocabulary::begin(std::span<const int32_t> prompt, std::span<const int32_t> prompt_top) {
  if (kind_ != Kind::Dynamic) return;
  const int32_t k = prompt.empty() ? 0 : static_cast<int32_t>(prompt_top.size() / prompt.size());
  stream_->begin(prompt, prompt_top, k);
  apply_window_changes();
}

void DraftVocabulary::accepted(std::span<const int32_t> tree_tokens, std::span<const int32_t> path,
                               const float* verify_logits) {
  if (kind_ != Kind::Dynamic || stream_->params().source == CandidateStreamParams::Source::Ctx) return;
  // Verification row of each accepted position: row 0 is the root's, node i's is i + 1.
  ver_rows_.clear();
  if (stream_->params().kver_rows == CandidateStreamParams::KverRows::Last) {
    ver_rows_.push_back(path.empty() ? 0 : path.back() + 1);
  } else {
    ver_rows_.push_back(0);
    for (int32_t p : path) ver_rows_.push_back(p + 1);
  }
  stream_->step(tree_tokens, verify_logits, ver_rows_);
  apply_window_changes();
}

}  // namespace microspec
