#include "speculative/drafter.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <string>

#include "gguf/gguf.h"
#include "util/error.h"

namespace microspec {

const char* name_of(DraftSource source) {
  switch (source) {
    case DraftSource::None: return "plain";
    case DraftSource::Ngram: return "n-gram";
    case DraftSource::Model: return "model";
  }
  return "?";
}

ModelTreeExpander::ModelTreeExpander(Model& model, KVCache& kv, int32_t n_layers, DraftVocabulary vocab)
    : model_(model), kv_(kv), n_layers_(n_layers), vocab_(std::move(vocab)) {
  if (n_layers < 1 || n_layers > model.config().n_layer)
    throw Error("draft layers must be in [1, " + std::to_string(model.config().n_layer) + "], got " +
                std::to_string(n_layers));
}

void ModelTreeExpander::start(std::span<const int32_t> prefix, int32_t root, int32_t position0) {
  prefix_.assign(prefix.begin(), prefix.end());
  root_ = root;
  root_pos_ = position0 + static_cast<int32_t>(prefix.size());
  root_slot_ = -1;  // not run yet
  next_slot_ = 0;
  slot_of_.clear();
}

void ModelTreeExpander::expand(std::span<const int32_t> frontier, std::span<const TreeNode> cand, int32_t k,
                               DraftSampling* sampling, Proposal* out) {
  const SequenceForward rows = stage(frontier, cand);
  model_.forward(std::span<const SequenceForward>(&rows, 1), forward_options());
  score(k, sampling, out);
}

SequenceForward ModelTreeExpander::stage(std::span<const int32_t> frontier, std::span<const TreeNode> cand) {
  batch_.clear();
  if (frontier.size() == 1 && frontier[0] < 0) {
    // The root, after any tokens the draft cache has not seen yet, as one sequential run.
    batch_.set_sequence(prefix_, root_pos_ - static_cast<int32_t>(prefix_.size()), false);
    batch_.output_rows.clear();
    batch_.tokens.push_back(root_);
    batch_.positions.push_back(root_pos_);
    batch_.parents.push_back(batch_.size() - 2);
    batch_.output_rows.push_back(batch_.size() - 1);
    root_slot_ = batch_.size() - 1;
    next_slot_ = batch_.size();
  } else {
    if (root_slot_ < 0) throw Error("tree expander: the root must be expanded first");
    batch_.start = next_slot_;
    slot_of_.resize(cand.size(), -1);
    for (size_t i = 0; i < frontier.size(); ++i) {
      const TreeNode& c = cand[frontier[i]];
      batch_.tokens.push_back(c.token);
      batch_.positions.push_back(root_pos_ + c.depth);
      batch_.parents.push_back(c.parent < 0 ? root_slot_ : slot_of_[c.parent]);
      batch_.output_rows.push_back(static_cast<int32_t>(i));
      slot_of_[frontier[i]] = next_slot_ + static_cast<int32_t>(i);
    }
    next_slot_ += batch_.size();
  }
  return {.batch = &batch_, .kv = &kv_, .out = &out_};
}

void ModelTreeExpander::score(int32_t k, DraftSampling* sampling, Proposal* out) {
  // Keep each run row's residual stream by pending slot: a self-drafter's verification resumes
  // those rows at layer n_layers_ instead of recomputing the layers the draft shares.
  const size_t d = size_t(model_.config().n_embd);
  if (slot_residual_.size() < size_t(next_slot_) * d) slot_residual_.resize(size_t(next_slot_) * d);
  for (int32_t r = 0; r < out_.n_rows; ++r) {
    const int32_t slot = batch_.start + batch_.output_rows[r];
    std::copy_n(out_.residual.data() + size_t(r) * d, d, slot_residual_.data() + size_t(slot) * d);
  }
  score_and_pick(vocab_, model_, out_.hidden.data(), out_.n_rows, k, sampling, logits_, lm_head_seconds_, out);
}

void TreeGrowth::grow_alone(DraftTree& tree) const {
  if (builder) builder->grow(*expander, tree);
}

namespace {
// Whether two expanders run the same layers of the same model (their rows can share a forward call).
bool same_backbone(const ModelTreeExpander& a, const ModelTreeExpander& b) {
  return &a.model() == &b.model() && a.n_layers() == b.n_layers();
}
}  // namespace

void draft_together(std::span<DraftJob> jobs) {
  // One level at a time: every tree still growing expands its frontier once. A tree is pending at
  // level L while it grows and has run L levels. The first pending tree leads a forward call that
  // every later pending tree with its backbone joins while the rows fit the batch size (and the
  // fixed call array: nothing is allocated per step); the rest wait for the next call of the level.
  constexpr size_t kMaxCall = 64;
  std::array<SequenceForward, kMaxCall> call;
  std::array<DraftJob*, kMaxCall> in_call;
  for (DraftJob& job : jobs) job.levels = job.shared_forwards = 0;
  const auto pending = [](const DraftJob& job, int32_t level) {
    return job.growth && !job.growth.builder->done() && job.levels == level;
  };
  for (int32_t level = 0;; ++level) {
    bool any = false;
    for (size_t lead = 0; lead < jobs.size(); ++lead) {
      if (!pending(jobs[lead], level)) continue;
      any = true;
      ModelTreeExpander& backbone = *jobs[lead].growth.expander;
      size_t n = 0;
      int32_t rows = 0;
      for (size_t j = lead; j < jobs.size() && n < kMaxCall; ++j) {
        DraftJob& job = jobs[j];
        if (!pending(job, level) || !same_backbone(backbone, *job.growth.expander)) continue;
        const TreeBuilder& builder = *job.growth.builder;
        const int32_t r = job.growth.expander->rows_to_stage(builder.frontier());
        if (n > 0 && rows + r > backbone.model().n_batch()) continue;
        call[n] = job.growth.expander->stage(builder.frontier(), builder.candidates());
        in_call[n++] = &job;
        rows += r;
      }
      backbone.model().forward(std::span<const SequenceForward>(call.data(), n), backbone.forward_options());
      for (size_t i = 0; i < n; ++i) {
        DraftJob& job = *in_call[i];
        TreeBuilder& builder = *job.growth.builder;
        job.growth.expander->score(builder.top_k(), builder.sampling(), builder.proposals());
        builder.absorb();
        ++job.levels;
        if (n > 1) ++job.shared_forwards;
      }
    }
    if (!any) break;
  }
  for (DraftJob& job : jobs)
    if (job.growth) job.growth.builder->finish(*job.tree);
}

void score_and_pick(DraftVocabulary& vocab, Model& model, const float* hidden, int32_t rows, int32_t k,
                    DraftSampling* sampling, std::vector<float>& logits, double& lm_head_seconds, Proposal* out) {
  const int32_t V = vocab.size();
  logits.resize(size_t(rows) * V);
  const auto t0 = std::chrono::steady_clock::now();
  vocab.logits(model, hidden, rows, logits.data());
  lm_head_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (int32_t r = 0; r < rows; ++r)
    pick_children(logits.data() + size_t(r) * V, V, vocab.ids(), k, sampling, r, out + size_t(r) * k);
}

SelfDrafter::SelfDrafter(Model& target, KVCache& target_kv, int32_t n_layers, DraftVocabulary vocab)
    : expander_(target, target_kv, n_layers, std::move(vocab)) {}

VerifyResume SelfDrafter::resume_for(const DraftTree& tree) const {
  // Verification puts the root at pending slot 0 and node i at slot i + 1; a row qualifies when
  // the draft ran that very token there, and so do all rows before it. The expander keeps the
  // residuals by slot, so the qualifying rows are already contiguous.
  if (expander_.root_slot() != 0) return {};
  int32_t rows = 1;
  for (const TreeNode& node : tree.nodes) {
    if (expander_.slot_of(node.candidate) != rows) break;
    ++rows;
  }
  return {rows, expander_.n_layers(), expander_.residual_of(0)};
}

void SelfDrafter::propose(int32_t root, int32_t position, const TreeParams& params, DraftSampling* sampling,
                          DraftTree& tree) {
  begin_propose(root, position, params, sampling, tree).grow_alone(tree);
}

TreeGrowth SelfDrafter::begin_propose(int32_t root, int32_t position, const TreeParams& params,
                                      DraftSampling* sampling, DraftTree& tree) {
  expander_.start({}, root, position);
  // An empty draft vocabulary (a window fed only by verifications, before the first one) has
  // nothing to propose: the step verifies the root alone.
  tree.clear();
  if (expander_.vocab().size() == 0) return {};
  builder_.begin(params, sampling);
  return {&builder_, &expander_};
}

ModelDrafter::ModelDrafter(Model& draft, int32_t n_ctx, DraftVocabulary vocab)
    : model_(draft),
      kv_(draft.make_cache(n_ctx)),
      expander_(draft, kv_, draft.config().n_layer, std::move(vocab)) {}

void ModelDrafter::begin(const std::vector<int32_t>& prompt, std::span<const int32_t> prompt_top) {
  kv_.clear();
  tokens_ = prompt;
  expander_.start({}, 0, 0);
  catch_up(0);
  expander_.vocab().begin(prompt, prompt_top);
}

void ModelDrafter::catch_up(int32_t keep) {
  while (static_cast<int32_t>(tokens_.size()) - kv_.n_past() > keep) {
    const int32_t len =
        std::min(model_.n_batch(), static_cast<int32_t>(tokens_.size()) - kv_.n_past() - keep);
    batch_.set_sequence(std::span<const int32_t>(tokens_.data() + kv_.n_past(), len), kv_.n_past(), false);
    model_.forward(batch_, kv_, out_);
    kv_.commit_prefix(len);
  }
}

bool ModelDrafter::fits(const TreeParams& params, int32_t room) const {
  // The draft cache holds at most the target's committed tokens, so the same room suffices.
  return params.max_draft_rows() <= room && params.top_k <= model_.n_batch();
}

void ModelDrafter::propose(int32_t root, int32_t position, const TreeParams& params, DraftSampling* sampling,
                           DraftTree& tree) {
  begin_propose(root, position, params, sampling, tree).grow_alone(tree);
}

TreeGrowth ModelDrafter::begin_propose(int32_t root, int32_t position, const TreeParams& params,
                                       DraftSampling* sampling, DraftTree& tree) {
  if (position != static_cast<int32_t>(tokens_.size()))
    throw Error("draft model: out of step with the target (" + std::to_string(tokens_.size()) +
                " tokens vs position " + std::to_string(position) + ")");
  // Bring the cache up to the committed tokens it has not seen, leaving the last chunk (with room
  // for the root) to the tree's first forward.
  catch_up(model_.n_batch() - 1);
  expander_.start(std::span<const int32_t>(tokens_.data() + kv_.n_past(), tokens_.size() - kv_.n_past()),
                  root, kv_.n_past());
  tree.clear();
  if (expander_.vocab().size() == 0) return {};  // nothing to propose (see SelfDrafter::begin_propose)
  builder_.begin(params, sampling);
  return {&builder_, &expander_};
}

void ModelDrafter::accepted(int32_t root, const DraftTree& tree, std::span<const int32_t> path,
                            const float* verify_logits) {
  tokens_.push_back(root);
  for (int32_t p : path) tokens_.push_back(tree.nodes[p].token);
  // Keep what the draft already computed for the committed tokens: the catch-up run, the root and
  // the accepted nodes it ran (a prefix of the path: a node is run only if its parent was).
  commit_.clear();
  if (expander_.root_slot() >= 0) {
    for (int32_t s = 0; s <= expander_.root_slot(); ++s) commit_.push_back(s);
    for (int32_t p : path) {
      const int32_t s = expander_.slot_of(tree.nodes[p].candidate);
      if (s < 0) break;
      commit_.push_back(s);
    }
  }
  kv_.commit(commit_);
  expander_.start({}, 0, 0);  // slots are stale after the commit
  expander_.vocab().accepted(node_tokens(tree, tree_tokens_), path, verify_logits);
}

void check_same_vocabulary(const GgufFile& target, const GgufFile& draft) {
  const char* key = "tokenizer.ggml.tokens";
  if (!target.has(key) || !draft.has(key))
    throw Error("draft model: cannot compare vocabularies (" + std::string(key) + " missing in " +
                (target.has(key) ? draft.name() : target.name()) + ")");
  const auto& a = target.get_string_array(key);
  const auto& b = draft.get_string_array(key);
  if (a.size() != b.size())
    throw Error("draft model " + draft.name() + " has a vocabulary of " + std::to_string(b.size()) +
                " tokens; the target " + target.name() + " has " + std::to_string(a.size()) +
                ": speculative decoding needs the same vocabulary");
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i])
      throw Error("draft model " + draft.name() + " has a different vocabulary from the target " +
                  target.name() + " (first difference at token id " + std::to_string(i) +
                  "): speculative decoding needs the same vocabulary");
}

}  // namespace microspec
