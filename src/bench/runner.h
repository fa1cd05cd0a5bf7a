#pragma once
// Runs benchmark methods over questions with one loaded model: plain decoding (`ar`) and
// speculative methods named as drafter x draft vocabulary, interleaved per prompt so that drift in
// machine load affects every method alike.
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "bench/dataset.h"
#include "bench/metrics.h"
#include "engine/generator.h"
#include "engine/speculative_decoder.h"
#include "gguf/gguf.h"
#include "model/model.h"
#include "speculative/settings.h"
#include "tokenizer/chat.h"
#include "tokenizer/tokenizer.h"

namespace microspec::bench {

// One method of a run: `ar`, or a speculative configuration.
struct MethodSpec {
  MethodInfo info;
  SpecConfig config{.mode = SpecMode::None};                  // speculative methods only (ar: none)
  std::vector<std::pair<std::string, std::string>> settings;  // per-method overrides, in order
};

// Parses "ar,full,dynamic:vocab-window=1024,tree-topk=2,hybrid,ngram,self+ngram:dynamic". A method
// is ar; full, freq, dynamic or hybrid (the draft vocabulary; the drafter and tree come from
// `shared`, with mode none meaning self); or a --spec mode name (ngram, self+ngram, ...) optionally
// with ":VOCAB" (self+ngram:dynamic; else the shared vocabulary). Each is optionally followed by
// ":key=value" settings as apply_spec_setting takes them; an item with "=" and no ":" continues the previous method's settings. Throws Error for
// unknown names or settings, duplicates and invalid configurations.
std::vector<MethodSpec> parse_methods(const std::string& list, const SpecConfig& shared);

// One method per value for every speculative method: "base:key=value" (study_key = key).
std::vector<MethodSpec> sweep_methods(const std::vector<MethodSpec>& methods, const std::string& key,
                                      const std::vector<std::string>& values);
// The paper's Table 2 for every speculative method: candidate source ctx only, ext only, both with
// the gather on the calling thread, both with the asynchronous gather.
std::vector<MethodSpec> ablation_methods(const std::vector<MethodSpec>& methods);

struct RunOptions {
  GenerateParams params;       // max tokens, sampling, ignore_eos (the seed is offset per question)
  int32_t repeats = 1;         // runs per question and method; the one with the median wall time is kept
  int32_t warmup_tokens = 16;  // one untimed generation per method before the run (0 = none)
};

struct Progress {
  const std::string& method;
  int32_t question;  // 0-based
  int32_t questions;
  int32_t runs_done;
  int32_t runs_total;
  double method_tokens_per_second;  // this method's mean over the prompts so far
  double elapsed_seconds;
  double eta_seconds;
};

class BenchRunner {
 public:
  // Builds a Decoder per method (ar: without a drafter), all sharing one Generator (the model is
  // loaded once). Prompts are written in chat_style (tokenizer/chat.h: chat_style_for).
  BenchRunner(const GgufFile& file, Model& model, const Tokenizer& tokenizer, int32_t n_ctx,
              const std::vector<MethodSpec>& methods, ChatStyle chat_style);
  ~BenchRunner();

  // The methods as run (descriptions filled in from their setups).
  std::vector<MethodInfo> methods() const;

  // Chat-formatted token ids of turn `turn` of q, with answers[i] as the assistant's reply to turn i.
  std::vector<int32_t> encode_turn(const BenchQuestion& q, size_t turn,
                                   const std::vector<std::string>& answers) const;
  // The rendered conversation up to turn `turn` with answer i replaced by placeholder(i).
  std::string render_with_placeholders(const BenchQuestion& q, size_t turn) const;
  static std::string placeholder(size_t i);
  // Whether the chat template trims what the assistant said (answers must be trimmed the same way).
  bool trims_contents() const { return trims_contents_; }

  // Runs every method on every question, interleaved per question. on_record sees each record as it
  // is final (for streaming to disk). Errors name the method and question.
  std::vector<PromptRecord> run(const std::vector<BenchQuestion>& questions, const RunOptions& options,
                                const std::function<void(const Progress&)>& on_progress,
                                const std::function<void(const PromptRecord&)>& on_record);

 private:
  struct Method;
  PromptRecord run_one(Method& m, const BenchQuestion& q, int32_t index, const GenerateParams& params);

  const Tokenizer& tokenizer_;
  Generator gen_;
  std::vector<Method> methods_;
  ChatStyle chat_style_;
  bool trims_contents_;
};

// Resets the process's resident-memory high-water mark (Linux /proc/self/clear_refs), so that
// peak_memory_bytes() afterwards measures one generation. False where the kernel does not allow it.
bool reset_peak_memory();

}  // namespace microspec::bench
