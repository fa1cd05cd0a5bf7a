#pragma once
// Options and helpers shared by the subcommands that load a model.
#include <CLI/CLI.hpp>
#include <memory>
#include <string>
#include <vector>

#include "gguf/gguf.h"
#include "model/model.h"
#include "sampling/penalties.h"
#include "speculative/settings.h"
#include "tokenizer/tokenizer.h"
#include "util/file.h"  // read_file_bytes: prompt files keep invalid UTF-8 as is

namespace microspec::cli {

// The help groups every subcommand files its options under, in this order where it has them.
namespace group {
inline constexpr const char* kModel = "Model";
inline constexpr const char* kInput = "Input";
inline constexpr const char* kSampling = "Sampling";
inline constexpr const char* kSpeculation = "Speculation";
inline constexpr const char* kServer = "Server";
inline constexpr const char* kBenchmark = "Benchmark";
inline constexpr const char* kOutput = "Output";
inline constexpr const char* kOther = "Other";
}  // namespace group

// The options of the model file every subcommand that reads one has (-m/--model), in the Model group.
CLI::Option* add_model_path_option(CLI::App& cmd, std::string& path, const char* help);

// --chat-template: how chat messages become a prompt (tokenizer/chat.h: chat_style_for's choice), in
// the Input group, for the commands that write conversations without --chat (bench, coverage, features).
CLI::Option* add_chat_template_option(CLI::App& cmd, std::string& choice);

struct ModelArgs {
  std::string model_path;
  int threads = 0;  // 0: all cores
  int32_t n_ctx = 4096;
  int32_t n_batch = 512;
  std::string kernels = "auto";
  bool repack = true;   // ModelOptions::repack (--no-repack)
  std::string hf_type;  // Hugging Face folders: weight type on load ("" keeps the checkpoint's)

  void add_to(CLI::App& cmd, int32_t default_batch = 512);
};

struct LoadedModel {
  std::unique_ptr<GgufFile> file;
  std::unique_ptr<Model> model;  // null when opened for a device (open_model)
  std::unique_ptr<Tokenizer> tokenizer;
};

// The file, its tokenizer and the model's weights on the CPU.
LoadedModel load_model(const ModelArgs& args);
// The file and its tokenizer alone, for a device that loads the weights itself (model stays null;
// read_model_config gives the configuration).
LoadedModel open_model(const ModelArgs& args);

// The speculative-decoding flags (--spec, --draft-layers, -md/--model-draft, --tree-*, --vocab-*, ...),
// one per row of the settings table (speculative/settings.h), shared by generate, serve and bench,
// in the Speculation group.
void add_spec_options(CLI::App& cmd, SpecConfig& config);

// The sampling flags generate and bench share, with llama.cpp's names: -n/--n-predict, --temp,
// --top-k, --top-p, -s/--seed, --ignore-eos, in the Sampling group.
struct SamplingFlags {
  int32_t& n_predict;
  float& temperature;
  int& top_k;
  float& top_p;
  int64_t& seed;
  bool& ignore_eos;
  int32_t min_n_predict = 0;
  int64_t min_seed = -1;  // -1: a random seed allowed
  const char* seed_help = "";
};
void add_sampling_options(CLI::App& cmd, const SamplingFlags& flags);

// The penalty and filter flags with llama.cpp's names, in the Sampling group: --repeat-penalty,
// --repeat-last-n, --presence-penalty, --frequency-penalty, --min-p and --logit-bias (repeatable,
// TOKEN_ID(+/-)BIAS as in llama.cpp, e.g. 15043+1 or 15043-1.5; read with parse_logit_bias_flags).
struct PenaltyFlags {
  PenaltyParams& penalties;
  float& min_p;
  std::vector<std::string>& logit_bias;
};
void add_penalty_options(CLI::App& cmd, const PenaltyFlags& flags);
// The --logit-bias values as (token id, bias) pairs; Error naming a malformed value.
std::vector<std::pair<int32_t, float>> parse_logit_bias_flags(const std::vector<std::string>& values);

// The verbosity flag of the subcommands that log (-lv/--log-verbosity, util/log.h), in the Other group.
void add_log_verbosity_option(CLI::App& cmd);

// Parses "1 2 3" or "1,2,3" into token ids. Throws Error on anything else.
std::vector<int32_t> parse_token_ids(const std::string& text);

}  // namespace microspec::cli
