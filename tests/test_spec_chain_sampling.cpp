// Speculative sampling on the device-resident chain (speculative/chain_sampling.h) driven on the
// host: chain_draw and chain_sample_accept must be the CPU decoder's own draws and verification
// (tree.h's pick_children and TreeSamplingVerifier) bit for bit, given the two samplers' random
// bits in order; and the whole resident step, run with CPU models doing the forwards the device
// launches (CudaModel::enqueue_chain_step's sampled variant, enqueue_head_drafts' for an EAGLE-3
// head), must emit the CPU Decoder's tokens for a seed, draft vocabulary and drafter.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "draft_head/eagle3_head.h"
#include "engine/generator.h"
#include "engine/speculative_decoder.h"
#include "gguf/gguf.h"
#include "model/model.h"
#include "sampling/sampler.h"
#include "speculative/chain_sampling.h"
#include "speculative/chain_state.h"
#include "speculative/drafter.h"
#include "speculative/head_drafter.h"
#include "speculative/tree.h"
#include "support/resident_sampling.h"
#include "support/resident_step.h"
#include "support/tiny_head.h"
#include "support/tiny_model.h"
#include "tokenizer/tokenizer.h"
#include "vocab/draft_vocab.h"

namespace microspec {
namespace {

using test::bits_of;
using test::ChainArrays;
using test::rank_row;
using test::run_resident_sampled;

// Random logits over a small vocabulary with what sampling must survive: ties, -inf, NaN, a row
// with nothing samplable, and target rows close to the draft's (so drafts are often accepted).
struct RandomRows {
  std::mt19937 rng;
  explicit RandomRows(uint32_t seed) : rng(seed) {}
  std::vector<float> row(int32_t V, const std::vector<float>* near) {
    std::normal_distribution<float> normal(0.0f, 2.0f);
    std::uniform_int_distribution<int> pick(0, 19);
    std::vector<float> r(static_cast<size_t>(V));
    for (int32_t i = 0; i < V; ++i) {
      r[size_t(i)] = near ? (*near)[size_t(i)] + 0.3f * normal(rng) : normal(rng);
      const int what = pick(rng);
      if (what == 0) r[size_t(i)] = -std::numeric_limits<float>::infinity();
      if (what == 1) r[size_t(i)] = std::round(r[size_t(i)]);  // ties
      if (what == 2 && !near) r[size_t(i)] = std::numeric_limits<float>::quiet_NaN();
    }
    if (near && pick(rng) == 0) r = *near;  // p == q: every draft accepted
    return r;
  }
};

TEST(ChainSampling, DrawsAndAcceptanceAreTheCpuDecodersOnAChain) {
  constexpr int32_t V = 48;
  RandomRows random(11);
  std::mt19937 rng(5);
  int32_t accepted_some = 0, rejected_some = 0, whole = 0, residual_draws = 0;
  for (int trial = 0; trial < 600; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const int32_t depth = 1 + int32_t(rng() % 5);
    const int32_t extra_draws = int32_t(rng() % 2);  // a tree deeper than the chain it keeps
    const int32_t k = std::vector<int32_t>{1, 2, 5, 16, 40}[rng() % 5];
    SamplingParams sp;
    sp.temperature = std::vector<float>{0.6f, 1.0f, 1.7f}[rng() % 3];
    sp.top_p = std::vector<float>{1.0f, 0.9f, 0.5f}[rng() % 3];
    sp.top_k = k;
    sp.seed = rng();
    const DrawSettings settings{sp.temperature, sp.top_p};

    // The CPU: the draft sampler draws the chain (pick_children, one child per row), the verifier
    // walks it with the target sampler.
    SamplingParams dp = sp;
    dp.seed = draft_sampler_seed(sp.seed);
    Sampler draft_sampler(dp, V), target_sampler(sp, V);
    DraftSampling ds{&draft_sampler, {}, {}};
    std::vector<std::vector<float>> draft_rows, target_rows;
    DraftTree tree;
    tree.q.resize(size_t(depth) + 1);
    for (int32_t d = 0; d < depth; ++d) {
      draft_rows.push_back(random.row(V, nullptr));
      Proposal p;
      ASSERT_EQ(pick_children(draft_rows.back().data(), V, nullptr, 1, &ds, 0, &p), 1);
      tree.nodes.push_back(TreeNode{p.token, d - 1, d + 1, 0.0f, d});
      tree.q[size_t(d)] = ds.row_q[0];
    }
    for (int32_t i = 0; i <= depth; ++i) target_rows.push_back(random.row(V, i < depth ? &draft_rows[size_t(i)] : nullptr));
    std::vector<float> target_logits;
    for (const auto& r : target_rows) target_logits.insert(target_logits.end(), r.begin(), r.end());
    TreeSamplingVerifier verifier(V);
    std::vector<int32_t> path, emitted;
    verifier.accept(tree, target_logits.data(), V, target_sampler, path, emitted);

    // The device's functions over the rows' ranked k best and the samplers' bits.
    ChainArrays arrays;
    const ChainState s = arrays.state(depth, depth + 1);
    arrays.tokens[0] = 3;
    std::vector<int32_t> draft_ids(size_t(depth) * k), target_ids(size_t(depth + 1) * k);
    std::vector<float> draft_values(draft_ids.size()), target_values(target_ids.size());
    for (int32_t d = 0; d < depth; ++d)
      rank_row(draft_rows[size_t(d)].data(), V, k, nullptr, &draft_ids[size_t(d) * k], &draft_values[size_t(d) * k]);
    for (int32_t i = 0; i <= depth; ++i)
      rank_row(target_rows[size_t(i)].data(), V, k, nullptr, &target_ids[size_t(i) * k], &target_values[size_t(i) * k]);
    const std::vector<uint64_t> draft_bits = bits_of(dp.seed, 64), target_bits = bits_of(sp.seed, 64);
    int32_t draft_drawn = 0, target_drawn = 0;
    const ChainSampling m{&settings, k, draft_ids.data(), draft_values.data(), target_ids.data(), target_values.data(),
                          draft_bits.data(), &draft_drawn, depth + extra_draws, target_bits.data(), &target_drawn};
    for (int32_t d = 0; d < depth; ++d) {
      chain_draw(s, m, d);
      ASSERT_EQ(arrays.tokens[size_t(d) + 1], tree.nodes[size_t(d)].token) << "draft " << d;
    }
    const int32_t a = chain_sample_accept(s, m);
    EXPECT_EQ(a, int32_t(path.size()));
    EXPECT_EQ(std::vector<int32_t>(arrays.out_ids.begin(), arrays.out_ids.begin() + arrays.counter), emitted);
    EXPECT_EQ(arrays.n_past, a + 1);
    EXPECT_EQ(arrays.tokens[0], emitted.back()) << "the next batch starts with the drawn token";
    EXPECT_EQ(draft_drawn, depth + extra_draws) << "a real step skips the draft draws the CPU's tree made";
    // The same target bits consumed: the CPU's next draw is the device's next one.
    EXPECT_EQ(target_sampler.uniform(), uniform_of(target_bits[size_t(target_drawn)]));
    accepted_some += a > 0;
    rejected_some += a < depth;
    whole += a == depth;
    residual_draws += a < depth && target_drawn == a + 2;
  }
  EXPECT_GT(accepted_some, 100);
  EXPECT_GT(rejected_some, 100);
  EXPECT_GT(whole, 20);
  EXPECT_GT(residual_draws, 100) << "a rejection's draw from the residual";
}

TEST(ChainSampling, PlaceholdersAndEmptyRows) {
  constexpr int32_t V = 20, depth = 3, k = 4;
  const DrawSettings settings{1.0f, 1.0f};
  std::vector<float> target_row(V);
  for (int32_t i = 0; i < V; ++i) target_row[size_t(i)] = float(i % 7);
  std::vector<int32_t> draft_ids(size_t(depth) * k, -1), target_ids(size_t(depth + 1) * k);
  std::vector<float> draft_values(draft_ids.size(), -std::numeric_limits<float>::infinity()), target_values(target_ids.size());
  for (int32_t i = 0; i <= depth; ++i)
    rank_row(target_row.data(), V, k, nullptr, &target_ids[size_t(i) * k], &target_values[size_t(i) * k]);
  const std::vector<uint64_t> bits = bits_of(9, 16);
  SamplingParams sp{.temperature = 1.0f, .top_k = k, .top_p = 1.0f, .seed = 9};
  // A draft vocabulary with no rows: placeholders, no draft draw, the target's one draw (plain
  // sampling's: Sampler::sample).
  {
    ChainArrays arrays;
    ChainState s = arrays.state(depth, depth + 1);
    const int32_t no_rows = 0;
    s.draft_rows = &no_rows;
    int32_t draft_drawn = 0, target_drawn = 0;
    const ChainSampling m{&settings, k, draft_ids.data(), draft_values.data(), target_ids.data(), target_values.data(),
                          bits.data(), &draft_drawn, depth, bits.data(), &target_drawn};
    for (int32_t d = 0; d < depth; ++d) chain_draw(s, m, d);
    EXPECT_EQ(std::vector<int32_t>(arrays.tokens.begin() + 1, arrays.tokens.end()), std::vector<int32_t>(depth, 0));
    EXPECT_EQ(chain_sample_accept(s, m), 0);
    EXPECT_EQ(draft_drawn, 0);
    EXPECT_EQ(target_drawn, 1);
    EXPECT_EQ(arrays.update.n_tree, 0) << "placeholders are not appended to the stream";
    Sampler plain(sp, V);
    EXPECT_EQ(arrays.out_ids[0], plain.sample(target_row.data()));
  }
  // Real drafts from rows with nothing samplable: token 0, rejected without a uniform (q is
  // empty), the emitted token drawn from p.
  {
    ChainArrays arrays;
    const ChainState s = arrays.state(depth, depth + 1);
    int32_t draft_drawn = 0, target_drawn = 0;
    const ChainSampling m{&settings, k, draft_ids.data(), draft_values.data(), target_ids.data(), target_values.data(),
                          bits.data(), &draft_drawn, depth, bits.data(), &target_drawn};
    for (int32_t d = 0; d < depth; ++d) chain_draw(s, m, d);
    EXPECT_EQ(chain_sample_accept(s, m), 0);
    EXPECT_EQ(target_drawn, 1);
    EXPECT_EQ(draft_drawn, depth);
    Sampler plain(sp, V);
    EXPECT_EQ(arrays.out_ids[0], plain.sample(target_row.data()));
  }
  // A verification row with nothing samplable: token -1 (the host reports it).
  {
    ChainArrays arrays;
    const ChainState s = arrays.state(depth, depth + 1);
    std::vector<int32_t> none(target_ids.size(), -1);
    int32_t draft_drawn = 0, target_drawn = 0;
    const ChainSampling m{&settings, k, draft_ids.data(), draft_values.data(), none.data(), target_values.data(),
                          bits.data(), &draft_drawn, depth, bits.data(), &target_drawn};
    EXPECT_EQ(chain_sample_accept(s, m), 0);
    EXPECT_EQ(arrays.out_ids[0], -1);
  }
}

class ChainSamplingTiny : public ::testing::Test {
 protected:
  void SetUp() override {
    stem_ = (std::filesystem::temp_directory_path() / ("microspec_chain_sampling_" + std::to_string(::getpid()))).string();
    target_ = load(stem_ + "_target.gguf", GgmlType::Q8_0);
    draft_ = load(stem_ + "_draft.gguf", GgmlType::Q4_1);
    tok_file_ = GgufFile::open(test::write_tiny_tokenizer(stem_ + "_tok.gguf", kVocab));
    paths_.push_back(stem_ + "_tok.gguf");
    tok_ = Tokenizer::from_gguf(*tok_file_);
    // A random EAGLE-3 head reading all three layers' inputs and the stream after the last.
    test::TinyHeadSpec head;
    head.target_layers = {0, 2, 3};
    head_path_ = stem_ + "_head.gguf";
    paths_.push_back(head_path_);
    test::write_tiny_head(head, head_path_);
  }
  void TearDown() override {
    for (const std::string& p : paths_) std::filesystem::remove(p);
  }
  test::TinyLoaded load(const std::string& path, GgmlType type) {
    test::TinyModelSpec spec;
    spec.arch = "llama";
    spec.n_vocab = kVocab;
    spec.n_layer = 3;
    spec.seed = 7;
    spec.weight_type = type;
    spec.untied_output = true;
    paths_.push_back(path);
    return test::load_tiny_model(spec, path);
  }
  static constexpr int32_t kVocab = 320;
  std::string stem_, head_path_;
  std::vector<std::string> paths_;
  test::TinyLoaded target_, draft_;
  std::unique_ptr<GgufFile> tok_file_;
  std::unique_ptr<Tokenizer> tok_;
};

TEST_F(ChainSamplingTiny, ResidentSampledStepsEqualTheCpuDecoder) {
  using Source = CandidateStreamParams::Source;
  using Rows = CandidateStreamParams::KverRows;
  const auto stream = test::window_spec;
  const auto pinned = test::with_every_7th;
  enum class DraftBy { Self, DraftModel, Head };
  struct Variant {
    const char* name;
    TreeParams tree;
    int32_t draft_layers;  // the self-draft's
    std::optional<PrunedVocabSpec> vocab;
    DraftBy drafter = DraftBy::Self;
  };
  const Variant variants[] = {
      {"full head, chain of 4", {3, 1, 4, 0}, 2, std::nullopt},
      {"full head, chain of 3 from a tree of depth 4 (draws past the chain)", {4, 1, 3, 0}, 2, std::nullopt},
      {"full head, every layer drafts (q == p: every draft accepted)", {3, 1, 4, 0}, 3, std::nullopt},
      {"dynamic W 64", {3, 1, 4, 0}, 2, stream(64, Source::Both, Rows::Accepted)},
      {"dynamic ext W 64 (first chain from an empty vocabulary)", {3, 1, 4, 0}, 2, stream(64, Source::Ext, Rows::Accepted)},
      {"dynamic W 5, K_ver of the last row", {2, 1, 3, 0}, 2, stream(5, Source::Both, Rows::Last)},
      {"hybrid W 16 + 20 pinned", {3, 1, 4, 0}, 2, pinned(stream(16, Source::Both, Rows::Accepted), 20, PrunedVocabSpec::Kind::Window)},
      {"freq: 40 fixed ids", {3, 1, 4, 0}, 2, pinned(stream(16, Source::Both, Rows::Accepted), 40, PrunedVocabSpec::Kind::Fixed)},
      {"draft model, full head", {3, 1, 4, 0}, 0, std::nullopt, DraftBy::DraftModel},
      {"draft model, dynamic W 64", {3, 1, 4, 0}, 0, stream(64, Source::Both, Rows::Accepted), DraftBy::DraftModel},
      {"EAGLE-3 head, full head", {3, 1, 4, 0}, 0, std::nullopt, DraftBy::Head},
      {"EAGLE-3 head, chain of 3 from a tree of depth 4", {4, 1, 3, 0}, 0, std::nullopt, DraftBy::Head},
      {"EAGLE-3 head, dynamic W 64", {3, 1, 4, 0}, 0, stream(64, Source::Both, Rows::Accepted), DraftBy::Head},
      {"EAGLE-3 head, dynamic ext W 64 (first chain from an empty vocabulary)", {3, 1, 4, 0}, 0,
       stream(64, Source::Ext, Rows::Accepted), DraftBy::Head}};
  const std::vector<int32_t> prompt = {5, 17, 99, 3, 250, 41, 8, 77, 120};
  const int32_t n_predict = 40;
  Model& target = *target_.model;
  int32_t accepted_partial = 0, accepted_by_head = 0;
  for (const Variant& v : variants) {
    for (const SamplingParams& sp : test::sampled_settings()) {
      SCOPED_TRACE(std::string(v.name) + ", T " + std::to_string(sp.temperature) + ", seed " + std::to_string(sp.seed));
      // The CPU decoder with the same drafter, chain and vocabulary.
      Generator gen(target, *tok_, 512);
      const bool draft_model = v.drafter == DraftBy::DraftModel;
      Model& head_of = draft_model ? *draft_.model : target;  // the drafter's LM head scores the drafts
      DraftVocabulary vocab = test::host_draft_vocabulary(head_of, v.vocab);
      std::unique_ptr<Drafter> drafter;
      if (draft_model)
        drafter = std::make_unique<ModelDrafter>(*draft_.model, 512, std::move(vocab));
      else if (v.drafter == DraftBy::Head)
        drafter = std::make_unique<HeadDrafter>(
            std::make_unique<Eagle3Head>(GgufFile::open(head_path_), target, target.n_batch()), target, 512, std::move(vocab));
      else
        drafter = std::make_unique<SelfDrafter>(target, gen.cache(), v.draft_layers, std::move(vocab));
      const SpecResult cpu = Decoder(gen, *tok_, drafter.get(), v.tree).generate(prompt, test::fixed_length(n_predict, sp));
      ASSERT_EQ(int32_t(cpu.gen.tokens.size()), n_predict);
      int32_t accepted = 0;
      const std::vector<int32_t> resident =
          run_resident_sampled(target, prompt, n_predict, v.tree, v.draft_layers, v.vocab,
                               draft_model ? draft_.model.get() : nullptr,
                               v.drafter == DraftBy::Head ? head_path_ : std::string(), sp, &accepted);
      EXPECT_EQ(resident, cpu.gen.tokens);
      EXPECT_GE(std::set<int32_t>(resident.begin(), resident.end()).size(), 10u) << "a degenerate text tests little";
      if (v.draft_layers == 3) EXPECT_EQ(cpu.stats.accepted_draft, cpu.stats.steps * int64_t(v.tree.total_tokens));
      if (v.draft_layers == 2) accepted_partial += accepted;
      if (v.drafter == DraftBy::Head) accepted_by_head += accepted;
    }
  }
  EXPECT_GT(accepted_partial, 0) << "no partial drafter ever agreed: only rejections were tested";
  EXPECT_GT(accepted_by_head, 0) << "the head never had a draft accepted: its catch-up over accepted rows went untested";
}

}  // namespace
}  // namespace microspec
