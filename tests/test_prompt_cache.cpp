// The server's prefix cache: the slot pool gives a request the free slot whose cache shares the
// longest prefix with its prompt (the least recently used of equals), and a generation that keeps
// a slot's cache rows (BatchScheduler::reusable_rows) gives exactly what a fresh prefill gives:
// tokens and log-probabilities bit for bit, for plain decoding and for speculative decoding whose
// drafter (K_pre window, n-gram index) begins from the whole prompt, greedy and seeded sampling.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "engine/generator.h"
#include "engine/speculative_decoder.h"
#include "gguf/gguf.h"
#include "model/model.h"
#include "server/batch_scheduler.h"
#include "server/slots.h"
#include "support/test_helpers.h"
#include "tokenizer/tokenizer.h"

namespace microspec::server {
namespace {

using Tokens = std::vector<int32_t>;

int lease_for(SlotPool& pool, const Tokens& prompt, std::unique_ptr<SlotLease>* lease) {
  double waited = 0.0;
  EXPECT_EQ(pool.acquire(prompt, lease, &waited), SlotPool::Status::Ok);
  return (*lease)->index();
}

TEST(SlotPool, LongestCommonPrefixWinsAndTiesGoToTheLeastRecentlyUsed) {
  SlotPool pool(3, 4);
  std::unique_ptr<SlotLease> a, b, c;
  EXPECT_EQ(lease_for(pool, {1, 2, 3}, &a), 0);  // nothing remembered: least recently used first
  EXPECT_EQ(lease_for(pool, {1, 2, 3}, &b), 1);
  EXPECT_EQ(lease_for(pool, {1, 2, 3}, &c), 2);
  a->remember(Tokens{1, 2, 3, 4, 5});
  b->remember(Tokens{1, 2, 9});
  c->remember(Tokens{7});
  c.reset();
  a.reset();
  b.reset();

  std::unique_ptr<SlotLease> x;
  EXPECT_EQ(lease_for(pool, {1, 2, 3, 4, 6}, &x), 0) << "4 tokens in common beat 2 and 0";
  x.reset();
  EXPECT_EQ(lease_for(pool, {1, 2, 9, 9}, &x), 1);
  x.reset();
  EXPECT_EQ(lease_for(pool, {7, 7}, &x), 2);
  x.reset();
  // No prefix anywhere: the slot leased longest ago (0, then 1) is evicted.
  EXPECT_EQ(lease_for(pool, {5}, &x), 0);
  x.reset();  // slot 0 remembers nothing now: its lease did not call remember()
  EXPECT_EQ(lease_for(pool, {1, 2, 3, 4, 5}, &x), 1) << "slot 0 forgot; slot 1 still shares {1, 2}";
  x.reset();
  EXPECT_EQ(lease_for(pool, {8}, &x), 2) << "slots 0 and 1 were leased after 2";
}

// One slot over the real SmolLM2, its decoder drafting with `mode` (the default MicroSpec window,
// K_pre 3, for the drafters with an LM head).
struct CachedSlot {
  std::unique_ptr<GgufFile> file;
  std::unique_ptr<Model> model;
  std::unique_ptr<Tokenizer> tok;
  std::unique_ptr<BatchScheduler> scheduler;

  explicit CachedSlot(SpecMode mode) {
    file = GgufFile::open(test::smollm_path());
    ModelOptions opt;
    opt.n_threads = 2;
    model = Model::load(*file, opt);
    tok = Tokenizer::from_gguf(*file);
    SpecConfig spec;
    spec.mode = mode;
    if (mode == SpecMode::Draft) spec.draft_model = test::smollm_path();  // SmolLM2 drafting for itself
    std::vector<SequenceSlot> slots(1);
    slots[0].gen = std::make_unique<Generator>(*model, *tok, 512);
    slots[0].decoder = std::make_unique<Decoder>(spec, *file, *slots[0].gen, *tok);
    scheduler = std::make_unique<BatchScheduler>(*model, *tok, std::move(slots), 64, 2);
  }
  SpecResult run(const Tokens& prompt, const GenerateParams& params, bool speculative, int32_t reuse) {
    return scheduler->generate(0, prompt, params, speculative, nullptr, reuse);
  }
};

GenerateParams params_for(uint64_t seed, float temperature) {
  GenerateParams p;
  p.max_new_tokens = 20;
  p.sampling.temperature = temperature;
  p.sampling.seed = seed;
  p.logprobs.enabled = true;
  p.logprobs.top = 3;
  return p;
}

void expect_same(const SpecResult& cached, const SpecResult& fresh, const std::string& what) {
  EXPECT_EQ(cached.gen.tokens, fresh.gen.tokens) << what;
  EXPECT_EQ(cached.gen.text, fresh.gen.text) << what;
  EXPECT_EQ(cached.gen.finish, fresh.gen.finish) << what;
  ASSERT_EQ(cached.gen.logprobs.entries.size(), fresh.gen.logprobs.entries.size()) << what;
  for (size_t i = 0; i < fresh.gen.logprobs.entries.size(); ++i) {
    EXPECT_EQ(cached.gen.logprobs.entries[i].token, fresh.gen.logprobs.entries[i].token)
        << what << " entry " << i;
    EXPECT_EQ(cached.gen.logprobs.entries[i].logprob, fresh.gen.logprobs.entries[i].logprob)
        << what << " entry " << i;
  }
}

// A second turn that continues the first (its prompt, its answer, a new question): kept rows, then
// the same generation from a fresh prefill in the same slot, for plain and speculative decoding.
void second_turn_equals_fresh(SpecMode mode) {
  test::require_file(test::smollm_path());
  CachedSlot s(mode);
  const Tokens first =
      s.tok->encode("<|im_start|>user\nName three rivers in Europe.<|im_end|>\n<|im_start|>assistant\n",
                    /*add_bos=*/false, /*parse_special=*/true);
  const Tokens more = s.tok->encode(
      "<|im_end|>\n<|im_start|>user\nWhich one is the longest?<|im_end|>\n<|im_start|>assistant\n",
      /*add_bos=*/false, /*parse_special=*/true);
  for (const bool speculative : {false, true}) {
    for (const float temperature : {0.0f, 0.8f}) {
      const std::string what =
          std::string(speculative ? "speculative" : "plain") + (temperature > 0 ? " sampled" : " greedy");
      const GenerateParams params = params_for(7, temperature);
      const SpecResult one = s.run(first, params, speculative, 0);
      ASSERT_FALSE(one.gen.tokens.empty()) << what;
      Tokens second(s.scheduler->slot(0).cached);
      ASSERT_GE(second.size(), first.size() + one.gen.tokens.size() - 1) << what;
      second.insert(second.end(), more.begin(), more.end());
      const int32_t reuse = s.scheduler->reusable_rows(0, second, speculative);
      // A speculative generation keeps the prompt rows its decoder holds statistics for; plain
      // decoding keeps the answer's rows too.
      if (speculative)
        EXPECT_EQ(reuse, int32_t(first.size())) << what;
      else
        EXPECT_EQ(reuse, int32_t(s.scheduler->slot(0).cached.size())) << what;
      const SpecResult cached = s.run(second, params, speculative, reuse);
      const SpecResult fresh = s.run(second, params, speculative, 0);
      expect_same(cached, fresh, what);
      EXPECT_GT(cached.gen.tokens.size(), 0u) << what;
      // More than the slot can give is refused, never silently wrong.
      EXPECT_NE(test::error_of([&] {
                  s.run(second, params, speculative, int32_t(second.size()));
                }).find("reused rows"),
                std::string::npos);
    }
  }
  // After a plain generation the decoder's prompt statistics cover only the rows plain decoding kept.
  const GenerateParams greedy = params_for(1, 0.0f);
  s.run(first, greedy, /*speculative=*/true, 0);
  Tokens longer(first);
  longer.insert(longer.end(), more.begin(), more.end());
  s.run(longer, greedy, /*speculative=*/false, s.scheduler->reusable_rows(0, longer, false));
  EXPECT_EQ(s.scheduler->reusable_rows(0, longer, true), int32_t(first.size()));
  EXPECT_EQ(s.scheduler->reusable_rows(0, longer, false), int32_t(longer.size()) - 1);
}

TEST(PromptCache, SecondTurnEqualsAFreshPrefillSelfDraft) {
  second_turn_equals_fresh(SpecMode::Self);
}
TEST(PromptCache, SecondTurnEqualsAFreshPrefillNgram) {
  second_turn_equals_fresh(SpecMode::Ngram);
}
// A separate draft model (its own cache prefilled from the whole prompt) and the EAGLE-3 head beside
// the model (the decoder keeps the kept rows' target features).
TEST(PromptCache, SecondTurnEqualsAFreshPrefillDraftModel) {
  second_turn_equals_fresh(SpecMode::Draft);
}
TEST(PromptCache, SecondTurnEqualsAFreshPrefillHead) {
  second_turn_equals_fresh(SpecMode::Head);
}

}  // namespace
}  // namespace microspec::server
