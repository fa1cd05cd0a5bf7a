#include "speculative/ngram.h"

#include <algorithm>
#include <string>

#include "util/error.h"

namespace microspec {

void NgramParams::validate() const {
  if (min_n < 1 || max_n > 64 || min_n > max_n)
    throw Error("n-gram lengths must satisfy 1 <= ngram-min <= ngram-max <= 64, got ngram-min " +
                std::to_string(min_n) + ", ngram-max " + std::to_string(max_n));
  if (min_accept_percent < 0 || min_accept_percent > 100)
    throw Error("ngram-min-accept must be a percentage in [0, 100], got " + std::to_string(min_accept_percent));
}

NgramConfidence::NgramConfidence(int32_t max_n) : max_n_(max_n), counts_(size_t(max_n + 1) * kDepths) {}

void NgramConfidence::reset() {
  std::fill(counts_.begin(), counts_.end(), Count{});
}

size_t NgramConfidence::slot(int32_t length, int32_t depth) const {
  if (length < 1 || length > max_n_ || depth < 1)
    throw Error("n-gram confidence: match length " + std::to_string(length) + " / depth " + std::to_string(depth) +
                " outside [1, " + std::to_string(max_n_) + "] / [1, ...)");
  return size_t(length) * kDepths + size_t(std::min(depth, kDepths) - 1);
}

double NgramConfidence::rate(int32_t length, int32_t depth) const {
  const Count& c = counts_[slot(length, depth)];
  return double(c.hits) / double(c.trials);
}

void NgramConfidence::record(int32_t length, int32_t depth, bool hit) {
  Count& c = counts_[slot(length, depth)];
  c.hits += hit ? 1 : 0;
  c.trials += 1;
}

int32_t NgramConfidence::tokens_worth_drafting(int32_t length, int32_t available, int32_t min_accept_percent) const {
  if (min_accept_percent == 0) return available;
  const double floor = min_accept_percent / 100.0;
  double all_accepted = 1.0;  // estimated probability that tokens 1..j are all accepted
  int32_t j = 0;
  while (j < available) {
    all_accepted *= rate(length, j + 1);
    if (all_accepted < floor) break;
    ++j;
  }
  return j;
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

NgramDrafter::NgramDrafter(const NgramParams& params, int32_t n_ctx)
    : index_(params, n_ctx), confidence_(params.max_n) {}

void NgramDrafter::begin(const std::vector<int32_t>& prompt, std::span<const int32_t>) {
  index_.reset(prompt);
  confidence_.reset();
  root_pushed_ = false;
  chain_length_ = 0;
  open_ = {};
}

void NgramDrafter::push_root(int32_t root) {
  if (open_.length > 0) confidence_.record(open_.length, open_.depth, root == open_.token);
  open_ = {};
  index_.push(root);
  root_pushed_ = true;
}

NgramMatch NgramDrafter::match_with_root(int32_t root) {
  if (!root_pushed_) push_root(root);
  return index_.longest_match();
}

int32_t NgramDrafter::plan_chain(const NgramMatch& m, const TreeParams& params) {
  const int32_t n = index_.continuation(m, params.total_tokens, chain_);
  chain_length_ = n > 0 ? m.length : 0;
  return n > 0 ? confidence_.tokens_worth_drafting(m.length, n, index_.params().min_accept_percent) : 0;
}

void NgramDrafter::draft_chain(int32_t tokens, DraftSampling* sampling, DraftTree& tree) {
  tree.clear();
  const int32_t n = std::min(tokens, static_cast<int32_t>(chain_.size()));
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
  const int32_t tokens = m.length >= index_.params().min_n ? plan_chain(m, params) : 0;
  draft_chain(tokens, sampling, tree);
}

void NgramDrafter::accepted(int32_t root, const DraftTree& tree, std::span<const int32_t> path, const float*) {
  if (!root_pushed_) push_root(root);  // the step did not draft (no room)
  // The step's continuation against the committed tokens, whoever drafted them: each depth is
  // observed while the ones before it held; the depth after the last committed token is settled
  // by the next root (the target's own next token).
  if (chain_length_ > 0) {
    const size_t compared = std::min(path.size(), chain_.size());
    size_t held = 0;  // leading committed tokens equal to the continuation's
    while (held < compared && tree.nodes[size_t(path[held])].token == chain_[held]) ++held;
    for (size_t d = 1; d <= held; ++d) confidence_.record(chain_length_, int32_t(d), true);
    if (held < compared)
      confidence_.record(chain_length_, int32_t(held) + 1, false);
    else if (held < chain_.size())
      open_ = {chain_length_, int32_t(held) + 1, chain_[held]};
  }
  for (int32_t p : path) index_.push(tree.nodes[size_t(p)].token);
  root_pushed_ = false;
  chain_length_ = 0;
}

NgramAndModelDrafter::NgramAndModelDrafter(const NgramParams& params, int32_t n_ctx, std::unique_ptr<Drafter> model)
    : ngram_(params, n_ctx), model_(std::move(model)) {
  if (!model_) throw Error("n-gram drafting: the fallback (model) drafter is missing");
}

void NgramAndModelDrafter::begin(const std::vector<int32_t>& prompt, std::span<const int32_t> prompt_top) {
  ngram_.begin(prompt, prompt_top);
  model_->begin(prompt, prompt_top);
  chosen_ = DraftSource::None;
}

void NgramAndModelDrafter::accepted(int32_t root, const DraftTree& tree, std::span<const int32_t> path,
                                    const float* verify_logits) {
  ngram_.accepted(root, tree, path, verify_logits);
  model_->accepted(root, tree, path, verify_logits);
  chosen_ = DraftSource::None;
}

NgramFirstDrafter::NgramFirstDrafter(const NgramParams& params, int32_t first_min, int32_t n_ctx,
                                     std::unique_ptr<Drafter> fallback)
    : NgramAndModelDrafter(params, n_ctx, std::move(fallback)), first_min_(first_min) {
  if (first_min < params.min_n || first_min > params.max_n)
    throw Error("--ngram-first must be in [ngram-min, ngram-max] = [" + std::to_string(params.min_n) + ", " +
                std::to_string(params.max_n) + "], got " + std::to_string(first_min));
}

TreeGrowth NgramFirstDrafter::begin_propose(int32_t root, int32_t position, const TreeParams& params,
                                            DraftSampling* sampling, DraftTree& tree) {
  const NgramMatch m = ngram_.match_with_root(root);
  // A long enough match drafts unless its continuation is not worth it (then the fallback drafts
  // and the continuation is still observed).
  const int32_t tokens = m.length >= first_min_ ? ngram_.plan_chain(m, params) : 0;
  if (tokens == 0) {
    chosen_ = DraftSource::Model;
    ++fallback_steps_;
    return model_->begin_propose(root, position, params, sampling, tree);
  }
  chosen_ = DraftSource::Ngram;
  ++ngram_steps_;
  ngram_.draft_chain(tokens, sampling, tree);
  return {};
}

}  // namespace microspec
