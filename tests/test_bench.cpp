// The benchmark harness's pieces: the dataset loader (SpecBench two-turn rows, HumanEval rows,
// category filter and limits, bad files), the metric aggregation (hand-computed per-category means,
// ratios and pooled acceptance on synthetic records), the output comparison, method parsing
// (settings, sweeps, the ablation), and a two-turn run on SmolLM2 whose second turn carries the
// method's own first answer.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "bench/dataset.h"
#include "bench/metrics.h"
#include "bench/runner.h"
#include "support/test_helpers.h"
#include "tokenizer/chat.h"
#include "util/error.h"

namespace microspec::bench {
namespace {

using test::error_of;

const char* kSpecBench =
    R"({"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]})"
    "\n"
    R"({"question_id": 82, "category": "writing", "turns": ["Write a letter.", "Now in French."]})"
    "\n\n"
    R"({"question_id": "qa-1", "category": "qa", "turns": ["Who wrote Hamlet?"], "reference": ["x"]})"
    "\n"
    R"({"question_id": 83, "category": "writing", "turns": ["Write a song.", "Again."]})"
    "\n"
    R"({"question_id": "qa-2", "category": "qa", "turns": ["What is 2+2?"]})"
    "\n";

TEST(BenchDataset, SpecBenchRowsKeepBothTurnsAndOrder) {
  const auto qs = parse_questions(kSpecBench, "mem", {});
  ASSERT_EQ(qs.size(), 5u);
  EXPECT_EQ(qs[0].id, "81");
  EXPECT_EQ(qs[0].category, "writing");
  ASSERT_EQ(qs[0].turns.size(), 2u);
  EXPECT_EQ(qs[0].turns[1], "Now shorter.");
  EXPECT_EQ(qs[2].id, "qa-1");
  EXPECT_EQ(qs[2].turns.size(), 1u);
  EXPECT_EQ(categories_of(qs), (std::vector<std::string>{"writing", "qa"}));
}

TEST(BenchDataset, HumanEvalRowsBecomeOneUserTurn) {
  const std::string text =
      R"({"task_id": "HumanEval/0", "prompt": "def f(x):\n    \"\"\"Double x.\"\"\"\n", "entry_point": "f"})"
      "\n"
      R"({"task_id": "HumanEval/1", "prompt": "def g():\n"})";
  const auto qs = parse_questions(text, "he.jsonl", {});
  ASSERT_EQ(qs.size(), 2u);
  EXPECT_EQ(qs[0].id, "HumanEval/0");
  EXPECT_EQ(qs[0].category, "humaneval");
  ASSERT_EQ(qs[0].turns.size(), 1u);
  EXPECT_EQ(qs[0].turns[0], "def f(x):\n    \"\"\"Double x.\"\"\"\n");
}

TEST(BenchDataset, CategoryFilterAndPerCategoryLimit) {
  DatasetOptions o;
  o.per_category = 2;
  auto qs = parse_questions(kSpecBench, "mem", o);
  ASSERT_EQ(qs.size(), 4u);  // 81, 82, qa-1, qa-2: 83 is the third writing question
  EXPECT_EQ(qs[0].id, "81");
  EXPECT_EQ(qs[1].id, "82");
  EXPECT_EQ(qs[2].id, "qa-1");
  EXPECT_EQ(qs[3].id, "qa-2");
  o.per_category = 1;
  o.categories = {"qa"};
  qs = parse_questions(kSpecBench, "mem", o);
  ASSERT_EQ(qs.size(), 1u);
  EXPECT_EQ(qs[0].id, "qa-1");
}

TEST(BenchDataset, BadInputGetsClearErrors) {
  DatasetOptions unknown;
  unknown.categories = {"poetry"};
  EXPECT_NE(error_of([&] {
              parse_questions(kSpecBench, "q.jsonl", unknown);
            }).find("no category 'poetry' (the file has: writing, qa)"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              parse_questions("{\"question_id\": 1, \"category\": \"a\", \"turns\": [\"x\"]}\n{oops\n",
                              "q.jsonl", {});
            }).find("q.jsonl:2: not valid JSON"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              parse_questions(R"({"category": "a", "turns": ["x"]})", "q.jsonl", {});
            }).find("q.jsonl:1: SpecBench row without \"question_id\""),
            std::string::npos);
  EXPECT_NE(error_of([] {
              parse_questions(R"({"question_id": 1, "category": "a", "turns": []})", "q", {});
            }).find("non-empty array"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              parse_questions(R"({"question_id": 1, "category": "a", "turns": [3]})", "q", {});
            }).find("non-empty array of strings"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_questions(R"({"hello": 1})", "q", {}); }).find("expected a SpecBench row"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_questions("[1, 2]", "q", {}); }).find("expected a JSON object"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              parse_questions("{\"task_id\": 1, \"prompt\": \"a\"}\n{\"task_id\": 1, \"prompt\": \"b\"}", "q",
                              {});
            }).find("duplicate question id '1'"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_questions("\n  \n", "empty.jsonl", {}); }).find("no questions"),
            std::string::npos);
  DatasetOptions negative;
  negative.per_category = -1;
  EXPECT_NE(error_of([&] { parse_questions(kSpecBench, "q", negative); }).find(">= 0"), std::string::npos);
  EXPECT_NE(error_of([] { load_questions("/nonexistent/question.jsonl", {}); }).find("cannot open"),
            std::string::npos);
}

TEST(BenchDataset, RealSpecBenchFile) {
  const std::string path = test::source_dir() + "/../shared/data/spec_bench/question.jsonl";
  test::require_file(path);
  DatasetOptions o;
  o.per_category = 2;
  const auto qs = load_questions(path, o);
  EXPECT_EQ(qs.size(), 26u);
  EXPECT_EQ(categories_of(qs).size(), 13u);
  int two_turn = 0;
  for (const auto& q : qs) two_turn += q.turns.size() == 2;
  EXPECT_EQ(two_turn, 16);  // the 8 MT-bench categories
}

// Synthetic records: ar, a speculative method "spec" and a peer, over two categories.
PromptRecord rec(const std::string& method, int32_t index, const std::string& cat, int64_t tokens,
                 double wall, std::vector<int32_t> out, int64_t steps = 0, int64_t accepted = 0) {
  PromptRecord r;
  r.method = method;
  r.index = index;
  r.question_id = "q" + std::to_string(index);
  r.category = cat;
  r.turns.push_back({std::move(out), "text", "length", 10});
  r.new_tokens = tokens;
  r.wall_seconds = wall;
  r.prefill_seconds = 0.1 * wall;
  r.decode_seconds = 0.9 * wall;
  r.decode_tokens = tokens - 1;
  r.steps = steps;
  r.accepted_draft = accepted;
  r.drafting_steps = steps;
  r.active_vocab_sum = steps * 1000;
  return r;
}

std::vector<MethodInfo> infos() {
  MethodInfo ar, spec, peer;
  ar.label = ar.base = "ar";
  spec.label = spec.base = "spec";
  spec.speculative = true;
  peer.label = peer.base = "peer";
  peer.peer = true;
  return {ar, spec, peer};
}

std::vector<PromptRecord> records() {
  const std::vector<int32_t> a = {1, 2, 3, 4, 5}, b = {6, 7, 8, 9}, c = {10, 11};
  return {rec("ar", 0, "c1", 100, 1.0, a),
          rec("spec", 0, "c1", 100, 0.5, a, 40, 60),
          rec("peer", 0, "c1", 100, 2.0, a),
          rec("ar", 1, "c1", 50, 1.0, b),
          rec("spec", 1, "c1", 50, 0.25, b, 20, 30),
          rec("peer", 1, "c1", 50, 1.0, {6, 7, 8, 0}),
          rec("ar", 2, "c2", 30, 0.5, c),
          rec("spec", 2, "c2", 30, 0.3, c, 15, 15),
          rec("peer", 2, "c2", 30, 0.5, c)};
}

TEST(BenchMetrics, HandComputedCategoryMeansAndRatios) {
  const Summary s = summarize(infos(), records(), {"c1", "c2"});
  ASSERT_EQ(s.methods.size(), 3u);
  const MethodSummary& ar = s.methods[0];
  const MethodSummary& spec = s.methods[1];
  // Per prompt tok/s: ar 100, 50, 60; spec 200, 200, 100.
  EXPECT_DOUBLE_EQ(ar.by_category.at("c1").tokens_per_second, 75.0);
  EXPECT_DOUBLE_EQ(spec.by_category.at("c1").tokens_per_second, 200.0);
  EXPECT_DOUBLE_EQ(spec.by_category.at("c1").speedup, 200.0 / 75.0);
  EXPECT_DOUBLE_EQ(spec.by_category.at("c2").speedup, 100.0 / 60.0);
  EXPECT_DOUBLE_EQ(ar.overall.tokens_per_second, 70.0);
  EXPECT_NEAR(spec.overall.speedup, (500.0 / 3) / 70.0, 1e-12);
  EXPECT_DOUBLE_EQ(ar.overall.speedup, 1.0);
  // Acceptance pooled over steps: c1 (60 + 30 + 60) / 60, overall (105 + 75) / 75.
  EXPECT_DOUBLE_EQ(spec.by_category.at("c1").mean_acceptance_length, 2.5);
  EXPECT_DOUBLE_EQ(spec.by_category.at("c2").mean_acceptance_length, 2.0);
  EXPECT_DOUBLE_EQ(spec.overall.mean_acceptance_length, 2.4);
  EXPECT_DOUBLE_EQ(spec.overall.mean_active_vocab, 1000.0);
  EXPECT_EQ(ar.overall.steps, 0);
  // Decode tok/s pooled: spec (99 + 49 + 29) / (0.9 * 1.05), ar 177 / (0.9 * 2.5).
  EXPECT_NEAR(spec.overall.decode_tokens_per_second, 177 / (0.9 * 1.05), 1e-9);
  EXPECT_NEAR(spec.overall.decode_speedup, 2.5 / 1.05, 1e-9);
  EXPECT_EQ(spec.overall.new_tokens, 180);
  EXPECT_EQ(spec.by_category.at("c1").prompts, 2);
  // The peer: tok/s 50, 50, 60.
  EXPECT_NEAR(s.methods[2].overall.speedup, (160.0 / 3) / 70.0, 1e-12);

  const std::string md = summary_markdown(s, true);
  EXPECT_NE(md.find("| spec | 3 | 180 | 166.7 | 2.38x |"), std::string::npos) << md;
  EXPECT_NE(md.find("| c1 | 2 | 2.67x (2.50) | 0.67x |"), std::string::npos) << md;
  EXPECT_NE(md.find("2/3 identical"), std::string::npos) << md;
}

TEST(BenchMetrics, SpeedupOnlyAgainstTheSamePrompts) {
  std::vector<PromptRecord> rs = records();
  rs.erase(rs.begin() + 6);  // ar has no record of question 2
  const Summary s = summarize(infos(), rs, {"c1", "c2"});
  EXPECT_DOUBLE_EQ(s.methods[1].by_category.at("c1").speedup, 200.0 / 75.0);
  EXPECT_EQ(s.methods[1].by_category.at("c2").speedup, 0.0);  // no reference: no ratio
  EXPECT_EQ(s.methods[1].overall.speedup, 0.0);
}

TEST(BenchMetrics, MismatchesFailGreedyRunsExceptPeers) {
  std::vector<PromptRecord> rs = records();
  Summary s = summarize(infos(), rs, {});
  ASSERT_EQ(s.mismatches.size(), 1u);  // the peer's question 1
  EXPECT_EQ(s.mismatches[0].method, "peer");
  EXPECT_EQ(s.mismatches[0].position, 3);
  EXPECT_TRUE(failing_mismatches(s, true).empty());
  EXPECT_EQ(s.methods[2].agreement.identical, 2);
  EXPECT_EQ(s.methods[2].agreement.agreeing_prefix_tokens, 5 + 3 + 2);
  EXPECT_EQ(s.methods[2].agreement.reference_tokens, 11);

  rs[4].turns[0].tokens = {6, 7, 8};  // the speculative method stops one token early on question 1
  rs[7].turns.push_back({{1}, "extra turn", "length", 5});
  s = summarize(infos(), rs, {});
  const auto failing = failing_mismatches(s, true);
  ASSERT_EQ(failing.size(), 2u);
  EXPECT_EQ(failing[0].method, "spec");
  EXPECT_EQ(failing[0].question_id, "q1");
  EXPECT_EQ(failing[0].position, 3);
  EXPECT_EQ(failing[0].reference_length, 4);
  EXPECT_EQ(failing[0].length, 3);
  EXPECT_EQ(failing[1].turn, 1);                      // a turn the reference does not have
  EXPECT_TRUE(failing_mismatches(s, false).empty());  // sampling: reported, not failed
  EXPECT_NE(summary_markdown(s, true).find("FAILURE: 2 prompt(s) differ"), std::string::npos);
}

TEST(BenchMetrics, RecordJsonRoundTripAndBadRecords) {
  const PromptRecord r = records()[1];
  const PromptRecord back = record_from_json(to_json(r));
  EXPECT_EQ(back.method, "spec");
  EXPECT_EQ(back.turns[0].tokens, r.turns[0].tokens);
  EXPECT_EQ(back.steps, 40);
  EXPECT_DOUBLE_EQ(back.wall_seconds, 0.5);
  EXPECT_NE(error_of([] { record_from_json(nlohmann::json::object()); }).find("without \"method\""),
            std::string::npos);
  EXPECT_NE(
      error_of([&] { summarize(infos(), {rec("other", 0, "c", 1, 1, {})}, {}); }).find("unknown method"),
      std::string::npos);
}

// One rule for every JSONL prompt reader (bench, coverage, generate --prompts-jsonl): "turns"
// wins over "prompt" when a row has both.
TEST(BenchDataset, OneRuleForPromptRows) {
  using nlohmann::json;
  const std::vector<std::string> both = row_turns(json::parse(R"({"prompt": "p", "turns": ["t1", "t2"]})"));
  EXPECT_EQ(both, (std::vector<std::string>{"t1", "t2"}));
  EXPECT_EQ(row_turns(json::parse(R"({"prompt": "p"})")), std::vector<std::string>{"p"});
  EXPECT_TRUE(row_turns(json::parse(R"({"hello": 1})")).empty());
  EXPECT_TRUE(row_turns(json::parse("[1]")).empty());
  EXPECT_NE(error_of([] { row_turns(json::parse(R"({"turns": "x", "prompt": "p"})")); }).find("non-empty array"),
            std::string::npos);
  EXPECT_NE(error_of([] { row_turns(json::parse(R"({"prompt": 3})")); }).find("must be a string"),
            std::string::npos);
  const auto qs = parse_questions(R"({"question_id": 1, "category": "a", "turns": ["t"], "prompt": "p"})", "q", {});
  ASSERT_EQ(qs.size(), 1u);
  EXPECT_EQ(qs[0].turns, std::vector<std::string>{"t"});
}

TEST(BenchMethods, ParseSettingsSweepAndAblation) {
  SpecConfig shared;
  shared.tree.depth = 3;
  auto ms = parse_methods("ar,full:draft-layers=12,tree-topk=2,tree-tokens=6,dynamic", shared);
  ASSERT_EQ(ms.size(), 3u);
  EXPECT_FALSE(ms[0].info.speculative);
  EXPECT_EQ(ms[0].config.mode, SpecMode::None) << "ar decodes plainly whatever the shared --spec";
  EXPECT_EQ(shared.mode, SpecMode::Auto) << "the default --spec";
  EXPECT_EQ(ms[2].config.mode, SpecMode::Self) << "a bare vocabulary under the default --spec drafts with self";
  const auto automatic = parse_methods("auto", shared);
  ASSERT_EQ(automatic.size(), 1u);
  EXPECT_EQ(automatic[0].config.mode, SpecMode::Auto);
  EXPECT_EQ(ms[1].info.label, "full:draft-layers=12,tree-topk=2,tree-tokens=6");
  EXPECT_EQ(ms[1].config.mode, SpecMode::Self);
  EXPECT_EQ(ms[1].config.draft_layers, 12);
  EXPECT_EQ(ms[1].config.tree.top_k, 2);
  EXPECT_EQ(ms[1].config.tree.depth, 3);  // from the shared flags
  EXPECT_EQ(ms[2].config.draft_vocab, DraftVocabKind::Dynamic);
  EXPECT_EQ(ms[2].config.draft_layers, 0);

  auto swept = sweep_methods(ms, "vocab-window", {"1024", "2048"});
  ASSERT_EQ(swept.size(), 5u);
  EXPECT_EQ(swept[3].info.label, "dynamic:vocab-window=1024");
  EXPECT_EQ(swept[3].config.vocab_window, 1024);
  EXPECT_EQ(swept[4].info.study_value, "2048");
  EXPECT_EQ(swept[2].info.label, "full:draft-layers=12,tree-topk=2,tree-tokens=6,vocab-window=2048");

  auto ab = ablation_methods(parse_methods("ar,dynamic", shared));
  ASSERT_EQ(ab.size(), 5u);
  EXPECT_EQ(ab[1].config.vocab_source, VocabSource::Ctx);
  EXPECT_EQ(ab[2].config.vocab_source, VocabSource::Ext);
  EXPECT_EQ(ab[3].config.vocab_source, VocabSource::Both);
  EXPECT_FALSE(ab[3].config.async_gather);
  EXPECT_TRUE(ab[4].config.async_gather);
  EXPECT_EQ(ab[4].info.study_value, "both, async gather");

  EXPECT_NE(error_of([&] { parse_methods("ar,medusa", shared); }).find("unknown benchmark method 'medusa'"),
            std::string::npos);

  // A --spec mode names the drafter, optionally with the vocabulary, then settings.
  SpecConfig with_draft = shared;
  with_draft.mode = SpecMode::Draft;
  with_draft.draft_model = "d.gguf";
  with_draft.draft_vocab = DraftVocabKind::Freq;
  auto ng = parse_methods("ar,ngram,self+ngram:dynamic,self+ngram:full:ngram-first=4,tree-tokens=6,"
                          "ngram:ngram-max=3,self+ngram,freq",
                          with_draft);
  ASSERT_EQ(ng.size(), 7u);
  EXPECT_EQ(ng[1].config.mode, SpecMode::Ngram);
  EXPECT_EQ(ng[1].config.draft_model, "") << "the shared draft model is the shared drafter's";
  EXPECT_EQ(ng[2].info.label, "self+ngram:dynamic");
  EXPECT_EQ(ng[2].config.mode, SpecMode::SelfNgram);
  EXPECT_EQ(ng[2].config.draft_vocab, DraftVocabKind::Dynamic);
  EXPECT_EQ(ng[3].info.label, "self+ngram:full:ngram-first=4,tree-tokens=6");
  EXPECT_EQ(ng[3].config.draft_vocab, DraftVocabKind::Full);
  EXPECT_EQ(ng[3].config.ngram_first, 4);
  EXPECT_EQ(ng[3].config.tree.total_tokens, 6);
  EXPECT_EQ(ng[4].config.ngram_max, 3);
  EXPECT_EQ(ng[5].config.draft_vocab, DraftVocabKind::Freq) << "no vocabulary named: the shared one";
  EXPECT_EQ(ng[6].config.mode, SpecMode::Draft) << "a bare vocabulary keeps the shared drafter";
  EXPECT_EQ(ng[6].config.draft_model, "d.gguf");
  EXPECT_NE(error_of([&] { parse_methods("ngram:dynamic", shared); }).find("ngram has no draft vocabulary"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parse_methods("self+ngram:tiny", shared); }).find("full, freq, dynamic, hybrid"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parse_methods("self+ngram:dynamic:spec=self", shared); }).find("sets the drafter"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parse_methods("draft+ngram:dynamic", shared); }).find("needs --draft-model"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parse_methods("none:dynamic", shared); }).find("ar method"), std::string::npos);
  EXPECT_NE(error_of([&] { parse_methods("ar:tree-topk=2", shared); }).find("ar takes no settings"),
            std::string::npos);
  EXPECT_NE(
      error_of([&] { parse_methods("full:bogus=1", shared); }).find("unknown speculative setting 'bogus'"),
      std::string::npos);
  EXPECT_NE(error_of([&] { parse_methods("full,tree-topk=2", shared); }).find("follows no method"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parse_methods("ar,full,full", shared); }).find("given twice"), std::string::npos);
  EXPECT_NE(error_of([&] { parse_methods("full:tree-topk=x", shared); }).find("expected an integer"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parse_methods("full:spec=draft", shared); }).find("--draft-model"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              sweep_methods(parse_methods("ar", shared), "vocab-window", {"1"});
            }).find("needs a speculative method"),
            std::string::npos);
  EXPECT_NE(error_of([&] { sweep_methods(ms, "vocab-window", {"0"}); }).find("vocab-window"),
            std::string::npos);
}

// Two turns on SmolLM2: the second turn's prompt is the conversation with the method's own first
// answer; ar and self-drafting agree token for token.
TEST(BenchRunner, TwoTurnQuestionCarriesTheOwnAnswer) {
  const std::string path = test::smollm_path();
  test::require_file(path);
  auto file = GgufFile::open(path);
  ModelOptions opt;
  opt.n_threads = 2;
  auto model = Model::load(*file, opt);
  auto tok = Tokenizer::from_gguf(*file);
  BenchRunner runner(*file, *model, *tok, 1024,
                     parse_methods("ar,full:tree-topk=1,tree-depth=2,tree-tokens=3", {}),
                     chat_style_for(*file, *tok, ""));

  BenchQuestion q{"7", "writing", {"Name a fruit.", "Why that one?"}};
  const auto turn2 = runner.encode_turn(q, 1, {"An apple, really."});
  const std::string text = tok->decode(turn2);
  const size_t u1 = text.find("Name a fruit."), a1 = text.find("An apple, really."),
               u2 = text.find("Why that one?");
  ASSERT_NE(u1, std::string::npos);
  ASSERT_NE(a1, std::string::npos);
  ASSERT_NE(u2, std::string::npos);
  EXPECT_LT(u1, a1);
  EXPECT_LT(a1, u2);
  const std::string rendered = runner.render_with_placeholders(q, 1);
  EXPECT_NE(rendered.find(BenchRunner::placeholder(0)), std::string::npos);
  EXPECT_FALSE(runner.trims_contents()) << "ChatML writes the assistant's text as given";

  RunOptions ro;
  ro.params.max_new_tokens = 12;
  ro.warmup_tokens = 4;
  int progress_calls = 0;
  const auto rs = runner.run(
      {q}, ro, [&](const Progress&) { ++progress_calls; }, nullptr);
  ASSERT_EQ(rs.size(), 2u);
  EXPECT_EQ(progress_calls, 2);
  for (const PromptRecord& r : rs) {
    ASSERT_EQ(r.turns.size(), 2u);
    const auto expected = runner.encode_turn(q, 1, {r.turns[0].text});
    EXPECT_EQ(r.turns[1].prompt_tokens, static_cast<int32_t>(expected.size()));
    EXPECT_GT(r.turns[1].prompt_tokens, r.turns[0].prompt_tokens + 2);
    EXPECT_EQ(r.new_tokens, static_cast<int64_t>(r.turns[0].tokens.size() + r.turns[1].tokens.size()));
    EXPECT_GT(r.wall_seconds, r.prefill_seconds);
  }
  EXPECT_GT(rs[1].steps, 0);
  EXPECT_TRUE(compare_outputs(rs, "ar").empty());
}

}  // namespace
}  // namespace microspec::bench
