#pragma once
// `microspec serve`: an OpenAI-compatible HTTP server with continuous batching over generation
// slots (batch_scheduler.h), speculative decoding, Prometheus metrics and a chat page.
//
// Threads: the HTTP transport (transport.h, Boost.Beast) reads every request and writes every
// answer on one I/O thread, asynchronously, so idle and slow connections hold no thread; /health,
// /metrics, /v1/models and the page are answered there. Completion requests go to a pool of
// workers, one for every slot and queue place, which parse them, wait for a slot and hand the
// generation to the batch scheduler's thread (which runs every sequence's steps on the one model);
// a streamed answer is written piece by piece as it is generated. A client that leaves, or stops
// reading past the write deadline, stops its generation at the next step.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "server/transport.h"
#include "speculative/settings.h"

namespace microspec::server {

struct ServerOptions {
  std::string model_path;
  std::string model_name;  // id reported by /v1/models and in answers ("" = file name without .gguf)
  std::string host = "127.0.0.1";
  int port = 8080;        // 0: any free port (the chosen one is printed)
  std::string api_key;    // "" = no authentication
  int parallel = 1;       // sequences in flight at most (slots of the running batch)
  int queue = 16;         // requests that may wait for a slot; more get 429
  int threads = 0;        // compute threads of the one shared model; 0 = all cores
  int32_t prefill_chunk = 64;  // most prompt tokens per batched step, over all newcomers
  int spec_max_batch = 2;      // draft policy (draft_shape): sequences in flight up to which speculative ones draft
  int32_t n_ctx = 4096;   // tokens per slot
  bool cache_prompt = true;
  std::string chat_template;  // --chat-template: "" the built-in format that fits, else the model's own (chat_style_for)  // the prefix cache: a slot's cache rows serve a later request sharing its prefix
  int32_t n_batch = 512;  // most tokens one forward pass takes (all sequences of a step together)
  std::string device = "cpu";  // cpu, or cuda: the CUDA backend, one sequence at a time, greedy
  std::string kernels = "auto";
  bool repack = true;   // ModelOptions::repack
  std::string hf_type;  // Hugging Face folder: weight type on load ("" keeps the checkpoint's)
  TransportLimits limits;                // request sizes, deadlines, open connections
  std::vector<std::string> cors_origins;  // origins whose pages may call the API ("*": any); none by default
  SpecConfig spec;
};

// Loads the model, builds every slot, and serves until SIGINT or SIGTERM; then stops taking
// requests, ends in-flight generations (streams get a final error event and `data: [DONE]`,
// waiting requests 503) and returns. Throws Error for bad options or a port it cannot bind.
void run_server(const ServerOptions& options);

}  // namespace microspec::server
