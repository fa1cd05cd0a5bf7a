// Published EAGLE heads (draft_head/eagle_checkpoint.h): Hugging Face-layout checkpoints written by
// scripts/make_eagle_checkpoint_fixtures.py (torch.save'd pytorch_model.bin, random weights) convert
// into head GGUFs whose C++ forward equals a PyTorch forward in Hugging Face's own conventions
// (rotate-half RoPE on the unpermuted rows, llama3 rope scaling), draft losslessly (speculative
// greedy output = plain greedy output), and heads that do not fit are refused naming both values.
//   EAGLE-3 with its own 48-row LM head + d2t, for the tiny llama target of draft_head_golden;
//   EAGLE-2 (fc over [embedding ; hidden], no input or final norm) for the real SmolLM2.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "draft_head/eagle3_head.h"
#include "draft_head/eagle_checkpoint.h"
#include "engine/generator.h"
#include "engine/speculative_decoder.h"
#include "gguf/gguf.h"
#include "model/model.h"
#include "speculative/head_drafter.h"
#include "support/test_helpers.h"
#include "support/tiny_model.h"
#include "tokenizer/tokenizer.h"

namespace microspec {
namespace {

namespace fs = std::filesystem;

std::string data_dir() { return test::source_dir() + "/tests/data/eagle_checkpoint/"; }
std::string tiny_target() { return test::source_dir() + "/tests/data/draft_head_golden/target.gguf"; }

class EagleCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("microspec_eagle_ckpt_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string convert(const std::string& checkpoint, const std::string& target, GgmlType type = GgmlType::F32) {
    EagleConvertOptions o;
    o.checkpoint_dir = checkpoint;
    o.target_path = target;
    o.output_path = (dir_ / "head.gguf").string();
    o.matrix_type = type;
    convert_eagle_checkpoint(o);
    return o.output_path;
  }
  std::unique_ptr<Model> load_model(const GgufFile& f) {
    ModelOptions opt;
    opt.n_threads = 2;
    opt.n_batch = 16;
    return Model::load(f, opt);
  }

  fs::path dir_;
};

struct Golden {
  std::unique_ptr<GgufFile> f;
  std::vector<float> values(const char* name) const {
    const GgufTensor* t = f->find_tensor(name);
    EXPECT_NE(t, nullptr) << name;
    if (!t) return {};
    const float* p = reinterpret_cast<const float*>(t->data);
    return std::vector<float>(p, p + t->n_elements());
  }
  std::vector<int32_t> ids(const char* name) const {
    std::vector<int32_t> out;
    for (float x : values(name)) out.push_back(static_cast<int32_t>(x));
    return out;
  }
};

// Runs the golden's three levels (T committed rows + root; two siblings of the root; a child of
// the first sibling) through the head; after each level `check(level, rows, prenorm, normed)`.
template <typename Check>
void run_levels(Eagle3Head& head, const Golden& gold, int32_t levels, Check check) {
  const int32_t H = head.config().n_embd, F = head.config().n_features();
  const std::vector<float> features = gold.values("features");
  const std::vector<int32_t> tokens = gold.ids("tokens");
  const int32_t T = static_cast<int32_t>(tokens.size()) - 1;
  KVCache kv = head.make_cache(64);
  std::vector<float> g(size_t(16) * H), prenorm(size_t(16) * H), normed(size_t(16) * H);
  Batch b;
  b.set_sequence(std::span<const int32_t>(tokens.data(), size_t(T)), 0, false);
  head.fuse(features.data(), T, g.data());
  head.forward(b, g.data(), kv, prenorm.data(), normed.data());
  kv.commit_prefix(T);
  b.set_sequence(std::span<const int32_t>(tokens.data() + T, 1), T, false);
  head.fuse(features.data() + size_t(T) * F, 1, g.data());
  head.forward(b, g.data(), kv, prenorm.data(), normed.data());
  check(1, 1, prenorm, normed);
  const std::vector<float> root_out(prenorm.begin(), prenorm.begin() + H);
  const std::vector<int32_t> level2 = gold.ids("level2_tokens");
  b.clear();
  b.start = 1;
  for (int32_t i = 0; i < 2; ++i) {
    b.tokens.push_back(level2[size_t(i)]);
    b.positions.push_back(T + 1);
    b.parents.push_back(0);
    std::copy(root_out.begin(), root_out.end(), g.begin() + size_t(i) * H);
  }
  head.forward(b, g.data(), kv, prenorm.data(), normed.data());
  check(2, 2, prenorm, normed);
  if (levels < 3) return;
  const std::vector<float> first_out(prenorm.begin(), prenorm.begin() + H);
  b.clear();
  b.start = 3;
  b.tokens.push_back(gold.ids("level3_tokens")[0]);
  b.positions.push_back(T + 2);
  b.parents.push_back(1);
  std::copy(first_out.begin(), first_out.end(), g.begin());
  head.forward(b, g.data(), kv, prenorm.data(), normed.data());
  check(3, 1, prenorm, normed);
}

TEST_F(EagleCheckpoint, Eagle3OwnLmHeadMatchesPyTorchForward) {
  auto target_file = GgufFile::open(tiny_target());
  auto target = load_model(*target_file);
  Eagle3Head head(GgufFile::open(convert(data_dir() + "eagle3", tiny_target())), *target, 16);
  const Golden gold{GgufFile::open(data_dir() + "eagle3_golden.gguf")};
  const Eagle3Config& c = head.config();
  EXPECT_EQ(c.arch, HeadArch::Eagle3);
  EXPECT_EQ(c.target_layers, (std::vector<int32_t>{0, 1, 1}));
  ASSERT_EQ(c.n_draft_vocab, 48);
  EXPECT_EQ(head.draft_to_target(), gold.ids("d2t"));  // offsets became absolute target ids

  std::vector<int32_t> all(48);
  for (int32_t i = 0; i < 48; ++i) all[size_t(i)] = i;
  std::vector<float> logits(size_t(2) * 48);
  // Tolerance: half-float KV cache and another summation order; logits of order 1.
  constexpr float kTol = 2e-3f;
  run_levels(head, gold, 3, [&](int32_t level, int32_t rows, auto&, auto& normed) {
    head.own_logits(normed.data(), rows, all.data(), 48, logits.data());
    const std::string name = "level" + std::to_string(level) + "_logits";
    const std::vector<float> want = gold.values(name.c_str());
    float worst = 0.0f;
    for (size_t i = 0; i < size_t(rows) * 48; ++i) worst = std::max(worst, std::abs(logits[i] - want[i]));
    EXPECT_LT(worst, kTol) << name;
    RecordProperty(name, std::to_string(worst));
  });
}

TEST_F(EagleCheckpoint, Eagle3OwnLmHeadDraftsLosslesslyWithEveryVocabulary) {
  auto target_file = GgufFile::open(tiny_target());
  auto target = load_model(*target_file);
  auto tok_file = GgufFile::open(test::write_tiny_tokenizer((dir_ / "tok.gguf").string(), 320));
  auto tok = Tokenizer::from_gguf(*tok_file);
  const std::string path = convert(data_dir() + "eagle3", tiny_target(), GgmlType::Q8_0);
  std::vector<int32_t> prompt = {1};
  for (int32_t i = 0; i < 29; ++i) prompt.push_back(3 + (i * 53 + 11) % 317);
  GenerateParams params;
  params.max_new_tokens = 32;
  params.ignore_eos = true;
  Generator plain_gen(*target, *tok, 256);
  const GenerateResult plain = plain_gen.generate(prompt, params);
  // The packed subset holds half of the head's 48 ids and half of the rest: the head scores the
  // intersection only.
  const Golden gold{GgufFile::open(data_dir() + "eagle3_golden.gguf")};
  const std::vector<int32_t> head_ids = gold.ids("d2t");
  std::vector<int32_t> subset;
  for (int32_t id = 0; id < 320; ++id)
    if (id % 2 == 0) subset.push_back(id);
  for (const TreeParams& tree : {TreeParams{3, 1, 4}, TreeParams{2, 3, 8}})
    for (int32_t kind = 0; kind < 3; ++kind) {
      Generator gen(*target, *tok, 256);
      DraftVocabulary vocab = kind == 0   ? DraftVocabulary::full(320)
                              : kind == 1 ? DraftVocabulary::packed(*target, subset)
                                          : DraftVocabulary::dynamic(*target, DynamicVocabParams{});
      HeadDrafter drafter(std::make_unique<Eagle3Head>(GgufFile::open(path), *target, target->n_batch()), *target,
                          256, std::move(vocab));
      Decoder dec(gen, *tok, &drafter, tree);
      const SpecResult r = dec.generate(prompt, params);
      const std::string what = "vocab kind " + std::to_string(kind) + " tree " + std::to_string(tree.top_k);
      EXPECT_EQ(r.gen.tokens, plain.tokens) << what;
      if (kind == 0) EXPECT_GT(r.stats.drafted, 0) << what;
      // Every drafted token is one of the head's own ids.
      EXPECT_LE(drafter.active_vocab_size(), 48) << what;
    }
}

TEST_F(EagleCheckpoint, Eagle2MatchesPyTorchForwardAndDraftsLosslesslyOnSmolLM2) {
  test::require_file(test::smollm_path());
  auto target_file = GgufFile::open(test::smollm_path());
  auto target = load_model(*target_file);
  const std::string path = convert(data_dir() + "eagle2_smollm2", test::smollm_path());
  {
    Eagle3Head head(GgufFile::open(path), *target, 16);
    EXPECT_EQ(head.config().arch, HeadArch::Eagle2);
    EXPECT_EQ(head.config().target_layers, (std::vector<int32_t>{target->config().n_layer}));
    EXPECT_EQ(head.config().n_draft_vocab, 0);
    const Golden gold{GgufFile::open(data_dir() + "eagle2_golden.gguf")};
    constexpr float kTol = 5e-3f;  // outputs of order 1-3 through a half-float KV cache
    run_levels(head, gold, 2, [&](int32_t level, int32_t rows, auto& prenorm, auto&) {
      const std::string name = "level" + std::to_string(level) + "_out";
      const std::vector<float> want = gold.values(name.c_str());
      float worst = 0.0f;
      for (size_t i = 0; i < size_t(rows) * 576; ++i) worst = std::max(worst, std::abs(prenorm[i] - want[i]));
      EXPECT_LT(worst, kTol) << name;
      RecordProperty(name, std::to_string(worst));
    });
  }
  auto tok = Tokenizer::from_gguf(*target_file);
  const std::vector<int32_t> prompt = tok->encode("The three primary colours are red, yellow and", true, false);
  GenerateParams params;
  params.max_new_tokens = 24;
  Generator plain_gen(*target, *tok, 256);
  const GenerateResult plain = plain_gen.generate(prompt, params);
  for (int32_t kind = 0; kind < 2; ++kind) {
    Generator gen(*target, *tok, 256);
    DraftVocabulary vocab = kind == 0 ? DraftVocabulary::full(target->config().n_vocab)
                                      : DraftVocabulary::dynamic(*target, DynamicVocabParams{});
    HeadDrafter drafter(std::make_unique<Eagle3Head>(GgufFile::open(path), *target, target->n_batch()), *target, 256,
                        std::move(vocab));
    Decoder dec(gen, *tok, &drafter, TreeParams{3, 2, 6});
    const SpecResult r = dec.generate(prompt, params);
    EXPECT_EQ(r.gen.tokens, plain.tokens) << "vocab kind " << kind;
    EXPECT_GT(r.stats.drafted, 0) << "vocab kind " << kind;
  }
}

// A model.safetensors in a temporary head folder, F32 tensors of the given shapes (zeros).
void write_safetensors(const fs::path& path, const std::vector<std::pair<std::string, std::vector<int64_t>>>& tensors) {
  std::string header = "{";
  uint64_t offset = 0;
  for (const auto& [name, shape] : tensors) {
    uint64_t n = 4;
    std::string dims;
    for (int64_t d : shape) {
      n *= uint64_t(d);
      dims += (dims.empty() ? "" : ",") + std::to_string(d);
    }
    header += (header.size() > 1 ? "," : "") + std::string("\"") + name + "\":{\"dtype\":\"F32\",\"shape\":[" + dims +
              "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + n) + "]}";
    offset += n;
  }
  header += "}";
  std::ofstream out(path, std::ios::binary);
  const uint64_t len = header.size();
  out.write(reinterpret_cast<const char*>(&len), 8);
  out << header;
  out << std::string(offset, '\0');
}

TEST_F(EagleCheckpoint, RefusesHeadsThatDoNotFitNamingBothValues) {
  // EAGLE-2 for SmolLM2 (hidden 576) against the 64-wide tiny target.
  std::string e = test::error_of([&] { convert(data_dir() + "eagle2_smollm2", tiny_target()); });
  EXPECT_NE(e.find("hidden_size"), std::string::npos) << e;
  EXPECT_NE(e.find("is 576, the target's is 64"), std::string::npos) << e;

  // A config for another vocabulary.
  const fs::path bad = dir_ / "bad";
  fs::create_directories(bad);
  std::ifstream in(data_dir() + "eagle3/config.json");
  std::string cfg((std::istreambuf_iterator<char>(in)), {});
  auto write_cfg = [&](const std::string& text) { std::ofstream(bad / "config.json") << text; };
  std::string other_vocab = cfg;
  other_vocab.replace(other_vocab.find("\"vocab_size\": 320"), 17, "\"vocab_size\": 128256");
  write_cfg(other_vocab);
  fs::copy_file(data_dir() + "eagle3/pytorch_model.bin", bad / "pytorch_model.bin");
  e = test::error_of([&] { convert(bad.string(), tiny_target()); });
  EXPECT_NE(e.find("vocab_size is 128256, the target's is 320"), std::string::npos) << e;

  // Shape lies and missing tensors (safetensors heads take the same checks).
  write_cfg(cfg);
  fs::remove(bad / "pytorch_model.bin");
  write_safetensors(bad / "model.safetensors", {{"fc.weight", {64, 100}}});
  e = test::error_of([&] { convert(bad.string(), tiny_target()); });
  EXPECT_NE(e.find("tensor 'fc.weight' has shape [64, 100], expected [64, 192]"), std::string::npos) << e;
  write_safetensors(bad / "model.safetensors", {{"fc.weight", {64, 192}}});
  e = test::error_of([&] { convert(bad.string(), tiny_target()); });
  EXPECT_NE(e.find("missing tensor 'layers.0.input_layernorm.weight'"), std::string::npos) << e;

  // No weights at all; a head for another target layer count.
  fs::remove(bad / "model.safetensors");
  e = test::error_of([&] { convert(bad.string(), tiny_target()); });
  EXPECT_NE(e.find("no model.safetensors or pytorch_model.bin"), std::string::npos) << e;
  std::string far_layers = cfg;
  const std::string ids = "[\n    0,\n    1,\n    1\n  ]";
  far_layers.replace(far_layers.find(ids), ids.size(), "[1, 16, 29]");
  write_cfg(far_layers);
  fs::copy_file(data_dir() + "eagle3/pytorch_model.bin", bad / "pytorch_model.bin");
  e = test::error_of([&] { convert(bad.string(), tiny_target()); });
  EXPECT_NE(e.find("target layer 16 is outside the target's 1 layers"), std::string::npos) << e;
}

}  // namespace
}  // namespace microspec
