#include "speculative/auto_drafter.h"

#include <algorithm>

#include "util/error.h"

namespace microspec {

namespace {
// A model chain's counts are kept as the n-gram side's are, under one "match length".
constexpr int32_t kModelLength = 1;

// 1 + the expected accepted tokens of a chain of `tokens`, the rate at depth d given by rate(d).
template <class Rate>
double expected_tokens(int32_t tokens, Rate&& rate) {
  double all = 1.0, sum = 1.0;
  for (int32_t d = 1; d <= tokens; ++d) {
    all *= rate(d);
    sum += all;
  }
  return sum;
}
}  // namespace

AutoDrafter::AutoDrafter(const NgramParams& ngram, int32_t n_ctx, std::unique_ptr<Drafter> model,
                         const ModelDraftCost& model_cost, StepCosts costs)
    : NgramAndModelDrafter(ngram, n_ctx, std::move(model)), model_cost_(model_cost), costs_(std::move(costs)),
      model_rates_(kModelLength) {
  costs_.validate();
  if (!(model_cost.level_seconds >= 0) || !(model_cost.resumed_share >= 0 && model_cost.resumed_share <= 1))
    throw Error("--spec auto: a draft level's cost must be >= 0 and the resumed share in [0, 1]");
}

void AutoDrafter::begin(const std::vector<int32_t>& prompt, std::span<const int32_t> prompt_top) {
  NgramAndModelDrafter::begin(prompt, prompt_top);
  model_rates_.reset();
  // The model's prior at depth 1 is one hit in three trials (deeper depths: one in two, given the
  // earlier ones): a trained head or a self-draft must show it beats the n-gram side's chains,
  // which, where the text repeats, are usually right.
  model_rates_.record(kModelLength, 1, false);
  steps_since_model_ = 0;
  probe_interval_ = kProbeInterval;
}

double AutoDrafter::verify_seconds(int32_t rows) const {
  const double b = shared_rows_;
  return costs_.forward_at(b + rows) - costs_.forward_at(b);
}

double AutoDrafter::model_seconds(int32_t tokens) const {
  const double b = shared_rows_;
  const double resumed = model_cost_.resumed_share * (costs_.body_at(b + tokens) - costs_.body_at(b));
  return tokens * model_cost_.level_seconds + verify_seconds(1 + tokens) - resumed +
         model_->pending_rows() * model_cost_.catch_up_row_seconds;
}

AutoDrafter::Choice AutoDrafter::choose(int32_t match_length, int32_t ngram_tokens, int32_t max_model_tokens) const {
  // Plain first: an option must beat it strictly.
  Choice best{DraftSource::None, 0, 1.0 / verify_seconds(1)};
  if (match_length > 0 && ngram_tokens > 0) {
    const int32_t L = ngram_tokens;
    const double e = expected_tokens(L, [&](int32_t d) { return ngram_.confidence().rate(match_length, d); });
    const double v = e / verify_seconds(1 + L);
    if (v > best.value) best = {DraftSource::Ngram, L, v};
  }
  const Choice model = best_model_chain(max_model_tokens);
  return model.value > best.value ? model : best;
}

AutoDrafter::Choice AutoDrafter::best_model_chain(int32_t max_tokens) const {
  Choice best{DraftSource::Model, 0, 0.0};
  for (int32_t L = 1; L <= max_tokens; ++L) {
    const double e = expected_tokens(L, [&](int32_t d) { return model_rates_.rate(kModelLength, d); });
    const double v = e / model_seconds(L);
    if (v > best.value) best = {DraftSource::Model, L, v};
  }
  return best;
}

double AutoDrafter::model_ceiling(int32_t max_tokens) const {
  double best = 0.0;
  for (int32_t L = 1; L <= max_tokens; ++L) best = std::max(best, (1.0 + L) / model_seconds(L));
  return best;
}

TreeGrowth AutoDrafter::begin_propose(int32_t root, int32_t position, const TreeParams& params,
                                      DraftSampling* sampling, DraftTree& tree) {
  tree.clear();  // a plain step's tree
  // The n-gram side plans its continuation whenever there is a match, so that it is observed
  // against what the target commits whoever drafts.
  const NgramMatch m = ngram_.match_with_root(root);
  const int32_t ngram_tokens = m.length >= ngram_.index().params().min_n ? ngram_.plan_chain(m, params) : 0;
  // The model drafts a chain no longer than the configured tree's depth allows.
  const int32_t max_model_tokens = std::min(params.total_tokens, params.depth + 1);
  Choice c = choose(ngram_tokens > 0 ? m.length : 0, ngram_tokens, max_model_tokens);
  ++steps_since_model_;
  if (c.source == DraftSource::Model) {
    probe_interval_ = kProbeInterval;  // won on its own
  } else if (steps_since_model_ >= probe_interval_ && max_model_tokens > 0 &&
             model_ceiling(max_model_tokens) > c.value) {
    // A probe: the model's best chain and one token more, so that each probe measures a depth
    // its chains do not reach yet. Until the model wins a step, each probe waits twice as long.
    // None where the model could not win even with every token accepted (the n-gram side's
    // chains hold up, or a head has many rows to catch up on).
    c = best_model_chain(max_model_tokens);
    c.tokens = std::min(max_model_tokens, c.tokens + 1);
    probe_interval_ = std::min(kMaxProbeInterval, 2 * probe_interval_);
  }
  chosen_ = c.source;
  if (c.source == DraftSource::Ngram) {
    ngram_.draft_chain(c.tokens, sampling, tree);
    return {};
  }
  if (c.source == DraftSource::None) return {};
  steps_since_model_ = 0;
  TreeParams chain = params;
  chain.top_k = 1;
  chain.depth = c.tokens - 1;
  chain.total_tokens = c.tokens;
  return model_->begin_propose(root, position, chain, sampling, tree);
}

void AutoDrafter::accepted(int32_t root, const DraftTree& tree, std::span<const int32_t> path,
                           const float* verify_logits) {
  if (chosen_ == DraftSource::Model && !tree.nodes.empty()) {
    // A chain's depth d was accepted when the path reached it; the first depth past the path was
    // refused if the chain had it. (A p-min cut may have drafted fewer tokens than planned.)
    int32_t drafted = 0;
    for (const TreeNode& n : tree.nodes) drafted = std::max(drafted, n.depth);
    const int32_t held = static_cast<int32_t>(path.size());
    for (int32_t d = 1; d <= held; ++d) model_rates_.record(kModelLength, d, true);
    if (held < drafted) model_rates_.record(kModelLength, held + 1, false);
  }
  NgramAndModelDrafter::accepted(root, tree, path, verify_logits);
}

}  // namespace microspec
