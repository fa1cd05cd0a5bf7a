#pragma once
// The device-resident tree step (speculative/tree_state.h, tree_sampling.h) driven on the host with
// the CPU model doing the forwards CudaModel::enqueue_tree_step launches: its arrays in host
// memory (HostTreeState) and the whole step (run_tree), greedy or sampled.
// tests/test_spec_tree_state.cpp checks it against TreeBuilder, accept_greedy, plain greedy
// decoding and the CPU Decoder; tests/cuda/ checks the device against it.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "math/select.h"
#include "model/model.h"
#include "sampling/ranked_draw.h"
#include "sampling/sampler.h"
#include "speculative/tree.h"
#include "speculative/tree_sampling.h"
#include "speculative/tree_state.h"
#include "vocab/draft_vocab.h"
#include "resident_sampling.h"
#include "resident_step.h"

namespace microspec::test {

// A TreeState over host vectors, sized for a shape and a number of tokens to emit.
struct HostTreeState {
  std::vector<int32_t> draft_tokens, draft_positions, draft_parents, prop_token, cand_token, cand_parent, cand_depth,
      cand_slot, cand_node, frontier, tokens, positions, parents, output_rows, row_slot, pred, keep, out_ids,
      step_counts;
  std::vector<float> prop_logprob, cand_score;
  int32_t n_nodes = 0, n_keep = 0, n_past = 0, counter = 0, steps = 0;
  VocabUpdate update;
  TreeState s;

  HostTreeState(const TreeShape& shape, int32_t capacity)
      : draft_tokens(size_t(shape.top_k)), draft_positions(draft_tokens.size()), draft_parents(draft_tokens.size()),
        prop_token(size_t(shape.top_k) * shape.top_k), cand_token(size_t(shape.candidates())),
        cand_parent(cand_token.size()), cand_depth(cand_token.size()), cand_slot(cand_token.size()),
        cand_node(cand_token.size()), frontier(size_t(shape.top_k)), tokens(size_t(shape.verify_rows())),
        positions(tokens.size()), parents(tokens.size()), output_rows(tokens.size()), row_slot(tokens.size()),
        pred(tokens.size()),
        keep(size_t(shape.max_emitted())), out_ids(size_t(capacity)),
        step_counts(size_t(capacity)), prop_logprob(prop_token.size()), cand_score(cand_token.size()) {
    s = TreeState{draft_tokens.data(), draft_positions.data(), draft_parents.data(), prop_token.data(),
                  prop_logprob.data(), cand_token.data(), cand_parent.data(), cand_depth.data(), cand_score.data(),
                  cand_slot.data(), cand_node.data(), frontier.data(), tokens.data(), positions.data(),
                  parents.data(), output_rows.data(), &n_nodes, row_slot.data(), pred.data(), keep.data(), &n_keep,
                  &n_past, out_ids.data(), &counter, &update, &steps, step_counts.data(),
                  shape, 0};
  }
  HostTreeState(const HostTreeState&) = delete;
  HostTreeState& operator=(const HostTreeState&) = delete;

  // An EAGLE-3 head's arrays (TreeHeadBatch), its cache holding n_past rows.
  std::vector<int32_t> catch_tokens, catch_rows, catch_positions, catch_parents, head_draft_positions, head_slot_parents;
  int32_t head_root_row = 0, head_n_past = 0;
  void attach_head(int32_t n_past) {
    const size_t e = size_t(s.shape.max_emitted());
    catch_tokens.assign(e, 0);
    catch_rows = catch_positions = catch_parents = catch_tokens;
    head_draft_positions.assign(size_t(s.shape.top_k), 0);
    head_slot_parents.assign(512, -2);
    head_n_past = n_past;
    s.head = TreeHeadBatch{catch_tokens.data(),         catch_rows.data(), catch_positions.data(), catch_parents.data(),
                           head_draft_positions.data(), &head_root_row,   &head_n_past,           head_slot_parents.data()};
  }
  HeadCounters head_counters() const { return HeadCounters{&head_n_past, &head_root_row, head_slot_parents.data()}; }

  // A separate draft model's arrays (TreeDraftModel), `newest` the committed token its cache lacks.
  std::vector<int32_t> dm_first, dm_first_positions, dm_first_parents, dm_parents, dm_keep;
  int32_t dm_first_output = 0;
  void attach_draft_model(int32_t newest) {
    dm_first = {newest, 0};
    dm_first_positions = dm_first_parents = dm_first;
    dm_parents.assign(size_t(s.shape.top_k), 0);
    dm_keep.assign(size_t(s.shape.max_emitted()), 0);
    s.draft = TreeDraftModel{dm_first.data(), dm_first_positions.data(), dm_first_parents.data(), &dm_first_output,
                             dm_parents.data(), dm_keep.data()};
  }

  // The tree as DraftTree nodes (parents as node indices), from the verification batch.
  DraftTree tree() const {
    DraftTree t;
    for (int32_t i = 1; i <= n_nodes; ++i)
      t.nodes.push_back({tokens[size_t(i)], parents[size_t(i)] - 1, positions[size_t(i)] - positions[0], 0.0f, -1});
    return t;
  }
  // The tokens from the root's child down to candidate c.
  std::vector<int32_t> path_of(int32_t c) const {
    std::vector<int32_t> path;
    for (; c >= 0; c = cand_parent[size_t(c)]) path.insert(path.begin(), cand_token[size_t(c)]);
    return path;
  }
};

struct TreeRun {
  std::vector<int32_t> emitted;
  int32_t steps = 0, accepted = 0, nodes = 0;
  int32_t later_siblings_accepted = 0;  // accepted nodes that are not their parent's first child
  std::vector<int32_t> step_counts;  // the count of tokens after each step
};

// The resident tree step on the host with the self-drafter (the target's first draft_layers
// layers), an EAGLE-3 head (head_path: its file; its rows scored by the target's LM head) or a
// separate draft model (draft_model: its rows scored by its own LM head). spec: MicroSpec's window
// (its state advanced by the device's functions, the draft head over its packed rows), a fixed set
// (Fixed: the pinned ids), or the full head. sp: greedy (the default), or speculative sampling
// (tree_sampling.h): each draft row and verification row ranked as top_k_rows ranks it, tree_draw
// after each draft forward, tree_keep_first, tree_sample_accept.
inline TreeRun run_tree(Model& model, const std::vector<int32_t>& prompt, int32_t n_predict, const TreeParams& params,
                        int32_t draft_layers, const std::optional<PrunedVocabSpec>& spec, const SamplingParams& sp = {},
                        const std::string& head_path = {}, Model* draft_model = nullptr) {
  const int32_t V = model.config().n_vocab, n_prompt = int32_t(prompt.size()), H = model.config().n_embd;
  Model& scorer = draft_model ? *draft_model : model;  // whose LM head scores the drafts
  const int32_t H_draft = scorer.config().n_embd;
  const TreeShape shape = params.fixed_shape();
  const int32_t k = shape.top_k;
  KVCache kv = model.make_cache(512);
  Batch b;
  ForwardOutput out;
  HostTreeState h(shape, n_predict + shape.max_emitted());
  std::vector<float> verify_logits;

  std::unique_ptr<ResidentVocab> dv;  // the vocabulary as the device keeps it, beside the host-driven stream

  // An EAGLE-3 head: its forwards as the device runs them, the features of the last verification's
  // rows ([verify_rows][F]; at first the prompt's last at row 0), the catch-up's rows of them
  // ([max_emitted][F]), each draft slot's pre-norm output ([draft_slots][H]) and a level's hidden
  // inputs ([top_k][H]).
  std::optional<ResidentHead> head;
  std::span<const int32_t> feature_layers;
  int32_t F = 0;
  std::vector<float> verify_features, catch_features, slot_prenorm, level_g, head_logits;
  if (!head_path.empty()) {
    head.emplace(head_path, model, std::max(shape.max_emitted(), k));
    feature_layers = head->feature_layers();
    F = head->n_features();
    catch_features.resize(size_t(shape.max_emitted()) * F);
    slot_prenorm.resize(size_t(shape.draft_slots()) * H);
    level_g.resize(size_t(k) * H);
    head_logits.resize(size_t(k) * V);
  }

  // Speculative sampling's ranked rows and the samplers' bits (the target's: the first token's
  // draw, then at most one per node and one per step; the draft's: tree_draft_draws per step).
  const bool sampled = !sp.greedy();
  const int32_t ks = sampled ? sp.top_k : 1;
  const DrawSettings settings{sp.temperature, sp.top_p};
  const std::vector<uint64_t> target_bits = bits_of(sp.seed, size_t(1 + n_predict * shape.verify_rows()));
  const std::vector<uint64_t> draft_bits =
      bits_of(draft_sampler_seed(sp.seed), size_t(n_predict * tree_draft_draws(shape)));
  std::vector<int32_t> draft_ids(size_t(shape.draft_slots()) * ks), target_ids(size_t(shape.verify_rows()) * ks);
  std::vector<float> draft_values(draft_ids.size()), target_values(target_ids.size());
  int32_t draft_drawn = 0, target_drawn = 0;
  const TreeSampling m{&settings,          ks, draft_ids.data(), draft_values.data(), target_ids.data(),
                       target_values.data(), draft_bits.data(), &draft_drawn, target_bits.data(), &target_drawn};

  // A draft model's cache: the prompt but its last token (its first forward runs it with the root).
  std::optional<KVCache> draft_kv;
  if (draft_model) {
    draft_kv.emplace(draft_cache_one_behind(*draft_model, prompt));
    h.attach_draft_model(prompt.back());
  }

  b.set_sequence(prompt, 0, true);
  model.forward(b, kv, out, {.logits = true, .capture_layers = feature_layers});
  kv.commit_prefix(n_prompt);
  h.n_past = n_prompt;
  if (head) {
    head->begin(prompt, out.layer_inputs.data());
    verify_features.assign(size_t(shape.verify_rows()) * F, 0.0f);
    std::copy_n(out.layer_inputs.data() + size_t(n_prompt - 1) * F, F, verify_features.begin());
    h.attach_head(n_prompt - 1);
  }
  const float* last_row = out.logits.data() + size_t(n_prompt - 1) * V;
  if (sampled) {  // the first token is the target's draw 0
    rank_row(last_row, V, ks, nullptr, target_ids.data(), target_values.data());
    const auto logit_of = [&](int32_t i) { return target_values[size_t(i)]; };
    h.tokens[0] = target_ids[size_t(draw_ranked(ranked_count(target_ids.data(), target_values.data(), ks), logit_of,
                                                settings, target_bits[size_t(target_drawn++)]))];
  } else {
    h.tokens[0] = argmax(last_row, V);
  }
  h.out_ids[size_t(h.counter++)] = h.tokens[0];
  if (spec) dv = std::make_unique<ResidentVocab>(V, *spec, prompt, out.logits.data());
  h.s.kver_last_only = dv && dv->kver_last_only();
  tree_begin(h.s);

  TreeRun run;
  std::vector<float> draft_logits;
  std::vector<Proposal> props(static_cast<size_t>(k));
  DraftTree last_tree;
  std::vector<int32_t> last_path;  // accept_greedy's path through last_tree
  while (h.counter < n_predict) {
    // 1. The vocabulary's update from the previous verification as tree_accept recorded it (the
    //    tree's tokens, the target's top K_ver at keep[first_row, + n_rows)); the host-driven
    //    stream takes the CPU drafter's own rule (DraftVocabulary::accepted: the nodes in order, the rows of the root
    //    and the accepted path, or the last alone) and must hold the same window.
    if (dv && dv->takes_steps()) {
      dv->device_step(h.tokens.data() + 1, h.update.n_tree, verify_logits.data(),
                      std::span<const int32_t>(h.keep).subspan(size_t(h.update.first_row), size_t(h.update.n_rows)));
      if (h.steps > 0) {
        std::vector<int32_t> tree_tokens, rows = {0};
        for (const TreeNode& n : last_tree.nodes) tree_tokens.push_back(n.token);
        for (int32_t p : last_path) rows.push_back(p + 1);
        if (dv->kver_last_only()) rows = {rows.back()};
        dv->reference_step(tree_tokens, verify_logits.data(), rows);
      }
      dv->expect_same_window(h.steps);
    }
    // 2. The draft forwards, each row's k best over the draft vocabulary (sampling: its k draws).
    //    The self-draft runs the root alone, then each level's frontier rows; a head runs its
    //    catch-up (the root row is its row a), then the frontier rows fed their parents' outputs;
    //    a draft model runs the newest committed token with the root, then the frontier rows one
    //    slot further on.
    for (int32_t f = 0; f <= shape.depth; ++f) {
      const int32_t n_rows = shape.draft_rows(f);
      const float* hidden = nullptr;  // [n_rows][H] the rows' normed outputs
      const float* full = nullptr;    // [n_rows][V] their logits over the full head
      if (head && f == 0) {
        const int32_t e = shape.max_emitted();
        for (int32_t i = 0; i < e; ++i)
          std::copy_n(verify_features.data() + size_t(h.catch_rows[size_t(i)]) * F, F, catch_features.data() + size_t(i) * F);
        b.clear();
        b.tokens = h.catch_tokens;
        b.positions = h.catch_positions;
        b.parents = h.catch_parents;
        hidden = head->catch_up(b, catch_features.data(), h.head_counters(), [&] { tree_head_caught_up(h.s); });
        std::copy_n(head->root_prenorm(), H, slot_prenorm.begin());  // slot 0: the root
      } else if (head) {
        b.clear();
        b.tokens.assign(h.draft_tokens.begin(), h.draft_tokens.end());
        b.positions.assign(h.head_draft_positions.begin(), h.head_draft_positions.end());
        b.parents.assign(h.draft_parents.begin(), h.draft_parents.end());
        b.start = shape.draft_start(f);
        for (int32_t i = 0; i < n_rows; ++i)
          std::copy_n(slot_prenorm.data() + size_t(h.draft_parents[size_t(i)]) * H, H, level_g.data() + size_t(i) * H);
        hidden = head->draft_rows(b, level_g.data());
        std::copy_n(head->prenorm(), size_t(n_rows) * H, slot_prenorm.data() + size_t(b.start) * H);
      } else if (draft_model) {
        b.clear();
        if (f == 0) {
          b.tokens = h.dm_first;
          b.positions = h.dm_first_positions;
          b.parents = h.dm_first_parents;
          b.output_rows = {h.dm_first_output};
        } else {
          b.tokens.assign(h.draft_tokens.begin(), h.draft_tokens.begin() + n_rows);
          b.positions.assign(h.draft_positions.begin(), h.draft_positions.begin() + n_rows);
          b.parents.assign(h.dm_parents.begin(), h.dm_parents.begin() + n_rows);
          for (int32_t i = 0; i < n_rows; ++i) b.output_rows.push_back(i);
          b.start = shape.draft_start(f) + 1;
        }
        draft_model->forward(b, *draft_kv, out, {.logits = !dv});
        hidden = out.hidden.data();
        full = out.logits.data();
      } else {
        b.clear();
        b.tokens.assign(h.draft_tokens.begin(), h.draft_tokens.begin() + n_rows);
        b.positions.assign(h.draft_positions.begin(), h.draft_positions.begin() + n_rows);
        b.parents.assign(h.draft_parents.begin(), h.draft_parents.begin() + n_rows);
        for (int32_t i = 0; i < n_rows; ++i) b.output_rows.push_back(i);
        b.start = shape.draft_start(f);
        model.forward(b, kv, out, {.logits = !dv, .end_layer = draft_layers});
        hidden = out.hidden.data();
        full = out.logits.data();
      }
      if (head && !dv) {
        model.lm_head(hidden, n_rows, head_logits.data());
        full = head_logits.data();
      }
      for (int32_t i = 0; i < n_rows && sampled; ++i) {
        const size_t at = size_t(shape.draft_start(f) + i) * ks;
        if (!dv) {
          rank_row(full + size_t(i) * V, V, ks, nullptr, &draft_ids[at], &draft_values[at]);
          continue;
        }
        const int32_t n = dv->rows();
        draft_logits.resize(size_t(std::max(n, 1)));
        if (n > 0)
          scorer.lm_head_rows(hidden + size_t(i) * H_draft, 1, dv->token_of_slot(), n, draft_logits.data());
        rank_row(draft_logits.data(), n, ks, dv->token_of_slot(), &draft_ids[at], &draft_values[at]);
      }
      if (sampled) {
        tree_draw(h.s, m, f);
        tree_absorb(h.s, f);
        continue;
      }
      for (int32_t i = 0; i < n_rows; ++i) {
        int32_t got = 0;
        if (!dv) {
          got = top_k_logprobs(full + size_t(i) * V, V, k, props.data());
        } else if (dv->rows() > 0) {
          const int32_t n = dv->rows();
          draft_logits.resize(size_t(n));
          scorer.lm_head_rows(hidden + size_t(i) * H_draft, 1, dv->token_of_slot(), n, draft_logits.data());
          got = top_k_logprobs(draft_logits.data(), n, k, props.data());
          for (int32_t j = 0; j < got; ++j) props[size_t(j)].token = dv->token_of_slot()[size_t(props[size_t(j)].token)];
        }
        for (int32_t j = 0; j < k; ++j) {
          h.prop_token[size_t(i * k + j)] = j < got ? props[size_t(j)].token : -1;
          h.prop_logprob[size_t(i * k + j)] = j < got ? props[size_t(j)].logprob : 0.0f;
        }
      }
      tree_absorb(h.s, f);
    }
    if (sampled)
      tree_keep_first(h.s);
    else
      for (int32_t c = 0; c < shape.candidates(); ++c) tree_rank(h.s, c);
    tree_lay_out_verification(h.s);
    // 3. The verification of every row, then the acceptance and the cache's compaction.
    verify_forward(model, kv, h.tokens, h.positions, h.parents, h.output_rows, feature_layers, b, out);
    verify_logits = out.logits;
    if (head) verify_features = out.layer_inputs;
    last_tree = h.tree();
    int32_t a = 0;
    if (sampled) {
      for (int32_t r = 0; r < shape.verify_rows(); ++r)
        rank_row(out.logits.data() + size_t(r) * V, V, ks, nullptr, &target_ids[size_t(r) * ks],
                       &target_values[size_t(r) * ks]);
      a = tree_sample_accept(h.s, m);
      last_path.assign(h.keep.begin() + 1, h.keep.begin() + h.n_keep);
      for (int32_t& node : last_path) node -= 1;  // verification row -> node index
    } else {
      for (int32_t r = 0; r < shape.verify_rows(); ++r) h.pred[size_t(r)] = argmax(out.logits.data() + size_t(r) * V, V);
      std::vector<int32_t> emitted;
      accept_greedy(last_tree, std::span<const int32_t>(h.pred).first(size_t(last_tree.size()) + 1), last_path, emitted);
      const int32_t before = h.counter;
      a = tree_accept(h.s);
      EXPECT_EQ(std::vector<int32_t>(h.out_ids.begin() + before, h.out_ids.begin() + h.counter), emitted);
    }
    if (head) head->keep_root(h.head_counters());  // tree_commit kept the head's root row
    // The compaction (the device's kv_compact moves its n_past, which is the state's).
    kv.commit(std::span<const int32_t>(h.keep).first(size_t(h.n_keep)));
    h.n_past += h.n_keep;
    tree_lay_out_root(h.s);
    EXPECT_EQ(kv.n_past(), h.n_past);
    if (draft_model) {  // its cache keeps the accepted text but the newest token
      draft_kv->commit(std::span<const int32_t>(h.dm_keep).first(size_t(h.n_keep)));
      EXPECT_EQ(draft_kv->n_past(), h.n_past - 1) << "the draft model's cache is one token behind the target's";
    }
    if (head) EXPECT_EQ(h.head_n_past, h.n_past - a - 1) << "the head's cache ends where the next catch-up starts";
    EXPECT_EQ(h.counter, h.n_past - n_prompt + 1) << "every emitted token but the newest is in the cache";
    run.accepted += a;
    run.nodes += last_tree.size();
    for (int32_t node : last_path)
      for (int32_t i = 0; i < node; ++i) {
        if (last_tree.nodes[size_t(i)].parent != last_tree.nodes[size_t(node)].parent) continue;
        ++run.later_siblings_accepted;  // an earlier sibling exists
        break;
      }
  }
  run.steps = h.steps;
  run.emitted.assign(h.out_ids.begin(), h.out_ids.begin() + n_predict);
  run.step_counts.assign(h.step_counts.begin(), h.step_counts.begin() + h.steps);
  return run;
}

}  // namespace microspec::test
