// Speculative greedy generation equals plain greedy generation token for token on tiny random
// models: self-drafting with several layer counts and tree shapes, a separate draft model (the
// same file, and a different model with the same vocabulary), a sliding window shorter than
// prompt + output, stop strings, token limits and a full context.
#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "engine/generator.h"
#include "gguf/gguf.h"
#include "gguf/gguf_writer.h"
#include "model/model.h"
#include "spec/drafter.h"
#include "spec/spec_generator.h"
#include "tiny_model.h"
#include "tokenizer/tokenizer.h"
#include "util/error.h"

namespace microspec {
namespace {

constexpr int32_t kVocab = 320;

// An SPM vocabulary for the tiny models: <unk>, <s>, </s>, then words "▁w3".."▁w319", so every
// token prints as text and </s> (2) ends generation.
std::string write_tokenizer(const std::string& path) {
  GgufWriter w;
  w.add_string("general.architecture", "llama");
  w.add_string("tokenizer.ggml.model", "llama");
  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
  std::vector<int32_t> types = {2, 3, 3};
  for (int32_t i = 3; i < kVocab; ++i) {
    tokens.push_back("\xe2\x96\x81w" + std::to_string(i));
    types.push_back(1);
  }
  std::vector<float> scores(kVocab, 0.0f);
  w.add_string_array("tokenizer.ggml.tokens", tokens);
  w.add_i32_array("tokenizer.ggml.token_type", types);
  w.add_f32_array("tokenizer.ggml.scores", scores);
  w.add_u32("tokenizer.ggml.bos_token_id", 1);
  w.add_u32("tokenizer.ggml.eos_token_id", 2);
  w.write_file(path);
  return path;
}

struct Tiny {
  std::unique_ptr<GgufFile> file;
  std::unique_ptr<Model> model;
};

Tiny load_tiny(const test::TinyModelSpec& spec, const std::string& path) {
  test::write_tiny_model(spec, path);
  Tiny t;
  t.file = GgufFile::open(path);
  ModelOptions opt;
  opt.n_threads = 2;
  opt.n_batch = 64;
  t.model = Model::load(*t.file, opt);
  return t;
}

class SpecTiny : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("microspec_spec_tiny_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
    tok_file_ = GgufFile::open(write_tokenizer((dir_ / "tok.gguf").string()));
    tok_ = Tokenizer::from_gguf(*tok_file_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  test::TinyModelSpec spec(const std::string& arch, uint32_t seed) {
    test::TinyModelSpec s;
    s.arch = arch;
    s.n_vocab = kVocab;
    s.n_layer = 3;
    s.sliding_window = 8;
    s.seed = seed;
    // An untied head: with the embeddings tied, a random model just repeats its last token, which
    // any drafter predicts; untied, the greedy output wanders over the vocabulary.
    s.untied_output = true;
    return s;
  }

  // Plain greedy output, then the same through speculative decoding; they must be identical.
  void expect_same(Model& target, const std::vector<int32_t>& prompt, const GenerateParams& params,
                   int32_t n_ctx, const std::function<std::unique_ptr<Drafter>(Generator&)>& make_drafter,
                   const TreeParams& tree, const std::string& what, double* acceptance = nullptr) {
    Generator plain_gen(target, *tok_, n_ctx);
    const GenerateResult plain = plain_gen.generate(prompt, params);
    Generator gen(target, *tok_, n_ctx);
    std::unique_ptr<Drafter> drafter = make_drafter(gen);
    SpeculativeGenerator sg(gen, *tok_, *drafter, tree);
    std::string streamed;
    const SpecResult spec = sg.generate(prompt, params, [&](std::string_view t) {
      streamed.append(t);
      return true;
    });
    EXPECT_EQ(plain.tokens, spec.gen.tokens) << what;
    EXPECT_EQ(plain.text, spec.gen.text) << what;
    EXPECT_EQ(streamed, spec.gen.text) << what;
    EXPECT_EQ(plain.finish, spec.gen.finish) << what;
    if (!spec.gen.tokens.empty() && spec.gen.tokens.size() > 1) EXPECT_GT(spec.stats.steps, 0) << what;
    if (acceptance) *acceptance = spec.stats.mean_acceptance_length();
  }

  std::filesystem::path dir_;
  std::unique_ptr<GgufFile> tok_file_;
  std::unique_ptr<Tokenizer> tok_;
};

const std::vector<int32_t> kPrompt = {1, 17, 250, 33, 90, 141};

TEST_F(SpecTiny, SelfDraftMatchesPlainAcrossSlidingWindow) {
  for (const char* arch : {"gemma3", "llama"}) {
    Tiny t = load_tiny(spec(arch, 7), (dir_ / (std::string(arch) + ".gguf")).string());
    GenerateParams params;
    params.max_new_tokens = 40;  // 6 + 40 tokens: far past the window of 8
    params.ignore_eos = true;
    const TreeParams trees[] = {{4, 1, 5}, {3, 2, 6}, {2, 3, 8}, {0, 4, 4}, {3, 2, 0}};
    for (int32_t layers = 1; layers <= 3; ++layers)
      for (const TreeParams& tree : trees) {
        double acc = 0.0;
        expect_same(
            *t.model, kPrompt, params, 128,
            [&](Generator& g) {
              return std::make_unique<SelfDrafter>(*t.model, g.cache(), layers,
                                                   DraftVocabulary::full(kVocab));
            },
            tree,
            std::string(arch) + " layers " + std::to_string(layers) + " tree " + std::to_string(tree.depth) +
                "/" + std::to_string(tree.top_k) + "/" + std::to_string(tree.total_tokens),
            &acc);
        // With all layers the draft is the target: every chain token is accepted.
        if (layers == 3 && tree.top_k == 1) EXPECT_GT(acc, 4.0) << arch;
      }
  }
}

TEST_F(SpecTiny, DraftModelMatchesPlain) {
  Tiny target = load_tiny(spec("gemma3", 3), (dir_ / "target.gguf").string());
  Tiny same = load_tiny(spec("gemma3", 3), (dir_ / "same.gguf").string());
  Tiny other = load_tiny(spec("llama", 11), (dir_ / "other.gguf").string());
  GenerateParams params;
  params.max_new_tokens = 40;
  params.ignore_eos = true;
  for (const TreeParams& tree : {TreeParams{4, 1, 5}, TreeParams{3, 2, 6}, TreeParams{2, 3, 9}}) {
    double acc_same = 0.0, acc_other = 0.0;
    expect_same(
        *target.model, kPrompt, params, 128,
        [&](Generator&) {
          return std::make_unique<ModelDrafter>(*same.model, 128, DraftVocabulary::full(kVocab));
        },
        tree, "same model as draft", &acc_same);
    expect_same(
        *target.model, kPrompt, params, 128,
        [&](Generator&) {
          return std::make_unique<ModelDrafter>(*other.model, 128, DraftVocabulary::full(kVocab));
        },
        tree, "other model as draft", &acc_other);
    EXPECT_GT(acc_same, 2.5);
    EXPECT_LT(acc_other, acc_same);
  }
  // A pruned draft vocabulary changes what is proposed, never the output.
  std::vector<int32_t> half;
  for (int32_t i = 0; i < kVocab; i += 2) half.push_back(i);
  expect_same(
      *target.model, kPrompt, params, 128,
      [&](Generator&) {
        return std::make_unique<ModelDrafter>(*same.model, 128, DraftVocabulary::subset(half, kVocab));
      },
      {3, 2, 6}, "pruned draft vocabulary");
}

TEST_F(SpecTiny, StopsExactlyWherePlainStops) {
  Tiny t = load_tiny(spec("gemma3", 5), (dir_ / "m.gguf").string());
  auto self = [&](Generator& g) {
    return std::make_unique<SelfDrafter>(*t.model, g.cache(), 3, DraftVocabulary::full(kVocab));
  };
  const TreeParams tree{4, 2, 8};
  GenerateParams params;
  params.ignore_eos = true;
  // Token limits that end inside an accepted run.
  for (int32_t n : {0, 1, 2, 3, 7, 13}) {
    params.max_new_tokens = n;
    expect_same(*t.model, kPrompt, params, 128, self, tree, "max tokens " + std::to_string(n));
  }
  // A stop string from the middle of the plain output (spanning two tokens).
  params.max_new_tokens = 40;
  Generator g(*t.model, *tok_, 128);
  const GenerateResult full = g.generate(kPrompt, params);
  ASSERT_GE(full.tokens.size(), 20u);
  const std::string piece = tok_->token_to_piece(full.tokens[9]) + tok_->token_to_piece(full.tokens[10]);
  params.stop_strings = {piece.substr(2)};
  Generator g2(*t.model, *tok_, 128);
  ASSERT_EQ(g2.generate(kPrompt, params).finish, FinishReason::StopString);
  expect_same(*t.model, kPrompt, params, 128, self, tree, "stop string");
  // End of generation: make </s> a stop by letting EOS end the run where plain decoding would.
  params.stop_strings.clear();
  params.ignore_eos = false;
  expect_same(*t.model, kPrompt, params, 128, self, tree, "eos");
  // A context that fills up mid-run, for both the self-drafter and a draft model.
  params.ignore_eos = true;
  for (int32_t n_ctx : {8, 12, 19, 23}) {
    expect_same(*t.model, kPrompt, params, n_ctx, self, tree, "context " + std::to_string(n_ctx));
    expect_same(
        *t.model, kPrompt, params, n_ctx,
        [&](Generator&) {
          return std::make_unique<ModelDrafter>(*t.model, n_ctx, DraftVocabulary::full(kVocab));
        },
        tree, "draft, context " + std::to_string(n_ctx));
  }
}

TEST_F(SpecTiny, PrefillTopKMatchesTeacherForcedLogits) {
  Tiny t = load_tiny(spec("gemma3", 5), (dir_ / "m.gguf").string());
  std::vector<int32_t> prompt;
  for (int32_t i = 0; i < 150; ++i) prompt.push_back(3 + (i * 37) % (kVocab - 3));  // > n_batch 64
  Generator plain(*t.model, *tok_, 256);
  const float* plain_logits = plain.prefill(prompt);
  const std::vector<float> last(plain_logits, plain_logits + kVocab);
  Generator g(*t.model, *tok_, 256);
  std::vector<int32_t> top;
  const float* logits = g.prefill(prompt, 3, top);
  ASSERT_EQ(top.size(), prompt.size() * 3);
  EXPECT_EQ(std::vector<float>(logits, logits + kVocab), last);
  // Each position's top-3 equals the top-3 of that position's logits from a plain prefix run.
  for (int32_t pos : {0, 1, 63, 64, 100, 149}) {
    Generator p(*t.model, *tok_, 256);
    const float* l = p.prefill(std::vector<int32_t>(prompt.begin(), prompt.begin() + pos + 1));
    int32_t want[3];
    top_k_indices(l, kVocab, 3, want);
    EXPECT_EQ(std::vector<int32_t>(top.begin() + pos * 3, top.begin() + pos * 3 + 3),
              std::vector<int32_t>(want, want + 3))
        << "position " << pos;
  }
}

TEST_F(SpecTiny, RejectsSamplingAndBadSetups) {
  Tiny t = load_tiny(spec("gemma3", 5), (dir_ / "m.gguf").string());
  Generator g(*t.model, *tok_, 64);
  SelfDrafter d(*t.model, g.cache(), 2, DraftVocabulary::full(kVocab));
  SpeculativeGenerator sg(g, *tok_, d, {3, 2, 6});
  GenerateParams params;
  params.sampling.temperature = 0.7f;
  EXPECT_THROW(sg.generate(kPrompt, params), Error);
  EXPECT_THROW(SelfDrafter(*t.model, g.cache(), 4, DraftVocabulary::full(kVocab)), Error);
  EXPECT_THROW(SpeculativeGenerator(g, *tok_, d, {3, 2, 64}), Error);  // 65 verified rows > n_batch 64
  EXPECT_THROW(DraftVocabulary::subset({1, 1}, kVocab), Error);
  EXPECT_THROW(DraftVocabulary::subset({kVocab}, kVocab), Error);
}

}  // namespace
}  // namespace microspec
