#pragma once
// `microspec bench` (run_bench): the benchmark harness. Runs plain decoding and speculative methods over
// SpecBench / HumanEval prompts with one model load, methods interleaved per prompt, checks every
// method's output against plain decoding, and writes per-prompt records, a summary (JSON and
// Markdown, also printed) and plots (benchmarks/plot_report.py). Optional peer rows from llama.cpp
// (benchmarks/peer_llama_cpp.py).
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "gguf/gguf.h"
#include "model/model.h"
#include "sampling/penalties.h"
#include "speculative/settings.h"
#include "tokenizer/tokenizer.h"

namespace microspec::bench {

// Every option of `microspec bench` but the model's own.
struct BenchOptions {
  std::string model_path;  // for the report and the peer's job (the model is loaded by load_target)
  int32_t n_ctx = 4096;
  int32_t n_batch = 512;
  SpecConfig spec;  // the shared speculative flags
  std::string dataset;
  std::string chat_template;  // --chat-template: tokenizer/chat.h's chat_style_for's choice
  std::vector<std::string> methods;
  std::string categories;
  int32_t per_category = 0;
  int32_t max_new_tokens = 256;
  int32_t repeats = 1;
  std::string sweep;
  bool ablation = false;
  bool smoke = false;
  float temperature = 0.0f;
  int top_k = 40;
  float top_p = 0.95f;
  int64_t seed = 0;
  // --repeat-penalty, --presence-penalty, ..., --logit-bias: every method decodes with them, ar too.
  PenaltyParams penalties;
  float min_p = 0.0f;
  bool ignore_eos = false;
  std::string output;
  std::vector<std::string> peers;
  std::string coverage_csv;
  bool no_plots = false;
  std::string python = "python3";
  std::string scripts_dir;
};

// The target, loaded by the caller when run_bench asks for it (after every option, the methods,
// the dataset and the output folder were checked, so bad input fails before the model loads).
struct LoadedTarget {
  const GgufFile& file;
  Model& model;
  const Tokenizer& tokenizer;
};

// Runs the benchmark and writes records.jsonl, summary.json/.md (also printed) and the plots into
// options.output. Throws Error.
void run_bench(BenchOptions options, const std::function<LoadedTarget()>& load_target);

}  // namespace microspec::bench
