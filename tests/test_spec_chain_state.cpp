// The device-resident speculative step's bookkeeping (speculative/chain_state.h) and the dynamic
// vocabulary's device state (vocab/window_state.h) driven on the host, with the CPU model doing
// the forwards src/cuda's CudaModel::enqueue_chain_step launches, in the same order and over the
// same arrays: the vocabulary's update from the previous verification, the drafts (each fed to the
// next through tokens[]), the verification of the whole chain, chain_accept. The tokens emitted
// must be plain greedy decoding's, token for token; the candidate stream the resident step builds
// must be the one the host-driven step builds (CandidateStream fed each verification's drafts and
// rows); a drafter with every layer must have every chain accepted whole; and an EAGLE-3 head's
// fixed-shape step (a catch-up forward over the last verification, chain_head_caught_up) must
// draft exactly what the host-driven HeadDrafter drafts, chain after chain.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "draft_head/eagle3_head.h"
#include "gguf/gguf.h"
#include "math/select.h"
#include "model/model.h"
#include "speculative/chain_state.h"
#include "speculative/head_drafter.h"
#include "support/resident_step.h"
#include "support/tiny_head.h"
#include "support/tiny_model.h"
#include "vocab/candidate_stream.h"
#include "vocab/draft_vocab.h"
#include "vocab/window_state.h"

namespace microspec {
namespace {

struct ResidentRun {
  std::vector<int32_t> emitted;
  ChainTotals totals;                // of the steps that emitted `emitted` (chain_totals_until)
  std::vector<int32_t> step_counts;  // the count of tokens after each step
};

using test::plain_greedy;

// The resident step on the host. vocab: a pruned draft vocabulary as src/cuda's DeviceDraftVocab
// keeps it (its state advanced by the device's functions, pinned ids included; its draft head over
// the packed rows; Fixed: the pinned ids alone, never stepped), or the full head. draft_model:
// a separate drafter (its cache one token behind the target's, speculative/chain_state.h), or null
// for the self-draft with the target's first draft_layers layers.
// head_path: an EAGLE-3 head file drafting instead (its steps as the device runs them, next to a
// host-driven HeadDrafter over the same head and vocabulary, whose chains must be the same).
// stop_id: a token that ends the text (-1: none), as the host looks for it after each step.
ResidentRun run_resident(Model& model, const std::vector<int32_t>& prompt, int32_t n_predict, int32_t depth,
                         int32_t draft_layers, const std::optional<PrunedVocabSpec>& spec, Model* draft_model,
                         const std::string& head_path = {}, int32_t stop_id = -1) {
  const int32_t V = model.config().n_vocab, n_prompt = int32_t(prompt.size());
  KVCache kv = model.make_cache(512);
  Batch b;
  ForwardOutput out;
  // The drafter: the target itself (its first layers, its cache) or the draft model (its own cache,
  // holding the prompt but its last token).
  Model& drafter = draft_model ? *draft_model : model;
  std::optional<test::ResidentDraftModel> dm;
  if (draft_model) dm.emplace(*draft_model, prompt, depth);

  // The device's arrays.
  test::ChainArrays arrays;
  ChainState cs = arrays.state(depth, n_predict + depth + 1);
  std::vector<int32_t>&tokens = arrays.tokens, &positions = arrays.positions, &parents = arrays.parents,
                      &output_rows = arrays.output_rows, &pred = arrays.pred, &out_ids = arrays.out_ids;
  int32_t &n_past = arrays.n_past, &counter = arrays.counter, &steps = arrays.steps;
  VocabUpdate& update = arrays.update;
  std::vector<float> verify_logits;  // [depth + 1][V] of the last verification

  // The vocabulary as the device keeps it, beside the host-driven stream (made after the prefill).
  std::unique_ptr<test::ResidentVocab> dv;

  // An EAGLE-3 head: its cache and arrays as the device keeps them, and the host-driven drafter.
  std::optional<test::ResidentChainHead> head;
  std::unique_ptr<HeadDrafter> host_head;
  std::span<const int32_t> feature_layers;  // what the forwards capture for the head
  std::vector<float> head_logits;
  if (!head_path.empty()) {
    host_head = std::make_unique<HeadDrafter>(std::make_unique<Eagle3Head>(GgufFile::open(head_path), model, model.n_batch()),
                                              model, 512, test::host_draft_vocabulary(model, spec));
    head.emplace(head_path, model, depth);
    feature_layers = head->feature_layers();
    head_logits.resize(size_t(V));
  }

  // Prefill: the prompt's last argmax is the first token (decode_begin), the target's top K_pre
  // at every prompt position start the stream.
  b.set_sequence(prompt, 0, true);
  model.forward(b, kv, out, {.logits = true, .capture_layers = feature_layers});
  kv.commit_prefix(n_prompt);
  n_past = n_prompt;
  tokens[0] = argmax(out.logits.data() + size_t(n_prompt - 1) * V, V);
  out_ids[counter++] = tokens[0];
  if (spec) dv = std::make_unique<test::ResidentVocab>(V, *spec, prompt, out.logits.data());
  if (host_head) {
    std::vector<int32_t> prompt_top(size_t(n_prompt) * std::max(host_head->prompt_top_k(), 1));
    for (int32_t i = 0; i < n_prompt && host_head->prompt_top_k() > 0; ++i)
      top_k_indices(out.logits.data() + size_t(i) * V, V, host_head->prompt_top_k(), prompt_top.data() + size_t(i) * host_head->prompt_top_k());
    host_head->target_features(out.layer_inputs.data(), n_prompt);
    host_head->begin(prompt, std::span<const int32_t>(prompt_top).first(size_t(n_prompt) * host_head->prompt_top_k()));
    head->begin(prompt, out.layer_inputs.data());
    pred[0] = tokens[0];
  }
  cs.draft_rows = dv ? dv->rows_counter() : nullptr;
  if (dm) cs.draft = dm->batch();
  if (head) cs.head = head->batch();
  cs.kver_last_only = dv && dv->kver_last_only();
  const std::vector<int32_t>& step_counts = arrays.step_counts;
  chain_begin(cs);
  // The head's draft: the best of its row's logits over the draft vocabulary (the target's LM head).
  auto head_pick = [&](const float* normed_row) {
    if (!dv) {
      model.lm_head(normed_row, 1, head_logits.data());
      return argmax(head_logits.data(), V);
    }
    const int32_t n = dv->rows();
    if (n == 0) return 0;  // the placeholder
    model.lm_head_rows(normed_row, 1, dv->token_of_slot(), n, head_logits.data());
    return dv->token_of_slot()[size_t(argmax(head_logits.data(), n))];
  };
  DraftTree host_tree;

  std::vector<int32_t> tree, rows;
  std::vector<float> draft_logits;
  bool drafts_real = true;
  int32_t last_accepted = 0;  // drafts the last verification accepted
  // The text's end as the host sees it: n_predict tokens or the stop token.
  auto ended = [&] { return counter >= n_predict || std::find(out_ids.begin(), out_ids.begin() + counter, stop_id) !=
                                                       out_ids.begin() + counter; };
  int32_t accepted_sum = 0;
  while (!ended()) {
    // 1. The vocabulary's update from the previous verification; the host-driven reference takes
    //    the same verification's drafts (when real) and rows, and must hold the same window.
    if (dv && dv->takes_steps()) {
      rows.clear();
      for (int32_t r = 0; r < update.n_rows; ++r) rows.push_back(update.first_row + r);
      dv->device_step(tokens.data() + 1, update.n_tree, verify_logits.data(), rows);
      if (steps > 0) {
        // The host-driven step's own rule: the drafts, then rows 0..a or a alone.
        tree.assign(tokens.begin() + 1, tokens.begin() + 1 + (drafts_real ? depth : 0));
        rows.clear();
        for (int32_t r = dv->kver_last_only() ? last_accepted : 0; r <= last_accepted; ++r) rows.push_back(r);
        dv->reference_step(tree, verify_logits.data(), rows);
      }
      dv->expect_same_window(steps);
    }
    // 2. Drafts: the self-draft runs batch row d alone in pending slot d; a draft model runs
    //    [its first token, tokens[0]], then tokens[d] in its slot d + 1. The draft head's best is
    //    row d + 1.
    drafts_real = !dv || dv->rows() > 0;
    if (head) {
      // The catch-up over the last verification, then draft d >= 1 from tokens[d].
      tokens[1] = head_pick(head->catch_up(cs, pred, b));
      for (int32_t d = 1; d < depth; ++d) tokens[d + 1] = head_pick(head->draft(d, tokens, b));
      // The host-driven drafter's chain from the same root: the same tokens.
      host_tree = DraftTree{};
      host_head->propose(tokens[0], positions[0], TreeParams{depth - 1, 1, depth, 0}, nullptr, host_tree);
      if (drafts_real) {
        std::vector<int32_t> host_chain;
        for (const TreeNode& node : host_tree.nodes) host_chain.push_back(node.token);
        EXPECT_EQ(host_chain, std::vector<int32_t>(tokens.begin() + 1, tokens.end())) << "step " << steps;
      } else {
        EXPECT_TRUE(host_tree.nodes.empty());
      }
    }
    for (int32_t d = 0; d < depth && !head; ++d) {
      if (dm)
        dm->forward(d, tokens, /*logits=*/!dv, b, out);
      else
        test::self_draft_forward(model, kv, d, tokens.data(), positions.data(), parents.data(), draft_layers, !dv, b, out);
      if (!dv) {
        tokens[d + 1] = argmax(out.logits.data(), V);
        continue;
      }
      const int32_t n = dv->rows();
      if (n == 0) {
        tokens[d + 1] = 0;  // the placeholder the device's argmax writes
        continue;
      }
      draft_logits.resize(size_t(n));
      drafter.lm_head_rows(out.hidden.data(), 1, dv->token_of_slot(), n, draft_logits.data());
      tokens[d + 1] = dv->token_of_slot()[size_t(argmax(draft_logits.data(), n))];
    }
    // 3. Verification of the whole chain.
    test::verify_forward(model, kv, tokens, positions, parents, output_rows, feature_layers, b, out);
    for (int32_t i = 0; i <= depth; ++i) pred[size_t(i)] = argmax(out.logits.data() + size_t(i) * V, V);
    verify_logits = out.logits;
    // 4. Acceptance: the cache keeps what chain_accept committed.
    const int32_t before = n_past, draft_before = dm ? dm->n_past : 0, root = tokens[0];
    last_accepted = chain_accept(cs);
    accepted_sum += last_accepted;
    if (head) {
      head->accepted(last_accepted, n_past, out.layer_inputs);
      std::vector<int32_t> path;
      for (int32_t i = 0; i < last_accepted; ++i) path.push_back(i);
      host_head->target_features(out.layer_inputs.data(), depth + 1);
      host_head->accepted(root, host_tree, path, verify_logits.data());
    }
    kv.commit_prefix(n_past - before);
    if (dm) {
      dm->kv.commit_prefix(dm->n_past - draft_before);
      EXPECT_EQ(dm->n_past, n_past - 1) << "the draft model's cache is one token behind";
    }
    EXPECT_EQ(counter, n_past - n_prompt + 1) << "every emitted token but the newest is in the cache";
    EXPECT_EQ(kv.n_past(), n_past);
  }
  // The text as the host reads it: up to the stop token or the limit.
  int32_t n = std::min(counter, n_predict);
  for (int32_t i = 0; i < n; ++i)
    if (out_ids[size_t(i)] == stop_id) n = i + 1;
  ResidentRun r;
  r.emitted.assign(out_ids.begin(), out_ids.begin() + n);
  r.step_counts.assign(step_counts.begin(), step_counts.begin() + steps);
  r.totals = chain_totals_until(step_counts.data(), steps, n);
  // The loop stopped at the step that ended the text: every step counts, with every acceptance.
  EXPECT_EQ(r.totals.steps, steps);
  EXPECT_EQ(r.totals.accepted, accepted_sum);
  return r;
}

// A tiny llama as the target, and the same weights in Q4_1 as a draft model: it agrees with the
// target often, not always, so chains are both cut and accepted whole.
class ChainStateTiny : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string stem = (std::filesystem::temp_directory_path() /
                              ("microspec_chain_state_" + std::to_string(::getpid()))).string();
    target_ = load(stem + "_target.gguf", GgmlType::Q8_0);
    draft_ = load(stem + "_draft.gguf", GgmlType::Q4_1);
    // A random EAGLE-3 head reading all three layers' inputs and the stream after the last.
    test::TinyHeadSpec head;
    head.target_layers = {0, 2, 3};
    head_path_ = stem + "_head.gguf";
    paths_.push_back(head_path_);
    test::write_tiny_head(head, head_path_);
  }
  void TearDown() override {
    for (const std::string& p : paths_) std::filesystem::remove(p);
  }
  test::TinyLoaded load(const std::string& path, GgmlType type) {
    test::TinyModelSpec spec;
    spec.arch = "llama";
    spec.n_vocab = 320;
    spec.n_layer = 3;
    spec.seed = 7;
    spec.weight_type = type;
    spec.untied_output = true;  // a tied random model only repeats its last token
    paths_.push_back(path);
    return test::load_tiny_model(spec, path);
  }
  std::vector<std::string> paths_;
  std::string head_path_;
  test::TinyLoaded target_, draft_;
};

TEST_F(ChainStateTiny, ResidentStepsEqualPlainGreedyDecoding) {
  using Source = CandidateStreamParams::Source;
  using Rows = CandidateStreamParams::KverRows;
  const auto stream = test::window_spec;   // a window (dynamic)
  const auto pinned = test::with_every_7th;  // ids 7, 14, 21, ... beside it (hybrid) or alone (freq)
  enum class Drafter { Self, TargetAsDraftModel, DraftModel, Head };
  struct Variant {
    const char* name;
    int32_t depth;
    int32_t draft_layers;  // of 3: with 3 and the full head the drafts are the target's own tokens
    std::optional<PrunedVocabSpec> vocab;
    Drafter drafter = Drafter::Self;
  };
  const Variant variants[] = {
      {"full head, depth 1", 1, 2, std::nullopt},
      {"full head, depth 4", 4, 2, std::nullopt},
      {"full head, every layer drafts", 4, 3, std::nullopt},
      {"dynamic W 64", 4, 2, stream(64, Source::Both, Rows::Accepted)},
      {"dynamic W 64, every layer drafts", 3, 3, stream(64, Source::Both, Rows::Accepted)},
      {"dynamic ext W 64 (first chain from an empty vocabulary)", 4, 2, stream(64, Source::Ext, Rows::Accepted)},
      {"dynamic W 5, K_ver of the last row", 4, 2, stream(5, Source::Both, Rows::Last)},
      {"dynamic ctx", 4, 2, stream(3072, Source::Ctx, Rows::Accepted)},
      {"hybrid W 16 + 20 pinned", 4, 2, pinned(stream(16, Source::Both, Rows::Accepted), 20, PrunedVocabSpec::Kind::Window)},
      {"freq: 40 fixed ids", 4, 2, pinned(stream(16, Source::Both, Rows::Accepted), 40, PrunedVocabSpec::Kind::Fixed)},
      {"the target as its own draft model, full head", 4, 3, std::nullopt, Drafter::TargetAsDraftModel},
      {"draft model, full head", 4, 2, std::nullopt, Drafter::DraftModel},
      {"draft model, dynamic W 64", 4, 2, stream(64, Source::Both, Rows::Accepted), Drafter::DraftModel},
      {"draft model, freq: 40 fixed ids", 3, 2, pinned(stream(16, Source::Both, Rows::Accepted), 40, PrunedVocabSpec::Kind::Fixed), Drafter::DraftModel},
      {"EAGLE-3 head, full head, depth 1", 1, 0, std::nullopt, Drafter::Head},
      {"EAGLE-3 head, full head, depth 4", 4, 0, std::nullopt, Drafter::Head},
      {"EAGLE-3 head, dynamic W 64", 4, 0, stream(64, Source::Both, Rows::Accepted), Drafter::Head},
      {"EAGLE-3 head, dynamic ext W 64 (first chain from an empty vocabulary)", 3, 0, stream(64, Source::Ext, Rows::Accepted), Drafter::Head},
      {"EAGLE-3 head, freq: 40 fixed ids", 4, 0, pinned(stream(16, Source::Both, Rows::Accepted), 40, PrunedVocabSpec::Kind::Fixed), Drafter::Head}};
  const std::vector<int32_t> prompt = {5, 17, 99, 3, 250, 41, 8, 77, 120};
  const int32_t n_predict = 40;
  Model& target = *target_.model;
  const std::vector<int32_t> plain = plain_greedy(target, prompt, n_predict);
  EXPECT_GE(std::set<int32_t>(plain.begin(), plain.end()).size(), 10u) << "a degenerate text tests little";
  // A stop token: the text ends at its first occurrence.
  const int32_t stop_id = plain[17];
  const int32_t stop_at = int32_t(std::find(plain.begin(), plain.end(), stop_id) - plain.begin());
  EXPECT_GE(stop_at, 5) << "a stop token that ends the text at once tests little";
  int32_t accepted_partial = 0, accepted_dynamic = 0, accepted_draft_model = 0, accepted_head = 0;
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    Model* draft_model = v.drafter == Drafter::TargetAsDraftModel ? &target
                         : v.drafter == Drafter::DraftModel         ? draft_.model.get()
                                                                    : nullptr;
    const ResidentRun r = run_resident(target, prompt, n_predict, v.depth, v.draft_layers, v.vocab, draft_model,
                                       v.drafter == Drafter::Head ? head_path_ : std::string());
    EXPECT_EQ(r.emitted, plain);
    EXPECT_GT(r.totals.steps, 0);
    // Ended by the stop token: the steps and acceptances of a run that wanted that many tokens.
    const ResidentRun stopped = run_resident(target, prompt, n_predict, v.depth, v.draft_layers, v.vocab, draft_model,
                                             v.drafter == Drafter::Head ? head_path_ : std::string(), stop_id);
    const ResidentRun limited = run_resident(target, prompt, stop_at + 1, v.depth, v.draft_layers, v.vocab, draft_model,
                                             v.drafter == Drafter::Head ? head_path_ : std::string());
    EXPECT_EQ(stopped.emitted, std::vector<int32_t>(plain.begin(), plain.begin() + stop_at + 1));
    EXPECT_EQ(limited.emitted, stopped.emitted);
    EXPECT_EQ(stopped.totals.steps, limited.totals.steps);
    EXPECT_EQ(stopped.totals.accepted, limited.totals.accepted);
    EXPECT_LT(stopped.totals.steps, r.totals.steps);
    // Steps run past the text's end before the host looked (the longer run's): they do not count.
    const ChainTotals cut = chain_totals_until(r.step_counts.data(), r.totals.steps, stop_at + 1);
    EXPECT_EQ(cut.steps, limited.totals.steps);
    EXPECT_EQ(cut.accepted, limited.totals.accepted);
    if (v.draft_layers == 3 && !v.vocab)
      EXPECT_EQ(r.totals.accepted, v.depth * r.totals.steps) << "the target drafting for itself";
    if (v.draft_layers == 2 && v.drafter == Drafter::Self) accepted_partial += r.totals.accepted;
    if (v.vocab) accepted_dynamic += r.totals.accepted;
    if (v.drafter == Drafter::DraftModel) accepted_draft_model += r.totals.accepted;
    if (v.drafter == Drafter::Head) accepted_head += r.totals.accepted;
  }
  EXPECT_GT(accepted_partial, 0) << "no partial drafter ever agreed: only chains cut at once were tested";
  EXPECT_GT(accepted_dynamic, 0) << "no draft from the packed rows was ever accepted";
  EXPECT_GT(accepted_draft_model, 0) << "the draft model never agreed";
  EXPECT_GT(accepted_head, 0) << "the head never agreed: no catch-up ever committed a row before its root";
}

// chain_accept on its own: a cut chain, a whole one, placeholders, the K_ver rows it asks for.
TEST(ChainState, AcceptEmitsCommitsAndLaysOutTheNextBatch) {
  const int32_t depth = 3;
  std::vector<int32_t> tokens = {10, 11, 12, 13}, positions(4), parents(4), rows(4), pred = {11, 12, 99, 7},
                       out_ids(16, -1);
  int32_t n_past = 20, counter = 1, draft_rows = 5, steps = -1;
  std::vector<int32_t> step_counts(16, -1);
  VocabUpdate update;
  ChainState s{tokens.data(), positions.data(), parents.data(), rows.data(), pred.data(), &draft_rows, &n_past,
               out_ids.data(), &counter, &update, &steps, step_counts.data(), {}, {}, depth, 0};
  chain_begin(s);
  EXPECT_EQ(positions, (std::vector<int32_t>{20, 21, 22, 23}));
  EXPECT_EQ(parents, (std::vector<int32_t>{-1, 0, 1, 2}));
  EXPECT_EQ(rows, (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(update.n_tree + update.n_rows, 0);

  // Drafts 11, 12 accepted, 13 rejected for 99.
  EXPECT_EQ(chain_accept(s), 2);
  EXPECT_EQ(std::vector<int32_t>(out_ids.begin() + 1, out_ids.begin() + 4), (std::vector<int32_t>{11, 12, 99}));
  EXPECT_EQ(counter, 4);
  EXPECT_EQ(n_past, 23);
  EXPECT_EQ(tokens[0], 99);
  EXPECT_EQ(positions, (std::vector<int32_t>{23, 24, 25, 26}));
  EXPECT_EQ(update.n_tree, 3);
  EXPECT_EQ(update.first_row, 0);
  EXPECT_EQ(update.n_rows, 3);

  // A whole chain, K_ver of the last row only.
  s.kver_last_only = 1;
  tokens = {99, 1, 2, 3};
  pred = {1, 2, 3, 4};
  EXPECT_EQ(chain_accept(s), 3);
  EXPECT_EQ(counter, 8);
  EXPECT_EQ(out_ids[7], 4);
  EXPECT_EQ(n_past, 27);
  EXPECT_EQ(update.first_row, 3);
  EXPECT_EQ(update.n_rows, 1);

  // Placeholders (an empty draft vocabulary): nothing accepted even where they match, no tree.
  draft_rows = 0;
  tokens = {4, 0, 0, 0};
  pred = {0, 0, 0, 0};
  EXPECT_EQ(chain_accept(s), 0);
  EXPECT_EQ(out_ids[8], 0);
  EXPECT_EQ(counter, 9);
  EXPECT_EQ(n_past, 28);
  EXPECT_EQ(update.n_tree, 0);
  EXPECT_EQ(update.first_row, 0);
  EXPECT_EQ(steps, 3);
  EXPECT_EQ(std::vector<int32_t>(step_counts.begin(), step_counts.begin() + 3), (std::vector<int32_t>{4, 8, 9}));
  const ChainTotals totals = chain_totals_until(step_counts.data(), steps, counter);
  EXPECT_EQ(totals.steps, 3);
  EXPECT_EQ(totals.accepted, 5);

  // A draft model's batch: it starts from the newest accepted token one position back, then the
  // target's token; its cache is one token behind.
  std::vector<int32_t> first = {-1, -1}, d_positions(4), d_parents(4), d_rows(2);
  int32_t d_n_past = 0;
  s.draft = DraftModelBatch{first.data(), d_positions.data(), d_parents.data(), d_rows.data(), &d_n_past};
  chain_begin(s);  // lays out what never moves (parents, output rows)
  draft_rows = 5;
  tokens = {0, 50, 51, 52};
  pred = {50, 60, 0, 0};
  EXPECT_EQ(chain_accept(s), 1);  // 50 accepted, 51 rejected for 60
  EXPECT_EQ(n_past, 30);
  EXPECT_EQ(first, (std::vector<int32_t>{50, 60}));
  EXPECT_EQ(d_positions, (std::vector<int32_t>{29, 30, 31, 32}));
  EXPECT_EQ(d_parents, (std::vector<int32_t>{-1, 0, 1, 2}));
  EXPECT_EQ(d_rows, (std::vector<int32_t>{1, 0}));
  EXPECT_EQ(d_n_past, 29);
  tokens = {60, 1, 2, 3};
  pred = {5, 0, 0, 0};
  EXPECT_EQ(chain_accept(s), 0);
  EXPECT_EQ(first, (std::vector<int32_t>{60, 5}));  // nothing accepted: the old last is the newest
  EXPECT_EQ(d_n_past, 30);
}

// chain_totals_until: the steps that emitted the first n tokens (after the prompt's argmax, token
// 1), from the count after each step.
TEST(ChainState, TotalsUntilCountTheStepsThatEmittedTheKeptTokens) {
  const int32_t counts[] = {3, 4, 8};  // steps emitting 2, 1 and 4 tokens: 1, 0 and 3 drafts accepted
  auto until = [&](int32_t n_steps, int32_t n_kept) {
    const ChainTotals t = chain_totals_until(counts, n_steps, n_kept);
    return std::vector<int32_t>{t.steps, t.accepted};
  };
  EXPECT_EQ(until(3, 0), (std::vector<int32_t>{0, 0}));
  EXPECT_EQ(until(3, 1), (std::vector<int32_t>{0, 0})) << "the prompt's argmax alone";
  EXPECT_EQ(until(3, 2), (std::vector<int32_t>{1, 1}));
  EXPECT_EQ(until(3, 3), (std::vector<int32_t>{1, 1}));
  EXPECT_EQ(until(3, 4), (std::vector<int32_t>{2, 1}));
  EXPECT_EQ(until(3, 5), (std::vector<int32_t>{3, 4}));
  EXPECT_EQ(until(3, 8), (std::vector<int32_t>{3, 4}));
  EXPECT_EQ(until(3, 12), (std::vector<int32_t>{3, 4})) << "tokens after the steps (plain decoding at the context's end)";
  EXPECT_EQ(until(1, 12), (std::vector<int32_t>{1, 1}));
  EXPECT_EQ(until(0, 12), (std::vector<int32_t>{0, 0}));
}

// An EAGLE-3 head's arrays: chain_begin lays out the first catch-up after the prompt, chain_accept
// commits the root row and records a, chain_head_caught_up commits the a rows before the root row,
// clears its parent and places the drafts' rows behind it.
TEST(ChainState, HeadCatchUpKeepsTheAcceptedRowsAndTheRoot) {
  const int32_t depth = 3;
  std::vector<int32_t> tokens = {10, 11, 12, 13}, positions(4), parents(4), rows(4), pred(4), out_ids(16, -1);
  std::vector<int32_t> catch_positions(4), catch_parents(4), draft_positions(4, -7), draft_parents(4),
      slot_parents(64, 5);
  int32_t n_past = 20, counter = 1, root_row = -1, head_n_past = 19;  // the prompt's rows but the last
  int32_t steps = 0;
  std::vector<int32_t> step_counts(16);
  VocabUpdate update;
  ChainState s{tokens.data(), positions.data(), parents.data(), rows.data(), pred.data(), nullptr, &n_past,
               out_ids.data(), &counter, &update, &steps, step_counts.data(), {}, {}, depth, 0};
  s.head = HeadBatch{catch_positions.data(), catch_parents.data(), draft_positions.data(), draft_parents.data(),
                     &root_row, &head_n_past, slot_parents.data()};
  chain_begin(s);
  EXPECT_EQ(catch_positions, (std::vector<int32_t>{19, 20, 21, 22}));
  EXPECT_EQ(catch_parents, (std::vector<int32_t>{-1, 0, 1, 2}));
  EXPECT_EQ(draft_parents, (std::vector<int32_t>{-1, 0, 1, 2}));
  EXPECT_EQ(root_row, 0);
  chain_head_caught_up(s);  // the first catch-up: the root row alone
  EXPECT_EQ(head_n_past, 19);
  EXPECT_EQ(slot_parents[19], -1);
  EXPECT_EQ(std::vector<int32_t>(draft_positions.begin() + 1, draft_positions.end()), (std::vector<int32_t>{20, 21, 22}));

  pred = {11, 12, 99, 7};  // drafts 11, 12 accepted
  EXPECT_EQ(chain_accept(s), 2);
  EXPECT_EQ(n_past, 23);
  EXPECT_EQ(head_n_past, 20) << "the root row (features at 19, token 10 at 20) is kept";
  EXPECT_EQ(root_row, 2);
  EXPECT_EQ(catch_positions, (std::vector<int32_t>{20, 21, 22, 23}));
  slot_parents[22] = 1;  // the catch-up wrote row 2 with parent row 1
  chain_head_caught_up(s);
  EXPECT_EQ(head_n_past, 22) << "rows for tokens 11 and 12 committed; row 2 (token 99 at 23) is the root";
  EXPECT_EQ(slot_parents[22], -1);
  EXPECT_EQ(std::vector<int32_t>(draft_positions.begin() + 1, draft_positions.end()), (std::vector<int32_t>{23, 24, 25}));
  EXPECT_EQ(head_n_past, n_past - 1) << "after the catch-up the head is one row behind the target";
}

}  // namespace
}  // namespace microspec
