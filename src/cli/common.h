#pragma once
// Options and helpers shared by the subcommands that load a model.
#include <CLI/CLI.hpp>
#include <memory>
#include <string>
#include <vector>

#include "gguf/gguf.h"
#include "model/model.h"
#include "speculative/settings.h"
#include "tokenizer/tokenizer.h"
#include "util/file.h"  // read_file_bytes: prompt files keep invalid UTF-8 as is

namespace microspec::cli {

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

// The speculative-decoding flags (--spec, --draft-layers, --draft-model, --tree-*, --vocab-*, ...),
// one per row of the settings table (speculative/settings.h), shared by generate, serve and bench.
void add_spec_options(CLI::App& cmd, SpecConfig& config);

// Parses "1 2 3" or "1,2,3" into token ids. Throws Error on anything else.
std::vector<int32_t> parse_token_ids(const std::string& text);

}  // namespace microspec::cli
