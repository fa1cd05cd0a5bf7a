// The tree-shaped forward pass and KV compaction against plain sequential runs, on the real models:
// a token tree must give each node the logits that running its root-to-node path alone gives.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "gguf/gguf.h"
#include "model/model.h"
#include "support/test_helpers.h"
#include "util/error.h"

namespace microspec {
namespace {

struct Loaded {
  std::unique_ptr<GgufFile> file;
  std::unique_ptr<Model> model;
};

Loaded load(const std::string& path, int threads = 2) {
  Loaded l;
  l.file = GgufFile::open(path);
  ModelOptions opt;
  opt.n_threads = threads;
  opt.n_batch = 64;
  l.model = Model::load(*l.file, opt);
  return l;
}

// Logits of the last token of `seq`, computed by one sequential forward from an empty cache.
std::vector<float> sequential_last_logits(Model& model, const std::vector<int32_t>& seq, int32_t n_ctx) {
  KVCache kv = model.make_cache(n_ctx);
  Batch b;
  ForwardOutput out;
  b.set_sequence(seq, 0, false);
  model.forward(b, kv, out, {.logits = true});
  return out.logits;
}

float max_abs_diff(const float* a, const float* b, size_t n) {
  float m = 0;
  for (size_t i = 0; i < n; ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

// Prefix (committed), then a tree in the pending region:
//   node 0 (root) ; 1,2 children of 0 ; 3,4 children of 1 ; 5 child of 2 ; 6 child of 5
// Written in two forward calls (nodes 0-2, then 3-6 with start = 3) as a drafter would.
void check_tree_equivalence(const std::string& path) {
  test::require_file(path);
  Loaded l = load(path);
  Model& model = *l.model;
  const int32_t V = model.config().n_vocab;
  const std::vector<int32_t> prefix = {17, 523, 1045, 88, 2047, 9, 301, 4242, 77, 1500, 612, 13};
  const std::vector<int32_t> node_tok = {900, 1200, 33, 4100, 58, 707, 2600};
  const std::vector<int32_t> parent = {-1, 0, 0, 1, 1, 2, 5};
  const std::vector<int32_t> depth = {0, 1, 1, 2, 2, 2, 3};
  const int32_t n_ctx = 64, P = static_cast<int32_t>(prefix.size());

  KVCache kv = model.make_cache(n_ctx);
  Batch b;
  ForwardOutput out;
  b.set_sequence(prefix, 0, false);
  model.forward(b, kv, out);
  kv.commit_prefix(P);

  std::vector<std::vector<float>> tree_logits(node_tok.size());
  auto run_nodes = [&](int32_t first, int32_t last) {
    b.clear();
    b.start = first;
    for (int32_t i = first; i <= last; ++i) {
      b.tokens.push_back(node_tok[i]);
      b.positions.push_back(P + depth[i]);
      b.parents.push_back(parent[i]);
      b.output_rows.push_back(i - first);
    }
    model.forward(b, kv, out, {.logits = true});
    for (int32_t i = first; i <= last; ++i)
      tree_logits[i].assign(out.logits.begin() + size_t(i - first) * V,
                            out.logits.begin() + size_t(i - first + 1) * V);
  };
  run_nodes(0, 2);
  run_nodes(3, 6);

  for (size_t i = 0; i < node_tok.size(); ++i) {
    std::vector<int32_t> path;
    for (int32_t p = static_cast<int32_t>(i); p >= 0; p = parent[p]) path.insert(path.begin(), node_tok[p]);
    std::vector<int32_t> seq = prefix;
    seq.insert(seq.end(), path.begin(), path.end());
    std::vector<float> ref = sequential_last_logits(model, seq, n_ctx);
    EXPECT_LT(max_abs_diff(ref.data(), tree_logits[i].data(), V), 2e-3f) << "node " << i;
  }

  // Accept the path 0 -> 2 -> 5 and continue with one more token: the compacted cache must behave
  // exactly like a cache that only ever saw prefix + path.
  const std::vector<int32_t> keep = {0, 2, 5};
  kv.commit(keep);
  ASSERT_EQ(kv.n_past(), P + 3);
  const int32_t next = 321;
  b.set_sequence(std::vector<int32_t>{next}, kv.n_past(), false);
  model.forward(b, kv, out, {.logits = true});
  std::vector<int32_t> seq = prefix;
  for (int32_t k : keep) seq.push_back(node_tok[k]);
  seq.push_back(next);
  std::vector<float> ref = sequential_last_logits(model, seq, n_ctx);
  EXPECT_LT(max_abs_diff(ref.data(), out.logits.data(), V), 2e-3f);
}

TEST(ModelTree, TreeForwardMatchesPathsSmolLM2) {
  check_tree_equivalence(test::smollm_path());
}
TEST(ModelTree, TreeForwardMatchesPathsGemma3) {
  check_tree_equivalence(test::gemma_path());
}

// The LM head on a subset of rows equals the same rows of the full head.
TEST(ModelTree, LmHeadRowsMatchFullHead) {
  test::require_file(test::smollm_path());
  Loaded l = load(test::smollm_path());
  Model& model = *l.model;
  const int32_t V = model.config().n_vocab, d = model.config().n_embd;
  KVCache kv = model.make_cache(32);
  Batch b;
  ForwardOutput out;
  b.set_sequence(std::vector<int32_t>{1, 2, 3, 4, 5}, 0, true);
  model.forward(b, kv, out, {.logits = true});
  const std::vector<int32_t> rows = {0, 7, 49151, 1234, 42, 42};
  std::vector<float> sub(rows.size() * 5);
  model.lm_head_rows(out.hidden.data(), 5, rows.data(), static_cast<int32_t>(rows.size()), sub.data());
  for (int32_t t = 0; t < 5; ++t)
    for (size_t j = 0; j < rows.size(); ++j)
      EXPECT_FLOAT_EQ(sub[t * rows.size() + j], out.logits[size_t(t) * V + rows[j]]) << t << "," << j;
  (void)d;
}

// A layer-limited forward (a self-drafter's first N layers) leaves later layers' cache rows alone
// and differs from the full model's output.
TEST(ModelTree, LayerLimitRunsOnlyFirstLayers) {
  test::require_file(test::smollm_path());
  Loaded l = load(test::smollm_path());
  Model& model = *l.model;
  KVCache kv = model.make_cache(32);
  Batch b;
  ForwardOutput full, partial;
  b.set_sequence(std::vector<int32_t>{10, 20, 30}, 0, false);
  model.forward(b, kv, full, {.logits = true, .end_layer = ForwardOptions::kAllLayers});
  const int32_t last = model.config().n_layer - 1;
  std::vector<uint16_t> k_last(kv.k(last, 2), kv.k(last, 2) + kv.kv_dim());
  b.set_sequence(std::vector<int32_t>{11, 21, 31}, 0, false);
  model.forward(b, kv, partial, {.logits = true, .end_layer = 4});
  EXPECT_EQ(0, std::memcmp(k_last.data(), kv.k(last, 2), kv.row_bytes()));
  EXPECT_GT(max_abs_diff(full.logits.data(), partial.logits.data(), full.logits.size()), 1e-2f);
}

TEST(ModelTree, RejectsBadBatches) {
  test::require_file(test::smollm_path());
  Loaded l = load(test::smollm_path());
  Model& model = *l.model;
  KVCache kv = model.make_cache(8);
  Batch b;
  ForwardOutput out;
  b.set_sequence(std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 8, 9}, 0, false);
  EXPECT_THROW(model.forward(b, kv, out), Error);  // does not fit the cache
  b.set_sequence(std::vector<int32_t>{1, 49152}, 0, false);
  EXPECT_THROW(model.forward(b, kv, out), Error);  // token outside the vocabulary
  b.set_sequence(std::vector<int32_t>{1, 2}, 0, false);
  b.parents[0] = 1;  // parent not written yet
  EXPECT_THROW(model.forward(b, kv, out), Error);
}

// A pending slot's parent is an earlier pending slot or none: the cache refuses anything else, so
// the walk up a chain of ancestors in visible_keys always ends.
TEST(KVCache, SlotMetaKeepsAncestorChainsAcyclic) {
  KVCache kv(/*n_layer=*/1, /*n_ctx=*/8, /*kv_dim=*/4);
  kv.commit_prefix(2);  // slots 0, 1 committed; pending slots start at 2
  kv.set_slot_meta(2, 2, -1);
  kv.set_slot_meta(3, 3, 0);
  kv.set_slot_meta(4, 3, -1);
  EXPECT_THROW(kv.set_slot_meta(5, 4, 3), Error);   // itself
  EXPECT_THROW(kv.set_slot_meta(4, 4, 2), Error);   // a later slot
  EXPECT_THROW(kv.set_slot_meta(4, 4, -2), Error);  // not a slot
  EXPECT_THROW(kv.set_slot_meta(1, 1, -1), Error);  // a committed slot
  EXPECT_THROW(kv.set_slot_meta(8, 8, 0), Error);   // past the cache
  std::vector<uint8_t> seen(5, 9);
  kv.visible_keys(/*pending=*/1, /*qpos=*/3, /*window=*/0, /*n_keys=*/5, seen.data());
  EXPECT_EQ(seen, (std::vector<uint8_t>{1, 1, 1, 1, 0}));
  kv.visible_keys(/*pending=*/2, /*qpos=*/3, /*window=*/0, /*n_keys=*/5, seen.data());
  EXPECT_EQ(seen, (std::vector<uint8_t>{1, 1, 0, 0, 1}));
}

}  // namespace
}  // namespace microspec
