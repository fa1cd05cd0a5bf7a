// `microspec convert`: checkpoints as published on Hugging Face into GGUF. The translations live in
// the library (checkpoint/hf_folder.h, draft_head/eagle_checkpoint.h); this file only parses flags.
//   convert --hf DIR -o OUT.gguf [--type f16|q8_0|q4_k|...]
//     a model folder written as the GGUF llama.cpp's convert_hf_to_gguf.py would write (same keys,
//     tensor names and layouts), optionally quantized (default: the checkpoint's own float type)
//   convert --eagle DIR --target MODEL.gguf -o head.gguf [--type f16|q8_0|f32]
//     a published EAGLE-3 or EAGLE-2 head (config.json + pytorch_model.bin or model.safetensors)
//     -> the head GGUF `--spec head --draft-head` loads (default type: f16)
#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>
#include <string>

#include "draft_head/eagle_checkpoint.h"
#include "checkpoint/hf_folder.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "gguf/gguf_writer.h"
#include "util/error.h"

namespace microspec::cli {

namespace {

struct ConvertArgs {
  std::string hf_dir;
  std::string eagle_dir;
  std::string target;  // --eagle: the model the head drafts for
  std::string output;
  std::string type;  // "": --hf keeps the checkpoint's float type, --eagle writes f16
};

void run_convert_hf(const ConvertArgs& a) {
  HfFolderOptions options;
  if (!a.type.empty()) options.weight_type = parse_weight_type(a.type);
  if (!is_hf_folder(a.hf_dir)) throw Error(a.hf_dir + ": not a Hugging Face model folder (no config.json)");
  const GgufWriter gguf = hf_folder_to_gguf(a.hf_dir, options);
  gguf.write_file(a.output);
  std::printf("wrote %s: %zu tensors, %zu metadata keys\n", a.output.c_str(), gguf.n_tensors(), gguf.n_kv());
}

void run_convert_eagle(const ConvertArgs& a) {
  if (a.target.empty()) throw Error("convert --eagle needs --target MODEL.gguf (the model the head drafts for)");
  EagleConvertOptions o;
  o.checkpoint_dir = a.eagle_dir;
  o.target_path = a.target;
  o.output_path = a.output;
  o.matrix_type = a.type.empty() ? GgmlType::F16 : parse_weight_type(a.type);
  const EagleConvertResult r = convert_eagle_checkpoint(o);
  std::fprintf(stderr, "convert: EAGLE-%d head, %d tensors%s -> %s\n", r.version, r.n_tensors,
               r.n_draft_vocab ? (", own LM head of " + std::to_string(r.n_draft_vocab) + " rows").c_str() : "",
               a.output.c_str());
}

}  // namespace

void add_convert_command(CLI::App& app) {
  auto args = std::make_shared<ConvertArgs>();
  CLI::App* cmd = app.add_subcommand("convert", "convert a Hugging Face model folder or a published EAGLE head into GGUF");
  cmd->option_defaults()->group(group::kInput);
  auto* hf = cmd->add_option("--hf", args->hf_dir, "Hugging Face model folder (config.json, *.safetensors, tokenizer.json)");
  auto* eagle = cmd->add_option("--eagle", args->eagle_dir, "an EAGLE-3 or EAGLE-2 head folder (config.json + weights)")
                    ->check(CLI::ExistingDirectory);
  hf->excludes(eagle);
  cmd->add_option("--target", args->target,
                  "--eagle: the target model (a GGUF file or a Hugging Face folder; sizes and tokenizer are checked against it)");
  cmd->option_defaults()->group(group::kOutput);
  cmd->add_option("-o,--output", args->output, "GGUF file to write")->required();
  cmd->add_option("--type", args->type,
                  "weight type: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k (--hf; default: the "
                  "checkpoint's own float type); f16 (default), q8_0 or f32 (--eagle); norms stay f32");
  cmd->callback([args] {
    if (!args->hf_dir.empty()) return run_convert_hf(*args);
    if (!args->eagle_dir.empty()) return run_convert_eagle(*args);
    throw Error("convert: name what to convert (--hf DIR or --eagle DIR)");
  });
}

}  // namespace microspec::cli
