// microspec: command-line entry point. Errors from inside the library surface here as one line
// on stderr and a non-zero exit status.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>

#include "cli/commands.h"
#include "util/error.h"

int main(int argc, char** argv) {
  CLI::App app{"microspec: fast CPU inference and speculative decoding for large-vocabulary GGUF models"};
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
  try {
    app.parse(argc, argv);
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
