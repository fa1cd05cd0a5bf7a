// `microspec serve`: the OpenAI-compatible HTTP server (src/server/) with speculative decoding,
// Prometheus metrics and a chat page.
#include "cli/commands.h"
#include "cli/common.h"
#include "server/server.h"

namespace microspec::cli {

namespace {

struct ServeArgs {
  ModelArgs model;
  server::ServerOptions server;
};

void run_serve(const ServeArgs& a) {
  server::ServerOptions o = a.server;
  o.model_path = a.model.model_path;
  o.threads = a.model.threads;
  o.n_ctx = a.model.n_ctx;
  o.n_batch = a.model.n_batch;
  o.kernels = a.model.kernels;
  server::run_server(o);
}

}  // namespace

void add_serve_command(CLI::App& app) {
  auto args = std::make_shared<ServeArgs>();
  CLI::App* cmd = app.add_subcommand(
      "serve",
      "OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /metrics, chat page at /)");
  args->model.add_to(*cmd);
  server::ServerOptions& s = args->server;
  cmd->add_option("--host", s.host, "address to listen on (127.0.0.1: this machine only)")
      ->capture_default_str();
  cmd->add_option("--port", s.port, "TCP port; 0 = any free port (printed at start)")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--api-key", s.api_key, "require 'Authorization: Bearer KEY' on /v1/* and /metrics");
  cmd->add_option("--alias", s.model_name, "model id in /v1/models and answers (default: file name)");
  cmd->add_option("--parallel", s.parallel,
                  "generation slots (each with its own KV cache, allocated at start)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--queue", s.queue, "requests that may wait for a free slot; more are answered 429")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 20));
  cmd->add_option("--max-body", s.max_body_bytes, "largest request body in bytes; larger gets 413")
      ->capture_default_str()
      ->check(CLI::Range(size_t(1), size_t(1) << 34));
  add_spec_options(*cmd, s.spec);
  cmd->footer(
      "-t sets compute threads per slot (default: cores / --parallel). -c is each slot's context.\n"
      "Stop with SIGINT or SIGTERM: in-flight streams end with an error event and [DONE], then exit 0.");
  cmd->callback([args] { run_serve(*args); });
}

}  // namespace microspec::cli
