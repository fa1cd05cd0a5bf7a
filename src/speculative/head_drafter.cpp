#include "speculative/head_drafter.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <string>

#include "util/error.h"

namespace microspec {

HeadDrafter::HeadDrafter(std::unique_ptr<Eagle3Head> head, Model& target, int32_t n_ctx, DraftVocabulary vocab)
    : head_(std::move(head)),
      target_(target),
      kv_(head_->make_cache(n_ctx)),
      vocab_(std::move(vocab)),
      feature_size_(head_->config().n_features()) {
  const size_t rows = size_t(head_->n_batch()), H = size_t(head_->config().n_embd);
  g_.assign(rows * H, 0.0f);
  prenorm_.assign(rows * H, 0.0f);
  normed_.assign(rows * H, 0.0f);
  root_features_.assign(size_t(feature_size_), 0.0f);
  const std::vector<int32_t>& d2t = head_->draft_to_target();
  if (!d2t.empty()) {
    own_row_of_.assign(size_t(target.config().n_vocab), -1);
    for (size_t r = 0; r < d2t.size(); ++r) own_row_of_[size_t(d2t[r])] = static_cast<int32_t>(r);
    own_rows_.reserve(d2t.size());
    own_ids_.reserve(d2t.size());
  }
}

void HeadDrafter::select_own_rows() {
  const std::vector<int32_t>& d2t = head_->draft_to_target();
  if (!vocab_.ids()) {  // the full vocabulary: every own row, the same every step
    if (own_rows_are_all_) return;
    own_rows_.clear();
    for (size_t r = 0; r < d2t.size(); ++r) own_rows_.push_back(static_cast<int32_t>(r));
    own_ids_ = d2t;
    own_rows_are_all_ = true;
    return;
  }
  own_rows_.clear();
  own_ids_.clear();
  own_rows_are_all_ = false;
  for (int32_t j = 0; j < vocab_.size(); ++j) {
    const int32_t id = vocab_.token(j), r = own_row_of_[size_t(id)];
    if (r >= 0) {
      own_rows_.push_back(r);
      own_ids_.push_back(id);
    }
  }
}

void HeadDrafter::score_own_rows(int32_t rows, int32_t k, DraftSampling* sampling, Proposal* out) {
  const int32_t V = static_cast<int32_t>(own_rows_.size());
  logits_.resize(size_t(rows) * V);
  const auto t0 = std::chrono::steady_clock::now();
  head_->own_logits(normed_.data(), rows, own_rows_.data(), V, logits_.data());
  lm_head_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (int32_t r = 0; r < rows; ++r)
    pick_children(logits_.data() + size_t(r) * V, V, own_ids_.data(), k, sampling, r, out + size_t(r) * k);
}

void HeadDrafter::target_features(const float* features, int32_t rows) {
  features_ = features;
  feature_rows_ = rows;
}

const float* HeadDrafter::feature_row(int32_t row) const {
  if (!features_ || row < 0 || row >= feature_rows_)
    throw Error("draft head: the target's features of row " + std::to_string(row) + " were not handed over");
  return features_ + size_t(row) * feature_size_;
}

void HeadDrafter::run_committed(std::span<const int32_t> tokens, const float* features) {
  const int32_t n = static_cast<int32_t>(tokens.size());
  for (int32_t at = 0; at < n; at += head_->n_batch()) {
    const int32_t len = std::min(head_->n_batch(), n - at);
    batch_.set_sequence(tokens.subspan(size_t(at), size_t(len)), kv_.n_past(), false);
    head_->fuse(features + size_t(at) * feature_size_, len, g_.data());
    head_->forward(batch_, g_.data(), kv_, prenorm_.data(), normed_.data());
    kv_.commit_prefix(len);
  }
}

void HeadDrafter::begin(const std::vector<int32_t>& prompt, std::span<const int32_t> prompt_top) {
  const int32_t n = static_cast<int32_t>(prompt.size());
  if (feature_rows_ != n)
    throw Error("draft head: features of " + std::to_string(feature_rows_) + " prompt rows for a prompt of " +
                std::to_string(n));
  kv_.clear();
  root_run_ = false;
  // Position i pairs the features at i with the token at i + 1; the last position's features
  // pair with the first generated token, the first root. They wait for the first proposal (as the
  // committed rows of steps the head does not draft do): a generation that never asks the head
  // (--spec auto, head+ngram) never runs them.
  pair_tokens_.assign(prompt.begin() + 1, prompt.end());
  pair_features_.assign(feature_row(0), feature_row(0) + size_t(n - 1) * size_t(feature_size_));
  std::copy_n(feature_row(n - 1), feature_size_, root_features_.begin());
  vocab_.begin(prompt, prompt_top);
}

bool HeadDrafter::fits(const TreeParams& params, int32_t room) const {
  return params.max_draft_rows() <= room && params.top_k <= head_->n_batch();
}

void HeadDrafter::propose(int32_t root, int32_t position, const TreeParams& params, DraftSampling* sampling,
                          DraftTree& tree) {
  run_committed(pair_tokens_, pair_features_.data());
  pair_tokens_.clear();
  pair_features_.clear();
  if (kv_.n_past() != position - 1)
    throw Error("draft head: out of step with the target (" + std::to_string(kv_.n_past()) +
                " rows for position " + std::to_string(position) + ")");
  root_ = root;
  root_pos_ = position - 1;
  root_run_ = false;
  next_slot_ = 0;
  slot_of_.clear();
  // An empty draft vocabulary has nothing to propose: the step verifies the root alone.
  if (vocab_.size() == 0) return;
  if (head_->config().n_draft_vocab) {
    select_own_rows();
    if (own_rows_.empty()) return;  // none of the active ids is in the head's vocabulary
  }
  builder_.build(params, *this, tree, sampling);
}

void HeadDrafter::expand(std::span<const int32_t> frontier, std::span<const TreeNode> cand, int32_t k,
                         DraftSampling* sampling, Proposal* out) {
  const int32_t H = head_->config().n_embd;
  batch_.clear();
  if (frontier.size() == 1 && frontier[0] < 0) {
    // Level 1: the root's row, fed the target's features at the position before it.
    batch_.tokens.push_back(root_);
    batch_.positions.push_back(root_pos_);
    batch_.parents.push_back(-1);
    head_->fuse(root_features_.data(), 1, g_.data());
    root_run_ = true;
  } else {
    // Deeper levels: each candidate's row fed its parent's own output.
    if (!root_run_) throw Error("draft head: the root must be expanded first");
    batch_.start = next_slot_;
    slot_of_.resize(cand.size(), -1);
    for (size_t i = 0; i < frontier.size(); ++i) {
      const TreeNode& c = cand[frontier[i]];
      const int32_t parent_slot = c.parent < 0 ? 0 : slot_of_[c.parent];
      batch_.tokens.push_back(c.token);
      batch_.positions.push_back(root_pos_ + c.depth);
      batch_.parents.push_back(parent_slot);
      std::copy_n(slot_hidden_.data() + size_t(parent_slot) * H, H, g_.data() + i * H);
      slot_of_[frontier[i]] = next_slot_ + static_cast<int32_t>(i);
    }
  }
  const int32_t rows = batch_.size();
  head_->forward(batch_, g_.data(), kv_, prenorm_.data(), normed_.data());
  next_slot_ = batch_.start + rows;
  if (slot_hidden_.size() < size_t(next_slot_) * H) slot_hidden_.resize(size_t(next_slot_) * H);
  std::copy_n(prenorm_.data(), size_t(rows) * H, slot_hidden_.data() + size_t(batch_.start) * H);
  if (head_->config().n_draft_vocab)
    score_own_rows(rows, k, sampling, out);
  else
    score_and_pick(vocab_, target_, normed_.data(), rows, k, sampling, logits_, lm_head_seconds_, out);
}

void HeadDrafter::accepted(int32_t root, const DraftTree& tree, std::span<const int32_t> path,
                           const float* verify_logits) {
  // The root's row used the target's own features: keep it (the tree's rows are dropped). When
  // no tree was drafted it has not run: it joins the rows to run.
  auto add_pair = [&](int32_t token, const float* features) {
    pair_tokens_.push_back(token);
    pair_features_.insert(pair_features_.end(), features, features + feature_size_);
  };
  if (root_run_) {
    kv_.commit_prefix(1);
  } else {
    add_pair(root, root_features_.data());
  }
  root_run_ = false;
  // Verification row 0 is the root, row i + 1 node i: each accepted token pairs with the features
  // of the row before it; the last accepted row's features pair with the next root (the bonus).
  int32_t row = 0;
  for (int32_t node : path) {
    add_pair(tree.nodes[size_t(node)].token, feature_row(row));
    row = node + 1;
  }
  std::copy_n(feature_row(row), feature_size_, root_features_.begin());
  vocab_.accepted(node_tokens(tree, tree_tokens_), path, verify_logits);
}

std::string default_draft_head_path(const std::string& model_path) {
  const std::filesystem::path p(model_path);
  std::string stem = p.filename().string();
  if (stem.size() > 5 && stem.compare(stem.size() - 5, 5, ".gguf") == 0) stem.resize(stem.size() - 5);
  return (p.parent_path() / "heads" / (stem + ".eagle3.gguf")).string();
}

}  // namespace microspec
