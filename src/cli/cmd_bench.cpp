// `microspec bench`: parses its options and runs bench::run_bench (src/bench/harness.h).
#include <CLI/CLI.hpp>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bench/harness.h"
#include "cli/commands.h"
#include "cli/common.h"

namespace microspec::cli {

namespace {

struct BenchArgs {
  ModelArgs model;
  bench::BenchOptions bench;
  std::vector<std::string> logit_bias;  // --logit-bias TOKEN_ID(+/-)BIAS
};

void run_bench(const BenchArgs& a) {
  bench::BenchOptions o = a.bench;
  o.penalties.logit_bias = parse_logit_bias_flags(a.logit_bias);
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
  bench::BenchOptions& b = args->bench;

  cmd->option_defaults()->group(group::kInput);
  cmd->add_option(
         "--dataset", b.dataset,
         "SpecBench question.jsonl (question_id, category, turns) or HumanEval JSONL (task_id, prompt)")
      ->required();
  cmd->add_option("--categories", b.categories, "comma-separated categories to keep (default: all)");
  cmd->add_option("--per-category", b.per_category, "first N questions of each category (0 = all)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 30));
  add_chat_template_option(*cmd, b.chat_template);

  add_sampling_options(*cmd, {.n_predict = b.max_new_tokens,
                              .temperature = b.temperature,
                              .top_k = b.top_k,
                              .top_p = b.top_p,
                              .seed = b.seed,
                              .ignore_eos = b.ignore_eos,
                              .min_n_predict = 1,
                              .min_seed = 0,
                              .seed_help = "sampling seed (question i uses seed + i for every method)"});

  add_penalty_options(*cmd, {.penalties = b.penalties, .min_p = b.min_p, .logit_bias = args->logit_bias});
  add_spec_options(*cmd, b.spec);

  cmd->option_defaults()->group(group::kBenchmark);
  cmd->add_option(
      "--methods", b.methods,
      "comma-separated methods: ar, full, freq, dynamic, hybrid (the vocabulary, with the drafter of "
      "--spec), or a --spec mode optionally with its vocabulary (ngram, self+ngram:dynamic), each "
      "optionally with settings (dynamic:vocab-window=1024,tree-topk=2); the shared --spec/--draft-*/--tree-*/--vocab-* flags "
      "apply to every speculative method (default ar,full,dynamic,auto; with --ablation ar,dynamic)");
  cmd->add_option("--repeats", b.repeats, "runs per prompt and method; the median wall time is kept")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--sweep", b.sweep,
                  "key=v1,v2,...: every speculative method once per value of a speculative setting "
                  "(vocab-window, tree-tokens, draft-layers, ...)");
  cmd->add_flag(
      "--ablation", b.ablation,
      "the paper's Table 2 per speculative method: vocab-source ctx, ext, both without and with async "
      "gather");
  cmd->add_flag("--smoke", b.smoke, "quick check for CI: 2 prompts per category, 32 new tokens");
  cmd->add_option("--peers", b.peers, "peer engines run on the same prompts: llama.cpp")->delimiter(',');

  cmd->option_defaults()->group(group::kOutput);
  cmd->add_option("-o,--output", b.output, "output folder (records.jsonl, summary.json/.md, plots)")->required();
  cmd->add_option("--coverage-csv", b.coverage_csv,
                  "coverage table from `microspec coverage` to plot in the report (Figure 1b)");
  cmd->add_flag("--no-plots", b.no_plots, "skip the PNG plots (no Python needed)");
  cmd->add_option("--python", b.python, "Python interpreter for plots and peers")->capture_default_str();
  cmd->add_option(
      "--scripts-dir", b.scripts_dir,
      "folder with plot_report.py and peer_llama_cpp.py (default: benchmarks/ of this source tree, or "
      "share/microspec/benchmarks/ of an installed microspec)");
  cmd->callback([args] { run_bench(*args); });
}

}  // namespace microspec::cli
