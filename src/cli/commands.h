#pragma once
// Each subcommand of the `microspec` binary registers itself on the CLI11 app.
// Every subcommand's callback may throw microspec::Error; main() reports it and exits non-zero.
namespace CLI {
class App;
}

namespace microspec::cli {

void add_generate_command(CLI::App& app);     // cmd_generate.cpp
void add_info_command(CLI::App& app);         // cmd_info.cpp: metadata and tensor table of a GGUF file
void add_dump_tensor_command(CLI::App& app);  // cmd_dump_tensor.cpp: dequantized rows as raw f32
void add_tokenize_command(CLI::App& app);     // cmd_tokenize.cpp: token ids of a text
void add_eval_command(CLI::App& app);         // cmd_eval.cpp: logits of a token sequence (teacher forcing)
void add_features_command(CLI::App& app);     // cmd_features.cpp: a draft head's training data
void add_vocab_freq_command(CLI::App& app);   // cmd_vocab_freq.cpp: token frequency file of a corpus
void add_coverage_command(CLI::App& app);     // cmd_coverage.cpp: draft-vocabulary coverage of greedy decoding
void add_bench_command(CLI::App& app);        // cmd_bench.cpp: benchmark harness (speed, acceptance, output check)
void add_serve_command(CLI::App& app);        // cmd_serve.cpp: OpenAI-compatible HTTP server
void add_convert_command(CLI::App& app);      // cmd_convert.cpp: Hugging Face folders and EAGLE heads -> GGUF
void add_template_command(CLI::App& app);     // cmd_template.cpp: render a Jinja chat template

}  // namespace microspec::cli
