// The speculative settings table (every flag parses, prints and validates through one row), the
// draft model's options (it runs on the target's kernel table), and the server's answer to a
// failure inside a generation (the server's fault, not the request's), and what of the settings
// and of a request the CUDA backend takes.
#include <gtest/gtest.h>

#include <functional>
#include <new>
#include <nlohmann/json.hpp>
#include <string>

#include "engine/cuda_generator.h"
#include "engine/generator.h"
#include "engine/speculative_decoder.h"
#include "gguf/gguf.h"
#include "model/model.h"
#include "speculative/step_costs.h"
#include "server/api.h"
#include "speculative/settings.h"
#include "support/test_helpers.h"
#include "tokenizer/tokenizer.h"
#include "util/error.h"

namespace microspec {
namespace {

using test::error_of;

TEST(SpecSettings, EveryMemberRoundTripsThroughTheTable) {
  // Every member away from its default, written out by the table and read back through it.
  SpecConfig c;
  c.mode = SpecMode::DraftNgram;
  c.draft_model = "draft.gguf";
  c.ngram_min = 1;
  c.ngram_max = 7;
  c.ngram_first = 4;
  c.tree = {5, 2, 9, /*p_min=*/0.25};
  c.draft_vocab = DraftVocabKind::Hybrid;
  c.freq_file = "f.bin";
  c.freq_top = 100;
  c.hybrid_top = 7;
  c.vocab_window = 1024;
  c.vocab_kpre = 1;
  c.vocab_kver = 5;
  c.vocab_source = VocabSource::Ext;
  c.async_gather = false;
  const nlohmann::json j = spec_config_json(c);
  EXPECT_EQ(j.size(), spec_settings().size());
  EXPECT_EQ(j.at("spec"), "draft+ngram");
  EXPECT_EQ(j.at("ngram-max"), 7);
  EXPECT_EQ(j.at("draft-vocab"), "hybrid");
  EXPECT_EQ(j.at("vocab-source"), "ext");
  EXPECT_EQ(j.at("vocab-window"), 1024);
  EXPECT_EQ(j.at("draft-p-min"), 0.25);
  EXPECT_EQ(j.at("async-gather"), false);
  SpecConfig back;
  for (const SpecSetting& s : spec_settings()) {
    const nlohmann::json& v = j.at(s.flag);
    apply_spec_setting(back, s.flag, v.is_string() ? v.get<std::string>() : v.dump());
  }
  EXPECT_EQ(spec_config_json(back), j);
  EXPECT_NO_THROW(back.validate());
  // Defaults as the CLI shows them are the config's own.
  EXPECT_EQ(spec_setting("spec").default_text(), "auto");
  EXPECT_EQ(spec_setting("draft-vocab").default_text(), "dynamic");
  EXPECT_EQ(spec_setting("vocab-window").default_text(), "3072");
  EXPECT_EQ(spec_setting("async-gather").default_text(), "true");
}

TEST(SpecSettings, ErrorsNameTheValidValuesAndRanges) {
  SpecConfig c;
  EXPECT_NE(error_of([&] { apply_spec_setting(c, "spec", "fast"); })
                .find("none, self, draft, head, ngram, self+ngram, draft+ngram, head+ngram, auto; got 'fast'"),
            std::string::npos);
  // auto takes one model drafter; --step-costs is auto's.
  SpecConfig a;
  a.draft_layers = 6;
  a.draft_head = "h.gguf";
  EXPECT_NE(error_of([&] { a.validate(); }).find("--spec auto takes one model drafter"), std::string::npos);
  a.draft_head.clear();
  EXPECT_NO_THROW(a.validate());
  EXPECT_EQ(auto_model_mode(a, true), SpecMode::Self) << "--draft-layers picks the self-draft";
  a.draft_layers = 0;
  EXPECT_EQ(auto_model_mode(a, true), SpecMode::Head) << "a head beside the model";
  EXPECT_EQ(auto_model_mode(a, false), SpecMode::Self);
  a.step_costs = "costs.json";
  a.mode = SpecMode::Ngram;
  EXPECT_NE(error_of([&] { a.validate(); }).find("--step-costs applies to --spec auto"), std::string::npos);
  EXPECT_NE(error_of([&] { apply_spec_setting(c, "ngram-min", "0"); }).find("--ngram-min must be in [1, 64]"),
            std::string::npos);
  EXPECT_NE(
      error_of([&] { apply_spec_setting(c, "draft-vocab", "tiny"); }).find("full, freq, dynamic, hybrid"),
      std::string::npos);
  EXPECT_NE(error_of([&] { apply_spec_setting(c, "vocab-source", "all"); }).find("both, ctx, ext"),
            std::string::npos);
  EXPECT_NE(
      error_of([&] { apply_spec_setting(c, "vocab-window", "0"); }).find("--vocab-window must be in [1, "),
      std::string::npos);
  EXPECT_NE(error_of([&] { apply_spec_setting(c, "tree-topk", "x"); }).find("expected an integer"),
            std::string::npos);
  EXPECT_NE(error_of([&] { apply_spec_setting(c, "async-gather", "maybe"); }).find("true or false"),
            std::string::npos);
  // --draft-p-min is a probability, as in llama.cpp: not a percent.
  EXPECT_NE(error_of([&] { apply_spec_setting(c, "draft-p-min", "1.5"); }).find("--draft-p-min must be in [0, 1], got 1.5"),
            std::string::npos);
  EXPECT_NE(error_of([&] { apply_spec_setting(c, "draft-p-min", "-0.1"); }).find("must be in [0, 1]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { apply_spec_setting(c, "draft-p-min", "20"); }).find("got 20"), std::string::npos);
  EXPECT_NE(error_of([&] { apply_spec_setting(c, "draft-p-min", "0.2x"); }).find("expected a number"),
            std::string::npos);
  const std::string unknown = error_of([&] { apply_spec_setting(c, "bogus", "1"); });
  EXPECT_NE(unknown.find("unknown speculative setting 'bogus'"), std::string::npos);
  EXPECT_NE(unknown.find("vocab-window"), std::string::npos) << "lists the settings: " << unknown;
  EXPECT_EQ(spec_config_json(c), spec_config_json(SpecConfig{})) << "a rejected value changes nothing";
  // validate() checks members set directly against the same ranges.
  c.vocab_window = 0;
  EXPECT_NE(error_of([&] { c.validate(); }).find("--vocab-window"), std::string::npos);
  c = SpecConfig{};
  c.mode = SpecMode::Draft;
  EXPECT_NE(error_of([&] { c.validate(); }).find("--draft-model"), std::string::npos);
  EXPECT_EQ(parse_spec_mode("self"), SpecMode::Self);
  // The n-gram modes: X+ngram takes X's settings; the lengths must be ordered.
  EXPECT_EQ(parse_spec_mode("self+ngram"), SpecMode::SelfNgram);
  EXPECT_EQ(fallback_mode(SpecMode::SelfNgram), SpecMode::Self);
  EXPECT_EQ(fallback_mode(SpecMode::DraftNgram), SpecMode::Draft);
  EXPECT_EQ(fallback_mode(SpecMode::Ngram), SpecMode::None);
  EXPECT_TRUE(uses_ngram(SpecMode::Ngram));
  EXPECT_FALSE(uses_ngram(SpecMode::Self));
  c = SpecConfig{};
  c.mode = SpecMode::DraftNgram;
  EXPECT_NE(error_of([&] { c.validate(); }).find("--spec draft+ngram needs --draft-model"), std::string::npos);
  c.mode = SpecMode::Ngram;
  c.draft_layers = 3;
  EXPECT_NE(error_of([&] { c.validate(); }).find("do not apply to --spec ngram"), std::string::npos);
  c = SpecConfig{};
  c.mode = SpecMode::SelfNgram;
  c.draft_layers = 3;
  EXPECT_NO_THROW(c.validate());
  c.ngram_min = 4;
  c.ngram_max = 3;
  EXPECT_NE(error_of([&] { c.validate(); }).find("--ngram-min 4 must not exceed --ngram-max 3"),
            std::string::npos);
  c.ngram_min = 2;
  c.ngram_max = 3;
  c.ngram_first = 5;
  EXPECT_NE(error_of([&] { c.validate(); }).find("--ngram-first must be in [ngram-min, ngram-max] = [2, 3], got 5"),
            std::string::npos);
  c.mode = SpecMode::Ngram;  // ngram-first applies to X+ngram only
  c.draft_layers = 0;
  EXPECT_NO_THROW(c.validate());
  // head+ngram: the head takes --draft-head; the other modes refuse it.
  EXPECT_EQ(parse_spec_mode("head+ngram"), SpecMode::HeadNgram);
  EXPECT_EQ(fallback_mode(SpecMode::HeadNgram), SpecMode::Head);
  EXPECT_TRUE(uses_ngram(SpecMode::HeadNgram));
  c = SpecConfig{};
  c.mode = SpecMode::HeadNgram;
  c.draft_head = "h.gguf";
  EXPECT_NO_THROW(c.validate());
  c.draft_layers = 3;
  EXPECT_NE(error_of([&] { c.validate(); }).find("do not apply to --spec head+ngram"), std::string::npos);
  c.draft_layers = 0;
  c.mode = SpecMode::SelfNgram;
  EXPECT_NE(error_of([&] { c.validate(); }).find("--draft-head applies to --spec head or head+ngram"),
            std::string::npos);
  EXPECT_STREQ(name_of(DraftVocabKind::Freq), "freq");
}

// --kernels reference --spec draft: the draft model runs on the reference kernels too, and a
// second decoder can share it.
TEST(StepCosts, InterpolatesRoundTripsAndRefusesMalformedFiles) {
  StepCosts c;
  c.rows = {1, 2, 4};
  c.forward = {1.0, 1.5, 2.5};
  c.lm_head = {0.5, 0.5, 0.6};
  EXPECT_DOUBLE_EQ(c.forward_at(0), 0.0);
  EXPECT_DOUBLE_EQ(c.forward_at(3), 2.0);
  EXPECT_DOUBLE_EQ(c.forward_at(6), 3.5) << "beyond the last point: the last two's slope";
  EXPECT_DOUBLE_EQ(c.body_at(2), 1.0);
  std::string key;
  const StepCosts back = parse_step_costs(step_costs_json(c, "k"), &key);
  EXPECT_EQ(key, "k");
  EXPECT_EQ(back.forward, c.forward);
  EXPECT_EQ(calibration_rows(5), (std::vector<int32_t>{1, 2, 3, 4, 5}));
  EXPECT_EQ(calibration_rows(40), (std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 32, 40}));
  EXPECT_NE(error_of([] { parse_step_costs("{", nullptr); }).find("malformed"), std::string::npos);
  EXPECT_NE(error_of([] {
              parse_step_costs(R"({"version":1,"key":"k","rows":[2],"forward":[1],"lm_head":[0]})", nullptr);
            }).find("first row count must be 1"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              parse_step_costs(R"({"version":1,"key":"k","rows":[1,2],"forward":[1,-1],"lm_head":[0,0]})", nullptr);
            }).find("positive"),
            std::string::npos);
}

TEST(SpecSettings, DraftModelLoadsWithTheTargetsKernels) {
  const std::string path = test::smollm_path();
  test::require_file(path);
  auto file = GgufFile::open(path);
  ModelOptions opt;
  opt.n_threads = 1;
  opt.n_batch = 16;
  opt.kernels = "reference";
  auto model = Model::load(*file, opt);
  auto tok = Tokenizer::from_gguf(*file);
  Generator gen(*model, *tok, 64);
  SpecConfig c;
  c.mode = SpecMode::Draft;
  c.draft_model = path;
  c.draft_vocab = DraftVocabKind::Full;
  Decoder decoder(c, *file, gen, *tok);
  ASSERT_NE(decoder.draft_model(), nullptr);
  EXPECT_STREQ(decoder.draft_model()->kernels().name, "reference");
  EXPECT_EQ(decoder.draft_model()->n_batch(), 16);
  // A second sequence's decoder (the server's next slot) runs on the same draft model, not a copy.
  Generator gen2(*model, *tok, 64);
  Decoder second(c, *file, gen2, *tok, &decoder);
  EXPECT_EQ(second.draft_model(), decoder.draft_model());
  Decoder plain(SpecConfig{.mode = SpecMode::None}, *file, gen, *tok);
  EXPECT_FALSE(plain.speculative());
  EXPECT_EQ(plain.draft_model(), nullptr);
}

// generate and serve refuse what the device cannot run before any device is asked for: chains and
// trees from the self-draft, a draft model or a head; sampling with top-k on.
TEST(DeviceSettings, TheDeviceTakesChainsTreesAndTopKSampling) {
  auto why = [](SpecMode mode, int32_t top_k, double p_min = 0.0) {
    SpecConfig c;
    c.mode = mode;
    c.tree.top_k = top_k;
    c.tree.p_min = p_min;
    return cuda_spec_unsupported(c);
  };
  EXPECT_EQ(why(SpecMode::None, 4), "") << "no speculation";
  for (SpecMode mode : {SpecMode::Self, SpecMode::Draft, SpecMode::Head}) EXPECT_EQ(why(mode, 1), "") << name_of(mode);
  EXPECT_EQ(why(SpecMode::Self, 4), "") << "a self-drafted tree";
  EXPECT_EQ(why(SpecMode::Head, 4), "") << "a tree drafted by an EAGLE-3 head";
  EXPECT_EQ(why(SpecMode::Draft, 4), "") << "a tree drafted by a draft model";
  for (SpecMode mode : {SpecMode::Ngram, SpecMode::SelfNgram, SpecMode::DraftNgram, SpecMode::HeadNgram})
    EXPECT_NE(why(mode, 1).find("--spec self|draft|head"), std::string::npos) << name_of(mode);
  EXPECT_NE(why(SpecMode::Self, 1, 0.2).find("--draft-p-min 0"), std::string::npos);
  // Speculative sampling: chains from any of the three drafters; a self-drafted tree whose draft
  // rows draw at most 512 tokens a step ((1 + depth x top-k) x top-k).
  auto why_sampled = [](SpecMode mode, int32_t top_k, int32_t depth = 3) {
    SpecConfig c;
    c.mode = mode;
    c.tree.top_k = top_k;
    c.tree.depth = depth;
    return cuda_spec_sampling_unsupported(c);
  };
  EXPECT_EQ(why_sampled(SpecMode::None, 4), "") << "no speculation";
  for (SpecMode mode : {SpecMode::Self, SpecMode::Draft, SpecMode::Head}) EXPECT_EQ(why_sampled(mode, 1), "") << name_of(mode);
  EXPECT_EQ(why_sampled(SpecMode::Self, 4), "") << "a tree of 13 draft rows: 52 draws";
  EXPECT_EQ(why_sampled(SpecMode::Self, 8, 7), "") << "57 draft rows: 456 draws";
  const std::string too_many = why_sampled(SpecMode::Self, 8, 8);
  EXPECT_NE(too_many.find("at most 512 draft draws a step"), std::string::npos) << too_many;
  EXPECT_NE(too_many.find("--tree-topk 8 --tree-depth 8 takes 520"), std::string::npos) << too_many;

  // Sampling: the CPU Sampler's draw with top-k on (1..64); a temperature whose inverse overflows
  // is greedy, as on the CPU.
  SamplingParams sampling{.temperature = 0.0f, .top_k = 0};
  EXPECT_TRUE(sampling.greedy());
  EXPECT_EQ(cuda_params_unsupported(sampling), "") << "greedy ignores top_k";
  sampling.temperature = 1e-39f;
  EXPECT_TRUE(sampling.greedy());
  EXPECT_EQ(cuda_params_unsupported(sampling), "") << "greedy ignores top_k";
  sampling.temperature = 0.7f;
  EXPECT_FALSE(sampling.greedy());
  EXPECT_NE(cuda_params_unsupported(sampling), "") << "sampling with top_k 0";
  for (int k : {0, -1, 65, 1000})
    EXPECT_NE(cuda_params_unsupported(SamplingParams{.temperature = 0.7f, .top_k = k}).find("top_k must be in 1..64"),
              std::string::npos)
        << k;
  for (int k : {1, 40, 64}) EXPECT_EQ(cuda_params_unsupported(SamplingParams{.temperature = 0.7f, .top_k = k}), "") << k;
}

TEST(ServerErrors, FailuresInsideAGenerationAreServerErrors) {
  // An engine invariant failing mid-generation (the request was validated before it ran).
  const server::ApiError e = server::generation_error(Error("draft model: out of step with the target"));
  EXPECT_EQ(e.status, 500);
  EXPECT_EQ(e.type, "server_error");
  EXPECT_EQ(e.code, "generation_failed");
  EXPECT_NE(std::string(e.what()).find("out of step"), std::string::npos);
  const server::ApiError oom = server::generation_error(std::bad_alloc());
  EXPECT_EQ(oom.status, 503);
  // The request's own problems stay 400 invalid_request_error.
  const server::ApiError bad(400, "Invalid 'temperature'.", "temperature");
  EXPECT_EQ(bad.type, "invalid_request_error");
}

// A speculative answer's usage: the CPU's counts and timings; the device's counts, named as
// the device's, with nothing it does not measure (its timings, the active vocabulary).
TEST(ServerAnswers, UsageCarriesWhatTheDeviceMeasures) {
  server::GenerationReport r;
  r.speculative = true;
  r.spec_mode = "self";
  r.draft_vocab = "dynamic";
  r.result.stats.steps = 4;
  r.result.stats.accepted_draft = 6;
  r.result.stats.drafted = 12;
  r.result.stats.draft_seconds = 0.5;
  const nlohmann::json cpu = server::usage_json(r)["microspec"];
  EXPECT_FALSE(cpu.contains("device"));
  EXPECT_EQ(cpu["draft_seconds"], 0.5);
  EXPECT_TRUE(cpu.contains("mean_active_vocab"));
  r.device = "cuda";
  const nlohmann::json device = server::usage_json(r)["microspec"];
  EXPECT_EQ(device["device"], "cuda");
  EXPECT_EQ(device["steps"], 4);
  EXPECT_EQ(device["accepted_draft_tokens"], 6);
  EXPECT_EQ(device["drafted_tokens"], 12);
  EXPECT_DOUBLE_EQ(device["mean_acceptance_length"].get<double>(), 2.5);
  for (const char* absent : {"draft_seconds", "verify_seconds", "mean_active_vocab"})
    EXPECT_FALSE(device.contains(absent)) << absent;
}

}  // namespace
}  // namespace microspec
