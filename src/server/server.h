#pragma once
// `microspec serve`: an OpenAI-compatible HTTP server (cpp-httplib) over generation slots, with
// speculative decoding, Prometheus metrics and a chat page.
//
// Threads: cpp-httplib's worker pool reads requests and runs each generation on the worker that
// owns the connection, inside the slot it leased (a streamed answer generates inside the chunked
// content provider, so each token is written to the socket as it is produced and a failed write -
// the client went away - stops the generation). The pool has a worker for every slot and queue
// place plus a few for /health, /metrics and the page, so those answer while every slot is busy.
#include <cstddef>
#include <cstdint>
#include <string>

#include "speculative/settings.h"

namespace microspec::server {

struct ServerOptions {
  std::string model_path;
  std::string model_name;  // id reported by /v1/models and in answers ("" = file name without .gguf)
  std::string host = "127.0.0.1";
  int port = 8080;        // 0: any free port (the chosen one is printed)
  std::string api_key;    // "" = no authentication
  int parallel = 1;       // generation slots
  int queue = 16;         // requests that may wait for a slot; more get 429
  int threads = 0;        // compute threads per slot; 0 = cores / parallel (at least 1)
  int32_t n_ctx = 4096;   // tokens per slot
  int32_t n_batch = 512;  // prefill chunk
  std::string kernels = "auto";
  size_t max_body_bytes = 1 << 20;  // larger request bodies get 413
  SpecConfig spec;
};

// Loads the model, builds every slot, and serves until SIGINT or SIGTERM; then stops taking
// requests, ends in-flight generations (streams get a final error event and `data: [DONE]`,
// waiting requests 503) and returns. Throws Error for bad options or a port it cannot bind.
void run_server(const ServerOptions& options);

}  // namespace microspec::server
