// `microspec eval`: teacher forcing over a token sequence. Prints the argmax at every position as
// JSON and writes the full logits rows of chosen positions to a file (raw f32, row-major), for
// conformance checks against llama.cpp.
#include <cstdio>
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
  std::string positions;
  std::string output;
};

void run_eval(const EvalArgs& a) {
  if (a.ids.empty() == a.ids_file.empty()) throw Error("give exactly one of --ids, --ids-file");
  std::vector<int32_t> ids = parse_token_ids(a.ids.empty() ? read_file_bytes(a.ids_file) : a.ids);
  if (ids.empty()) throw Error("no token ids given");
  std::vector<int32_t> dump = parse_token_ids(a.positions);
  if (!dump.empty() && a.output.empty()) throw Error("--positions needs -o");
  LoadedModel m = load_model(a.model);
  Model& model = *m.model;
  const int32_t n = static_cast<int32_t>(ids.size()), V = model.config().n_vocab;
  if (n > a.model.n_ctx)
    throw Error("sequence of " + std::to_string(n) + " tokens exceeds the context " +
                std::to_string(a.model.n_ctx));
  for (int32_t p : dump)
    if (p >= n) throw Error("--positions: " + std::to_string(p) + " is past the sequence end");
  std::vector<char> want(n, 0);
  for (int32_t p : dump) want[p] = 1;

  FILE* out = nullptr;
  if (!a.output.empty()) {
    out = std::fopen(a.output.c_str(), "wb");
    if (!out) throw Error(a.output + ": cannot open for writing");
  }
  KVCache kv = model.make_cache(a.model.n_ctx);
  Batch batch;
  ForwardOutput fo;
  std::vector<int32_t> top1(n);
  for (int32_t at = 0; at < n; at += model.n_batch()) {
    const int32_t len = std::min(model.n_batch(), n - at);
    batch.set_sequence(std::span<const int32_t>(ids.data() + at, len), at, true);
    model.forward(batch, kv, fo, {.logits = true});
    kv.commit_prefix(len);
    for (int32_t i = 0; i < len; ++i) {
      const float* row = fo.logits.data() + size_t(i) * V;
      top1[at + i] = argmax(row, V);
      if (out && want[at + i]) std::fwrite(row, sizeof(float), V, out);
    }
  }
  if (out) std::fclose(out);
  nlohmann::json j;
  j["n_tokens"] = n;
  j["n_vocab"] = V;
  j["argmax"] = top1;
  std::printf("%s\n", j.dump().c_str());
}

}  // namespace

void add_eval_command(CLI::App& app) {
  auto args = std::make_shared<EvalArgs>();
  CLI::App* cmd = app.add_subcommand("eval", "teacher-forced logits of a token sequence");
  args->model.add_to(*cmd, 64);
  cmd->add_option("--ids", args->ids, "token ids (\"1 2 3\")");
  cmd->add_option("--ids-file", args->ids_file, "file of token ids");
  cmd->add_option("--positions", args->positions, "positions whose full logits rows go to -o (\"0,5,9\")");
  cmd->add_option("-o,--output", args->output, "file for the logits rows (raw f32)");
  cmd->callback([args] { run_eval(*args); });
}

}  // namespace microspec::cli
