// `microspec convert`: checkpoints as published on Hugging Face into GGUF.
//   convert --eagle DIR --target MODEL.gguf -o head.gguf [--type f16|q8_0|f32]
//     a published EAGLE-3 or EAGLE-2 head (config.json + pytorch_model.bin or model.safetensors)
//     -> the head GGUF `--spec head --draft-head` loads (checkpoint/eagle_checkpoint.h).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>

#include "checkpoint/eagle_checkpoint.h"
#include "cli/commands.h"
#include "util/error.h"

namespace microspec::cli {

namespace {

struct ConvertArgs {
  std::string eagle_dir;
  std::string target;
  std::string output;
  std::string type = "f16";
};

GgmlType matrix_type(const std::string& name) {
  if (name == "f16") return GgmlType::F16;
  if (name == "f32") return GgmlType::F32;
  if (name == "q8_0") return GgmlType::Q8_0;
  throw Error("--type: '" + name + "' is not one of f16, q8_0, f32");
}

void run_convert_eagle(const ConvertArgs& a) {
  if (a.target.empty()) throw Error("convert --eagle needs --target MODEL.gguf (the model the head drafts for)");
  EagleConvertOptions o;
  o.checkpoint_dir = a.eagle_dir;
  o.target_path = a.target;
  o.output_path = a.output;
  o.matrix_type = matrix_type(a.type);
  const EagleConvertResult r = convert_eagle_checkpoint(o);
  std::fprintf(stderr, "convert: EAGLE-%d head, %d tensors%s -> %s\n", r.version, r.n_tensors,
               r.n_draft_vocab ? (", own LM head of " + std::to_string(r.n_draft_vocab) + " rows").c_str() : "",
               a.output.c_str());
}

}  // namespace

void add_convert_command(CLI::App& app) {
  auto args = std::make_shared<ConvertArgs>();
  CLI::App* cmd = app.add_subcommand("convert", "convert a published checkpoint into GGUF");
  cmd->add_option("--eagle", args->eagle_dir, "an EAGLE-3 or EAGLE-2 head folder (config.json + weights)")
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--target", args->target, "the target model's GGUF (--eagle: sizes and tokenizer are checked against it)");
  cmd->add_option("-o,--output", args->output, "the GGUF file to write")->required();
  cmd->add_option("--type", args->type, "matrix type: f16 (default), q8_0 or f32; norms stay f32");
  cmd->callback([args] {
    if (args->eagle_dir.empty()) throw Error("convert: name what to convert (--eagle DIR)");
    run_convert_eagle(*args);
  });
}

}  // namespace microspec::cli
