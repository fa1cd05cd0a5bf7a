#pragma once
// What the tests of speculative sampling on the device-resident chain (speculative/chain_sampling.h)
// share: the resident sampled step driven on the host with CPU models doing the forwards the device
// launches (CudaModel::enqueue_chain_step's sampled variant), which tests/test_spec_chain_sampling.cpp
// checks against the CPU Decoder token for token and tests/cuda/ checks the device against.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "model/model.h"
#include "sampling/ranked_draw.h"
#include "sampling/sampler.h"
#include "speculative/chain_sampling.h"
#include "speculative/chain_state.h"
#include "speculative/tree.h"
#include "vocab/draft_vocab.h"
#include "resident_step.h"

namespace microspec::test {

// top_k_rows on the host: row[0, n)'s k best (value descending, then index ascending; NaN never,
// -inf kept), as ids through `map` (null: the index), then -1 / -inf past the non-NaN values.
inline void rank_row(const float* row, int32_t n, int32_t k, const int32_t* map, int32_t* ids, float* values) {
  std::vector<int32_t> order;
  for (int32_t i = 0; i < n; ++i)
    if (!std::isnan(row[i])) order.push_back(i);
  const size_t kept = std::min(order.size(), size_t(k));
  std::partial_sort(order.begin(), order.begin() + kept, order.end(),
                    [&](int32_t a, int32_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
  for (int32_t j = 0; j < k; ++j) {
    const bool in = size_t(j) < kept;
    ids[j] = in ? (map ? map[order[j]] : order[j]) : -1;
    values[j] = in ? row[order[j]] : -std::numeric_limits<float>::infinity();
  }
}

// The two settings the resident sampled steps are checked with: top-k 8 with top-p at a low
// temperature, top-k 40 without top-p at a high one.
inline std::vector<SamplingParams> sampled_settings() {
  return {{.temperature = 0.8f, .top_k = 8, .top_p = 0.95f, .seed = 3},
          {.temperature = 1.3f, .top_k = 40, .top_p = 1.0f, .seed = 11}};
}

inline std::vector<uint64_t> bits_of(uint64_t seed, size_t n) {
  std::mt19937_64 rng(seed);
  std::vector<uint64_t> out(n);
  for (uint64_t& b : out) b = rng();
  return out;
}

// The resident sampled step on the host with CPU models doing the forwards: the self-draft (the
// target's first draft_layers layers), a draft model or an EAGLE-3 head (head_path: its file; its
// rows scored by the target's LM head), the full head or a pruned vocabulary as the device keeps it; each draft row and verification row ranked as top_k_rows ranks it, chain_draw
// after each draft forward, chain_sample_accept after the verification. tree: the CPU decoder's
// chain (top-k 1; the device's depth is min(depth + 1, total_tokens)).
inline std::vector<int32_t> run_resident_sampled(Model& model, const std::vector<int32_t>& prompt, int32_t n_predict,
                                          const TreeParams& tree, int32_t draft_layers,
                                          const std::optional<PrunedVocabSpec>& spec, Model* draft_model,
                                          const std::string& head_path, const SamplingParams& sp,
                                          int32_t* accepted_total) {
  const int32_t V = model.config().n_vocab, n_prompt = int32_t(prompt.size()), k = sp.top_k;
  const int32_t depth = std::min(tree.depth + 1, tree.total_tokens);
  KVCache kv = model.make_cache(512);
  Batch b;
  ForwardOutput out;
  Model& drafter = draft_model ? *draft_model : model;
  std::optional<ResidentDraftModel> dm;
  if (draft_model) dm.emplace(*draft_model, prompt, depth);
  std::optional<ResidentChainHead> head;
  std::span<const int32_t> feature_layers;  // what the forwards capture for the head
  if (!head_path.empty()) {
    head.emplace(head_path, model, depth);
    feature_layers = head->feature_layers();
  }

  ChainArrays arrays;
  ChainState cs = arrays.state(depth, n_predict + depth + 1);
  if (dm) cs.draft = dm->batch();
  // The samplers' bits: the first token's draw, then at most depth + 1 per step; the draft's
  // tree.depth + 1 per step.
  const DrawSettings settings{sp.temperature, sp.top_p};
  const std::vector<uint64_t> target_bits = bits_of(sp.seed, size_t(1 + n_predict * (depth + 1)));
  const std::vector<uint64_t> draft_bits = bits_of(draft_sampler_seed(sp.seed), size_t(n_predict * (tree.depth + 1)));
  std::vector<int32_t> draft_ids(size_t(depth) * k), target_ids(size_t(depth + 1) * k);
  std::vector<float> draft_values(draft_ids.size()), target_values(target_ids.size());
  int32_t draft_drawn = 0, target_drawn = 0;
  const ChainSampling m{&settings, k, draft_ids.data(), draft_values.data(), target_ids.data(), target_values.data(),
                        draft_bits.data(), &draft_drawn, tree.depth + 1, target_bits.data(), &target_drawn};

  // Prefill: the first token is the target's draw 0 from the prompt's last row.
  b.set_sequence(prompt, 0, true);
  model.forward(b, kv, out, {.logits = true, .capture_layers = feature_layers});
  kv.commit_prefix(n_prompt);
  arrays.n_past = n_prompt;
  rank_row(out.logits.data() + size_t(n_prompt - 1) * V, V, k, nullptr, target_ids.data(), target_values.data());
  const auto first_logit = [&](int32_t i) { return target_values[size_t(i)]; };
  arrays.tokens[0] = target_ids[size_t(draw_ranked(ranked_count(target_ids.data(), target_values.data(), k), first_logit,
                                                   settings, target_bits[size_t(target_drawn++)]))];
  arrays.out_ids[size_t(arrays.counter++)] = arrays.tokens[0];
  std::unique_ptr<test::ResidentVocab> dv;
  if (spec) dv = std::make_unique<test::ResidentVocab>(V, *spec, prompt, out.logits.data());
  if (head) {
    head->begin(prompt, out.layer_inputs.data());
    arrays.pred[0] = arrays.tokens[0];
    cs.head = head->batch();
  }
  cs.draft_rows = dv ? dv->rows_counter() : nullptr;
  cs.kver_last_only = dv && dv->kver_last_only();
  chain_begin(cs);

  std::vector<float> verify_logits, draft_logits(static_cast<size_t>(V));
  std::vector<int32_t> rows;
  *accepted_total = 0;
  while (arrays.counter < n_predict) {
    // 1. The vocabulary's update from the previous verification.
    if (dv && dv->takes_steps()) {
      rows.clear();
      for (int32_t r = 0; r < arrays.update.n_rows; ++r) rows.push_back(arrays.update.first_row + r);
      dv->device_step(arrays.tokens.data() + 1, arrays.update.n_tree, verify_logits.data(), rows);
    }
    // 2. Drafts: each row's k best over the draft head (the drafter's LM head, the target's for a
    //    head), then the draw. A head's draft 0 is its catch-up's root row.
    for (int32_t d = 0; d < depth; ++d) {
      const float* hidden = nullptr;      // the row's normed output
      const float* full_logits = nullptr;  // its logits over the full head
      if (head) {
        hidden = d == 0 ? head->catch_up(cs, arrays.pred, b) : head->draft(d, arrays.tokens, b);
        if (!dv) {
          model.lm_head(hidden, 1, draft_logits.data());
          full_logits = draft_logits.data();
        }
      } else {
        if (dm)
          dm->forward(d, arrays.tokens, /*logits=*/!dv, b, out);
        else
          self_draft_forward(model, kv, d, arrays.tokens.data(), arrays.positions.data(), arrays.parents.data(),
                             draft_layers, !dv, b, out);
        hidden = out.hidden.data();
        full_logits = out.logits.data();
      }
      int32_t* ids = &draft_ids[size_t(d) * k];
      float* values = &draft_values[size_t(d) * k];
      if (!dv) {
        rank_row(full_logits, V, k, nullptr, ids, values);
      } else {
        const int32_t n = dv->rows();
        if (n > 0) drafter.lm_head_rows(hidden, 1, dv->token_of_slot(), n, draft_logits.data());
        rank_row(draft_logits.data(), n, k, dv->token_of_slot(), ids, values);
      }
      chain_draw(cs, m, d);
    }
    // 3. Verification: every row's k best.
    verify_forward(model, kv, arrays.tokens, arrays.positions, arrays.parents, arrays.output_rows, feature_layers, b, out);
    for (int32_t i = 0; i <= depth; ++i)
      rank_row(out.logits.data() + size_t(i) * V, V, k, nullptr, &target_ids[size_t(i) * k],
               &target_values[size_t(i) * k]);
    verify_logits = out.logits;
    // 4. Acceptance: the caches keep what chain_sample_accept committed.
    const int32_t before = arrays.n_past, draft_before = dm ? dm->n_past : 0;
    const int32_t accepted = chain_sample_accept(cs, m);
    *accepted_total += accepted;
    kv.commit_prefix(arrays.n_past - before);
    if (dm) dm->kv.commit_prefix(dm->n_past - draft_before);
    if (head) head->accepted(accepted, arrays.n_past, out.layer_inputs);
  }
  return std::vector<int32_t>(arrays.out_ids.begin(), arrays.out_ids.begin() + n_predict);
}

}  // namespace microspec::test
