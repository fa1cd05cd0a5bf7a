// `microspec bench`: parses its options and runs bench::run_bench (src/bench/harness.h).
#include <CLI/CLI.hpp>
#include <cstdint>
#include <memory>

#include "bench/harness.h"
#include "cli/commands.h"
#include "cli/common.h"

namespace microspec::cli {

namespace {

struct BenchArgs {
  ModelArgs model;
  bench::BenchOptions bench;
};

void run_bench(const BenchArgs& a) {
  bench::BenchOptions o = a.bench;
  o.model_path = a.model.model_path;
  o.n_ctx = a.model.n_ctx;
  o.n_batch = a.model.n_batch;
  LoadedModel m;
  bench::run_bench(o, [&] {
    m = load_model(a.model);
    return bench::LoadedTarget{*m.file, *m.model, *m.tokenizer};
  });
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto args = std::make_shared<BenchArgs>();
  CLI::App* cmd = app.add_subcommand(
      "bench",
      "benchmark plain and speculative decoding on SpecBench / HumanEval prompts: speed, acceptance, "
      "time breakdown, outputs checked against plain decoding");
  args->model.add_to(*cmd);
  add_spec_options(*cmd, args->bench.spec);
  cmd->add_option(
         "--dataset", args->bench.dataset,
         "SpecBench question.jsonl (question_id, category, turns) or HumanEval JSONL (task_id, prompt)")
      ->required();
  cmd->add_option(
      "--methods", args->bench.methods,
      "comma-separated methods: ar, full, freq, dynamic, hybrid (the vocabulary, with the drafter of "
      "--spec), or a --spec mode optionally with its vocabulary (ngram, self+ngram:dynamic), each "
      "optionally with settings (dynamic:vocab-window=1024,tree-topk=2); the shared --spec/--draft-*/--tree-*/--vocab-* flags "
      "apply to every speculative method (default ar,full,dynamic; with --ablation ar,dynamic)");
  cmd->add_option("--categories", args->bench.categories,
                  "comma-separated categories to keep (default: all)");
  cmd->add_option("--per-category", args->bench.per_category, "first N questions of each category (0 = all)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 30));
  cmd->add_option("-n,--max-new-tokens", args->bench.max_new_tokens, "most tokens generated per turn")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 24));
  cmd->add_option("--repeats", args->bench.repeats,
                  "runs per prompt and method; the median wall time is kept")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--sweep", args->bench.sweep,
                  "key=v1,v2,...: every speculative method once per value of a speculative setting "
                  "(vocab-window, tree-tokens, draft-layers, ...)");
  cmd->add_flag(
      "--ablation", args->bench.ablation,
      "the paper's Table 2 per speculative method: vocab-source ctx, ext, both without and with async "
      "gather");
  cmd->add_flag("--smoke", args->bench.smoke, "quick check for CI: 2 prompts per category, 32 new tokens");
  cmd->add_option("--temp", args->bench.temperature, "temperature; 0 = greedy (outputs must then equal ar's)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 100.0));
  cmd->add_option("--top-k", args->bench.top_k, "top-k filter when sampling")->capture_default_str();
  cmd->add_option("--top-p", args->bench.top_p, "top-p filter when sampling")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--seed", args->bench.seed, "sampling seed (question i uses seed + i for every method)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t(0), INT64_MAX));
  cmd->add_flag("--ignore-eos", args->bench.ignore_eos, "always generate --max-new-tokens tokens");
  cmd->add_option("-o,--output", args->bench.output, "output folder (records.jsonl, summary.json/.md, plots)")
      ->required();
  cmd->add_option("--peers", args->bench.peers, "peer engines run on the same prompts: llama.cpp")
      ->delimiter(',');
  cmd->add_option("--coverage-csv", args->bench.coverage_csv,
                  "coverage table from `microspec coverage` to plot in the report (Figure 1b)");
  cmd->add_flag("--no-plots", args->bench.no_plots, "skip the PNG plots (no Python needed)");
  cmd->add_option("--python", args->bench.python, "Python interpreter for plots and peers")
      ->capture_default_str();
  cmd->add_option(
      "--scripts-dir", args->bench.scripts_dir,
      "folder with plot_report.py and peer_llama_cpp.py (default: benchmarks/ of this source tree)");
  cmd->callback([args] { run_bench(*args); });
}

}  // namespace microspec::cli
