// Draft vocabularies inside speculative decoding: every kind (full, freq's packed set, MicroSpec's
// dynamic window with its ablations, hybrid) keeps greedy output identical to plain decoding on
// tiny random models, for a self-drafter and a draft model, with windows small enough to evict
// every step; a Decoder builds them from a SpecConfig and a frequency file; and on the real Gemma
// 3 270M head the packed rows give bit-for-bit the full head's logits after random updates.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/generator.h"
#include "engine/speculative_decoder.h"
#include "gguf/gguf.h"
#include "gguf/gguf_writer.h"
#include "model/model.h"
#include "speculative/drafter.h"
#include "speculative/settings.h"
#include "support/test_helpers.h"
#include "support/tiny_model.h"
#include "tokenizer/tokenizer.h"
#include "util/error.h"
#include "vocab/draft_vocab.h"
#include "vocab/freq_file.h"
#include "vocab/packed_head.h"

namespace microspec {
namespace {

constexpr int32_t kVocab = 320;


class VocabSpec : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("microspec_vocab_spec_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
    tok_file_ = GgufFile::open(test::write_tiny_tokenizer((dir_ / "tok.gguf").string(), kVocab));
    tok_ = Tokenizer::from_gguf(*tok_file_);
    test::TinyModelSpec s;
    s.arch = "gemma3";
    s.n_vocab = kVocab;
    s.n_layer = 3;
    s.sliding_window = 8;
    s.seed = 21;
    s.untied_output = true;  // a tied random model only repeats its last token
    const std::string path = (dir_ / "m.gguf").string();
    test::write_tiny_model(s, path);
    file_ = GgufFile::open(path);
    ModelOptions opt;
    opt.n_threads = 2;
    opt.n_batch = 64;
    model_ = Model::load(*file_, opt);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Plain greedy output, then speculative; they must be identical. Returns the statistics.
  SpecStats expect_same(const std::function<std::unique_ptr<Drafter>(Generator&)>& make_drafter,
                        const TreeParams& tree, const std::string& what, int32_t max_new = 48) {
    GenerateParams params;
    params.max_new_tokens = max_new;
    params.ignore_eos = true;
    Generator plain_gen(*model_, *tok_, 256);
    const GenerateResult plain = plain_gen.generate(kPrompt, params);
    Generator gen(*model_, *tok_, 256);
    std::unique_ptr<Drafter> drafter = make_drafter(gen);
    Decoder sg(gen, *tok_, drafter.get(), tree);
    SpecResult spec;
    // Twice through the same drafter: begin() must restart the window.
    for (int rep = 0; rep < 2; ++rep) {
      spec = sg.generate(kPrompt, params);
      EXPECT_EQ(plain.tokens, spec.gen.tokens) << what << " run " << rep;
      EXPECT_EQ(plain.text, spec.gen.text) << what;
      EXPECT_EQ(plain.finish, spec.gen.finish) << what;
    }
    return spec.stats;
  }

  static DynamicVocabParams dyn(int32_t w, int32_t kpre, int32_t kver, bool async) {
    DynamicVocabParams p;
    p.stream.w_max = w;
    p.stream.k_pre = kpre;
    p.stream.k_ver = kver;
    p.async_gather = async;
    return p;
  }

  std::filesystem::path dir_;
  std::unique_ptr<GgufFile> tok_file_, file_;
  std::unique_ptr<Tokenizer> tok_;
  std::unique_ptr<Model> model_;
  const std::vector<int32_t> kPrompt = {1, 17, 250, 33, 90, 141, 17, 33};
};

TEST_F(VocabSpec, EveryDynamicSettingIsLosslessForASelfDrafter) {
  struct Case {
    std::string name;
    DynamicVocabParams p;
    std::vector<int32_t> pinned;
  };
  std::vector<Case> cases;
  for (bool async : {true, false}) {
    cases.push_back({"W 12 (evicts every step)", dyn(12, 2, 2, async), {}});
    cases.push_back({"W 64", dyn(64, 3, 3, async), {}});
    cases.push_back({"W 4096 > vocabulary", dyn(4096, 3, 3, async), {}});
  }
  cases.push_back({"W 3 smaller than the prompt", dyn(3, 3, 1, true), {}});
  cases.push_back({"kpre 0 kver 0", dyn(32, 0, 0, true), {}});
  Case last = {"K_ver of the last accepted row only", dyn(24, 3, 3, true), {}};
  last.p.stream.kver_rows = CandidateStreamParams::KverRows::Last;
  cases.push_back(last);
  Case ctx = {"source ctx", dyn(24, 3, 3, true), {}};
  ctx.p.stream.source = CandidateStreamParams::Source::Ctx;
  cases.push_back(ctx);
  Case ext = {"source ext (empty at first)", dyn(24, 3, 3, true), {}};
  ext.p.stream.source = CandidateStreamParams::Source::Ext;
  cases.push_back(ext);
  cases.push_back({"hybrid", dyn(12, 2, 2, true), {2, 5, 6, 7, 8, 9, 10}});

  for (const Case& c : cases)
    for (int32_t layers : {1, 3})
      for (const TreeParams& tree : {TreeParams{4, 1, 5}, TreeParams{3, 2, 6}}) {
        const std::string what =
            c.name + ", layers " + std::to_string(layers) + ", top-k " + std::to_string(tree.top_k);
        const SpecStats st = expect_same(
            [&](Generator& g) {
              return std::make_unique<SelfDrafter>(*model_, g.cache(), layers,
                                                   DraftVocabulary::dynamic(*model_, c.p, c.pinned));
            },
            tree, what);
        const int32_t cap = std::min<int32_t>(kVocab, c.p.stream.w_max + int32_t(c.pinned.size()));
        EXPECT_LE(st.mean_active_vocab(), cap) << what;
        if (c.p.stream.source != CandidateStreamParams::Source::Ext)
          EXPECT_GT(st.mean_active_vocab(), 0.0) << what;
        // The draft is the target itself: whenever the target's next token is in the window it is
        // proposed and accepted, and a random model's output revisits its recent tokens.
        if (layers == 3 && c.p.stream.source != CandidateStreamParams::Source::Ctx && c.p.stream.k_ver > 0)
          EXPECT_GT(st.accepted_draft, 0) << what;
      }
}

TEST_F(VocabSpec, FreqAndDynamicAreLosslessForADraftModel) {
  std::vector<int32_t> some;
  for (int32_t i = 0; i < kVocab; i += 3) some.push_back(i);
  const TreeParams tree{3, 2, 6};
  expect_same(
      [&](Generator&) {
        return std::make_unique<ModelDrafter>(*model_, 256, DraftVocabulary::packed(*model_, some));
      },
      tree, "draft model, packed third of the vocabulary");
  for (bool async : {true, false})
    expect_same(
        [&](Generator&) {
          return std::make_unique<ModelDrafter>(*model_, 256,
                                                DraftVocabulary::dynamic(*model_, dyn(16, 2, 2, async)));
        },
        tree, std::string("draft model, dynamic W 16") + (async ? "" : " sync"));
  CandidateStreamParams::Source ext = CandidateStreamParams::Source::Ext;
  DynamicVocabParams p = dyn(16, 2, 2, true);
  p.stream.source = ext;
  expect_same(
      [&](Generator&) {
        return std::make_unique<ModelDrafter>(*model_, 256, DraftVocabulary::dynamic(*model_, p));
      },
      tree, "draft model, ext source");
}

TEST_F(VocabSpec, DecoderBuildsEveryKindFromAFrequencyFile) {
  // Counts that rank ids 300.. first, so the freq set misses </s> (2) unless it is added.
  std::vector<uint64_t> counts(kVocab, 1);
  for (int32_t i = 300; i < kVocab; ++i) counts[i] = 1000 + i;
  const std::string freq_path = (dir_ / "freq.bin").string();
  write_freq_file(freq_path, TokenFrequencies::from_counts(counts));
  GenerateParams params;
  params.max_new_tokens = 40;
  params.ignore_eos = true;
  Generator plain_gen(*model_, *tok_, 256);
  const GenerateResult plain = plain_gen.generate(kPrompt, params);
  for (const char* kind : {"full", "freq", "dynamic", "hybrid"}) {
    SpecConfig c;
    c.mode = SpecMode::Self;
    c.draft_vocab = parse_draft_vocab(kind);
    c.freq_file = freq_path;
    c.freq_top = 16;
    c.hybrid_top = 8;
    c.vocab_window = 20;
    Generator gen(*model_, *tok_, 256);
    Decoder setup(c, *file_, gen, *tok_);
    const SpecResult r = setup.generate(kPrompt, params);
    EXPECT_EQ(r.gen.tokens, plain.tokens) << kind;
    const double vocab = r.stats.mean_active_vocab();
    if (std::string(kind) == "freq") EXPECT_EQ(vocab, 17.0) << "16 frequent + </s>";
    if (std::string(kind) == "full") EXPECT_EQ(vocab, double(kVocab));
    if (std::string(kind) == "dynamic") EXPECT_LE(vocab, 20.0);
    if (std::string(kind) == "hybrid") EXPECT_LE(vocab, 20.0 + 9.0);
    EXPECT_NE(setup.describe().find(kind), std::string::npos) << setup.describe();
  }
  SpecConfig c;
  c.mode = SpecMode::Self;
  c.draft_vocab = DraftVocabKind::Freq;
  Generator gen(*model_, *tok_, 256);
  try {
    Decoder s(c, *file_, gen, *tok_);
    ADD_FAILURE() << "freq without a file";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--freq-file"), std::string::npos) << e.what();
  }
  // A file counted for another vocabulary.
  write_freq_file(freq_path, TokenFrequencies::from_counts(std::vector<uint64_t>(kVocab + 1, 1)));
  c.freq_file = freq_path;
  EXPECT_THROW(Decoder(c, *file_, gen, *tok_), Error);
  c.draft_vocab = DraftVocabKind::Dynamic;
  EXPECT_THROW(apply_spec_setting(c, "vocab-source", "nope"), Error);
}

// The real Gemma 3 270M head (262,144 rows of Q8_0, the tied token embedding): the packed rows'
// logits equal the full head's at those rows, bit for bit, while the window churns.
TEST(VocabRealModel, PackedGemmaHeadEqualsFullHeadRows) {
  const std::string path = test::gemma_path();
  test::require_file(path);
  auto file = GgufFile::open(path);
  ModelOptions opt;
  opt.n_threads = 2;
  auto model = Model::load(*file, opt);
  const int32_t V = model->config().n_vocab, E = model->config().n_embd;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> hidden(size_t(2) * E);
  for (float& x : hidden) x = normal(rng);
  std::vector<float> full(size_t(2) * V);
  model->lm_head(hidden.data(), 2, full.data());
  DynamicVocabParams p;
  p.stream.w_max = 512;
  p.async_gather = true;
  DraftVocabulary vocab = DraftVocabulary::dynamic(*model, p, {1, 106});
  std::vector<int32_t> prompt(300);
  for (int32_t& t : prompt) t = int32_t(rng() % V);
  vocab.begin(prompt, {});
  std::vector<float> logits;
  DraftTree tree;
  std::vector<int32_t> tree_tokens;  // [tree nodes]
  std::vector<float> verify(size_t(5) * V);
  for (int step = 0; step < 30; ++step) {
    tree.nodes.clear();
    for (int i = 0; i < 4; ++i) tree.nodes.push_back({int32_t(rng() % 2000), i - 1, i + 1});
    for (float& x : verify) x = normal(rng);
    const std::vector<int32_t> path = {0, 1};
    vocab.accepted(node_tokens(tree, tree_tokens), path, verify.data());
    logits.resize(size_t(2) * vocab.size());
    vocab.logits(*model, hidden.data(), 2, logits.data());
    ASSERT_EQ(vocab.size(), vocab.stream()->window().active_size());
    for (int32_t j = 0; j < vocab.size(); ++j)
      for (int r = 0; r < 2; ++r)
        ASSERT_EQ(
            std::memcmp(&logits[size_t(r) * vocab.size() + j], &full[size_t(r) * V + vocab.token(j)], 4), 0)
            << "step " << step << " row " << j;
  }
  EXPECT_GT(vocab.packed_head()->rows_gathered(), 512);
}

}  // namespace
}  // namespace microspec
