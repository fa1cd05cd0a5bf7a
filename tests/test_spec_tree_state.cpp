// The fixed-shape greedy tree step's bookkeeping (speculative/tree_state.h): the tree it builds
// from a drafter's proposals must be TreeBuilder's (speculative/tree.h) node for node, its
// acceptance accept_greedy's, and driven on the host with the CPU model doing each forward (the
// self-drafter's depth + 1 draft forwards in their pending slots, the verification over them, the
// cache compacted to the slots it keeps) it must emit plain greedy decoding's tokens, token for
// token, with the full draft head and with MicroSpec's vocabulary advanced by the device's
// functions (vocab/window_state.h), whose window must be the host-driven CandidateStream's; and it
// must draft the CPU decoder's own trees (the same steps, nodes and accepted drafts).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "draft_head/eagle3_head.h"
#include "engine/generator.h"
#include "engine/speculative_decoder.h"
#include "math/select.h"
#include "model/model.h"
#include "speculative/drafter.h"
#include "speculative/head_drafter.h"
#include "speculative/tree.h"
#include "speculative/tree_sampling.h"
#include "speculative/tree_state.h"
#include "support/resident_step.h"
#include "support/resident_tree.h"
#include "support/tiny_head.h"
#include "support/tiny_model.h"
#include "tokenizer/tokenizer.h"
#include "util/error.h"
#include "vocab/candidate_stream.h"
#include "vocab/draft_vocab.h"

namespace microspec {
namespace {

using test::HostTreeState;
using test::run_tree;
using test::TreeRun;

// Proposals that depend only on the path to the node expanded: k distinct tokens of 40, with
// log-probabilities <= 0 from a small set (ties and zeros included), best first; sometimes fewer
// than k (the rest token -1), as a row with few finite logits gives.
std::vector<Proposal> proposals_for(const std::vector<int32_t>& path, int32_t k, uint32_t seed) {
  uint64_t h = 1469598103934665603ull ^ seed;
  for (int32_t t : path) h = (h ^ uint64_t(t + 7)) * 1099511628211ull;
  std::mt19937 rng(uint32_t(h ^ (h >> 32)));
  const float levels[] = {0.0f, -0.25f, -0.25f, -0.5f, -1.0f, -1.0f, -2.5f};
  int32_t n = k;
  if (rng() % 6 == 0) n = int32_t(rng() % uint32_t(k));
  std::vector<int32_t> ids(40);
  for (int32_t i = 0; i < 40; ++i) ids[size_t(i)] = i;
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<float> lp(static_cast<size_t>(n));
  for (float& v : lp) v = levels[rng() % 7];
  std::sort(lp.begin(), lp.end(), std::greater<float>());
  std::vector<Proposal> out(size_t(k), Proposal{-1, 0.0f});
  for (int32_t j = 0; j < n; ++j) out[size_t(j)] = {ids[size_t(j)], lp[size_t(j)]};
  return out;
}

struct PathExpander : TreeExpander {
  uint32_t seed = 0;
  void expand(std::span<const int32_t> frontier, std::span<const TreeNode> cand, int32_t k, DraftSampling*,
              Proposal* out) override {
    for (size_t i = 0; i < frontier.size(); ++i) {
      std::vector<int32_t> path;
      for (int32_t c = frontier[i]; c >= 0; c = cand[size_t(c)].parent) path.insert(path.begin(), cand[size_t(c)].token);
      const std::vector<Proposal> p = proposals_for(path, k, seed);
      std::copy(p.begin(), p.end(), out + i * k);
    }
  }
};

// One step's drafting through the state with proposals_for, checking each draft forward's rows.
void draft_tree(HostTreeState& h, uint32_t seed) {
  const TreeShape& shape = h.s.shape;
  const int32_t k = shape.top_k;
  std::vector<int32_t> cand_in_slot(size_t(shape.draft_slots()), -2);
  cand_in_slot[0] = -1;  // the root
  for (int32_t f = 0; f <= shape.depth; ++f) {
    const int32_t rows = shape.draft_rows(f), start = shape.draft_start(f);
    for (int32_t i = 0; i < rows; ++i) {
      const int32_t c = f == 0 ? -1 : h.frontier[size_t(i)];
      if (f > 0 && c >= 0) {
        EXPECT_EQ(h.cand_slot[size_t(c)], start + i);
        cand_in_slot[size_t(start + i)] = c;
        // The row's parent is the slot where its parent candidate's row ran, at an earlier slot.
        const int32_t parent_slot = h.draft_parents[size_t(i)];
        ASSERT_GE(parent_slot, 0);
        ASSERT_LT(parent_slot, start);
        EXPECT_EQ(cand_in_slot[size_t(parent_slot)], h.cand_parent[size_t(c)]);
        EXPECT_EQ(h.draft_tokens[size_t(i)], h.cand_token[size_t(c)]);
        EXPECT_EQ(h.draft_positions[size_t(i)], h.n_past + h.cand_depth[size_t(c)]);
      }
      if (f == 0) {
        EXPECT_EQ(h.draft_tokens[0], h.tokens[0]);
        EXPECT_EQ(h.draft_positions[0], h.n_past);
        EXPECT_EQ(h.draft_parents[0], -1);
      }
      const std::vector<Proposal> p =
          c < 0 && f > 0 ? std::vector<Proposal>(size_t(k), Proposal{7, -0.1f})  // a placeholder row: ignored
                         : proposals_for(f == 0 ? std::vector<int32_t>{} : h.path_of(c), k, seed);
      for (int32_t j = 0; j < k; ++j) {
        h.prop_token[size_t(i * k + j)] = p[size_t(j)].token;
        h.prop_logprob[size_t(i * k + j)] = p[size_t(j)].logprob;
      }
    }
    tree_absorb(h.s, f);
  }
  for (int32_t c = 0; c < shape.candidates(); ++c) tree_rank(h.s, c);
  tree_lay_out_verification(h.s);
}

TEST(TreeState, BuildsTreeBuildersTreeFromTheSameProposals) {
  int32_t trees = 0, pruned = 0, short_rows = 0;
  for (uint32_t seed = 0; seed < 400; ++seed) {
    std::mt19937 rng(seed);
    TreeParams params;
    params.top_k = 1 + int32_t(rng() % 4);
    params.depth = int32_t(rng() % 5);
    const int32_t n_cand = params.top_k + params.depth * params.top_k * params.top_k;
    params.total_tokens = 1 + int32_t(rng() % uint32_t(n_cand + 3));
    const TreeShape shape = params.fixed_shape();
    ASSERT_EQ(shape.candidates(), n_cand);
    ASSERT_EQ(shape.total, std::min(params.total_tokens, n_cand));
    SCOPED_TRACE("seed " + std::to_string(seed) + ", k " + std::to_string(shape.top_k) + ", depth " +
                 std::to_string(shape.depth) + ", total " + std::to_string(shape.total));
    PathExpander expander;
    expander.seed = seed;
    DraftTree want;
    TreeBuilder builder;
    builder.build(params, expander, want);

    HostTreeState h(shape, 64);
    h.n_past = 30;
    h.tokens[0] = 3;
    tree_begin(h.s);
    draft_tree(h, seed);
    ASSERT_EQ(h.n_nodes, want.size());
    for (int32_t i = 0; i < want.size(); ++i) {
      const TreeNode& n = want.nodes[size_t(i)];
      EXPECT_EQ(h.tokens[size_t(1 + i)], n.token) << "node " << i;
      EXPECT_EQ(h.parents[size_t(1 + i)], n.parent + 1) << "node " << i;
      EXPECT_EQ(h.positions[size_t(1 + i)], 30 + n.depth) << "node " << i;
    }
    for (int32_t r = 1 + h.n_nodes; r < shape.verify_rows(); ++r) EXPECT_EQ(h.parents[size_t(r)], 0) << "placeholder";
    EXPECT_EQ(h.positions[0], 30);
    EXPECT_EQ(h.parents[0], -1);
    ++trees;
    pruned += want.size() < n_cand;
    short_rows += want.size() < shape.total;
  }
  EXPECT_EQ(trees, 400);
  EXPECT_GT(pruned, 100) << "too few trees cut to their best nodes";
  EXPECT_GT(short_rows, 10) << "too few trees with fewer candidates than rows (empty proposals)";
}

TEST(TreeState, AcceptFollowsTheTargetLikeAcceptGreedy) {
  int32_t deep = 0;
  for (uint32_t seed = 0; seed < 300; ++seed) {
    std::mt19937 rng(seed + 1000);
    TreeParams params;
    params.top_k = 1 + int32_t(rng() % 3);
    params.depth = 1 + int32_t(rng() % 4);
    params.total_tokens = 1 + int32_t(rng() % 12);
    const TreeShape shape = params.fixed_shape();
    SCOPED_TRACE("seed " + std::to_string(seed));
    HostTreeState h(shape, 64);
    h.n_past = 12;
    h.counter = 1;
    h.tokens[0] = 5;
    h.out_ids[0] = 5;
    h.s.kver_last_only = int32_t(seed % 2);
    tree_begin(h.s);
    draft_tree(h, seed);
    const DraftTree tree = h.tree();
    // The target's argmax: mostly a child's token, so that paths are accepted deep.
    for (int32_t r = 0; r < shape.verify_rows(); ++r) {
      std::vector<int32_t> children;
      for (int32_t i = 0; i < tree.size(); ++i)
        if (tree.nodes[size_t(i)].parent == r - 1) children.push_back(tree.nodes[size_t(i)].token);
      h.pred[size_t(r)] = !children.empty() && rng() % 4 != 0 ? children[rng() % children.size()] : int32_t(rng() % 40);
    }
    std::vector<int32_t> path, emitted;
    accept_greedy(tree, std::span<const int32_t>(h.pred).first(size_t(tree.size()) + 1), path, emitted);
    const int32_t a = tree_accept(h.s);
    ASSERT_EQ(a, int32_t(path.size()));
    EXPECT_EQ(std::vector<int32_t>(h.out_ids.begin() + 1, h.out_ids.begin() + h.counter), emitted);
    std::vector<int32_t> keep = {0};
    for (int32_t p : path) keep.push_back(p + 1);
    EXPECT_EQ(std::vector<int32_t>(h.keep.begin(), h.keep.begin() + h.n_keep), keep);
    EXPECT_EQ(h.n_past, 12) << "the cache's compaction moves n_past";
    EXPECT_EQ(h.tokens[0], emitted.back());
    h.n_past += h.n_keep;
    tree_lay_out_root(h.s);
    EXPECT_EQ(h.draft_tokens[0], emitted.back()) << "the next root forward";
    EXPECT_EQ(h.draft_positions[0], 12 + a + 1);
    EXPECT_EQ(h.positions[0], 12 + a + 1);
    EXPECT_EQ(h.parents[0], -1);
    EXPECT_EQ(h.update.n_tree, tree.size());
    const std::vector<int32_t> rows = h.s.kver_last_only ? std::vector<int32_t>{keep.back()} : keep;
    EXPECT_EQ(std::vector<int32_t>(h.keep.begin() + h.update.first_row,
                                   h.keep.begin() + h.update.first_row + h.update.n_rows),
              rows);
    EXPECT_EQ(h.steps, 1);
    EXPECT_EQ(h.step_counts[0], h.counter);
    deep += a >= 2;
  }
  EXPECT_GT(deep, 30) << "too few paths accepted past the first level";
}

TEST(TreeState, ShapesWithoutAFixedSizeAreRefused) {
  EXPECT_THROW((TreeParams{.depth = 2, .top_k = 2, .total_tokens = 4, .p_min = 0.05}.fixed_shape()), Error);
  EXPECT_THROW((TreeParams{.depth = 2, .top_k = 2, .total_tokens = 0}.fixed_shape()), Error);
  EXPECT_THROW((TreeParams{.depth = 2, .top_k = 0, .total_tokens = 4}.fixed_shape()), Error);
  const TreeShape s = TreeParams{.depth = 5, .top_k = 10, .total_tokens = 60}.fixed_shape();
  EXPECT_EQ(s.candidates(), 510);
  EXPECT_EQ(s.draft_slots(), 51);
  EXPECT_EQ(s.pending_slots(), 61);
  EXPECT_EQ(s.max_emitted(), 7);
}

// The shapes, drafters and vocabularies the resident tree step is run with (greedy and sampled).
struct TreeVariant {
  std::string name;
  TreeParams tree;
  int32_t draft_layers;  // of 3 (the self-draft's; 0 for the other drafters)
  std::optional<PrunedVocabSpec> vocab;
  // The target's first layers, an EAGLE-3 head, the target as its own draft model, or the
  // target's weights in Q4_1 as a separate draft model.
  enum class Drafter { Self, Head, TargetAsDraftModel, DraftModel } drafter = Drafter::Self;
  // The drafter is the whole target (every layer, or the target as its own draft model): its
  // first child at each row is the target's own token.
  bool drafts_as_the_target() const {
    return drafter == Drafter::TargetAsDraftModel || (drafter == Drafter::Self && draft_layers == 3);
  }
  bool partial_self_draft() const { return drafter == Drafter::Self && draft_layers == 2; }
};
// The settings every drafter runs: the full head with 6 nodes and with every candidate,
// MicroSpec's window (also from an empty vocabulary), freq. draft_layers: the self-draft's.
std::vector<TreeVariant> drafter_variants(const std::string& who, TreeVariant::Drafter drafter, int32_t draft_layers) {
  using Source = CandidateStreamParams::Source;
  using Rows = CandidateStreamParams::KverRows;
  const auto stream = test::window_spec;
  const int32_t l = draft_layers;
  return {{who + "full head, k 2 depth 3, 6 nodes", {.depth = 3, .top_k = 2, .total_tokens = 6}, l, std::nullopt, drafter},
          {who + "full head, k 3 depth 2, every candidate", {.depth = 2, .top_k = 3, .total_tokens = 40}, l, std::nullopt,
           drafter},
          {who + "dynamic W 64, k 3 depth 3", {.depth = 3, .top_k = 3, .total_tokens = 10}, l,
           stream(64, Source::Both, Rows::Accepted), drafter},
          {who + "dynamic ext W 64 (the first tree from an empty vocabulary)", {.depth = 2, .top_k = 2, .total_tokens = 5},
           l, stream(64, Source::Ext, Rows::Accepted), drafter},
          {who + "freq: 40 fixed ids", {.depth = 3, .top_k = 2, .total_tokens = 6}, l,
           test::with_every_7th(stream(16, Source::Both, Rows::Accepted), 40, PrunedVocabSpec::Kind::Fixed), drafter}};
}
std::vector<TreeVariant> tree_variants() {
  using Source = CandidateStreamParams::Source;
  using Rows = CandidateStreamParams::KverRows;
  using Drafter = TreeVariant::Drafter;
  const auto stream = test::window_spec;   // a window (dynamic)
  const auto pinned = test::with_every_7th;  // ids 7, 14, 21, ... beside it (hybrid) or alone (freq)
  // The self-draft's own: other depths and layer counts, the window's other settings, hybrid.
  std::vector<TreeVariant> v = {
      {"full head, k 4 depth 0 (the root's children only)", {.depth = 0, .top_k = 4, .total_tokens = 4}, 1, std::nullopt},
      {"full head, chain of 4, every layer drafts", {.depth = 3, .top_k = 1, .total_tokens = 4}, 3, std::nullopt},
      {"full head, k 3 depth 3, every layer drafts", {.depth = 3, .top_k = 3, .total_tokens = 10}, 3, std::nullopt},
      {"dynamic W 5, K_ver of the last row", {.depth = 3, .top_k = 2, .total_tokens = 6}, 2, stream(5, Source::Both, Rows::Last)},
      {"dynamic ctx", {.depth = 2, .top_k = 2, .total_tokens = 6}, 2, stream(3072, Source::Ctx, Rows::Accepted)},
      {"hybrid W 16 + 20 pinned", {.depth = 3, .top_k = 2, .total_tokens = 6}, 2,
       pinned(stream(16, Source::Both, Rows::Accepted), 20, PrunedVocabSpec::Kind::Window)},
      {"the target as its own draft model, chain of 4", {.depth = 3, .top_k = 1, .total_tokens = 4}, 0, std::nullopt,
       Drafter::TargetAsDraftModel},
      {"the target as its own draft model, k 3 depth 3", {.depth = 3, .top_k = 3, .total_tokens = 10}, 0, std::nullopt,
       Drafter::TargetAsDraftModel}};
  for (const std::vector<TreeVariant>& common :
       {drafter_variants("", Drafter::Self, 2), drafter_variants("EAGLE-3 head, ", Drafter::Head, 0),
        drafter_variants("draft model, ", Drafter::DraftModel, 0)})
    v.insert(v.end(), common.begin(), common.end());
  return v;
}

class TreeStateTiny : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = (std::filesystem::temp_directory_path() / ("microspec_tree_state_" + std::to_string(::getpid()) + ".gguf"))
                .string();
    test::TinyModelSpec spec;
    spec.arch = "llama";
    spec.n_vocab = 320;
    spec.n_layer = 3;
    spec.seed = 7;
    spec.weight_type = GgmlType::Q8_0;
    spec.untied_output = true;  // a tied random model only repeats its last token
    target_ = test::load_tiny_model(spec, path_);
    // The same weights in Q4_1: a draft model that agrees with the target often, not always.
    draft_path_ = path_ + ".draft.gguf";
    spec.weight_type = GgmlType::Q4_1;
    draft_ = test::load_tiny_model(spec, draft_path_);
    tok_path_ = path_ + ".tok.gguf";
    tok_file_ = GgufFile::open(test::write_tiny_tokenizer(tok_path_, spec.n_vocab));
    tok_ = Tokenizer::from_gguf(*tok_file_);
    // A random EAGLE-3 head reading all three layers' inputs and the stream after the last.
    test::TinyHeadSpec head;
    head.target_layers = {0, 2, 3};
    head_path_ = path_ + ".head.gguf";
    test::write_tiny_head(head, head_path_);
  }
  void TearDown() override {
    std::filesystem::remove(path_);
    std::filesystem::remove(tok_path_);
    std::filesystem::remove(head_path_);
    std::filesystem::remove(draft_path_);
  }
  // The head file a variant drafts with ("" for the self-draft), and the CPU decoder's drafter for
  // it over the same vocabulary.
  std::string head_path(const TreeVariant& v) const {
    return v.drafter == TreeVariant::Drafter::Head ? head_path_ : std::string();
  }
  // The separate draft model a variant drafts with (null for the self-draft and the head).
  Model* draft_model(const TreeVariant& v) const {
    return v.drafter == TreeVariant::Drafter::TargetAsDraftModel ? target_.model.get()
           : v.drafter == TreeVariant::Drafter::DraftModel       ? draft_.model.get()
                                                                 : nullptr;
  }
  std::unique_ptr<Drafter> cpu_drafter(const TreeVariant& v, Generator& gen) {
    Model& target = *target_.model;
    if (Model* dm = draft_model(v))  // its own LM head scores its drafts
      return std::make_unique<ModelDrafter>(*dm, 512, test::host_draft_vocabulary(*dm, v.vocab));
    DraftVocabulary vocab = test::host_draft_vocabulary(target, v.vocab);
    if (v.drafter == TreeVariant::Drafter::Head)
      return std::make_unique<HeadDrafter>(std::make_unique<Eagle3Head>(GgufFile::open(head_path_), target, target.n_batch()),
                                           target, 512, std::move(vocab));
    return std::make_unique<SelfDrafter>(target, gen.cache(), v.draft_layers, std::move(vocab));
  }
  std::string path_, tok_path_, head_path_, draft_path_;
  test::TinyLoaded target_, draft_;
  std::unique_ptr<GgufFile> tok_file_;
  std::unique_ptr<Tokenizer> tok_;
};

TEST_F(TreeStateTiny, ResidentTreeStepsEqualPlainGreedyDecoding) {
  const std::vector<TreeVariant> variants = tree_variants();
  const std::vector<int32_t> prompt = {5, 17, 99, 3, 250, 41, 8, 77, 120};
  const int32_t n_predict = 40;
  Model& target = *target_.model;
  const std::vector<int32_t> plain = test::plain_greedy(target, prompt, n_predict);
  EXPECT_GE(std::set<int32_t>(plain.begin(), plain.end()).size(), 10u) << "a degenerate text tests little";
  int32_t accepted_partial = 0, accepted_dynamic = 0, accepted_by_draft_model = 0;
  for (const TreeVariant& v : variants) {
    SCOPED_TRACE(v.name);
    const TreeRun r = run_tree(target, prompt, n_predict, v.tree, v.draft_layers, v.vocab, {}, head_path(v), draft_model(v));
    EXPECT_EQ(r.emitted, plain);
    EXPECT_GT(r.steps, 0);
    EXPECT_GT(r.nodes, 0);
    if (v.drafts_as_the_target() && v.tree.top_k == 1)
      EXPECT_EQ(r.accepted, (v.tree.depth + 1) * r.steps) << "the target drafting its own chain";
    if (v.drafts_as_the_target() && v.tree.top_k > 1)
      EXPECT_GE(r.accepted, r.steps) << "the target's own first token is always in its tree";
    if (v.partial_self_draft() && !v.vocab) accepted_partial += r.accepted;
    if (v.vocab) accepted_dynamic += r.accepted;
    if (v.drafter == TreeVariant::Drafter::DraftModel) accepted_by_draft_model += r.accepted;
    // The CPU decoder with the same drafter, tree and vocabulary drafts the same trees: the same
    // steps, nodes and accepted drafts, so the device's counts are the CPU path's.
    Generator gen(target, *tok_, 512);
    const std::unique_ptr<Drafter> drafter = cpu_drafter(v, gen);
    Decoder decoder(gen, *tok_, drafter.get(), v.tree);
    const SpecResult cpu = decoder.generate(prompt, test::fixed_length(n_predict));
    EXPECT_EQ(cpu.gen.tokens, plain);
    EXPECT_EQ(cpu.stats.steps, r.steps);
    EXPECT_EQ(cpu.stats.drafted, r.nodes);
    EXPECT_EQ(cpu.stats.accepted_draft, r.accepted);
    // A text that ends earlier (18 tokens): the device's counts from the step log
    // (chain_totals_until, as CudaModel reports them) are the CPU's for that text.
    const SpecResult short_cpu = decoder.generate(prompt, test::fixed_length(18));
    const ChainTotals cut = chain_totals_until(r.step_counts.data(), r.steps, 18);
    EXPECT_EQ(cut.steps, short_cpu.stats.steps);
    EXPECT_EQ(cut.accepted, short_cpu.stats.accepted_draft);
  }
  EXPECT_GT(accepted_partial, 0) << "no partial drafter ever agreed";
  EXPECT_GT(accepted_dynamic, 0) << "no draft from the packed rows was ever accepted";
  EXPECT_GT(accepted_by_draft_model, 0) << "the draft model never agreed: its kept slots went untested";
}

// Speculative sampling on the resident tree (tree_sampling.h) emits the CPU Decoder's tokens for a
// seed: the same drafts drawn without replacement, the same kept nodes and the same recursive
// rejection sampling, with the same steps, nodes and accepted drafts.
TEST_F(TreeStateTiny, ResidentSampledTreeStepsEqualTheCpuDecoder) {
  const std::vector<TreeVariant> variants = tree_variants();
  const std::vector<int32_t> prompt = {5, 17, 99, 3, 250, 41, 8, 77, 120};
  const int32_t n_predict = 40;
  Model& target = *target_.model;
  const int32_t V = target.config().n_vocab;
  int32_t accepted_partial = 0, siblings_accepted = 0, accepted_by_head = 0, accepted_by_draft_model = 0;
  for (const TreeVariant& v : variants) {
    for (const SamplingParams& sp : test::sampled_settings()) {
      SCOPED_TRACE(v.name + ", T " + std::to_string(sp.temperature) + ", seed " + std::to_string(sp.seed));
      const TreeRun r = run_tree(target, prompt, n_predict, v.tree, v.draft_layers, v.vocab, sp, head_path(v), draft_model(v));
      Generator gen(target, *tok_, 512);
      const std::unique_ptr<Drafter> drafter = cpu_drafter(v, gen);
      const SpecResult cpu = Decoder(gen, *tok_, drafter.get(), v.tree).generate(prompt, test::fixed_length(n_predict, sp));
      ASSERT_EQ(int32_t(cpu.gen.tokens.size()), n_predict);
      EXPECT_EQ(r.emitted, cpu.gen.tokens);
      EXPECT_EQ(r.steps, cpu.stats.steps);
      EXPECT_EQ(r.nodes, cpu.stats.drafted);
      EXPECT_EQ(r.accepted, cpu.stats.accepted_draft);
      EXPECT_GE(std::set<int32_t>(r.emitted.begin(), r.emitted.end()).size(), 10u) << "a degenerate text tests little";
      if (v.drafts_as_the_target()) EXPECT_GE(r.accepted, r.steps) << "q == p: the first child is always accepted";
      if (v.partial_self_draft()) accepted_partial += r.accepted;
      siblings_accepted += r.later_siblings_accepted;
      if (v.drafter == TreeVariant::Drafter::Head) accepted_by_head += r.accepted;
      if (v.drafter == TreeVariant::Drafter::DraftModel) accepted_by_draft_model += r.accepted;
    }
  }
  EXPECT_GT(accepted_partial, 0) << "no partial drafter ever agreed: only rejections were tested";
  EXPECT_GT(siblings_accepted, 0) << "no child after a rejected sibling was ever accepted: q's renormalisation went untested";
  EXPECT_GT(accepted_by_head, 0) << "the head never had a draft accepted: its catch-up over kept rows went untested";
  EXPECT_GT(accepted_by_draft_model, 0) << "the draft model never had a draft accepted: its kept slots went untested";
}

}  // namespace
}  // namespace microspec
