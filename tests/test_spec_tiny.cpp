// Speculative greedy generation equals plain greedy generation token for token on tiny random
// models: self-drafting with several layer counts and tree shapes, a separate draft model (the
// same file, and a different model with the same vocabulary), a sliding window shorter than
// prompt + output (Gemma 3's layer pattern, and "mistral": llama with the window on every layer),
// stop strings, token limits and a full context.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/generator.h"
#include "engine/speculative_decoder.h"
#include "gguf/gguf.h"
#include "gguf/gguf_writer.h"
#include "math/select.h"
#include "model/model.h"
#include "sampling/sampler.h"
#include "server/batch_scheduler.h"
#include "speculative/auto_drafter.h"
#include "speculative/drafter.h"
#include "speculative/head_drafter.h"
#include "speculative/ngram.h"
#include "support/tiny_head.h"
#include "support/tiny_model.h"
#include "tokenizer/tokenizer.h"
#include "util/error.h"

namespace microspec {
namespace {

constexpr int32_t kVocab = 320;


using Tiny = test::TinyLoaded;
Tiny load_tiny(const test::TinyModelSpec& spec, const std::string& path) { return test::load_tiny_model(spec, path); }

class SpecTiny : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("microspec_spec_tiny_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
    tok_file_ = GgufFile::open(test::write_tiny_tokenizer((dir_ / "tok.gguf").string(), kVocab));
    tok_ = Tokenizer::from_gguf(*tok_file_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // "mistral": a llama file with llama.attention.sliding_window (8, every layer).
  test::TinyModelSpec spec(const std::string& arch, uint32_t seed) {
    test::TinyModelSpec s;
    s.arch = arch == "mistral" ? "llama" : arch;
    s.llama_window = arch == "mistral";
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
                   const TreeParams& tree, const std::string& what, double* acceptance = nullptr,
                   const std::function<void(const Drafter&)>& inspect = nullptr) {
    Generator plain_gen(target, *tok_, n_ctx);
    const GenerateResult plain = plain_gen.generate(prompt, params);
    Generator gen(target, *tok_, n_ctx);
    std::unique_ptr<Drafter> drafter = make_drafter(gen);
    Decoder sg(gen, *tok_, drafter.get(), tree);
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
    if (inspect) inspect(*drafter);
  }

  std::filesystem::path dir_;
  std::unique_ptr<GgufFile> tok_file_;
  std::unique_ptr<Tokenizer> tok_;
};

const std::vector<int32_t> kPrompt = {1, 17, 250, 33, 90, 141};

// Step costs for --spec auto on tiny models, in units of a one-row forward: a forward of r rows
// costs 1 + extra_row * (r - 1), a tenth of it in the LM head.
StepCosts linear_costs(double extra_row) {
  StepCosts c;
  for (int32_t r = 1; r <= 16; ++r) {
    c.rows.push_back(r);
    c.forward.push_back(1.0 + extra_row * (r - 1));
    c.lm_head.push_back(0.1 * c.forward.back());
  }
  return c;
}

std::unique_ptr<AutoDrafter> make_auto(Model& model, Generator& g, int32_t n_ctx, double extra_row,
                                       double level = 0.1) {
  return std::make_unique<AutoDrafter>(NgramParams{1, 4}, n_ctx,
                                       std::make_unique<SelfDrafter>(model, g.cache(), 2, DraftVocabulary::full(kVocab)),
                                       ModelDraftCost{.level_seconds = level, .resumed_share = 0.0},
                                       linear_costs(extra_row));
}

TEST_F(SpecTiny, SelfDraftMatchesPlainAcrossSlidingWindow) {
  for (const char* arch : {"gemma3", "mistral", "llama"}) {
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

TEST_F(SpecTiny, NgramDraftingMatchesPlain) {
  // Tied embeddings: the random model soon repeats itself, so n-gram matches draft and are
  // accepted; untied: it wanders, matches are rare and mostly rejected. Both must equal plain,
  // up to a full context (n_ctx 48 < prompt + tokens asked for).
  const std::vector<int32_t> prompt = {1, 17, 250, 33, 90, 141, 17, 250, 33, 2, 17, 250};
  GenerateParams params;
  params.max_new_tokens = 60;
  params.ignore_eos = true;
  for (const char* arch : {"gemma3", "mistral"})
  for (const bool tied : {true, false}) {
    test::TinyModelSpec sp = spec(arch, 21);
    sp.untied_output = !tied;
    Tiny t = load_tiny(sp, (dir_ / (std::string(arch) + (tied ? "-tied.gguf" : "-untied.gguf"))).string());
    const std::string kind = std::string(arch) + (tied ? " tied" : " untied");
    for (const int32_t n_ctx : {128, 48})
      for (const TreeParams& tree : {TreeParams{3, 1, 4}, TreeParams{0, 1, 8}}) {
        const std::string what = kind + " n_ctx " + std::to_string(n_ctx) + " tokens " +
                                 std::to_string(tree.total_tokens);
        double acc = 0.0;
        expect_same(
            *t.model, prompt, params, n_ctx,
            [&](Generator&) { return std::make_unique<NgramDrafter>(NgramParams{1, 4}, n_ctx); }, tree,
            "ngram " + what, &acc);
        if (tied) EXPECT_GT(acc, 2.0) << "ngram " << what;
        // n-gram first, else self-drafting with 2 of 3 layers: both sides draft.
        expect_same(
            *t.model, prompt, params, n_ctx,
            [&](Generator& g) {
              return std::make_unique<NgramFirstDrafter>(
                  NgramParams{1, 4}, 2, n_ctx,
                  std::make_unique<SelfDrafter>(*t.model, g.cache(), 2, DraftVocabulary::full(kVocab)));
            },
            tree, "self+ngram " + what, nullptr, [&](const Drafter& d) {
              const auto& combined = dynamic_cast<const NgramFirstDrafter&>(d);
              EXPECT_GT(combined.fallback_steps(), 0) << what;
              if (tied) EXPECT_GT(combined.ngram_steps(), 0) << what;
            });
      }
  }
}

TEST_F(SpecTiny, AutoMatchesPlainAndPicksByCost) {
  // --spec auto on a model that repeats itself (tied embeddings) and one that wanders, up to a full
  // context: greedy output equals plain whichever options run. Cheap rows draft (n-gram chains
  // where the text repeats, the model where it does not); rows that each cost a whole step never
  // pay, not even with every drafted token accepted, so every step is plain (not even a probe).
  const std::vector<int32_t> prompt = {1, 17, 250, 33, 90, 141, 17, 250, 33, 2, 17, 250};
  GenerateParams params;
  params.max_new_tokens = 60;
  params.ignore_eos = true;
  for (const bool tied : {true, false}) {
    test::TinyModelSpec sp = spec("gemma3", 21);
    sp.untied_output = !tied;
    Tiny t = load_tiny(sp, (dir_ / (tied ? "tied.gguf" : "untied.gguf")).string());
    for (const int32_t n_ctx : {128, 48})
      for (const double extra_row : {0.05, 1.0}) {
        const std::string what = std::string(tied ? "tied" : "untied") + " n_ctx " + std::to_string(n_ctx) +
                                 " row cost " + std::to_string(extra_row);
        SpecStats stats;
        Generator plain_gen(*t.model, *tok_, n_ctx);
        const GenerateResult plain = plain_gen.generate(prompt, params);
        Generator gen(*t.model, *tok_, n_ctx);
        std::unique_ptr<AutoDrafter> drafter = make_auto(*t.model, gen, n_ctx, extra_row);
        Decoder sg(gen, *tok_, drafter.get(), TreeParams{3, 1, 4});
        const SpecResult r = sg.generate(prompt, params);
        EXPECT_EQ(plain.tokens, r.gen.tokens) << what;
        EXPECT_EQ(plain.finish, r.gen.finish) << what;
        const auto& by = r.stats.by_source;
        EXPECT_EQ(by[0].steps + by[1].steps + by[2].steps, r.stats.steps) << what;
        if (extra_row >= 1.0) {
          EXPECT_EQ(by[size_t(DraftSource::Ngram)].steps, 0) << what;
          EXPECT_EQ(by[size_t(DraftSource::Model)].steps, 0) << what;
          EXPECT_GT(by[size_t(DraftSource::None)].steps, r.stats.steps / 2) << what;
        } else if (tied) {
          EXPECT_GT(by[size_t(DraftSource::Ngram)].steps, 0) << what;
          EXPECT_GT(r.stats.mean_acceptance_length(), 2.0) << what;
        } else {
          EXPECT_GT(by[size_t(DraftSource::Model)].steps, 0) << what;
        }
      }
  }
}

TEST_F(SpecTiny, AutoCountsTheRowsADraftModelMustCatchUpOn) {
  // A draft model runs the rows of the steps it did not draft when it next drafts, so auto counts
  // them into the model's cost. Rows at 0.1 of a step, a level at 0.1, the model's prior of 1 in 3:
  // its one-token chain is worth (1 + 1/3) / 1.2 = 1.11 with nothing pending and beats plain's 1;
  // three pending rows at 0.1 each make it (1 + 1/3) / 1.5 = 0.89, and no longer chain does better.
  Tiny t = load_tiny(spec("llama", 5), (dir_ / "m.gguf").string());
  AutoDrafter lazy(NgramParams{1, 4}, 64, std::make_unique<ModelDrafter>(*t.model, 64, DraftVocabulary::full(kVocab)),
                   ModelDraftCost{.level_seconds = 0.1, .resumed_share = 0.0, .catch_up_row_seconds = 0.1},
                   linear_costs(0.1));
  lazy.begin(kPrompt, {});
  AutoDrafter::Choice c = lazy.choose(0, 0, 4);
  EXPECT_EQ(c.source, DraftSource::Model);
  EXPECT_EQ(c.tokens, 1);
  EXPECT_NEAR(c.value, (4.0 / 3.0) / 1.2, 1e-9);
  const DraftTree plain_step;
  const std::vector<float> logits(kVocab);
  for (int32_t i = 0; i < 3; ++i) lazy.accepted(40 + i, plain_step, {}, logits.data());
  c = lazy.choose(0, 0, 4);
  EXPECT_EQ(c.source, DraftSource::None);
  EXPECT_NEAR(c.value, 1.0, 1e-9);
}

TEST_F(SpecTiny, AutoProbesALosingModelEverMoreRarely) {
  // Rows at half a step: the model's one-token chain, at its prior (1 + 1/3) / 1.6, loses to plain,
  // though with its token accepted it would win (2 / 1.6). Every step is plain but the model's
  // probes, the first 32 steps after the start, each later one twice as long after the last (32,
  // 96, 224, 480, ...), as long as they leave the model losing.
  Tiny t = load_tiny(spec("llama", 5), (dir_ / "m.gguf").string());
  GenerateParams params;
  params.max_new_tokens = 400;
  params.ignore_eos = true;
  Generator gen(*t.model, *tok_, 512);
  std::unique_ptr<AutoDrafter> drafter = make_auto(*t.model, gen, 512, 0.5);
  Decoder sg(gen, *tok_, drafter.get(), TreeParams{3, 1, 4});
  const SpecResult r = sg.generate(kPrompt, params);
  int32_t probes = 0;
  for (int64_t at = AutoDrafter::kProbeInterval, wait = 2 * at; at <= r.stats.steps; at += wait, wait *= 2) ++probes;
  ASSERT_GE(r.stats.steps, 224);
  const auto& by = r.stats.by_source;
  EXPECT_EQ(by[size_t(DraftSource::Ngram)].steps, 0);
  EXPECT_GE(by[size_t(DraftSource::Model)].steps, probes - 1);
  EXPECT_LE(by[size_t(DraftSource::Model)].steps, probes) << "one in 32 would be " << r.stats.steps / 32;
}

TEST_F(SpecTiny, AutoChoosesByExpectedTokensPerSecond) {
  // At the priors (every rate 1/2) with rows at 0.3 of a step and a model level at 0.1: the model's
  // chain of 1 is worth 1.5 / 1.4 = 1.07 steps' tokens per step, over plain's 1; a one-token n-gram
  // chain 1.5 / 1.3 = 1.15, a two-token one 1.75 / 1.6 = 1.09. Rows that cost a step each never
  // beat plain.
  Tiny t = load_tiny(spec("llama", 5), (dir_ / "m.gguf").string());
  Generator g(*t.model, *tok_, 64);
  auto cheap = make_auto(*t.model, g, 64, 0.3);
  AutoDrafter::Choice c = cheap->choose(0, 0, 4);
  EXPECT_EQ(c.source, DraftSource::Model);
  EXPECT_EQ(c.tokens, 1);
  EXPECT_NEAR(c.value, 1.5 / 1.4, 1e-9);
  c = cheap->choose(2, 1, 4);
  EXPECT_EQ(c.source, DraftSource::Ngram);
  EXPECT_EQ(c.tokens, 1);
  EXPECT_NEAR(c.value, 1.5 / 1.3, 1e-9);
  c = cheap->choose(2, 2, 4);
  EXPECT_EQ(c.source, DraftSource::Ngram);
  EXPECT_EQ(c.tokens, 2) << "the n-gram chain is drafted as its confidence cut it";
  EXPECT_NEAR(c.value, 1.75 / 1.6, 1e-9);
  EXPECT_EQ(cheap->choose(2, 4, 4).source, DraftSource::Model) << "1.94 / 2.2 = 0.88: the model's 1.07 wins";
  auto dear = make_auto(*t.model, g, 64, 1.0);
  EXPECT_EQ(dear->choose(2, 4, 4).source, DraftSource::None);
  // Shared rows: with 7 other sequences in the pass, a row costs what it adds to theirs. Rows free
  // up to 4 then a step each: alone a 2-token n-gram chain costs what a plain step does (F(3) = F(1)),
  // beside 7 other rows it costs three times a plain row (F(10) - F(7) = 3 against F(8) - F(7) = 1).
  StepCosts knee;
  for (int32_t r = 1; r <= 16; ++r) {
    knee.rows.push_back(r);
    knee.forward.push_back(1.0 + std::max(0, r - 4));
    knee.lm_head.push_back(0.1);
  }
  AutoDrafter batched(NgramParams{1, 4}, 64,
                      std::make_unique<SelfDrafter>(*t.model, g.cache(), 2, DraftVocabulary::full(kVocab)),
                      ModelDraftCost{.level_seconds = 0.1, .resumed_share = 0.0}, knee);
  EXPECT_EQ(batched.choose(2, 2, 0).source, DraftSource::Ngram);
  batched.set_shared_rows(7);
  EXPECT_EQ(batched.choose(2, 2, 0).source, DraftSource::None);
  EXPECT_THROW(make_auto(*t.model, g, 64, 0.3, -1.0), Error);
  // Measured costs: positive, never falling with rows; extending a file keeps its points, so what
  // earlier runs read stays as it was.
  const StepCosts three = measure_step_costs(*t.model, 3);
  EXPECT_EQ(three.rows, (std::vector<int32_t>{1, 2, 3}));
  const StepCosts more = measure_step_costs(*t.model, 12, three);
  EXPECT_EQ(more.rows, (std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 8, 9, 12}));
  EXPECT_EQ(std::vector<double>(more.forward.begin(), more.forward.begin() + 3), three.forward);
  EXPECT_NO_THROW(more.validate());
  for (size_t i = 1; i < more.rows.size(); ++i) EXPECT_GE(more.forward[i], more.forward[i - 1]);
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

// The batching server's way of stepping: several generations, each with its own cache and
// drafter, draft their trees together (Decoder::draft_steps: one draft forward per tree level over
// all of them) of a shape that changes from step to step, as the server's draft policy changes it
// with the load, and all their verification rows go through ONE forward call;
// each then accepts its own path. Every generation's tokens equal plain greedy decoding's.
TEST_F(SpecTiny, TreesOfSeveralSequencesVerifiedInOneForwardMatchPlain) {
  // Self-drafters over all 3 layers (the draft is the target: trees are accepted, the pass resumes
  // every drafted row after the last layer) and over 2 (the pass resumes them after layer 2). The
  // sequences of one server share their settings, so all drafters of a call run the same layers.
  for (const char* arch : {"gemma3", "mistral", "llama"})
  for (int32_t layers : {3, 2}) {
    Tiny t = load_tiny(spec(arch, 11), (dir_ / (std::string(arch) + ".gguf")).string());
    GenerateParams params;
    params.max_new_tokens = 30;  // past the sliding window of 8
    params.ignore_eos = true;
    const std::vector<std::vector<int32_t>> prompts = {kPrompt, {5, 9, 200}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}};
    const TreeParams configured[] = {{3, 2, 6}, {4, 1, 5}, {2, 3, 8}};
    // Shapes the steps cycle through: the configured tree, a short chain, none.
    const auto shape_at = [](const TreeParams& full, int step) -> TreeParams {
      if (step % 3 == 0) return full;
      if (step % 3 == 1) return {.depth = 1, .top_k = 1, .total_tokens = std::min(2, full.total_tokens)};
      return {.depth = 0, .top_k = 1, .total_tokens = 0};
    };
    std::vector<std::unique_ptr<Generator>> gens;
    std::vector<std::unique_ptr<Drafter>> drafters;
    std::vector<std::unique_ptr<Decoder>> decoders;
    std::vector<std::unique_ptr<Decoder::Run>> runs;
    for (size_t i = 0; i < prompts.size(); ++i) {
      gens.push_back(std::make_unique<Generator>(*t.model, *tok_, 128));
      drafters.push_back(std::make_unique<SelfDrafter>(*t.model, gens[i]->cache(), layers,
                                                       DraftVocabulary::full(kVocab)));
      decoders.push_back(std::make_unique<Decoder>(*gens[i], *tok_, drafters[i].get(), configured[i]));
      runs.push_back(std::make_unique<Decoder::Run>(*tok_, params, nullptr, kVocab));
    }
    std::vector<bool> running(prompts.size());
    for (size_t i = 0; i < prompts.size(); ++i) running[i] = decoders[i]->start(*runs[i], prompts[i]);
    std::vector<SequenceForward> call;
    std::vector<size_t> in_call;
    std::vector<Decoder::DraftStep> steps;
    std::vector<DraftJob> jobs(prompts.size());
    int32_t shared_drafts = 0;
    for (int step = 0; std::count(running.begin(), running.end(), true) > 0; ++step) {
      call.clear();
      in_call.clear();
      steps.clear();
      for (size_t i = 0; i < prompts.size(); ++i) {
        if (!running[i]) continue;
        steps.push_back({.decoder = decoders[i].get(), .run = runs[i].get(), .shape = shape_at(configured[i], step + int(i))});
        in_call.push_back(i);
      }
      // The trees are drafted together (one draft forward per level over all sequences), as the server does.
      Decoder::draft_steps(steps, jobs);
      for (size_t i : in_call) {
        shared_drafts += runs[i]->drafted;
        call.push_back(decoders[i]->verify_rows(*runs[i]));
      }
      t.model->forward(call, decoders[0]->verify_options());
      for (size_t i : in_call) running[i] = decoders[i]->accept_step(*runs[i]);
    }
    EXPECT_GT(shared_drafts, 10) << arch;
    for (size_t i = 0; i < prompts.size(); ++i) {
      decoders[i]->finish(*runs[i]);
      Generator plain(*t.model, *tok_, 128);
      const GenerateResult expected = plain.generate(prompts[i], params);
      EXPECT_EQ(expected.tokens, runs[i]->res.gen.tokens) << arch << " layers " << layers << " sequence " << i;
      EXPECT_EQ(expected.finish, runs[i]->res.gen.finish) << arch << " sequence " << i;
      if (layers == 3) EXPECT_GT(runs[i]->res.stats.accepted_draft, 10) << arch << " sequence " << i;
      EXPECT_GT(runs[i]->res.stats.shared_draft_forwards, 0) << arch << " sequence " << i;
    }
  }
}

// The batching server drafts the trees of several sequences together (draft_together): each tree
// level's draft forward is ONE call over all the sequences' rows. Each sequence, with its own cache
// and its own draft vocabulary (packed LM-head rows, different per sequence), must get bitwise the
// tree it gets alone, and hand verification the same resumed rows. Self-drafters over the target's
// first 2 layers; draft models sharing one draft Model, whose root level also carries the committed
// tokens the draft cache has not run yet (the accepted chain's last node); greedy and sampled trees.
TEST_F(SpecTiny, DraftingTogetherGivesEachSequenceItsTreeAlone) {
  Tiny t = load_tiny(spec("gemma3", 11), (dir_ / "t.gguf").string());
  Tiny d = load_tiny(spec("llama", 5), (dir_ / "d.gguf").string());
  const std::vector<std::vector<int32_t>> prompts = {kPrompt, {5, 9, 200, 7, 3, 250, 11, 12, 13, 14, 15}};
  std::vector<int32_t> vocab_of[2];  // sequence 0: even ids, sequence 1: odd ids
  for (int32_t id = 0; id < kVocab; ++id) vocab_of[id % 2].push_back(id);
  std::vector<std::unique_ptr<Generator>> gens;
  std::vector<std::unique_ptr<Drafter>> self, draft;
  for (size_t i = 0; i < prompts.size(); ++i) {
    gens.push_back(std::make_unique<Generator>(*t.model, *tok_, 128));
    gens[i]->prefill(prompts[i]);
    self.push_back(std::make_unique<SelfDrafter>(*t.model, gens[i]->cache(), 2,
                                                 DraftVocabulary::packed(*t.model, vocab_of[i])));
    draft.push_back(std::make_unique<ModelDrafter>(*d.model, 128, DraftVocabulary::packed(*d.model, vocab_of[i])));
    draft[i]->begin(prompts[i], {});
  }
  const auto same_tree = [](const DraftTree& a, const DraftTree& b) {
    if (a.size() != b.size() || a.q.size() != b.q.size()) return false;
    for (int32_t i = 0; i < a.size(); ++i) {
      const TreeNode &x = a.nodes[i], &y = b.nodes[i];
      if (x.token != y.token || x.parent != y.parent || x.depth != y.depth || x.candidate != y.candidate ||
          std::memcmp(&x.score, &y.score, sizeof(float)) != 0)
        return false;
    }
    for (size_t i = 0; i < a.q.size(); ++i)
      if (a.q[i] != b.q[i]) return false;
    return true;
  };
  const int32_t d_embd = t.model->config().n_embd;
  std::vector<int32_t> position(prompts.size());  // each draft model's committed tokens so far
  for (size_t i = 0; i < prompts.size(); ++i) position[i] = int32_t(prompts[i].size());
  for (const bool sampled : {false, true})
  for (const TreeParams& shape : {TreeParams{3, 2, 6}, TreeParams{3, 1, 4}}) {
    const std::string what = std::string(sampled ? "sampled" : "greedy") + " tree " + std::to_string(shape.top_k);
    for (int step = 0; step < 4; ++step) {
      for (auto* drafters : {&self, &draft}) {
        const bool is_self = drafters == &self;
        DraftTree alone[2], together[2];
        std::vector<float> alone_resumed[2];
        std::vector<std::unique_ptr<Sampler>> samplers;  // the same seed alone and together
        std::vector<DraftSampling> sampling(2 * prompts.size());
        for (auto& ds : sampling) {
          samplers.push_back(std::make_unique<Sampler>(SamplingParams{.temperature = 0.9f, .seed = 7}, kVocab));
          ds.sampler = samplers.back().get();
        }
        const auto root = [&](size_t i) { return int32_t(3 + 41 * step + 97 * i) % kVocab; };
        const auto pos = [&](size_t i) { return is_self ? gens[i]->cache().n_past() : position[i]; };
        for (size_t i = 0; i < prompts.size(); ++i) {
          (*drafters)[i]->propose(root(i), pos(i), shape, sampled ? &sampling[i] : nullptr, alone[i]);
          const VerifyResume r = (*drafters)[i]->resume_for(alone[i]);
          alone_resumed[i].assign(r.activations, r.activations + size_t(r.rows) * (r.rows ? d_embd : 0));
        }
        DraftJob jobs[2];
        for (size_t i = 0; i < prompts.size(); ++i)
          jobs[i] = {.growth = (*drafters)[i]->begin_propose(root(i), pos(i), shape,
                                                             sampled ? &sampling[2 + i] : nullptr, together[i]),
                     .tree = &together[i]};
        draft_together(jobs);
        for (size_t i = 0; i < prompts.size(); ++i) {
          const std::string where = what + (is_self ? " self" : " draft model") + " step " + std::to_string(step) +
                                    " sequence " + std::to_string(i);
          ASSERT_GT(alone[i].size(), 0) << where;
          EXPECT_TRUE(same_tree(alone[i], together[i])) << where;
          EXPECT_EQ(jobs[i].levels, shape.depth + 1) << where;
          EXPECT_EQ(jobs[i].shared_forwards, jobs[i].levels) << where;  // every level ran with the other sequence
          for (const TreeNode& node : together[i].nodes)
            EXPECT_EQ(node.token % 2, int32_t(i)) << where << ": a token outside the sequence's vocabulary";
          const VerifyResume r = (*drafters)[i]->resume_for(together[i]);
          if (is_self) EXPECT_GT(r.rows, 1) << where;
          ASSERT_EQ(size_t(r.rows) * (r.rows ? d_embd : 0), alone_resumed[i].size()) << where;
          if (r.rows > 0)
            EXPECT_EQ(0, std::memcmp(r.activations, alone_resumed[i].data(), alone_resumed[i].size() * sizeof(float)))
                << where;
          if (is_self) continue;
          // The draft model's sequence commits the root and its tree's first branch (root to leaf):
          // the leaf was never run through the draft, so the next root level carries it.
          std::vector<int32_t> path;
          for (int32_t cur = -1, n = 0; n < together[i].size(); ++n)
            if (together[i].nodes[n].parent == cur) {
              path.push_back(n);
              cur = n;
            }
          (*drafters)[i]->accepted(root(i), together[i], path, nullptr);
          position[i] += 1 + int32_t(path.size());
        }
      }
    }
  }
}

// The server's draft policy (one table, server/batch_scheduler.h): the configured tree at low
// load, a chain of at most 2 tokens up to --spec-max-batch sequences in flight, nothing above.
TEST(DraftPolicy, ShapeShrinksWithTheSequencesInFlight) {
  const TreeParams tree{3, 2, 6};
  const auto shape = [&](int in_flight, int max_batch) { return server::draft_shape(tree, in_flight, max_batch); };
  for (int n : {1, 2}) EXPECT_EQ(shape(n, 4).total_tokens, 6) << n;
  for (int n : {3, 4}) {
    EXPECT_EQ(shape(n, 4).total_tokens, 2) << n;
    EXPECT_EQ(shape(n, 4).top_k, 1) << n;
    EXPECT_EQ(shape(n, 4).depth, 1) << n;
  }
  EXPECT_EQ(shape(5, 4).total_tokens, 0);
  EXPECT_EQ(shape(8, 16).total_tokens, 6);
  EXPECT_EQ(shape(16, 16).total_tokens, 2);
  EXPECT_EQ(shape(2, 0).total_tokens, 0);  // 0: draft only alone
  EXPECT_EQ(shape(1, 0).total_tokens, 6);
  EXPECT_EQ(server::draft_shape({3, 1, 1}, 3, 4).total_tokens, 1);  // never more than configured
  EXPECT_EQ(server::draft_shape({3, 1, 1}, 3, 4).depth, 0);
}

// Plain decoding is the Decoder without a drafter: the same tokens, text, finish and counters as
// the reference Generator, greedy and sampled (same seed, same draws).
TEST_F(SpecTiny, DecoderWithoutDrafterIsPlainDecoding) {
  Tiny t = load_tiny(spec("llama", 3), (dir_ / "m.gguf").string());
  GenerateParams params;
  params.max_new_tokens = 30;
  params.ignore_eos = true;
  for (float temperature : {0.0f, 1.2f}) {
    params.sampling.temperature = temperature;
    params.sampling.seed = 11;
    Generator plain_gen(*t.model, *tok_, 128);
    const GenerateResult plain = plain_gen.generate(kPrompt, params);
    Generator gen(*t.model, *tok_, 128);
    Decoder decoder(gen, *tok_, nullptr, TreeParams{});
    EXPECT_FALSE(decoder.speculative());
    const SpecResult r = decoder.generate(kPrompt, params);
    EXPECT_EQ(r.gen.tokens, plain.tokens) << "T=" << temperature;
    EXPECT_EQ(r.gen.text, plain.text);
    EXPECT_EQ(r.gen.finish, plain.finish);
    EXPECT_EQ(r.gen.decode_forwards, plain.decode_forwards);
    EXPECT_EQ(r.decode_tokens(), plain.decode_forwards);
    EXPECT_EQ(r.stats.drafted, 0);
  }
}

// decode_tokens (and so every tok/s) counts only what the sink took: the tokens a step accepted
// past the token limit, a stop string or the end of generation are not decoded output.
TEST_F(SpecTiny, DecodeTokensCountOnlyWhatTheSinkTook) {
  Tiny t = load_tiny(spec("gemma3", 5), (dir_ / "m.gguf").string());
  GenerateParams params;
  params.ignore_eos = true;
  for (int32_t n : {1, 2, 3, 7, 13}) {
    params.max_new_tokens = n;
    Generator plain_gen(*t.model, *tok_, 128);
    const GenerateResult plain = plain_gen.generate(kPrompt, params);
    Generator gen(*t.model, *tok_, 128);
    // All layers: every draft token is accepted, so each step yields 5 tokens.
    SelfDrafter d(*t.model, gen.cache(), 3, DraftVocabulary::full(kVocab));
    Decoder decoder(gen, *tok_, &d, {3, 1, 4});
    const SpecResult r = decoder.generate(kPrompt, params);
    ASSERT_EQ(r.gen.tokens, plain.tokens) << n;
    EXPECT_EQ(r.decode_tokens(), plain.decode_forwards) << "max tokens " << n;
    EXPECT_EQ(r.decode_tokens(), int64_t(r.gen.tokens.size()) - 1) << "max tokens " << n;
  }
  // Ended by a stop string inside a step.
  params.max_new_tokens = 40;
  Generator g(*t.model, *tok_, 128);
  const GenerateResult full = g.generate(kPrompt, params);
  ASSERT_GE(full.tokens.size(), 12u);
  params.stop_strings = {tok_->token_to_piece(full.tokens[9]).substr(1)};
  Generator plain_gen(*t.model, *tok_, 128);
  const GenerateResult plain = plain_gen.generate(kPrompt, params);
  ASSERT_EQ(plain.finish, FinishReason::StopString);
  Generator gen(*t.model, *tok_, 128);
  SelfDrafter d(*t.model, gen.cache(), 3, DraftVocabulary::full(kVocab));
  const SpecResult r = Decoder(gen, *tok_, &d, {3, 1, 4}).generate(kPrompt, params);
  EXPECT_EQ(r.gen.tokens, plain.tokens);
  EXPECT_EQ(r.decode_tokens(), plain.decode_forwards) << "stop string";
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
  const float* logits = g.prefill(prompt, 3, &top);
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

TEST_F(SpecTiny, ForwardResumedAtEachLayerIsBitwiseTheSame) {
  for (const char* arch : {"gemma3", "llama"}) {
    Tiny t = load_tiny(spec(arch, 13), (dir_ / (std::string(arch) + ".gguf")).string());
    Model& m = *t.model;
    // A committed prefix, then a small tree run whole vs. resumed: its leading rows run the first
    // layers in calls of their own (as a self-drafter drafts the root and tree nodes), then join the
    // whole tree's call at that layer (SequenceForward::resumed_rows), the other rows run fresh.
    Batch prefix;
    prefix.set_sequence(kPrompt, 0, false);
    Batch tree;
    tree.tokens = {40, 41, 42, 43};
    tree.positions = {6, 7, 7, 8};
    tree.parents = {-1, 0, 0, 1};
    tree.output_rows = {0, 1, 2, 3};
    ForwardOutput whole, part, rest;
    KVCache kv0 = m.make_cache(64);
    m.forward(prefix, kv0, whole);
    kv0.commit_prefix(int32_t(kPrompt.size()));
    m.forward(tree, kv0, whole, {.logits = true});
    // Rows [from, to) of the tree as a batch of their own, at their own pending slots.
    auto tree_rows = [&](int32_t from, int32_t to) {
      Batch b;
      b.start = from;
      b.tokens.assign(tree.tokens.begin() + from, tree.tokens.begin() + to);
      b.positions.assign(tree.positions.begin() + from, tree.positions.begin() + to);
      b.parents.assign(tree.parents.begin() + from, tree.parents.begin() + to);
      for (int32_t i = 0; i < to - from; ++i) b.output_rows.push_back(i);
      return b;
    };
    for (int32_t layer = 1; layer <= m.config().n_layer; ++layer) {
      for (int32_t resumed = 1; resumed <= tree.size(); ++resumed) {
        KVCache kv = m.make_cache(64);
        m.forward(prefix, kv, part);
        kv.commit_prefix(int32_t(kPrompt.size()));
        // The root through layers [0, layer) alone, then the other resumed rows in a second call.
        m.forward(tree_rows(0, 1), kv, part, {.end_layer = layer});
        std::vector<float> x(part.residual);
        if (resumed > 1) {
          m.forward(tree_rows(1, resumed), kv, part, {.end_layer = layer});
          x.insert(x.end(), part.residual.begin(), part.residual.end());
        }
        const SequenceForward seq{.batch = &tree,
                                  .kv = &kv,
                                  .out = &rest,
                                  .resumed_rows = resumed,
                                  .resumed_layer = layer,
                                  .resumed = x.data()};
        m.forward(std::span<const SequenceForward>(&seq, 1), {.logits = true});
        EXPECT_EQ(rest.logits, whole.logits) << arch << " " << resumed << " rows resumed at layer " << layer;
        EXPECT_EQ(rest.hidden, whole.hidden) << arch << " " << resumed << " rows resumed at layer " << layer;
      }
    }
    KVCache kv = m.make_cache(64);
    auto resume = [&](int32_t rows, int32_t layer, const float* streams, int32_t end_layer) {
      const SequenceForward seq{.batch = &tree,
                                .kv = &kv,
                                .out = &rest,
                                .resumed_rows = rows,
                                .resumed_layer = layer,
                                .resumed = streams};
      m.forward(std::span<const SequenceForward>(&seq, 1), {.end_layer = end_layer});
    };
    const int32_t all = ForwardOptions::kAllLayers;
    EXPECT_THROW(resume(2, 2, nullptr, all), Error);                // resumed rows without their streams
    EXPECT_THROW(resume(2, 0, whole.residual.data(), all), Error);  // resumed at layer 0
    EXPECT_THROW(resume(5, 2, whole.residual.data(), all), Error);  // more rows than the batch has
    EXPECT_THROW(resume(2, 2, whole.residual.data(), 1), Error);    // past the call's last layer
    EXPECT_NO_THROW(resume(2, 2, whole.residual.data(), all));
  }
}

TEST_F(SpecTiny, RejectsBadSetups) {
  Tiny t = load_tiny(spec("gemma3", 5), (dir_ / "m.gguf").string());
  Generator g(*t.model, *tok_, 64);
  SelfDrafter d(*t.model, g.cache(), 2, DraftVocabulary::full(kVocab));
  Decoder sg(g, *tok_, &d, {3, 2, 6});
  EXPECT_THROW(SelfDrafter(*t.model, g.cache(), 4, DraftVocabulary::full(kVocab)), Error);
  EXPECT_THROW(Decoder(g, *tok_, &d, {3, 2, 64}), Error);  // 65 verified rows > n_batch 64
  EXPECT_THROW(DraftVocabulary::subset({1, 1}, kVocab), Error);
  EXPECT_THROW(DraftVocabulary::subset({kVocab}, kVocab), Error);
}

// --- Speculative sampling: the distribution of the output equals plain sampling's ------------

// Chi-square goodness of fit of observed counts against exact probabilities, pooling categories
// whose expected count is below 5. Returns (statistic, critical value at significance 1e-4),
// the critical value from the Wilson-Hilferty approximation of the chi-square quantile.
std::pair<double, double> chi_square(const std::map<std::vector<int32_t>, double>& exact,
                                     const std::map<std::vector<int32_t>, int>& observed, int n) {
  double stat = 0.0, pooled_expected = 0.0;
  int pooled_observed = 0, bins = 0;
  int seen = 0;
  for (const auto& [seq, prob] : exact) {
    const double e = prob * n;
    auto it = observed.find(seq);
    const int o = it == observed.end() ? 0 : it->second;
    seen += o;
    if (e < 5.0) {
      pooled_expected += e;
      pooled_observed += o;
      continue;
    }
    stat += (o - e) * (o - e) / e;
    ++bins;
  }
  // Sequences the exact distribution gives no mass at all are impossible: count them as a huge
  // deviation in the pooled bin.
  pooled_observed += n - seen;
  if (pooled_expected > 0.0 || pooled_observed > 0) {
    const double e = std::max(pooled_expected, 1e-9);
    stat += (pooled_observed - e) * (pooled_observed - e) / e;
    ++bins;
  }
  const double df = std::max(1, bins - 1);
  const double z = 3.719;  // standard normal quantile of 1 - 1e-4
  const double a = 2.0 / (9.0 * df);
  return {stat, df * std::pow(1.0 - a + z * std::sqrt(a), 3.0)};
}

class SpecSampling : public SpecTiny {
 protected:
  static constexpr int32_t kTokens = 4;  // tokens per sample: 1 from the prefill, 3 from steps
  // Exact probability of every kTokens-token continuation under plain sampling.
  // Exact plain-sampling probability of every kTokens-token continuation of kPrompt; with
  // penalties, each prefix's row is transformed with the prompt and the prefix as history.
  std::map<std::vector<int32_t>, double> exact_sequences(Model& model, const SamplingParams& sp,
                                                         const PenaltyParams& penalties = {}) {
    std::map<std::vector<int32_t>, double> out;
    Generator g(model, *tok_, 64);
    Sampler s(sp, kVocab);
    Penalizer penalizer(penalties, kVocab);
    std::vector<float> row(kVocab);
    std::vector<std::pair<std::vector<int32_t>, double>> frontier = {{{}, 1.0}};
    std::vector<std::pair<int32_t, float>> dist;
    for (int32_t depth = 0; depth < kTokens; ++depth) {
      std::vector<std::pair<std::vector<int32_t>, double>> next;
      for (const auto& [seq, prob] : frontier) {
        std::vector<int32_t> prompt = kPrompt;
        prompt.insert(prompt.end(), seq.begin(), seq.end());
        const float* logits = g.prefill(prompt);
        std::copy(logits, logits + kVocab, row.begin());
        if (penalizer.active()) {
          penalizer.begin(kPrompt, 64);
          for (int32_t tok : seq) penalizer.accept(tok);
          penalizer.apply(row.data());
        }
        s.distribution(row.data(), dist);
        for (const auto& [id, p] : dist) {
          std::vector<int32_t> longer = seq;
          longer.push_back(id);
          next.emplace_back(longer, prob * p);
        }
      }
      frontier.swap(next);
    }
    for (const auto& [seq, prob] : frontier) out[seq] += prob;
    return out;
  }
};

TEST_F(SpecSampling, OutputDistributionEqualsPlainSampling) {
  Tiny t = load_tiny(spec("gemma3", 9), (dir_ / "target.gguf").string());
  Tiny other = load_tiny(spec("llama", 4), (dir_ / "other.gguf").string());
  SamplingParams sp;
  sp.temperature = 1.5f;
  sp.top_k = 3;
  sp.top_p = 1.0f;
  const auto exact = exact_sequences(*t.model, sp);
  constexpr int kSamples = 6000;
  GenerateParams params;
  params.max_new_tokens = kTokens;
  params.ignore_eos = true;
  params.sampling = sp;

  std::vector<int32_t> odd;  // a pruned draft vocabulary: q lacks half of p's support
  for (int32_t i = 1; i < kVocab; i += 2) odd.push_back(i);
  struct Case {
    std::string name;
    std::function<std::unique_ptr<Drafter>(Generator&)> make;
    TreeParams tree;
    double min_accept_rate;  // accepted / drafted
  };
  const std::vector<Case> cases = {
      // All layers: q == p bit for bit (verification reproduces the draft's logits), so every
      // draft token must be accepted.
      {"self all layers, chain",
       [&](Generator& g) {
         return std::make_unique<SelfDrafter>(*t.model, g.cache(), 3, DraftVocabulary::full(kVocab));
       },
       {3, 1, 4},
       1.0},
      {"self 1 layer, chain",
       [&](Generator& g) {
         return std::make_unique<SelfDrafter>(*t.model, g.cache(), 1, DraftVocabulary::full(kVocab));
       },
       {3, 1, 4},
       0.02},
      {"self 2 layers, tree k2",
       [&](Generator& g) {
         return std::make_unique<SelfDrafter>(*t.model, g.cache(), 2, DraftVocabulary::full(kVocab));
       },
       {2, 2, 6},
       0.05},
      {"other model, tree k3",
       [&](Generator&) { return std::make_unique<ModelDrafter>(*other.model, 64, DraftVocabulary::full(kVocab)); },
       {2, 3, 8},
       0.0005},
      // An EAGLE-3 head (random weights) reading the target's features: its own q, its own cache.
      {"EAGLE-3 head, tree k2",
       [&](Generator&) {
         const std::string path = (dir_ / "head.gguf").string();
         test::write_tiny_head(test::TinyHeadSpec{}, path);
         return std::make_unique<HeadDrafter>(
             std::make_unique<Eagle3Head>(GgufFile::open(path), *t.model, t.model->n_batch()), *t.model, 64,
             DraftVocabulary::full(kVocab));
       },
       {2, 2, 6},
       0.0005},
      // --spec auto switching between an n-gram chain, the self-draft and plain steps within a
      // generation (checked below): each step's option depends only on the steps before it.
      {"auto (n-gram, self 2 layers, plain)",
       [&](Generator& g) { return make_auto(*t.model, g, 64, 0.15); },
       {3, 1, 4},
       0.02},
      {"self 2 layers, pruned vocabulary, tree k2",
       [&](Generator& g) {
         return std::make_unique<SelfDrafter>(*t.model, g.cache(), 2, DraftVocabulary::subset(odd, kVocab));
       },
       {2, 2, 5},
       0.02},
  };
  for (const Case& c : cases) {
    Generator gen(*t.model, *tok_, 64);
    std::unique_ptr<Drafter> d = c.make(gen);
    Decoder sg(gen, *tok_, d.get(), c.tree);
    std::map<std::vector<int32_t>, int> observed;
    int64_t accepted = 0, drafted = 0;
    int switched = 0;  // generations whose steps came from more than one option (auto)
    for (int i = 0; i < kSamples; ++i) {
      params.sampling.seed = 1000 + i;
      const SpecResult r = sg.generate(kPrompt, params);
      ASSERT_EQ(r.gen.tokens.size(), size_t(kTokens)) << c.name;
      ++observed[r.gen.tokens];
      accepted += r.stats.accepted_draft;
      drafted += r.stats.drafted;
      int sources = 0;
      for (const auto& by : r.stats.by_source) sources += by.steps > 0;
      switched += sources > 1;
    }
    if (dynamic_cast<const AutoDrafter*>(d.get())) {
      EXPECT_GT(switched, kSamples / 10) << c.name;
      std::printf("%s: %d of %d generations switched options\n", c.name.c_str(), switched, kSamples);
    }
    const auto [stat, crit] = chi_square(exact, observed, kSamples);
    EXPECT_LT(stat, crit) << c.name << ": chi-square " << stat << " >= " << crit;
    // Both branches of the rejection sampler ran: some drafts were accepted, some rejected (none
    // when the draft is the target itself).
    EXPECT_GE(double(accepted), c.min_accept_rate * double(drafted)) << c.name;
    if (c.min_accept_rate < 1.0) EXPECT_LT(accepted, drafted) << c.name;
    std::printf("%s: chi-square %.1f (critical %.1f), accepted %lld of %lld drafted\n", c.name.c_str(), stat,
                crit, (long long)accepted, (long long)drafted);
  }

  // The test has power: plain sampling passes it, and taking the draft's own samples (what
  // accepting every draft token would emit) fails it.
  {
    Generator plain(*t.model, *tok_, 64);
    std::map<std::vector<int32_t>, int> observed;
    for (int i = 0; i < kSamples; ++i) {
      params.sampling.seed = 50000 + i;
      ++observed[plain.generate(kPrompt, params).tokens];
    }
    const auto [stat, crit] = chi_square(exact, observed, kSamples);
    EXPECT_LT(stat, crit) << "plain sampling: chi-square " << stat;
    Generator draft_gen(*other.model, *tok_, 64);
    std::map<std::vector<int32_t>, int> wrong;
    for (int i = 0; i < kSamples; ++i) {
      params.sampling.seed = 90000 + i;
      ++wrong[draft_gen.generate(kPrompt, params).tokens];
    }
    const auto [wstat, wcrit] = chi_square(exact, wrong, kSamples);
    EXPECT_GT(wstat, wcrit) << "the draft's own distribution should fail the test";
  }
}

// Penalties (sampling/penalties.h) transform the target's rows identically in plain and
// speculative decoding, each tree node's row with the history up to that node.
PenaltyParams tiny_penalties() {
  PenaltyParams p;
  p.repeat_penalty = 1.5f;
  p.repeat_last_n = -1;  // the prompt counts too
  p.presence_penalty = 0.5f;
  p.frequency_penalty = 0.7f;
  p.logit_bias = {{17, 1.0f}, {250, -2.0f}};
  return p;
}

TEST_F(SpecTiny, GreedyWithPenaltiesMatchesPlain) {
  Tiny t = load_tiny(spec("gemma3", 7), (dir_ / "t.gguf").string());
  GenerateParams params;
  params.max_new_tokens = 40;
  params.ignore_eos = true;
  params.penalties = tiny_penalties();
  Generator g(*t.model, *tok_, 128);
  const std::vector<int32_t> penalised = g.generate(kPrompt, params).tokens;
  GenerateParams unpenalised = params;
  unpenalised.penalties = {};
  EXPECT_NE(penalised, g.generate(kPrompt, unpenalised).tokens) << "the penalties must change the output";
  for (const TreeParams& tree : {TreeParams{4, 1, 5}, TreeParams{3, 2, 6}, TreeParams{2, 3, 8}})
    for (int32_t layers : {1, 3})
      expect_same(
          *t.model, kPrompt, params, 128,
          [&](Generator& gen) {
            return std::make_unique<SelfDrafter>(*t.model, gen.cache(), layers, DraftVocabulary::full(kVocab));
          },
          tree, "penalties, layers " + std::to_string(layers) + " tree k" + std::to_string(tree.top_k));
  // Plain decoding through the Decoder (no drafter) is the same too.
  Generator gen(*t.model, *tok_, 128);
  Decoder plain(gen, *tok_, nullptr, TreeParams{});
  EXPECT_EQ(plain.generate(kPrompt, params).gen.tokens, penalised);
}

TEST_F(SpecSampling, PenalisedOutputDistributionEqualsPenalisedPlainSampling) {
  Tiny t = load_tiny(spec("gemma3", 9), (dir_ / "target.gguf").string());
  SamplingParams sp;
  sp.temperature = 1.5f;
  sp.top_k = 4;
  sp.top_p = 1.0f;
  sp.min_p = 0.05f;
  const PenaltyParams pen = tiny_penalties();
  // Exact penalised plain sampling over kTokens tokens.
  const std::map<std::vector<int32_t>, double> exact = exact_sequences(*t.model, sp, pen);
  constexpr int kSamples = 6000;
  GenerateParams params;
  params.max_new_tokens = kTokens;
  params.ignore_eos = true;
  params.sampling = sp;
  params.penalties = pen;
  const std::pair<std::string, TreeParams> cases[] = {{"self 1 layer, chain", {3, 1, 4}},
                                                      {"self 2 layers, tree k2", {2, 2, 6}}};
  for (const auto& [name, tree] : cases) {
    Generator gen(*t.model, *tok_, 64);
    SelfDrafter d(*t.model, gen.cache(), name.find("1 layer") != std::string::npos ? 1 : 2,
                  DraftVocabulary::full(kVocab));
    Decoder sg(gen, *tok_, &d, tree);
    std::map<std::vector<int32_t>, int> observed;
    int64_t accepted = 0, drafted = 0;
    for (int i = 0; i < kSamples; ++i) {
      params.sampling.seed = 7000 + i;
      const SpecResult r = sg.generate(kPrompt, params);
      ASSERT_EQ(r.gen.tokens.size(), size_t(kTokens)) << name;
      ++observed[r.gen.tokens];
      accepted += r.stats.accepted_draft;
      drafted += r.stats.drafted;
    }
    const auto [stat, crit] = chi_square(exact, observed, kSamples);
    std::printf("penalised, %s: chi-square %.1f (critical %.1f), accepted %lld of %lld drafted\n", name.c_str(), stat,
                crit, (long long)accepted, (long long)drafted);
    EXPECT_LT(stat, crit) << name;
    EXPECT_GT(accepted, 0) << name;
    EXPECT_LT(accepted, drafted) << name;
  }
  // Power: speculative sampling WITHOUT the penalties (the unpenalised distribution) fails.
  Generator gen(*t.model, *tok_, 64);
  SelfDrafter d(*t.model, gen.cache(), 2, DraftVocabulary::full(kVocab));
  Decoder sg(gen, *tok_, &d, {2, 2, 6});
  params.penalties = {};
  std::map<std::vector<int32_t>, int> wrong;
  for (int i = 0; i < kSamples; ++i) {
    params.sampling.seed = 90000 + i;
    ++wrong[sg.generate(kPrompt, params).gen.tokens];
  }
  const auto [wstat, wcrit] = chi_square(exact, wrong, kSamples);
  std::printf("unpenalised against penalised: chi-square %.1f (critical %.1f)\n", wstat, wcrit);
  EXPECT_GT(wstat, wcrit) << "sampling without the penalties must fail the test";
}

TEST(TreeSamplingVerifier, AcceptsRejectsAndDrawsFromTheResidual) {
  // One root with children a (0) then b (1), drawn from q = {0: .5, 1: .5}; target p over 3 tokens.
  constexpr int32_t V = 3;
  DraftTree tree;
  tree.nodes = {{0, -1, 1, 0.0f, 0}, {1, -1, 1, 0.0f, 1}};
  tree.q = {{{0, 0.5f}, {1, 0.5f}}, {}, {}};
  // Target logits rows: root, node 0, node 1. Temperature 1, no filters: p = softmax(row).
  auto logits_for = [](std::vector<float> p) {
    std::vector<float> l;
    for (float x : p) l.push_back(x > 0 ? std::log(x) : -std::numeric_limits<float>::infinity());
    return l;
  };
  SamplingParams sp;
  sp.temperature = 1.0f;
  sp.top_k = 0;
  sp.top_p = 1.0f;
  TreeSamplingVerifier v(V);
  std::vector<int32_t> path, emitted;
  // p = (0.2, 0.2, 0.6): P(accept a) = 0.4; after rejecting a, p' = norm(max(0, p - q)) = (0, 0, 1)
  // and q' = (0, 1, 0): P(accept b | a rejected) = 0, so the bonus is token 2 with prob 0.6.
  std::vector<float> rows = logits_for({0.2f, 0.2f, 0.6f});
  const std::vector<float> child = logits_for({1.0f, 0.0f, 0.0f});  // node rows: next token is 0
  rows.insert(rows.end(), child.begin(), child.end());
  rows.insert(rows.end(), child.begin(), child.end());
  Sampler s(sp, V);
  int accept_a = 0, accept_b = 0, bonus2 = 0, other = 0;
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    v.accept(tree, rows.data(), V, s, path, emitted);
    if (path == std::vector<int32_t>{0} && emitted == std::vector<int32_t>{0, 0}) ++accept_a;
    else if (path == std::vector<int32_t>{1}) ++accept_b;
    else if (path.empty() && emitted == std::vector<int32_t>{2}) ++bonus2;
    else ++other;
  }
  EXPECT_EQ(other, 0);
  EXPECT_EQ(accept_b, 0);
  EXPECT_NEAR(accept_a / double(n), 0.4, 0.015);
  EXPECT_NEAR(bonus2 / double(n), 0.6, 0.015);
  // p == q on the children's tokens: the first child is always accepted.
  std::vector<float> same = logits_for({0.5f, 0.5f, 0.0f});
  same.insert(same.end(), child.begin(), child.end());
  same.insert(same.end(), child.begin(), child.end());
  for (int i = 0; i < 200; ++i) {
    v.accept(tree, same.data(), V, s, path, emitted);
    EXPECT_EQ(path, std::vector<int32_t>{0});
  }
  // A tree built without sampling is refused.
  DraftTree greedy_tree;
  greedy_tree.nodes = tree.nodes;
  EXPECT_THROW(v.accept(greedy_tree, rows.data(), V, s, path, emitted), Error);
}

}  // namespace
}  // namespace microspec
