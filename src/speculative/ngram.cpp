#include "speculative/ngram.h"

#include <algorithm>
#include <string>

#include "util/error.h"

namespace microspec {

void NgramParams::validate() const {
  if (min_n < 1 || max_n > 64 || min_n > max_n)
    throw Error("n-gram lengths must satisfy 1 <= ngram-min <= ngram-max <= 64, got ngram-min " +
                std::to_string(min_n) + ", ngram-max " + std::to_string(max_n));
}

NgramIndex::NgramIndex(const NgramParams& params, int32_t capacity) : params_(params), capacity_(capacity) {
  params_.validate();
  if (capacity < 1) throw Error("n-gram index: capacity must be >= 1, got " + std::to_string(capacity));
  // Every indexed n-gram is one (end, length) pair: at most capacity * lengths keys, so a table of
  // twice that keeps the load under one half.
  const size_t keys = size_t(capacity) * size_t(params_.max_n - params_.min_n + 1);
  size_t slots = 16;
  while (slots < 2 * keys) slots *= 2;
  table_.resize(slots);
  mask_ = slots - 1;
  tokens_.reserve(size_t(capacity));
}

uint64_t NgramIndex::hash(int32_t start, int32_t n) const {
  // FNV-1a over the length and the token ids, then a final avalanche (splitmix64's).
  uint64_t h = 0xcbf29ce484222325ull ^ uint64_t(n);
  for (int32_t i = start; i < start + n; ++i) h = (h ^ uint32_t(tokens_[size_t(i)])) * 0x100000001b3ull;
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebull;
  h ^= h >> 31;
  return h | 1;  // never 0, the empty key
}

size_t NgramIndex::find(uint64_t key) const {
  size_t at = key & mask_;
  while (table_[at].key != 0 && table_[at].key != key) at = (at + 1) & mask_;
  return at;
}

void NgramIndex::reset(std::span<const int32_t> tokens) {
  if (tokens.size() > size_t(capacity_))
    throw Error("n-gram index: " + std::to_string(tokens.size()) + " context tokens exceed the capacity " +
                std::to_string(capacity_));
  std::fill(table_.begin(), table_.end(), Slot{});
  tokens_.clear();
  for (int32_t t : tokens) push(t);
}

void NgramIndex::push(int32_t token) {
  if (size() >= capacity_)
    throw Error("n-gram index: the context is full (" + std::to_string(capacity_) + " tokens)");
  tokens_.push_back(token);
  // The n-grams ending at the previous token now have a follower: index them.
  const int32_t end = size() - 2;
  for (int32_t n = params_.min_n; n <= params_.max_n && end - n + 1 >= 0; ++n) {
    const uint64_t key = hash(end - n + 1, n);
    Slot& s = table_[find(key)];
    s.key = key;
    s.end = end;
  }
}

NgramMatch NgramIndex::longest_match() const {
  const int32_t len = size();
  // An earlier occurrence ends at len - 2 at the latest, so at most len - 1 tokens can match.
  for (int32_t n = std::min(params_.max_n, len - 1); n >= params_.min_n; --n) {
    const Slot& s = table_[find(hash(len - n, n))];
    if (s.key == 0) continue;
    // Equal hashes of different n-grams are possible: compare the tokens.
    if (std::equal(tokens_.begin() + (s.end - n + 1), tokens_.begin() + (s.end + 1), tokens_.begin() + (len - n)))
      return {n, s.end + 1};
  }
  return {};
}

int32_t NgramIndex::continuation(const NgramMatch& m, int32_t max_tokens, std::vector<int32_t>& out) const {
  out.clear();
  if (m.length <= 0) return 0;
  const int32_t len = size();
  for (int32_t j = 0; j < max_tokens; ++j) {
    // m.next <= len - 1, so a source past the context is one of the tokens already drafted.
    const int32_t src = m.next + j;
    out.push_back(src < len ? tokens_[size_t(src)] : out[size_t(src - len)]);
  }
  return static_cast<int32_t>(out.size());
}

NgramDrafter::NgramDrafter(const NgramParams& params, int32_t n_ctx) : index_(params, n_ctx) {}

void NgramDrafter::begin(const std::vector<int32_t>& prompt, std::span<const int32_t>) {
  index_.reset(prompt);
  root_pushed_ = false;
}

NgramMatch NgramDrafter::match_with_root(int32_t root) {
  if (!root_pushed_) {
    index_.push(root);
    root_pushed_ = true;
  }
  return index_.longest_match();
}

void NgramDrafter::draft_chain(const NgramMatch& m, const TreeParams& params, DraftSampling* sampling,
                               DraftTree& tree) {
  tree.clear();
  const int32_t n = index_.continuation(m, params.total_tokens, chain_);
  for (int32_t i = 0; i < n; ++i) tree.nodes.push_back({chain_[size_t(i)], i - 1, i + 1, 0.0f, i});
  if (!sampling || n == 0) return;
  // The draft distribution of a deterministic proposal: q[0] at the root, q[i + 1] at node i;
  // the leaf was not expanded.
  tree.q.resize(size_t(n) + 1);
  for (int32_t i = 0; i < n; ++i) tree.q[size_t(i)].assign(1, {chain_[size_t(i)], 1.0f});
  tree.q[size_t(n)].clear();
}

void NgramDrafter::propose(int32_t root, int32_t, const TreeParams& params, DraftSampling* sampling,
                           DraftTree& tree) {
  const NgramMatch m = match_with_root(root);
  if (m.length >= index_.params().min_n)
    draft_chain(m, params, sampling, tree);
  else
    tree.clear();
}

void NgramDrafter::accepted(int32_t root, const DraftTree& tree, std::span<const int32_t> path, const float*) {
  if (!root_pushed_) index_.push(root);  // the step did not draft (no room)
  for (int32_t p : path) index_.push(tree.nodes[size_t(p)].token);
  root_pushed_ = false;
}

NgramFirstDrafter::NgramFirstDrafter(const NgramParams& params, int32_t first_min, int32_t n_ctx,
                                     std::unique_ptr<Drafter> fallback)
    : ngram_(params, n_ctx), first_min_(first_min), fallback_(std::move(fallback)) {
  if (!fallback_) throw Error("n-gram drafting: the fallback drafter is missing");
  if (first_min < params.min_n || first_min > params.max_n)
    throw Error("--ngram-first must be in [ngram-min, ngram-max] = [" + std::to_string(params.min_n) + ", " +
                std::to_string(params.max_n) + "], got " + std::to_string(first_min));
}

void NgramFirstDrafter::begin(const std::vector<int32_t>& prompt, std::span<const int32_t> prompt_top) {
  ngram_.begin(prompt, prompt_top);
  fallback_->begin(prompt, prompt_top);
  fallback_drafted_ = false;
}

void NgramFirstDrafter::propose(int32_t root, int32_t position, const TreeParams& params, DraftSampling* sampling,
                                DraftTree& tree) {
  begin_propose(root, position, params, sampling, tree).grow_alone(tree);
}

TreeGrowth NgramFirstDrafter::begin_propose(int32_t root, int32_t position, const TreeParams& params,
                                            DraftSampling* sampling, DraftTree& tree) {
  const NgramMatch m = ngram_.match_with_root(root);
  fallback_drafted_ = m.length < first_min_;
  if (fallback_drafted_) {
    ++fallback_steps_;
    return fallback_->begin_propose(root, position, params, sampling, tree);
  }
  ++ngram_steps_;
  ngram_.draft_chain(m, params, sampling, tree);
  return {};
}

void NgramFirstDrafter::accepted(int32_t root, const DraftTree& tree, std::span<const int32_t> path,
                                 const float* verify_logits) {
  ngram_.accepted(root, tree, path, verify_logits);
  fallback_->accepted(root, tree, path, verify_logits);
  fallback_drafted_ = false;
}

}  // namespace microspec
