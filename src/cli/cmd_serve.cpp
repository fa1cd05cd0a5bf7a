// `microspec serve`: the OpenAI-compatible HTTP server (src/server/) with speculative decoding,
// Prometheus metrics and a chat page.
#include <chrono>

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
  o.repack = a.model.repack;
  o.hf_type = a.model.hf_type;
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
  cmd->option_defaults()->group(group::kModel);
  cmd->add_option("--device", s.device,
                  "cpu, or cuda: the GPU serves one request at a time (--parallel 1), greedy or sampled (top_k "
                  "1..64, else 400), plain or speculative (a chain, or a tree from the self-draft, a draft model or the head; "
                  "builds with MICROSPEC_CUDA)")
      ->capture_default_str();
  cmd->add_option("--alias", s.model_name, "model id in /v1/models and answers (default: file name)");
  cmd->option_defaults()->group(group::kServer);
  cmd->add_option("--host", s.host, "address to listen on (127.0.0.1: this machine only)")
      ->capture_default_str();
  cmd->add_option("--port", s.port, "TCP port; 0 = any free port (printed at start)")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--api-key", s.api_key, "require 'Authorization: Bearer KEY' on /v1/* and /metrics");
  cmd->add_option("--parallel", s.parallel,
                  "sequences generated together in one batch at most (each with its own KV cache, allocated at "
                  "start)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--queue", s.queue, "requests that may wait for a free slot; more are answered 429")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 20));
  cmd->add_option("--max-body", s.limits.max_body_bytes,
                  "largest request body in bytes on any route, chunked or not; larger gets 413")
      ->capture_default_str()
      ->check(CLI::Range(size_t(1), size_t(1) << 34));
  cmd->add_option("--cors", s.cors_origins,
                  "origins (ORIGIN[,ORIGIN...], e.g. http://localhost:3000; '*': any) whose web pages may call "
                  "the API; default none: cross-origin requests get 403")
      ->delimiter(',');
  cmd->add_option("--max-connections", s.limits.max_connections,
                  "open connections at most; more are answered 503 and closed")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  auto add_ms = [&](const char* name, std::chrono::milliseconds& value, const char* what) {
    cmd->add_option_function<double>(
           name, [&value](double seconds) { value = std::chrono::milliseconds(int64_t(seconds * 1000.0)); },
           std::string(what) + " (seconds, default " + std::to_string(value.count() / 1000) + ")")
        ->check(CLI::Range(0.001, 86400.0));
  };
  add_ms("--request-timeout", s.limits.request_timeout,
         "a request's head and body must arrive within this of its first byte, else 408");
  add_ms("--idle-timeout", s.limits.idle_timeout, "a keep-alive connection without a request is closed after this");
  add_ms("--write-timeout", s.limits.write_timeout,
         "a client that does not take an answer's bytes for this long is disconnected and its generation stopped");
  cmd->add_option("--prefill-chunk", s.prefill_chunk,
                  "most prompt tokens one batched step takes over all newcomers (a long prompt is prefilled in "
                  "pieces while the other sequences keep decoding)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--chat-template", s.chat_template,
                  "how chat messages become a prompt: a Jinja chat template file, a built-in format (gemma, chatml, "
                  "llama3) or 'model' (the model's own template); default: the built-in format that fits the "
                  "model, else its own template");
  cmd->add_flag(
      "!--no-cache-prompt", s.cache_prompt,
      "keep no slot's cache for later requests (the prefix cache: by default a request continuing a "
      "previous one, such as the next turn of a chat, goes to the slot holding its longest prefix and "
      "prefills only the rest)");
  cmd->add_option("--spec-max-batch", s.spec_max_batch,
                  "with --spec: sequences in flight up to which speculative sequences still draft (the configured "
                  "tree up to half of it, a chain of 2 tokens up to it, nothing above; 0: draft only when alone)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 20))
      ->group(group::kSpeculation);
  add_spec_options(*cmd, s.spec);
  add_log_verbosity_option(*cmd);
  cmd->footer(
      "-t sets the compute threads of the one model all slots share (default: all cores). -c is each slot's context.\n"
      "Stop with SIGINT or SIGTERM: in-flight streams end with an error event and [DONE], then exit 0.");
  cmd->callback([args] { run_serve(*args); });
}

}  // namespace microspec::cli
