// `microspec eval`: teacher forcing over token sequences. Prints the argmax at every position as
// JSON (one line per sequence) and writes the full logits rows of chosen positions to a file (raw
// f32, row-major), for conformance checks against llama.cpp. --ids-jsonl runs many sequences on
// one model load.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <sstream>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/common.h"
#include "math/select.h"
#include "model/kv_cache.h"
#include "util/error.h"

namespace microspec::cli {

namespace {

struct EvalArgs {
  ModelArgs model;
  std::string ids;
  std::string ids_file;
  std::string ids_jsonl;
  std::string positions;
  std::string output;
};

// One sequence: its token ids and the positions whose full logits rows are written out.
struct EvalSequence {
  std::vector<int32_t> ids;
  std::vector<int32_t> positions;
};

// Teacher forcing over one sequence from an empty cache: the argmax at every position, and the
// logits rows of `seq.positions` appended to `rows_out` in ascending position order.
std::vector<int32_t> eval_sequence(Model& model, KVCache& kv, const EvalSequence& seq, FILE* rows_out) {
  const int32_t n = static_cast<int32_t>(seq.ids.size()), V = model.config().n_vocab;
  if (n == 0) throw Error("no token ids given");
  if (n > kv.n_ctx())
    throw Error("sequence of " + std::to_string(n) + " tokens exceeds the context " + std::to_string(kv.n_ctx()));
  std::vector<char> want(n, 0);
  for (int32_t p : seq.positions) {
    if (p < 0 || p >= n) throw Error("--positions: " + std::to_string(p) + " is outside the sequence");
    want[p] = 1;
  }
  kv.clear();
  Batch batch;
  ForwardOutput fo;
  std::vector<int32_t> top1(n);
  for (int32_t at = 0; at < n; at += model.n_batch()) {
    const int32_t len = std::min(model.n_batch(), n - at);
    batch.set_sequence(std::span<const int32_t>(seq.ids.data() + at, len), at, true);
    model.forward(batch, kv, fo, {.logits = true});
    kv.commit_prefix(len);
    for (int32_t i = 0; i < len; ++i) {
      const float* row = fo.logits.data() + size_t(i) * V;
      top1[at + i] = argmax(row, V);
      if (rows_out && want[at + i]) std::fwrite(row, sizeof(float), V, rows_out);
    }
  }
  return top1;
}

// --ids-jsonl: one {"ids": [...], "positions": [...]} object per line ("positions" optional).
std::vector<EvalSequence> read_sequences(const std::string& path) {
  std::vector<EvalSequence> out;
  std::istringstream lines(read_file_bytes(path));
  std::string line;
  int line_no = 0;
  while (std::getline(lines, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(line_no) + ": ";
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_object() || !j.contains("ids") || !j["ids"].is_array())
      throw Error(where + "expected a JSON object with \"ids\" (array of token ids) and optional \"positions\"");
    EvalSequence s;
    try {
      s.ids = j["ids"].get<std::vector<int32_t>>();
      if (j.contains("positions")) s.positions = j["positions"].get<std::vector<int32_t>>();
    } catch (const nlohmann::json::exception&) {
      throw Error(where + "\"ids\" and \"positions\" must be arrays of integers");
    }
    out.push_back(std::move(s));
  }
  if (out.empty()) throw Error(path + ": no sequences");
  return out;
}

void run_eval(const EvalArgs& a) {
  const int sources = !a.ids.empty() + !a.ids_file.empty() + !a.ids_jsonl.empty();
  if (sources != 1) throw Error("give exactly one of --ids, --ids-file, --ids-jsonl");
  if (!a.ids_jsonl.empty() && !a.positions.empty())
    throw Error("--positions applies to --ids/--ids-file; with --ids-jsonl each line has its own");
  std::vector<EvalSequence> seqs;
  if (!a.ids_jsonl.empty()) {
    seqs = read_sequences(a.ids_jsonl);
  } else {
    seqs.push_back({parse_token_ids(a.ids.empty() ? read_file_bytes(a.ids_file) : a.ids),
                    parse_token_ids(a.positions)});
  }
  const bool any_rows = std::any_of(seqs.begin(), seqs.end(), [](const EvalSequence& s) { return !s.positions.empty(); });
  if (any_rows && a.output.empty()) throw Error("logits rows requested (positions) but no -o file given");
  LoadedModel m = load_model(a.model);
  Model& model = *m.model;

  FILE* out = nullptr;
  if (!a.output.empty()) {
    out = std::fopen(a.output.c_str(), "wb");
    if (!out) throw Error(a.output + ": cannot open for writing");
  }
  std::unique_ptr<FILE, int (*)(FILE*)> close_out(out, [](FILE* f) { return f ? std::fclose(f) : 0; });
  KVCache kv = model.make_cache(a.model.n_ctx);
  for (const EvalSequence& seq : seqs) {
    nlohmann::json j;
    j["n_tokens"] = seq.ids.size();
    j["n_vocab"] = model.config().n_vocab;
    j["argmax"] = eval_sequence(model, kv, seq, out);
    std::printf("%s\n", j.dump().c_str());
    std::fflush(stdout);
  }
}

}  // namespace

void add_eval_command(CLI::App& app) {
  auto args = std::make_shared<EvalArgs>();
  CLI::App* cmd = app.add_subcommand("eval", "teacher-forced logits of a token sequence");
  args->model.add_to(*cmd, 64);
  cmd->option_defaults()->group(group::kInput);
  cmd->add_option("--ids", args->ids, "token ids (\"1 2 3\")");
  cmd->add_option("--ids-file", args->ids_file, "file of token ids");
  cmd->add_option("--ids-jsonl", args->ids_jsonl,
                  "batch mode: a JSONL file of {\"ids\": [...], \"positions\": [...]} objects, one model load; "
                  "prints one JSON line per sequence, rows of all sequences go to -o in order");
  cmd->add_option("--positions", args->positions, "positions whose full logits rows go to -o (\"0,5,9\")");
  cmd->option_defaults()->group(group::kOutput);
  cmd->add_option("-o,--output", args->output, "file for the logits rows (raw f32)");
  cmd->callback([args] { run_eval(*args); });
}

}  // namespace microspec::cli
