#pragma once
// What the tests of the device-resident speculative steps (speculative/chain_state.h,
// speculative/tree_state.h) share when they drive a step on the host with the CPU model: plain
// greedy decoding, their reference; and MicroSpec's draft vocabulary kept as the device keeps it
// (a DraftVocabState advanced by vocab/window_state.h's functions) beside the host-driven
// CandidateStream, which must hold the same window after every step.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "draft_head/eagle3_head.h"
#include "engine/generator.h"
#include "gguf/gguf.h"
#include "math/select.h"
#include "model/model.h"
#include "speculative/chain_state.h"
#include "vocab/candidate_stream.h"
#include "vocab/draft_vocab.h"
#include "vocab/window_state.h"
#include "host_vocab_state.h"

namespace microspec::test {

// A window of w_max tokens fed from `source`, K_ver taken at `rows` (dynamic).
inline std::optional<PrunedVocabSpec> window_spec(int32_t w_max, CandidateStreamParams::Source source,
                                                  CandidateStreamParams::KverRows rows) {
  PrunedVocabSpec p;
  p.window.stream.w_max = w_max;
  p.window.stream.source = source;
  p.window.stream.kver_rows = rows;
  return p;
}

// ids 7, 14, ..., 7n pinned beside the window (hybrid: Kind::Window) or alone (freq: Kind::Fixed).
inline std::optional<PrunedVocabSpec> with_every_7th(std::optional<PrunedVocabSpec> p, int32_t n,
                                                     PrunedVocabSpec::Kind kind) {
  for (int32_t i = 1; i <= n; ++i) p->pinned.push_back(7 * i);
  p->kind = kind;
  return p;
}

// The CPU drafter's vocabulary for a pruned spec (none: the full head) over head_of's LM head: what
// the host-driven reference drafts with.
inline DraftVocabulary host_draft_vocabulary(Model& head_of, const std::optional<PrunedVocabSpec>& spec) {
  if (!spec) return DraftVocabulary::full(head_of.config().n_vocab);
  if (spec->kind == PrunedVocabSpec::Kind::Fixed) return DraftVocabulary::packed(head_of, spec->pinned);
  return DraftVocabulary::dynamic(head_of, spec->window, spec->pinned);
}

// What the CPU decoder is asked for beside a resident run: n tokens whatever the end-of-generation
// tokens, greedy or with sp's sampling.
inline GenerateParams fixed_length(int32_t n, const SamplingParams& sp = {}) {
  GenerateParams params;
  params.max_new_tokens = n;
  params.ignore_eos = true;
  params.sampling = sp;
  return params;
}

// A resident step's verification: the target's forward over the step's batch arrays (every row
// an output row), capturing a draft head's features (capture: its layers; empty: none).
inline void verify_forward(Model& model, KVCache& kv, const std::vector<int32_t>& tokens,
                           const std::vector<int32_t>& positions, const std::vector<int32_t>& parents,
                           const std::vector<int32_t>& output_rows, std::span<const int32_t> capture, Batch& b,
                           ForwardOutput& out) {
  b.clear();
  b.tokens = tokens;
  b.positions = positions;
  b.parents = parents;
  b.output_rows = output_rows;
  model.forward(b, kv, out, {.logits = true, .capture_layers = capture});
}

// Plain greedy decoding: n tokens after the prompt.
inline std::vector<int32_t> plain_greedy(Model& model, const std::vector<int32_t>& prompt, int32_t n) {
  KVCache kv = model.make_cache(512);
  Batch b;
  ForwardOutput out;
  b.set_sequence(prompt, 0, false);
  std::vector<int32_t> ids;
  const int32_t V = model.config().n_vocab;
  while (int32_t(ids.size()) < n) {
    model.forward(b, kv, out, {.logits = true});
    kv.commit_prefix(b.size());
    ids.push_back(argmax(out.logits.data() + size_t(out.n_rows - 1) * V, V));
    b.set_sequence(std::vector<int32_t>{ids.back()}, kv.n_past(), false);
  }
  return ids;
}

// A chain step's arrays (chain_state.h) in host memory, as the device keeps them; state() sizes
// them (capacity: emitted tokens) and points a ChainState at them (the drafter's arrays unset).
struct ChainArrays {
  std::vector<int32_t> tokens, positions, parents, output_rows, pred, out_ids, step_counts;
  int32_t n_past = 0, counter = 0, steps = 0;
  VocabUpdate update;
  ChainState state(int32_t depth, int32_t capacity) {
    tokens.assign(size_t(depth + 1), 0);
    positions = parents = output_rows = pred = tokens;
    out_ids.assign(size_t(capacity), -2);
    step_counts.assign(size_t(capacity), 0);
    ChainState s;
    s.tokens = tokens.data();
    s.positions = positions.data();
    s.parents = parents.data();
    s.output_rows = output_rows.data();
    s.pred = pred.data();
    s.n_past = &n_past;
    s.out_ids = out_ids.data();
    s.counter = &counter;
    s.update = &update;
    s.steps = &steps;
    s.step_counts = step_counts.data();
    s.depth = depth;
    return s;
  }
};

// A separate draft model's cache as a resident step starts it (a chain's and a tree's): the
// prompt but its last token, which the step's first draft forward runs with the root.
inline KVCache draft_cache_one_behind(Model& m, const std::vector<int32_t>& prompt) {
  KVCache kv = m.make_cache(512);
  const int32_t n_prompt = int32_t(prompt.size());
  if (n_prompt > 1) {
    Batch b;
    ForwardOutput out;
    b.set_sequence(std::span<const int32_t>(prompt).first(size_t(n_prompt - 1)), 0, false);
    m.forward(b, kv, out, {});
    kv.commit_prefix(n_prompt - 1);
  }
  return kv;
}

// A separate draft model's side of a resident chain step on the host (speculative/chain_state.h):
// its cache holds the prompt but its last token, which starts its first batch; draft d's forward
// runs [the last committed token, tokens[0]] at d = 0, then tokens[d] in its pending slot d + 1.
struct ResidentDraftModel {
  Model& model;
  KVCache kv;
  std::vector<int32_t> first, positions, parents, output_rows;  // DraftModelBatch's arrays
  int32_t n_past = 0;

  ResidentDraftModel(Model& m, const std::vector<int32_t>& prompt, int32_t depth)
      : model(m), kv(draft_cache_one_behind(m, prompt)), first(2), positions(size_t(depth) + 1),
        parents(size_t(depth) + 1), output_rows(2) {
    first[0] = prompt.back();
  }
  DraftModelBatch batch() { return DraftModelBatch{first.data(), positions.data(), parents.data(), output_rows.data(), &n_past}; }
  // Draft d's forward; tokens: the chain's batch (tokens[d] is draft d's input for d >= 1).
  void forward(int32_t d, const std::vector<int32_t>& tokens, bool logits, Batch& b, ForwardOutput& out) {
    b.clear();
    if (d == 0) {
      b.tokens = first;
      b.positions = {positions[0], positions[1]};
      b.parents = {parents[0], parents[1]};
      b.output_rows = {output_rows[0]};
    } else {
      b.tokens = {tokens[size_t(d)]};
      b.positions = {positions[size_t(d) + 1]};
      b.parents = {parents[size_t(d) + 1]};
      b.output_rows = {output_rows[1]};
      b.start = d + 1;
    }
    EXPECT_EQ(kv.n_past(), n_past);
    model.forward(b, kv, out, {.logits = logits});
  }
};

// The self-draft's forward of batch row d alone in pending slot d (the target's first
// draft_layers layers, the target's cache).
inline void self_draft_forward(Model& model, KVCache& kv, int32_t d, const int32_t* tokens, const int32_t* positions,
                               const int32_t* parents, int32_t draft_layers, bool logits, Batch& b, ForwardOutput& out) {
  b.clear();
  b.tokens = {tokens[d]};
  b.positions = {positions[d]};
  b.parents = {parents[d]};
  b.output_rows = {0};
  b.start = d;
  model.forward(b, kv, out, {.logits = logits, .end_layer = draft_layers});
}

// Where a step's state keeps an EAGLE-3 head's counters (chain_state.h's HeadBatch, tree_state.h's
// TreeHeadBatch).
struct HeadCounters {
  const int32_t* n_past = nullptr;        // [1] its committed cache rows
  const int32_t* root_row = nullptr;      // [1] the catch-up row that is the step's root
  const int32_t* slot_parents = nullptr;  // [n_ctx] its cache's parent of each slot
};

// An EAGLE-3 head's forwards in a resident step on the host, as the device runs them (chain_state.h
// and tree_state.h share the design): its cache holds the prompt's rows but the last (the features
// at i with token i + 1); each step's catch-up runs the rows the state laid out, after which the
// state's function commits the rows before the root row a and clears its parent, and the root
// row's output drafts first; further draft rows run in pending slots, each fed a pre-norm output
// of an earlier row. Each row's normed output is what the target's LM head scores.
class ResidentHead {
 public:
  // max_rows: the most rows one forward takes.
  ResidentHead(const std::string& path, Model& target, int32_t max_rows)
      : head_(std::make_unique<Eagle3Head>(GgufFile::open(path), target, target.n_batch())),
        kv_(head_->make_cache(512)),
        H_(target.config().n_embd),
        g_(size_t(max_rows) * H_),
        prenorm_(g_.size()),
        normed_(g_.size()) {}

  std::span<const int32_t> feature_layers() const { return head_->config().target_layers; }
  int32_t n_features() const { return head_->config().n_features(); }

  // After the prefill (prompt_features: its captured features, [prompt.size()][F]): the prompt's
  // rows but the last into the cache.
  void begin(const std::vector<int32_t>& prompt, const float* prompt_features) {
    const int32_t n_prompt = int32_t(prompt.size());
    if (n_prompt < 2) return;
    std::vector<float> fused(size_t(n_prompt) * H_), pre(fused.size()), nrm(fused.size());
    Batch b;
    b.set_sequence(std::span<const int32_t>(prompt).subspan(1), 0, false);
    head_->fuse(prompt_features, n_prompt - 1, fused.data());
    head_->forward(b, fused.data(), kv_, pre.data(), nrm.data());
    kv_.commit_prefix(n_prompt - 1);
  }
  // The catch-up: b's rows (tokens, positions, parents) fused from features ([b.size()][F]), then
  // caught_up() (the state's function: n_past advanced by the root row a, that slot's parent
  // cleared) and the cache's commit of the a rows before the root row. Returns the root row's
  // normed output ([H]); root_prenorm() is its pre-norm output.
  const float* catch_up(const Batch& b, const float* features, const HeadCounters& c,
                        const std::function<void()>& caught_up) {
    EXPECT_EQ(kv_.n_past(), *c.n_past);
    head_->fuse(features, b.size(), g_.data());
    head_->forward(b, g_.data(), kv_, prenorm_.data(), normed_.data());
    const int32_t a = *c.root_row, root_position = b.positions[size_t(a)];
    caught_up();
    EXPECT_EQ(*c.n_past - kv_.n_past(), a);
    kv_.commit_prefix(a);
    EXPECT_EQ(c.slot_parents[size_t(*c.n_past)], -1) << "the root row's parent is cleared";
    kv_.set_slot_meta(*c.n_past, root_position, -1);
    root_prenorm_ = prenorm_.data() + size_t(a) * H_;
    return normed_.data() + size_t(a) * H_;
  }
  const float* root_prenorm() const { return root_prenorm_; }
  // Draft rows: b's rows in their pending slots, fed g ([b.size()][H]). Returns their normed
  // outputs ([n][H]); prenorm() holds their pre-norm outputs.
  const float* draft_rows(const Batch& b, const float* g) {
    head_->forward(b, g, kv_, prenorm_.data(), normed_.data());
    return normed_.data();
  }
  const float* prenorm() const { return prenorm_.data(); }
  // After the verification's acceptance: the root row committed (the state's n_past counts it).
  void keep_root(const HeadCounters& c) {
    kv_.commit_prefix(1);
    EXPECT_EQ(kv_.n_past(), *c.n_past);
  }

 private:
  std::unique_ptr<Eagle3Head> head_;
  KVCache kv_;
  int32_t H_;
  std::vector<float> g_, prenorm_, normed_;  // [max_rows][H]
  const float* root_prenorm_ = nullptr;      // [H] in prenorm_
};

// The head's side of a resident chain step (chain_state.h's HeadBatch): the catch-up runs
// pred[0..depth] with the last verification's features (row i with row i); draft d >= 1 runs
// tokens[d] in pending slot d, fed the previous row's pre-norm output.
class ResidentChainHead {
 public:
  ResidentChainHead(const std::string& path, Model& target, int32_t depth)
      : head_(path, target, depth + 1),
        H_(target.config().n_embd),
        F_(head_.n_features()),
        catch_positions_(size_t(depth) + 1),
        catch_parents_(size_t(depth) + 1),
        draft_positions_(size_t(depth) + 1),
        draft_parents_(size_t(depth) + 1),
        slot_parents_(512, -2),
        features_(size_t(depth + 1) * F_, 0.0f),
        g_next_(size_t(H_)) {}

  // After the prefill: the prompt's rows in the cache; the first catch-up is row 0 alone, the
  // prompt's last features with the first token.
  void begin(const std::vector<int32_t>& prompt, const float* prompt_features) {
    head_.begin(prompt, prompt_features);
    n_past_ = int32_t(prompt.size()) - 1;
    std::copy_n(prompt_features + size_t(n_past_) * F_, F_, features_.begin());
  }
  std::span<const int32_t> feature_layers() const { return head_.feature_layers(); }
  HeadBatch batch() {
    return HeadBatch{catch_positions_.data(), catch_parents_.data(), draft_positions_.data(), draft_parents_.data(),
                     &root_row_, &n_past_, slot_parents_.data()};
  }

  // The catch-up over the last verification (pred, the chain's next tokens), then
  // chain_head_caught_up; returns the root row's normed output ([H]), draft 0's.
  const float* catch_up(const ChainState& cs, const std::vector<int32_t>& pred, Batch& b) {
    b.clear();
    b.tokens = pred;
    b.positions = catch_positions_;
    b.parents = catch_parents_;
    const float* root = head_.catch_up(b, features_.data(), counters(), [&] { chain_head_caught_up(cs); });
    std::copy_n(head_.root_prenorm(), H_, g_next_.begin());
    return root;
  }
  // Draft d >= 1: tokens[d] in pending slot d; returns its normed output ([H]), draft d's.
  const float* draft(int32_t d, const std::vector<int32_t>& tokens, Batch& b) {
    b.clear();
    b.tokens = {tokens[size_t(d)]};
    b.positions = {draft_positions_[size_t(d)]};
    b.parents = {draft_parents_[size_t(d)]};
    b.start = d;
    const float* normed = head_.draft_rows(b, g_next_.data());
    std::copy_n(head_.prenorm(), H_, g_next_.begin());
    return normed;
  }
  // After the verification's acceptance (a drafts accepted, the target's cache at target_n_past):
  // the root row committed; the next catch-up reads that verification's features.
  void accepted(int32_t a, int32_t target_n_past, const std::vector<float>& verify_features) {
    head_.keep_root(counters());
    EXPECT_EQ(n_past_, target_n_past - a - 1) << "the head's cache ends where the next catch-up starts";
    features_ = verify_features;
  }

 private:
  HeadCounters counters() const { return HeadCounters{&n_past_, &root_row_, slot_parents_.data()}; }

  ResidentHead head_;
  int32_t H_, F_;
  int32_t n_past_ = 0, root_row_ = 0;  // HeadBatch's counters
  std::vector<int32_t> catch_positions_, catch_parents_;  // [depth + 1]
  std::vector<int32_t> draft_positions_, draft_parents_;  // [depth + 1]
  std::vector<int32_t> slot_parents_;                     // [512] the cache's parent of each slot
  std::vector<float> features_;                           // [depth + 1][F] the last verification's
  std::vector<float> g_next_;                             // [H] the previous draft row's pre-norm output
};

// A pruned draft vocabulary (a window, with pinned ids for hybrid; Fixed: the pinned ids alone, a
// window of one entry that nothing enters) in its device form and as the host-driven stream.
class ResidentVocab {
 public:
  // prompt_logits: the prefill's [prompt.size()][n_vocab], whose top K_pre per position start the
  // stream (unless its source is ext).
  ResidentVocab(int32_t n_vocab, const PrunedVocabSpec& spec, const std::vector<int32_t>& prompt,
                const float* prompt_logits)
      : n_vocab_(n_vocab),
        fixed_(spec.kind == PrunedVocabSpec::Kind::Fixed),
        params_(fixed_ ? CandidateStreamParams{.w_max = 1, .k_pre = 0, .k_ver = 0} : spec.window.stream),
        reference_(n_vocab, params_, spec.pinned),
        device_(n_vocab, params_.w_max, reference_.window().capacity()) {
    const int32_t n_prompt = int32_t(prompt.size()), k_pre = params_.prompt_top_k();
    std::vector<int32_t> prompt_top(size_t(n_prompt) * std::max(k_pre, 1));
    for (int32_t i = 0; i < n_prompt && k_pre > 0; ++i)
      top_k_indices(prompt_logits + size_t(i) * n_vocab, n_vocab, k_pre, prompt_top.data() + size_t(i) * k_pre);
    for (int32_t id : spec.pinned) window_pin(device_.st.window, id);
    if (params_.source == CandidateStreamParams::Source::Ext || fixed_) {
      reference_.begin(prompt, {}, 0);
      vocab_state_begin(device_.st, prompt.data(), 0, prompt_top.data(), k_pre, 0);
    } else {
      reference_.begin(prompt, prompt_top, k_pre);
      vocab_state_begin(device_.st, prompt.data(), n_prompt, prompt_top.data(), k_pre, k_pre);
    }
    if (fixed_)  // the packed rows are the ids as given, for good
      EXPECT_EQ(std::vector<int32_t>(device_.token_of_slot.begin(), device_.token_of_slot.begin() + rows()), spec.pinned);
  }

  const CandidateStreamParams& params() const { return params_; }
  bool kver_last_only() const { return params_.kver_rows == CandidateStreamParams::KverRows::Last; }
  // Whether verifications feed the window (not Fixed, not source ctx).
  bool takes_steps() const { return !fixed_ && params_.source != CandidateStreamParams::Source::Ctx; }
  // The packed rows in use and the token of each slot: what the draft head scores.
  int32_t rows() const { return device_.st.slots.n_rows; }
  const int32_t* rows_counter() const { return &device_.st.slots.n_rows; }  // where the device keeps rows()
  const int32_t* token_of_slot() const { return device_.token_of_slot.data(); }

  // The device's step as a resident step records it: tree[0, n_tree), then the target's top K_ver
  // at verification rows `rows` of verify_logits ([.][n_vocab]).
  void device_step(const int32_t* tree, int32_t n_tree, const float* verify_logits, std::span<const int32_t> rows) {
    const int32_t k_ver = params_.k_ver;
    tops_.assign(rows.size() * size_t(std::max(k_ver, 1)), -1);
    for (size_t r = 0; r < rows.size() && k_ver > 0; ++r)
      top_k_indices(verify_logits + size_t(rows[r]) * n_vocab_, n_vocab_, k_ver, tops_.data() + r * k_ver);
    vocab_state_step(device_.st, tree, n_tree, tops_.data(), int32_t(rows.size()) * k_ver);
  }
  // The host-driven stream's step by its own rule (the drafts it proposed, the rows it accepted).
  void reference_step(std::span<const int32_t> tree, const float* verify_logits, std::span<const int32_t> rows) {
    reference_.step(tree, verify_logits, rows);
  }
  // Both hold the same window.
  void expect_same_window(int32_t step) const {
    EXPECT_EQ(device_.st.window.active, reference_.window().active_size()) << "step " << step;
    int32_t differ = 0;
    for (int32_t t = 0; t < n_vocab_; ++t) differ += (device_.count[size_t(t)] > 0) != reference_.window().contains(t);
    EXPECT_EQ(differ, 0) << "tokens in one window only, step " << step;
  }

 private:
  int32_t n_vocab_;
  bool fixed_;
  CandidateStreamParams params_;
  CandidateStream reference_;
  HostDraftVocabState device_;
  std::vector<int32_t> tops_;
};

}  // namespace microspec::test
