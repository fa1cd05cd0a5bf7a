// Model behaviour on tiny random models the test writes: the sliding window's reach, tree forwards
// that straddle the window, and the Qwen2 / untied-output paths the real models do not exercise.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <vector>

#include "gguf/gguf.h"
#include "model/model.h"
#include "support/tiny_model.h"
#include "util/error.h"

namespace microspec {
namespace {

struct Tiny {
  std::string path;
  std::unique_ptr<GgufFile> file;
  std::unique_ptr<Model> model;
  explicit Tiny(const test::TinyModelSpec& spec) {
    path = (std::filesystem::temp_directory_path() /
            ("microspec_tiny_" + spec.arch + "_" + std::to_string(spec.n_layer) + "_" +
             std::to_string(::getpid()) + ".gguf"))
               .string();
    test::write_tiny_model(spec, path);
    file = GgufFile::open(path);
    ModelOptions opt;
    opt.n_threads = 2;
    opt.n_batch = 128;
    model = Model::load(*file, opt);
  }
  ~Tiny() { std::filesystem::remove(path); }
};

std::vector<float> last_logits(Model& m, const std::vector<int32_t>& seq) {
  KVCache kv = m.make_cache(256);
  Batch b;
  ForwardOutput out;
  b.set_sequence(seq, 0, false);
  m.forward(b, kv, out, {.logits = true});
  return out.logits;
}

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  float m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

std::vector<int32_t> random_tokens(int n, int vocab, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = static_cast<int32_t>(rng() % vocab);
  return t;
}

// With only sliding layers (window 8, 3 layers), the last token can see at most 3 * 7 positions
// back; a change further back must not move its logits, a change inside the reach must.
TEST(ModelTiny, SlidingWindowLimitsReach) {
  test::TinyModelSpec spec;
  spec.n_layer = 3;  // layers 0-2 are all sliding (pattern il % 6 < 5)
  Tiny t(spec);
  std::vector<int32_t> seq = random_tokens(40, spec.n_vocab, 7);
  const std::vector<float> base = last_logits(*t.model, seq);
  std::vector<int32_t> far = seq;
  far[39 - 22] = (far[39 - 22] + 1) % spec.n_vocab;  // 22 positions back: out of reach
  EXPECT_EQ(max_abs_diff(base, last_logits(*t.model, far)), 0.0f);
  std::vector<int32_t> near = seq;
  near[39 - 5] = (near[39 - 5] + 1) % spec.n_vocab;
  EXPECT_GT(max_abs_diff(base, last_logits(*t.model, near)), 1e-4f);
}

// Layer 5 of a 6-layer Gemma 3 is global: then a change anywhere in the past moves the logits.
TEST(ModelTiny, GlobalLayerSeesEverything) {
  test::TinyModelSpec spec;
  spec.n_layer = 6;
  Tiny t(spec);
  std::vector<int32_t> seq = random_tokens(40, spec.n_vocab, 8);
  const std::vector<float> base = last_logits(*t.model, seq);
  seq[1] = (seq[1] + 1) % spec.n_vocab;
  EXPECT_GT(max_abs_diff(base, last_logits(*t.model, seq)), 1e-5f);
}

// Mistral's window (llama.attention.sliding_window) slides every layer: a one-layer model's last
// token (position 39) sees positions 39 - 7 .. 39 and not 39 - 8 (i - j < window, as transformers
// masks); three layers reach 3 * 7 back. The same file without the key sees everything (llama.cpp).
TEST(ModelTiny, MistralWindowOnEveryLlamaLayer) {
  for (const int32_t n_layer : {1, 3}) {
    test::TinyModelSpec spec;
    spec.arch = "llama";
    spec.llama_window = true;
    spec.n_layer = n_layer;
    Tiny t(spec);
    ASSERT_EQ(t.model->config().sliding_window, 8);
    for (int32_t il = 0; il < n_layer; ++il) EXPECT_TRUE(t.model->config().layer_is_sliding[il]);
    const std::vector<int32_t> seq = random_tokens(40, spec.n_vocab, 7);
    const std::vector<float> base = last_logits(*t.model, seq);
    const auto moved_by = [&](int32_t back) {
      std::vector<int32_t> changed = seq;
      changed[39 - back] = (changed[39 - back] + 1) % spec.n_vocab;
      return max_abs_diff(base, last_logits(*t.model, changed));
    };
    const int32_t reach = n_layer * 7;
    EXPECT_GT(moved_by(reach), 1e-4f) << n_layer << " layers";
    EXPECT_EQ(moved_by(reach + 1), 0.0f) << n_layer << " layers";
  }
  test::TinyModelSpec spec;
  spec.arch = "llama";
  spec.n_layer = 1;
  Tiny t(spec);  // no window key: the whole context
  EXPECT_EQ(t.model->config().sliding_window, 0);
  std::vector<int32_t> seq = random_tokens(40, spec.n_vocab, 7);
  const std::vector<float> base = last_logits(*t.model, seq);
  seq[1] = (seq[1] + 1) % spec.n_vocab;
  EXPECT_GT(max_abs_diff(base, last_logits(*t.model, seq)), 1e-5f);
}

// A token tree whose nodes sit past the window edge (prefix 30 tokens, window 8) gives each node
// the logits of its path run alone; then commit a path and continue.
void check_tree(const test::TinyModelSpec& spec) {
  Tiny t(spec);
  Model& m = *t.model;
  const int32_t V = spec.n_vocab;
  const std::vector<int32_t> prefix = random_tokens(30, V, 3);
  const std::vector<int32_t> tok = {5, 17, 99, 240, 3, 77, 150, 201};
  const std::vector<int32_t> parent = {-1, 0, 0, 1, 1, 3, 2, 6};
  std::vector<int32_t> depth(tok.size());
  for (size_t i = 0; i < tok.size(); ++i) depth[i] = parent[i] < 0 ? 0 : depth[parent[i]] + 1;

  KVCache kv = m.make_cache(256);
  Batch b;
  ForwardOutput out;
  b.set_sequence(prefix, 0, false);
  m.forward(b, kv, out);
  kv.commit_prefix(static_cast<int32_t>(prefix.size()));
  b.clear();
  for (size_t i = 0; i < tok.size(); ++i) {
    b.tokens.push_back(tok[i]);
    b.positions.push_back(static_cast<int32_t>(prefix.size()) + depth[i]);
    b.parents.push_back(parent[i]);
    b.output_rows.push_back(static_cast<int32_t>(i));
  }
  m.forward(b, kv, out, {.logits = true});
  for (size_t i = 0; i < tok.size(); ++i) {
    std::vector<int32_t> seq = prefix, path;
    for (int32_t p = static_cast<int32_t>(i); p >= 0; p = parent[p]) path.insert(path.begin(), tok[p]);
    seq.insert(seq.end(), path.begin(), path.end());
    std::vector<float> ref = last_logits(m, seq);
    std::vector<float> got(out.logits.begin() + i * V, out.logits.begin() + (i + 1) * V);
    EXPECT_LT(max_abs_diff(ref, got), 1e-4f) << spec.arch << " node " << i;
  }
  const std::vector<int32_t> keep = {0, 1, 3, 5};
  kv.commit(keep);
  b.set_sequence(std::vector<int32_t>{42, 43}, kv.n_past(), false);
  m.forward(b, kv, out, {.logits = true});
  std::vector<int32_t> seq = prefix;
  for (int32_t k : keep) seq.push_back(tok[k]);
  seq.push_back(42);
  seq.push_back(43);
  std::vector<float> ref = last_logits(m, seq);
  EXPECT_LT(max_abs_diff(ref, out.logits), 1e-4f) << spec.arch << " after commit";
}

TEST(ModelTiny, TreeStraddlingSlidingWindowGemma3) {
  test::TinyModelSpec spec;
  spec.n_layer = 6;
  check_tree(spec);
}

TEST(ModelTiny, TreeQwen2WithBiasesAndUntiedOutput) {
  test::TinyModelSpec spec;
  spec.arch = "qwen2";
  spec.untied_output = true;
  spec.weight_type = GgmlType::Q4_K;
  spec.n_embd = 256;
  spec.n_ff = 512;
  spec.head_dim = 64;
  check_tree(spec);
}

TEST(ModelTiny, TreeLlama) {
  test::TinyModelSpec spec;
  spec.arch = "llama";
  spec.weight_type = GgmlType::Q4_1;
  check_tree(spec);
}

TEST(ModelTiny, TreeStraddlingMistralWindow) {
  test::TinyModelSpec spec;
  spec.arch = "llama";
  spec.llama_window = true;
  check_tree(spec);
}

// The newer architectures' trees: q/k norms (qwen3); soft-capped attention and logits with a window
// on even layers (gemma2, 4 layers, window 8 so the tree straddles it); fused QKV and gate/up,
// partial rotary and LongRoPE's long factors (phi3: the 256-slot cache exceeds its original
// context of 64); Llama 3's frequency divisors (llama + rope_freqs).
TEST(ModelTiny, TreeQwen3) {
  test::TinyModelSpec spec;
  spec.arch = "qwen3";
  check_tree(spec);
}

TEST(ModelTiny, TreeGemma2SoftCapsAndWindow) {
  test::TinyModelSpec spec;
  spec.arch = "gemma2";
  spec.n_layer = 4;
  check_tree(spec);
}

TEST(ModelTiny, TreePhi3FusedPartialRotaryLongRope) {
  test::TinyModelSpec spec;
  spec.arch = "phi3";
  spec.untied_output = true;
  check_tree(spec);
}

TEST(ModelTiny, TreeLlama3RopeFreqs) {
  test::TinyModelSpec spec;
  spec.arch = "llama";
  spec.llama3_rope = true;
  check_tree(spec);
}

// Gemma 2 soft-caps its logits at 20 in every LM-head path: the full head, chosen rows, and rows
// packed into a draft vocabulary's own matrix give the same (capped) values.
TEST(ModelTiny, Gemma2FinalSoftCapInEveryHeadPath) {
  test::TinyModelSpec spec;
  spec.arch = "gemma2";
  spec.n_layer = 4;
  Tiny t(spec);
  Model& m = *t.model;
  const int32_t V = spec.n_vocab, d = spec.n_embd;
  std::vector<float> hidden(static_cast<size_t>(d));
  for (int32_t i = 0; i < d; ++i) hidden[i] = 40.0f * std::sin(0.7f * float(i));  // large: logits cap
  std::vector<float> full(static_cast<size_t>(V));
  m.lm_head(hidden.data(), 1, full.data());
  float top = 0.0f;
  for (float x : full) {
    ASSERT_LT(std::fabs(x), 20.0f);
    top = std::max(top, std::fabs(x));
  }
  EXPECT_GT(top, 15.0f) << "the test's hidden state should push logits into the cap";
  const std::vector<int32_t> rows = {0, 7, 100, V - 1};
  std::vector<float> some(rows.size());
  m.lm_head_rows(hidden.data(), 1, rows.data(), static_cast<int32_t>(rows.size()), some.data());
  const QMatrix& head = m.output_matrix();
  std::vector<uint8_t> packed_bytes(rows.size() * head.row_stride);
  for (size_t j = 0; j < rows.size(); ++j)
    std::memcpy(packed_bytes.data() + j * head.row_stride, head.data + size_t(rows[j]) * head.row_stride,
                head.row_stride);
  QMatrix packed = head;
  packed.data = packed_bytes.data();
  packed.rows = static_cast<int64_t>(rows.size());
  std::vector<float> from_packed(rows.size());
  m.lm_head_packed(hidden.data(), 1, packed, from_packed.data());
  for (size_t j = 0; j < rows.size(); ++j) {
    EXPECT_EQ(some[j], full[rows[j]]) << "row " << rows[j];
    EXPECT_EQ(from_packed[j], full[rows[j]]) << "row " << rows[j];
  }
}

TEST(ModelTiny, WrongTensorShapeIsAClearError) {
  test::TinyModelSpec spec;
  spec.arch = "llama";
  spec.n_head = 4;
  spec.n_head_kv = 2;
  spec.declared_n_head = 6;  // the metadata claims 6 heads of 32; attn_q holds 4
  const std::string path = (std::filesystem::temp_directory_path() / "microspec_tiny_badshape.gguf").string();
  test::write_tiny_model(spec, path);
  auto file = GgufFile::open(path);
  ModelOptions opt;
  opt.n_threads = 1;
  try {
    Model::load(*file, opt);
    ADD_FAILURE() << "a model whose attn_q does not match head_count loaded";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("blk.0.attn_q.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("expected [64, 192]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[64, 128]"), std::string::npos) << msg;
  }
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace microspec
