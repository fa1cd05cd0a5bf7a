// `microspec convert --hf DIR -o OUT.gguf [--type f16|q8_0|q4_k|...]`: a Hugging Face model folder
// written as the GGUF that llama.cpp's convert_hf_to_gguf.py would write (same keys, tensor names
// and layouts), optionally quantized. The translation itself lives in the library
// (checkpoint/hf_folder.h); this file only parses the flags.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>
#include <string>

#include "checkpoint/hf_folder.h"
#include "cli/commands.h"
#include "gguf/gguf_writer.h"
#include "util/error.h"

namespace microspec::cli {

namespace {

struct ConvertArgs {
  std::string hf_dir;
  std::string output;
  std::string type;  // "" keeps the checkpoint's float type
};

void run_convert(const ConvertArgs& a) {
  if (a.hf_dir.empty()) throw Error("convert: give the model to convert with --hf DIR");
  HfFolderOptions options;
  if (!a.type.empty()) options.weight_type = parse_weight_type(a.type);
  if (!is_hf_folder(a.hf_dir)) throw Error(a.hf_dir + ": not a Hugging Face model folder (no config.json)");
  const GgufWriter gguf = hf_folder_to_gguf(a.hf_dir, options);
  gguf.write_file(a.output);
  std::printf("wrote %s: %zu tensors, %zu metadata keys\n", a.output.c_str(), gguf.n_tensors(), gguf.n_kv());
}

}  // namespace

void add_convert_command(CLI::App& app) {
  auto args = std::make_shared<ConvertArgs>();
  CLI::App* cmd = app.add_subcommand("convert", "Convert a Hugging Face model folder into a GGUF file");
  cmd->add_option("--hf", args->hf_dir, "Hugging Face model folder (config.json, *.safetensors, tokenizer.json)");
  cmd->add_option("-o,--output", args->output, "GGUF file to write")->required();
  cmd->add_option("--type", args->type,
                  "weight type: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k "
                  "(default: the checkpoint's own float type)");
  cmd->callback([args] { run_convert(*args); });
}

}  // namespace microspec::cli
