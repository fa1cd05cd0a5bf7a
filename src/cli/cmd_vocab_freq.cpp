// `microspec vocab-freq`: token frequencies of a corpus under a model's tokenizer, written as a
// ranked frequency file (vocab/freq_file.h) for the `freq` and `hybrid` draft vocabularies.
//
// Inputs: files ending in .jsonl are JSON lines; every string value of each line's JSON value is
// counted, at any depth (object fields and array elements alike: {"text": ...}, SpecBench-style
// {"turns": [...]}, chat {"messages": [{"content": ...}]}), keys are not. Any other file is
// UTF-8 text, counted in chunks that end at line breaks (at most 8 KiB each, so the tokenizer's
// work stays linear). Texts are encoded without BOS and with special tokens as plain text: the file
// counts what the model reads and writes in content, not the chat template's markers.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/common.h"
#include "gguf/gguf.h"
#include "model/model_file.h"
#include "tokenizer/tokenizer.h"
#include "util/error.h"
#include "vocab/freq_file.h"

namespace microspec::cli {
namespace {

struct VocabFreqArgs {
  std::string model;
  std::vector<std::string> corpus;
  std::string output;
  bool quiet = false;
};

struct Counter {
  const Tokenizer& tok;
  std::vector<uint64_t> counts;  // [n_vocab]
  uint64_t texts = 0;
  void text(std::string_view s) {
    if (s.empty()) return;
    ++texts;
    for (int32_t id : tok.encode(s, false, false)) ++counts[size_t(id)];
  }
  void json_strings(const nlohmann::json& j) {
    if (j.is_string()) {
      text(j.get_ref<const std::string&>());
    } else if (j.is_array() || j.is_object()) {
      for (const auto& v : j) json_strings(v);
    }
  }
};

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

void count_file(Counter& c, const std::string& path) {
  const std::string data = read_file_bytes(path);
  if (ends_with(path, ".jsonl")) {
    size_t line_no = 0, at = 0;
    while (at < data.size()) {
      size_t end = data.find('\n', at);
      if (end == std::string::npos) end = data.size();
      ++line_no;
      const std::string_view line(data.data() + at, end - at);
      at = end + 1;
      if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const nlohmann::json::exception& e) {
        throw Error(path + ":" + std::to_string(line_no) + ": not JSON (" + e.what() + ")");
      }
      c.json_strings(j);
    }
    return;
  }
  constexpr size_t kChunk = 8192;
  size_t at = 0;
  while (at < data.size()) {
    size_t end = std::min(data.size(), at + kChunk);
    if (end < data.size()) {
      const size_t nl = data.rfind('\n', end);
      if (nl != std::string::npos && nl > at) end = nl + 1;
    }
    c.text(std::string_view(data.data() + at, end - at));
    at = end;
  }
}

void run_vocab_freq(const VocabFreqArgs& a) {
  if (a.corpus.empty()) throw Error("vocab-freq: give at least one --corpus file");
  auto file = open_model_file(a.model);
  auto tok = Tokenizer::from_gguf(*file);
  Counter c{*tok, std::vector<uint64_t>(size_t(tok->n_vocab()), 0)};
  for (size_t i = 0; i < a.corpus.size(); ++i) {
    count_file(c, a.corpus[i]);
    if (!a.quiet) std::fprintf(stderr, "\rvocab-freq: %zu/%zu files", i + 1, a.corpus.size());
  }
  const TokenFrequencies f = TokenFrequencies::from_counts(c.counts);
  if (f.total == 0) throw Error("vocab-freq: the corpus has no text");
  write_freq_file(a.output, f);
  size_t distinct = 0;
  while (distinct < f.counts.size() && f.counts[distinct] > 0) ++distinct;
  if (!a.quiet)
    std::fprintf(stderr, "\nvocab-freq: %llu tokens from %llu texts, %zu distinct of %d -> %s\n",
                 static_cast<unsigned long long>(f.total), static_cast<unsigned long long>(c.texts), distinct,
                 tok->n_vocab(), a.output.c_str());
}

}  // namespace

void add_vocab_freq_command(CLI::App& app) {
  auto args = std::make_shared<VocabFreqArgs>();
  CLI::App* cmd =
      app.add_subcommand("vocab-freq", "token frequencies of a corpus, for --draft-vocab freq/hybrid");
  add_model_path_option(*cmd, args->model, "GGUF model file (its tokenizer counts)");
  cmd->option_defaults()->group(group::kInput);
  cmd->add_option("--corpus", args->corpus, "text files; .jsonl files count every string value of each line")
      ->required()
      ->expected(1, -1);
  cmd->option_defaults()->group(group::kOutput);
  cmd->add_option("-o,--output", args->output, "frequency file to write")->required();
  cmd->add_flag("-q,--quiet", args->quiet, "no progress on stderr");
  cmd->callback([args] { run_vocab_freq(*args); });
}

}  // namespace microspec::cli
