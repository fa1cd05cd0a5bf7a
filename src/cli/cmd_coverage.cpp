// `microspec coverage`: parses its options and runs bench::run_coverage (src/bench/coverage.h).
#include <CLI/CLI.hpp>
#include <memory>

#include "bench/coverage.h"
#include "cli/commands.h"
#include "cli/common.h"

namespace microspec::cli {
namespace {

struct CoverageArgs {
  ModelArgs model;
  bench::CoverageOptions coverage;
};

void run_coverage(const CoverageArgs& a) {
  LoadedModel m = load_model(a.model);
  bench::CoverageOptions o = a.coverage;
  o.n_ctx = a.model.n_ctx;
  bench::run_coverage(o, *m.file, *m.model, *m.tokenizer);
}

}  // namespace

void add_coverage_command(CLI::App& app) {
  auto args = std::make_shared<CoverageArgs>();
  CLI::App* cmd = app.add_subcommand(
      "coverage", "how often greedy decoding's next token is inside each draft vocabulary");
  args->model.add_to(*cmd);
  bench::CoverageOptions& c = args->coverage;

  cmd->option_defaults()->group(group::kInput);
  cmd->add_option("--dataset", c.dataset, "JSON lines with {\"category\", \"turns\": [...]} (SpecBench)")->required();
  cmd->add_option("--freq-file", c.freq_file, "frequency file for the static top-K sets (vocab-freq)")->required();
  cmd->add_option("--per-category", c.per_category, "prompts per category")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  add_chat_template_option(*cmd, c.chat_template);
  cmd->add_option("-n,--n-predict,--max-new-tokens", c.max_new_tokens, "greedy tokens per prompt")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));

  cmd->option_defaults()->group(group::kSpeculation);
  cmd->add_option("--vocab-kpre", c.kpre, "dynamic: target top-k per prompt position")
      ->capture_default_str()
      ->check(CLI::Range(0, 1024));
  cmd->add_option("--vocab-kver", c.kver, "dynamic: target top-k per step")
      ->capture_default_str()
      ->check(CLI::Range(0, 1024));
  cmd->add_option("--static-sizes", c.static_sizes, "static top-K sizes")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 30));
  cmd->add_option("--windows", c.windows, "dynamic W_max values")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 30));

  cmd->option_defaults()->group(group::kOutput);
  cmd->add_option("-o,--output", c.output, "folder for coverage.csv and coverage.png")->capture_default_str();
  cmd->add_flag("--no-plots", c.no_plot, "write the CSV only");
  cmd->add_flag("-q,--quiet", c.quiet, "no progress bar");
  cmd->callback([args] { run_coverage(*args); });
}

}  // namespace microspec::cli
