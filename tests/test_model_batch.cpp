// Multi-sequence forward calls on the real models: a call that mixes several sequences (their
// prefills in chunks, their draft trees, with or without leading rows resumed after the first
// layers, with or without logits for their first rows) must give each sequence exactly, bit for
// bit, the hidden states and logits it gets when it runs alone. Gemma's sequence runs past the sliding window
// (512 positions), so its local layers mask inside a mixed call too.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>
#include <vector>

#include "gguf/gguf.h"
#include "model/model.h"
#include "support/test_helpers.h"
#include "support/tiny_model.h"
#include "util/error.h"

namespace microspec {
namespace {

// One sequence: a committed prefix, then a token tree in the pending region.
struct SeqCase {
  std::vector<int32_t> prefix;
  std::vector<int32_t> tree_tokens;
  std::vector<int32_t> tree_parents;  // pending index of each node's parent, -1 = the prefix
  std::vector<int32_t> tree_depths;   // 0 for children of the prefix
};

SeqCase make_case(int32_t prefix_len, int32_t seed, int32_t n_vocab, bool chain) {
  SeqCase c;
  uint32_t x = 2654435761u * uint32_t(seed + 1);
  auto next = [&] {
    x = x * 1664525u + 1013904223u;
    return int32_t((x >> 8) % uint32_t(std::min(n_vocab, 30000)));
  };
  for (int32_t i = 0; i < prefix_len; ++i) c.prefix.push_back(next());
  if (chain) {
    for (int32_t i = 0; i < 4; ++i) {
      c.tree_tokens.push_back(next());
      c.tree_parents.push_back(i - 1);
      c.tree_depths.push_back(i);
    }
  } else {  // root ; two children ; two grandchildren under the first, one under the second
    c.tree_parents = {-1, 0, 0, 1, 1, 2};
    c.tree_depths = {0, 1, 1, 2, 2, 2};
    for (size_t i = 0; i < c.tree_parents.size(); ++i) c.tree_tokens.push_back(next());
  }
  return c;
}

void set_tree(const SeqCase& c, Batch& b) {
  b.clear();
  const int32_t P = static_cast<int32_t>(c.prefix.size());
  for (size_t i = 0; i < c.tree_tokens.size(); ++i) {
    b.tokens.push_back(c.tree_tokens[i]);
    b.positions.push_back(P + c.tree_depths[i]);
    b.parents.push_back(c.tree_parents[i]);
    b.output_rows.push_back(static_cast<int32_t>(i));
  }
}

struct SeqResult {
  std::vector<float> prefill_logits;  // [n_vocab] last prefix position
  std::vector<float> tree_hidden;     // [tree][n_embd]
  std::vector<float> tree_logits;     // [tree][n_vocab]
  // The tree again, its leading rows run through the first layers beforehand (as a self-drafter
  // runs them) and resumed in the mixed call (SequenceForward::resumed_rows).
  std::vector<float> resumed_tree_logits;  // [tree][n_vocab]
  // The tree's logits again with the first `logits_from` output rows left out of the LM head
  // (SequenceForward::logits_from: sequence s skips s rows).
  std::vector<float> partial_tree_logits;  // [tree - logits_from][n_vocab]
};

// The sequence alone: its prefix in chunks of `chunk` tokens, then its tree.
SeqResult run_alone(Model& model, const SeqCase& c, int32_t n_ctx, int32_t chunk) {
  KVCache kv = model.make_cache(n_ctx);
  Batch b;
  ForwardOutput out;
  SeqResult r;
  const int32_t P = static_cast<int32_t>(c.prefix.size());
  for (int32_t at = 0; at < P; at += chunk) {
    const int32_t len = std::min(chunk, P - at);
    b.set_sequence(std::span<const int32_t>(c.prefix.data() + at, len), at, false);
    model.forward(b, kv, out, {.logits = at + len == P});
    kv.commit_prefix(len);
  }
  r.prefill_logits = out.logits;
  set_tree(c, b);
  model.forward(b, kv, out, {.logits = true});
  r.tree_hidden = out.hidden;
  r.tree_logits = out.logits;
  return r;
}

// All sequences together: every call carries a prefill chunk of each sequence that still has
// prompt left (chunks of different sizes per sequence, so sequences finish their prefill at
// different calls), and a sequence whose prefill is done waits; then one call with every tree.
std::vector<SeqResult> run_together(Model& model, const std::vector<SeqCase>& cases, int32_t n_ctx) {
  const size_t S = cases.size();
  std::vector<KVCache> kvs;
  for (size_t s = 0; s < S; ++s) kvs.push_back(model.make_cache(n_ctx));
  std::vector<Batch> batches(S);
  std::vector<ForwardOutput> outs(S);
  std::vector<SeqResult> results(S);
  std::vector<int32_t> done(S, 0);
  for (;;) {
    std::vector<SequenceForward> call;
    std::vector<size_t> in_call;
    bool any_last = false;
    for (size_t s = 0; s < S; ++s) {
      const int32_t P = static_cast<int32_t>(cases[s].prefix.size());
      if (done[s] == P) continue;
      const int32_t chunk = 13 + 7 * int32_t(s);  // 13, 20, 27 ...: total stays under n_batch
      const int32_t len = std::min(chunk, P - done[s]);
      batches[s].set_sequence(std::span<const int32_t>(cases[s].prefix.data() + done[s], len), done[s], false);
      call.push_back({.batch = &batches[s], .kv = &kvs[s], .out = &outs[s]});
      in_call.push_back(s);
      any_last |= done[s] + len == P;
    }
    if (call.empty()) break;
    model.forward(call, {.logits = any_last});
    for (size_t s : in_call) {
      const int32_t len = batches[s].size();
      kvs[s].commit_prefix(len);
      done[s] += len;
      if (done[s] == static_cast<int32_t>(cases[s].prefix.size())) results[s].prefill_logits = outs[s].logits;
    }
  }
  std::vector<SequenceForward> call;
  for (size_t s = 0; s < S; ++s) {
    set_tree(cases[s], batches[s]);
    call.push_back({.batch = &batches[s], .kv = &kvs[s], .out = &outs[s]});
  }
  model.forward(call, {.logits = true});
  for (size_t s = 0; s < S; ++s) {
    results[s].tree_hidden = outs[s].hidden;
    results[s].tree_logits = outs[s].logits;
  }
  // The same trees (nothing was committed: the pending slots are written again), now with the
  // leading rows of each sequence run through the first layers on their own first: all rows of
  // sequence 0, half of sequence 1's, none of the others'.
  const int32_t layer = model.config().n_layer / 2;
  std::vector<Batch> lead(S);
  std::vector<ForwardOutput> lead_out(S);
  for (size_t s = 0; s < S; ++s) {
    const int32_t n = batches[s].size(), r = s == 0 ? n : s == 1 ? n / 2 : 0;
    if (r > 0) {
      lead[s].tokens.assign(batches[s].tokens.begin(), batches[s].tokens.begin() + r);
      lead[s].positions.assign(batches[s].positions.begin(), batches[s].positions.begin() + r);
      lead[s].parents.assign(batches[s].parents.begin(), batches[s].parents.begin() + r);
      for (int32_t i = 0; i < r; ++i) lead[s].output_rows.push_back(i);
      model.forward(lead[s], kvs[s], lead_out[s], {.end_layer = layer});
      call[s].resumed_rows = r;
      call[s].resumed_layer = layer;
      call[s].resumed = lead_out[s].residual.data();
    }
  }
  model.forward(call, {.logits = true});
  for (size_t s = 0; s < S; ++s) results[s].resumed_tree_logits = outs[s].logits;
  for (size_t s = 0; s < S; ++s) {
    call[s].resumed_rows = 0;
    call[s].logits_from = static_cast<int32_t>(s);
  }
  model.forward(call, {.logits = true});
  for (size_t s = 0; s < S; ++s) results[s].partial_tree_logits = outs[s].logits;
  return results;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), sizeof(float) * a.size()) == 0;
}

void check_mixed_batch(const std::string& path, int32_t long_prefix) {
  test::require_file(path);
  auto file = GgufFile::open(path);
  ModelOptions opt;
  opt.n_threads = 2;
  opt.n_batch = 64;
  auto model = Model::load(*file, opt);
  const int32_t V = model->config().n_vocab, n_ctx = long_prefix + 32;
  const std::vector<SeqCase> cases = {make_case(21, 1, V, false), make_case(long_prefix, 2, V, true),
                                      make_case(5, 3, V, false)};
  const std::vector<SeqResult> together = run_together(*model, cases, n_ctx);
  for (size_t s = 0; s < cases.size(); ++s) {
    const SeqResult alone = run_alone(*model, cases[s], n_ctx, 64);
    ASSERT_EQ(alone.tree_logits.size(), cases[s].tree_tokens.size() * size_t(V));
    EXPECT_TRUE(bitwise_equal(alone.prefill_logits, together[s].prefill_logits)) << "prefill of sequence " << s;
    EXPECT_TRUE(bitwise_equal(alone.tree_hidden, together[s].tree_hidden)) << "tree hidden of sequence " << s;
    EXPECT_TRUE(bitwise_equal(alone.tree_logits, together[s].tree_logits)) << "tree logits of sequence " << s;
    EXPECT_TRUE(bitwise_equal(alone.tree_logits, together[s].resumed_tree_logits))
        << "tree logits of sequence " << s << " with resumed rows";
    const std::vector<float> tail(alone.tree_logits.begin() + ptrdiff_t(s * V), alone.tree_logits.end());
    EXPECT_TRUE(bitwise_equal(tail, together[s].partial_tree_logits))
        << "tree logits of sequence " << s << " from output row " << s;
  }
}

TEST(ModelBatch, MixedSequencesGiveTheirOwnLogitsSmolLM2) {
  check_mixed_batch(test::smollm_path(), 40);
}

// 600 positions: past Gemma 3's 512-token sliding window.
TEST(ModelBatch, MixedSequencesGiveTheirOwnLogitsGemma3) {
  check_mixed_batch(test::gemma_path(), 600);
}

// The newer architectures on tiny files: phi3 rotates each sequence with the LongRoPE factors its
// own cache calls for, gemma2 soft-caps and slides (window 8) inside a mixed call; qwen3's q/k norms;
// "mistral", a llama file with Mistral's window (8, every layer).
TEST(ModelBatch, MixedSequencesGiveTheirOwnLogitsTinyArchitectures) {
  for (const std::string arch : {"phi3", "gemma2", "qwen3", "mistral"}) {
    test::TinyModelSpec spec;
    spec.arch = arch == "mistral" ? "llama" : arch;
    spec.llama_window = arch == "mistral";
    spec.n_layer = 4;
    const std::string path =
        (std::filesystem::temp_directory_path() / ("microspec_batch_" + arch + ".gguf")).string();
    test::write_tiny_model(spec, path);
    SCOPED_TRACE(arch);
    check_mixed_batch(path, 40);
    std::filesystem::remove(path);
  }
}

// Sequences of one call must not share a cache, and the call must fit n_batch.
TEST(ModelBatch, RefusesSharedCacheAndOversizedCall) {
  test::require_file(test::smollm_path());
  auto file = GgufFile::open(test::smollm_path());
  ModelOptions opt;
  opt.n_threads = 1;
  opt.n_batch = 8;
  auto model = Model::load(*file, opt);
  KVCache kv = model->make_cache(32), kv2 = model->make_cache(32);
  Batch a, b;
  ForwardOutput oa, ob;
  a.set_sequence(std::vector<int32_t>{1, 2, 3}, 0, false);
  b.set_sequence(std::vector<int32_t>{4, 5, 6, 7, 8, 9}, 0, false);
  std::vector<SequenceForward> shared = {{.batch = &a, .kv = &kv, .out = &oa}, {.batch = &a, .kv = &kv, .out = &ob}};
  EXPECT_NE(test::error_of([&] { model->forward(shared, {}); }).find("share a KV cache"), std::string::npos);
  std::vector<SequenceForward> big = {{.batch = &a, .kv = &kv, .out = &oa}, {.batch = &b, .kv = &kv2, .out = &ob}};
  EXPECT_NE(test::error_of([&] { model->forward(big, {}); }).find("exceeds n_batch"), std::string::npos);
  // Logits from an output row the sequence has (or from one past its last: none).
  std::vector<SequenceForward> past_rows = {{.batch = &a, .kv = &kv, .out = &oa, .logits_from = 2}};
  EXPECT_NE(test::error_of([&] { model->forward(past_rows, {.logits = true}); }).find("logits from output row 2 of 1"),
            std::string::npos);
  // Resumed rows: one layer for the whole call, no more rows than the sequence has, from layer 0.
  std::vector<float> streams(size_t(3) * model->config().n_embd);
  Batch c;
  c.set_sequence(std::vector<int32_t>{4, 5, 6}, 0, false);
  std::vector<SequenceForward> uneven = {
      {.batch = &a, .kv = &kv, .out = &oa, .resumed_rows = 1, .resumed_layer = 1, .resumed = streams.data()},
      {.batch = &c, .kv = &kv2, .out = &ob, .resumed_rows = 1, .resumed_layer = 2, .resumed = streams.data()}};
  EXPECT_NE(test::error_of([&] { model->forward(uneven, {}); }).find("different layers"), std::string::npos);
  uneven[1].resumed_layer = 1;
  uneven[0].resumed_rows = 4;
  EXPECT_NE(test::error_of([&] { model->forward(uneven, {}); }).find("resumed rows 4"), std::string::npos);
  uneven[0].resumed_rows = 1;
  EXPECT_NE(test::error_of([&] { model->forward(uneven, {.end_layer = 0}); }).find("past the call"),
            std::string::npos);
}

}  // namespace
}  // namespace microspec
