// Greedy speculative decoding is lossless because of one property: the logits row that
// verification computes for a tree node equals, bit for bit, the row plain decoding computes when
// it reaches the same position after the same tokens one at a time. This checks that property
// directly on both real models: prompts encoded from text, random trees of up to 12 nodes (random
// shapes and tokens, verified in one forward as the speculative generator does: the root is the
// last committed-to-be token, the nodes hang below it), and for every node a reference that
// decodes the node's root-to-node path one token per forward call from the same committed prompt.
// Verification runs on repacked weights (the default), plain decoding on the file's layout
// (--no-repack). Two loads of each model (one mapping).
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gguf/gguf.h"
#include "model/model.h"
#include "support/test_helpers.h"
#include "tokenizer/tokenizer.h"

namespace microspec {
namespace {

const char* const kPrompts[] = {
    "Explain how a refrigerator keeps food cold, step by step.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Translate to French: The library opens at nine and closes at six on weekdays.",
};
constexpr int kTreesPerPrompt = 3;
constexpr int32_t kMaxNodes = 12;  // besides the root
constexpr int32_t kCtx = 128;

struct RandomTree {
  std::vector<int32_t> tokens;   // [1 + nodes]: the root first
  std::vector<int32_t> parents;  // [1 + nodes]: -1 for the root, else an earlier index
  std::vector<int32_t> depths;   // [1 + nodes]: 0 for the root
};

RandomTree random_tree(std::mt19937& rng, int32_t root_token, int32_t n_vocab) {
  RandomTree t{{root_token}, {-1}, {0}};
  const int32_t n = 1 + int32_t(rng() % kMaxNodes);
  for (int32_t i = 1; i <= n; ++i) {
    const int32_t parent = int32_t(rng() % i);
    t.tokens.push_back(int32_t(rng() % uint32_t(n_vocab)));
    t.parents.push_back(parent);
    t.depths.push_back(t.depths[parent] + 1);
  }
  return t;
}

void check_rows_bit_exact(const std::string& path) {
  test::require_file(path);
  std::unique_ptr<GgufFile> file = GgufFile::open(path);
  ModelOptions opt;
  opt.n_threads = 2;
  std::unique_ptr<Model> model = Model::load(*file, opt);
  // Plain decoding runs on the mapped file's bytes as stored (--no-repack), verification on the
  // default (the quantized matrices repacked into the interleaved layout): rows equal across both.
  ModelOptions plain_opt = opt;
  plain_opt.repack = false;
  std::unique_ptr<Model> plain = Model::load(*file, plain_opt);
  ASSERT_EQ(plain->repacked_bytes(), 0u);
  std::unique_ptr<Tokenizer> tok = Tokenizer::from_gguf(*file);
  const int32_t V = model->config().n_vocab;
  std::mt19937 rng(1234);
  KVCache verify_kv = model->make_cache(kCtx), decode_kv = plain->make_cache(kCtx);
  Batch b;
  ForwardOutput out;
  int checked = 0;
  for (const char* text : kPrompts) {
    std::vector<int32_t> prompt = tok->encode(text, true, false);
    ASSERT_GE(prompt.size(), 8u);
    const int32_t root_token = prompt.back();
    prompt.pop_back();
    const int32_t P = int32_t(prompt.size());
    for (auto [m, kv] : {std::pair{model.get(), &verify_kv}, std::pair{plain.get(), &decode_kv}}) {
      kv->clear();
      b.set_sequence(prompt, 0, false);
      m->forward(b, *kv, out);
      kv->commit_prefix(P);
    }
    for (int trial = 0; trial < kTreesPerPrompt; ++trial) {
      const RandomTree t = random_tree(rng, root_token, V);
      const int32_t n = int32_t(t.tokens.size());
      // Verification: the whole tree in one forward, every row's logits.
      verify_kv.truncate(P);
      b.clear();
      b.start = 0;
      for (int32_t i = 0; i < n; ++i) {
        b.tokens.push_back(t.tokens[i]);
        b.positions.push_back(P + t.depths[i]);
        b.parents.push_back(t.parents[i]);
        b.output_rows.push_back(i);
      }
      model->forward(b, verify_kv, out, {.logits = true});
      const std::vector<float> rows = out.logits;
      ASSERT_EQ(rows.size(), size_t(n) * V);
      // Plain decoding of each node's path, one token per forward call.
      for (int32_t i = 0; i < n; ++i) {
        std::vector<int32_t> path;
        for (int32_t p = i; p >= 0; p = t.parents[p]) path.insert(path.begin(), t.tokens[p]);
        decode_kv.truncate(P);
        for (int32_t token : path) {
          b.set_sequence(std::span<const int32_t>(&token, 1), decode_kv.n_past(), false);
          plain->forward(b, decode_kv, out, {.logits = true});
          decode_kv.commit_prefix(1);
        }
        ASSERT_EQ(std::memcmp(out.logits.data(), rows.data() + size_t(i) * V, sizeof(float) * V), 0)
            << testing::PrintToString(path) << ": prompt \"" << text << "\", tree " << trial << ", node " << i << " (depth " << t.depths[i]
            << "): the verification row differs from plain decoding's";
        ++checked;
      }
    }
  }
  std::printf("%s: %d verification rows (%zu bytes of weights repacked) equal plain decoding's (not repacked) "
              "bit for bit\n",
              path.c_str(), checked, model->repacked_bytes());
}

TEST(VerifyBitExact, SmolLM2RowsEqualPlainDecoding) {
  check_rows_bit_exact(test::smollm_path());
}

TEST(VerifyBitExact, Gemma3RowsEqualPlainDecoding) {
  check_rows_bit_exact(test::gemma_path());
}

}  // namespace
}  // namespace microspec
