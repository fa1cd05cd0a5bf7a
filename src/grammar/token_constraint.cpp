#include "grammar/token_constraint.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "math/select.h"
#include "tokenizer/tokenizer.h"
#include "util/error.h"

namespace microspec {

namespace {
// Whole-row masks the cache keeps per constraint before it starts over (Gemma: 32 KiB each).
constexpr size_t kMaxCachedMasks = 1024;
// mask_ranked looks at this many of a row's best tokens per allowed token asked for.
constexpr int32_t kRankedPerKept = 4;
constexpr int32_t kMinRanked = 16;
}  // namespace

// ---- vocabulary ----

namespace {

std::vector<std::string> token_bytes(const Tokenizer& tok) {
  std::vector<std::string> pieces(size_t(tok.n_vocab()));
  for (int32_t id = 0; id < tok.n_vocab(); ++id) {
    const TokenType t = tok.token_type(id);
    if (t != TokenType::Control && t != TokenType::Unknown && t != TokenType::Unused && !tok.is_end_of_generation(id))
      pieces[size_t(id)] = tok.token_to_piece(id);
  }
  return pieces;
}

}  // namespace

GrammarVocabulary::GrammarVocabulary(const Tokenizer& tok)
    : GrammarVocabulary(token_bytes(tok), tok.end_of_generation_ids()) {}

GrammarVocabulary::GrammarVocabulary(const std::vector<std::string>& pieces, const std::vector<int32_t>& end_ids) {
  const int32_t n = static_cast<int32_t>(pieces.size());
  offset_.assign(size_t(n) + 1, 0);
  ends_.assign(size_t(n), 0);
  for (int32_t id : end_ids) {
    if (id < 0 || id >= n) throw Error("grammar vocabulary: end-of-generation id " + std::to_string(id) + " is outside the vocabulary");
    ends_[size_t(id)] = 1;
  }
  for (int32_t id = 0; id < n; ++id) {
    if (!ends_[size_t(id)]) text_ += pieces[size_t(id)];
    offset_[size_t(id) + 1] = int64_t(text_.size());
  }
  // The trie: children kept as first-child / next-sibling lists.
  trie_.emplace_back();
  std::vector<std::vector<int32_t>> ending(1);  // [node] tokens whose bytes end there
  for (int32_t id = 0; id < n; ++id) {
    const std::string_view b = bytes(id);
    if (b.empty() || ends(id)) continue;
    int32_t node = 0;
    for (char c : b) {
      int32_t child = trie_[size_t(node)].first_child;
      while (child >= 0 && trie_[size_t(child)].byte != uint8_t(c)) child = trie_[size_t(child)].next_sibling;
      if (child < 0) {
        child = static_cast<int32_t>(trie_.size());
        TrieNode fresh;
        fresh.byte = uint8_t(c);
        fresh.next_sibling = trie_[size_t(node)].first_child;
        trie_.push_back(fresh);
        ending.emplace_back();
        trie_[size_t(node)].first_child = child;
      }
      node = child;
    }
    ending[size_t(node)].push_back(id);
  }
  for (size_t i = 0; i < trie_.size(); ++i) {
    trie_[i].tokens_begin = static_cast<int32_t>(trie_tokens_.size());
    trie_tokens_.insert(trie_tokens_.end(), ending[i].begin(), ending[i].end());
    trie_[i].tokens_end = static_cast<int32_t>(trie_tokens_.size());
  }
}

// ---- constraint ----

TokenConstraint::TokenConstraint(Grammar grammar, std::shared_ptr<const GrammarVocabulary> vocab)
    : grammar_(std::move(grammar)), vocab_(std::move(vocab)) {}

bool TokenConstraint::allows(const GrammarState& state, int32_t token, GrammarScratch& scratch) const {
  if (vocab_->ends(token)) return Grammar::complete(state);
  const std::string_view b = vocab_->bytes(token);
  if (b.empty() || !grammar_.accepts(state, uint8_t(b[0]))) return false;
  scratch.probe.flat.assign(state.flat.begin(), state.flat.end());  // its capacity reused: no allocation per check
  return grammar_.advance_bytes(scratch.probe, b, scratch);
}

bool TokenConstraint::advance(GrammarState& state, int32_t token, GrammarScratch& scratch) const {
  if (vocab_->ends(token)) {
    if (!Grammar::complete(state)) state.flat.clear();
    return !state.dead();
  }
  const std::string_view b = vocab_->bytes(token);
  if (b.empty()) {
    state.flat.clear();
    return false;
  }
  return grammar_.advance_bytes(state, b, scratch);
}

size_t TokenConstraint::StateHash::operator()(const std::vector<int32_t>& v) const {
  uint64_t h = 1469598103934665603ull;
  for (int32_t x : v) h = (h ^ uint32_t(x)) * 1099511628211ull;
  return size_t(h);
}

void TokenConstraint::walk(const GrammarState& state, std::vector<uint64_t>& bits, GrammarScratch& scratch) const {
  const auto& trie = vocab_->trie();
  const auto& tokens = vocab_->trie_tokens();
  // Depth-first over the trie, one state per depth (levels[d]: after the node's d bytes).
  std::vector<GrammarState> levels(1, state);
  struct Frame {
    int32_t child;  // next child to visit
    int32_t depth;
  };
  std::vector<Frame> frames{{trie[0].first_child, 0}};
  while (!frames.empty()) {
    Frame& f = frames.back();
    if (f.child < 0) {
      frames.pop_back();
      continue;
    }
    const int32_t node = f.child;
    const int32_t depth = f.depth;
    f.child = trie[size_t(node)].next_sibling;
    const GrammarState& from = levels[size_t(depth)];
    if (!grammar_.accepts(from, trie[size_t(node)].byte)) continue;
    if (levels.size() < size_t(depth) + 2) levels.resize(size_t(depth) + 2);
    grammar_.advance(levels[size_t(depth)], trie[size_t(node)].byte, levels[size_t(depth) + 1], scratch);
    if (levels[size_t(depth) + 1].dead()) continue;
    for (int32_t i = trie[size_t(node)].tokens_begin; i < trie[size_t(node)].tokens_end; ++i)
      bits[size_t(tokens[size_t(i)]) >> 6] |= uint64_t(1) << (tokens[size_t(i)] & 63);
    frames.push_back({trie[size_t(node)].first_child, depth + 1});
  }
}

std::shared_ptr<const std::vector<uint64_t>> TokenConstraint::full_mask(const GrammarState& state,
                                                                       GrammarScratch& scratch) const {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (auto it = masks_.find(state.flat); it != masks_.end()) return it->second;
  }
  auto bits = std::make_shared<std::vector<uint64_t>>((size_t(vocab_->size()) + 63) / 64, 0);
  walk(state, *bits, scratch);
  if (Grammar::complete(state))
    for (int32_t id = 0; id < vocab_->size(); ++id)
      if (vocab_->ends(id)) (*bits)[size_t(id) >> 6] |= uint64_t(1) << (id & 63);
  std::lock_guard<std::mutex> lock(mutex_);
  if (masks_.size() >= kMaxCachedMasks) masks_.clear();
  masks_.emplace(state.flat, bits);
  return bits;
}

// ---- one sequence ----

GrammarMatcher::GrammarMatcher(std::shared_ptr<const TokenConstraint> constraint, int32_t keep_best)
    : constraint_(std::move(constraint)), keep_best_(std::max(keep_best, 0)), n_vocab_(constraint_->vocab().size()) {
  constraint_->grammar().start(start_, scratch_);
  state_ = start_;
}

void GrammarMatcher::begin() { state_ = start_; }

void GrammarMatcher::accept(int32_t token) {
  if (!constraint_->advance(state_, token, scratch_))
    throw Error("grammar: token " + std::to_string(token) + " is not allowed here");
}

void GrammarMatcher::state_after(std::span<const int32_t> path, GrammarState& out) {
  out = state_;
  for (int32_t t : path)
    if (!constraint_->advance(out, t, scratch_)) return;
}

bool GrammarMatcher::allows_path(std::span<const int32_t> path) {
  state_after(path, path_state_);
  return !path_state_.dead();
}

void GrammarMatcher::mask_row(float* logits, std::span<const int32_t> path) {
  const GrammarState* state = &state_;
  if (!path.empty()) {
    state_after(path, path_state_);
    state = &path_state_;
  }
  // A path the grammar refuses (a sampled draft tree keeps such nodes) leaves the row as it is:
  // its node's own token is masked in its parent's row, so it is never accepted and this row
  // never read.
  if (state->dead()) return;
  if (keep_best_ > 0 && mask_ranked(logits, *state)) return;
  mask_all(logits, *state);
}

void GrammarMatcher::mask_all(float* logits, const GrammarState& state) {
  const auto bits = constraint_->full_mask(state, scratch_);
  bool any = false;
  for (int32_t id = 0; id < n_vocab_; ++id) {
    if (((*bits)[size_t(id) >> 6] >> (id & 63)) & 1u) {
      any = any || logits[id] > -std::numeric_limits<float>::infinity();
    } else {
      logits[id] = -std::numeric_limits<float>::infinity();
    }
  }
  if (!any) throw Error("grammar: no token the model can give is allowed here");
}

bool GrammarMatcher::mask_ranked(float* logits, const GrammarState& state) {
  constexpr float kNever = -std::numeric_limits<float>::infinity();
  // Greedy: the row's argmax is usually allowed, and then nothing needs masking at all.
  if (keep_best_ == 1) {
    for (int32_t tries = 0; tries < kMinRanked; ++tries) {
      const int32_t best = argmax(logits, n_vocab_);
      if (best < 0 || !(logits[best] > kNever)) throw Error("grammar: no token the model can give is allowed here");
      if (constraint_->allows(state, best, scratch_)) return true;
      logits[best] = kNever;
    }
  }
  // The row's best tokens, best first (ties: lower id first): a bounded min-heap, then sorted.
  const int32_t want = std::max(kMinRanked, keep_best_ * kRankedPerKept);
  auto worse = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  ranked_.clear();
  for (int32_t id = 0; id < n_vocab_; ++id) {
    const float v = logits[id];
    if (!(v > kNever)) continue;  // -inf and NaN are never chosen
    if (int32_t(ranked_.size()) < want) {
      ranked_.emplace_back(v, id);
      std::push_heap(ranked_.begin(), ranked_.end(), worse);
    } else if (worse({v, id}, ranked_.front())) {
      std::pop_heap(ranked_.begin(), ranked_.end(), worse);
      ranked_.back() = {v, id};
      std::push_heap(ranked_.begin(), ranked_.end(), worse);
    }
  }
  std::sort_heap(ranked_.begin(), ranked_.end(), worse);  // best first
  int32_t kept = 0;
  refused_.clear();
  for (size_t i = 0; i < ranked_.size() && kept < keep_best_; ++i) {
    if (constraint_->allows(state, ranked_[i].second, scratch_)) ++kept;
    else refused_.push_back(ranked_[i].second);
  }
  // Too few allowed among them while more tokens remain below: the whole mask decides.
  if (kept < keep_best_ && int32_t(ranked_.size()) == want) return false;
  if (kept == 0) throw Error("grammar: no token the model can give is allowed here");
  for (int32_t id : refused_) logits[id] = kNever;
  return true;
}

}  // namespace microspec
