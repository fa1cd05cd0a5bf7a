// microspec: command-line entry point. Errors from inside the library surface here as one line
// on stderr and a non-zero exit status. (A CPU without AVX2 is refused before this runs:
// cpu_check.cpp.)
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <memory>

#include "cli/aliases.h"
#include "cli/commands.h"
#include "cli/version.h"
#include "util/error.h"

int main(int argc, char** argv) {
  CLI::App app{"microspec: fast CPU inference and speculative decoding for large-vocabulary GGUF models", "microspec"};
  // Before the subcommands: each takes its parent's formatter when it is made.
  app.formatter(std::make_shared<microspec::cli::AliasFormatter>());
  app.set_version_flag("--version", [] { return microspec::cli::version_text(); },
                       "print the version, git commit, kernel table and CUDA support, then exit");
  app.require_subcommand(1);
  microspec::cli::add_generate_command(app);
  microspec::cli::add_info_command(app);
  microspec::cli::add_dump_tensor_command(app);
  microspec::cli::add_tokenize_command(app);
  microspec::cli::add_eval_command(app);
  microspec::cli::add_features_command(app);
  microspec::cli::add_vocab_freq_command(app);
  microspec::cli::add_coverage_command(app);
  microspec::cli::add_bench_command(app);
  microspec::cli::add_serve_command(app);
  microspec::cli::add_convert_command(app);
  microspec::cli::add_template_command(app);
  // CLI11 answers `microspec WORD --help` with the top-level help and status 0 even when WORD is no
  // subcommand: refuse an unknown first word before parsing.
  if (argc > 1 && argv[1][0] != '-' &&
      app.get_subcommands([&](CLI::App* sub) { return sub->get_name() == argv[1]; }).empty()) {
    std::fprintf(stderr, "error: unknown command '%s' (see microspec --help)\n", argv[1]);
    return 2;
  }
  try {
    app.parse(microspec::cli::expand_aliases(argc, argv));
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const microspec::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "error: out of memory\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
