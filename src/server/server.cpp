#include "server/server.h"

#include <httplib.h>
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <random>
#include <thread>

#include "gguf/gguf.h"
#include "server/api.h"
#include "server/chat_page.h"
#include "server/metrics.h"
#include "server/slots.h"
#include "tokenizer/chat.h"
#include "util/error.h"

namespace microspec::server {

using nlohmann::json;

namespace {

// HTTP workers beyond one per slot and queue place: they answer /health, /metrics, the page and
// 429s while every slot and queue place is taken.
constexpr int kExtraHttpWorkers = 8;

const char* const kRoutes[] = {
    "/", "/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions"};

// Metric label for a path: a known route, or "other" so unknown paths cannot grow the label set.
std::string route_label(const std::string& path) {
  for (const char* r : kRoutes)
    if (path == r) return r;
  if (path.rfind("/v1/models/", 0) == 0) return "/v1/models/{id}";
  return "other";
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

void send_json(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_content(dump_json(body), "application/json");
}

void send_error(httplib::Response& res, const ApiError& e) {
  if (e.status == 401) res.set_header("WWW-Authenticate", "Bearer");
  if (e.status == 429) res.set_header("Retry-After", "1");
  send_json(res, e.status, error_body(e.status, e.what(), e.param, e.code, e.type));
}

// One completion request on its way through a slot. Shared between the handler and, for streamed
// answers, the content provider that runs the generation.
struct Job {
  CompletionRequest request;
  AnswerIds ids;
  std::unique_ptr<SlotLease> lease;
  double queue_seconds = 0.0;
  bool started = false;
  bool client_gone = false;           // a stream write failed: stop generating
  bool stopped_for_shutdown = false;  // the generation was ended by SIGTERM/SIGINT
};

class Server {
 public:
  Server(const ServerOptions& options, std::unique_ptr<GgufFile> file, std::unique_ptr<Tokenizer> tokenizer,
         std::unique_ptr<SlotPool> pool)
      : opt_(options), file_(std::move(file)), tokenizer_(std::move(tokenizer)), pool_(std::move(pool)) {
    model_name_ = opt_.model_name;
    if (model_name_.empty()) {
      model_name_ = std::filesystem::path(opt_.model_path).filename().string();
      if (model_name_.size() > 5 && model_name_.compare(model_name_.size() - 5, 5, ".gguf") == 0)
        model_name_.resize(model_name_.size() - 5);
    }
    ctx_.tokenizer = tokenizer_.get();
    ctx_.n_ctx = opt_.n_ctx;
    ctx_.spec = &opt_.spec;
    try {
      ctx_.chat_format = detect_chat_format(*file_, *tokenizer_);
      ctx_.default_system = default_system_prompt(*file_);
    } catch (const Error& e) {
      std::fprintf(stderr, "serve: no chat format (%s); /v1/chat/completions answers 400\n", e.what());
    }
    created_ = static_cast<int64_t>(std::time(nullptr));
    id_salt_ = splitmix64(std::random_device{}() ^ (uint64_t(std::random_device{}()) << 32));
    setup_routes();
  }

  // Binds, then serves until shutdown() has run. Throws Error when the address cannot be bound.
  void serve() {
    const int port = opt_.port == 0 ? http_.bind_to_any_port(opt_.host) : opt_.port;
    if (port < 0 || (opt_.port != 0 && !http_.bind_to_port(opt_.host, opt_.port)))
      throw Error("cannot listen on " + opt_.host + ":" + std::to_string(opt_.port) +
                  " (address in use, not local, or not permitted)");
    std::fprintf(stderr, "serve: listening on http://%s:%d (model %s, %d slot%s, queue %d%s)\n",
                 opt_.host.c_str(), port, model_name_.c_str(), pool_->size(), pool_->size() == 1 ? "" : "s",
                 pool_->queue_limit(), opt_.api_key.empty() ? "" : ", API key required");
    std::fflush(stderr);
    const bool ok = http_.listen_after_bind();
    if (!ok && !shutting_down_) throw Error("the HTTP server stopped unexpectedly");
  }

  // Called once, from the signal-watching thread: in-flight generations end at their next token,
  // waiting requests get 503, then the listener closes and serve() returns.
  void shutdown() {
    shutting_down_ = true;
    pool_->shutdown();
    pool_->wait_idle();
    // listen_after_bind() may not have started yet; stop() only works on a running server.
    while (!http_.is_running() && !serve_returned_)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    http_.stop();
  }
  void mark_serve_returned() { serve_returned_ = true; }

 private:
  ServerOptions opt_;
  std::unique_ptr<GgufFile> file_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<SlotPool> pool_;
  RequestContext ctx_;
  Metrics metrics_;
  httplib::Server http_;
  std::string model_name_;
  int64_t created_ = 0;
  uint64_t id_salt_ = 0;
  std::atomic<uint64_t> id_counter_{0};
  std::atomic<bool> shutting_down_{false};
  std::atomic<bool> serve_returned_{false};

  std::string make_id(const char* prefix) {
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx",
                  static_cast<unsigned long long>(splitmix64(id_salt_ + id_counter_.fetch_add(1))));
    return std::string(prefix) + hex;
  }

  void check_auth(const httplib::Request& req) const {
    if (opt_.api_key.empty()) return;
    const std::string header = req.get_header_value("Authorization");
    if (header.empty())
      throw ApiError(401, "You didn't provide an API key: send the header 'Authorization: Bearer <key>'.", "",
                     "missing_api_key");
    const bool bearer =
        header.size() > 7 && (header.compare(0, 7, "Bearer ") == 0 || header.compare(0, 7, "bearer ") == 0);
    if (!bearer || !secrets_equal(header.substr(7), opt_.api_key))
      throw ApiError(401, "Incorrect API key provided.", "", "invalid_api_key");
  }

  // Runs f, answering any error it throws as OpenAI-style JSON.
  template <class F>
  void guarded(httplib::Response& res, F&& f) {
    try {
      f();
    } catch (const ApiError& e) {
      send_error(res, e);
    } catch (const Error& e) {
      // The library's errors are about its input, which here came from the request.
      send_error(res, ApiError(400, e.what()));
    } catch (const std::bad_alloc&) {
      send_error(res, ApiError(503, "The server ran out of memory for this request.", "", "out_of_memory"));
    } catch (const std::exception& e) {
      send_error(res, ApiError(500, std::string("Internal error: ") + e.what()));
    }
  }

  void setup_routes() {
    http_.new_task_queue = [n = pool_->size() + pool_->queue_limit() + kExtraHttpWorkers] {
      return new httplib::ThreadPool(size_t(n));
    };
    http_.set_tcp_nodelay(true);  // stream events are small writes: send them at once
    http_.set_payload_max_length(opt_.max_body_bytes);
    http_.set_error_handler(
        httplib::Server::HandlerWithResponse([this](const httplib::Request& req, httplib::Response& res) {
          if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;  // already an API error
          std::string message;
          switch (res.status) {
            case 404:
              message = "Invalid URL (" + req.method + " " + req.path + ").";
              break;
            case 413:
              message = "Request body too large: the limit is " + std::to_string(opt_.max_body_bytes) +
                        " bytes (--max-body).";
              break;
            case 400:
              message = "Malformed HTTP request.";
              break;
            case 414:
              message = "Request URI too long.";
              break;
            default:
              message = "HTTP error " + std::to_string(res.status) + ".";
          }
          send_json(res, res.status, error_body(res.status, message));
          return httplib::Server::HandlerResponse::Handled;
        }));
    http_.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
      std::string what = "unknown exception";
      try {
        if (ep) std::rethrow_exception(ep);
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      send_error(res, ApiError(500, "Internal error: " + what));
    });
    http_.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
      metrics_.count_request(route_label(req.path), res.status);
    });

    http_.Get("/", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(chat_page_html().data(), chat_page_html().size(), "text/html; charset=utf-8");
    });
    http_.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
      const bool stopping = shutting_down_;
      send_json(res, stopping ? 503 : 200,
                json{{"status", stopping ? "shutting_down" : "ok"},
                     {"model", model_name_},
                     {"slots", pool_->size()},
                     {"slots_busy", pool_->busy()},
                     {"queue_depth", pool_->waiting()}});
    });
    http_.Get("/metrics", [this](const httplib::Request& req, httplib::Response& res) {
      guarded(res, [&] {
        check_auth(req);
        GaugeSnapshot g;
        g.slots_total = pool_->size();
        g.slots_busy = pool_->busy();
        g.queue_depth = pool_->waiting();
        g.queue_limit = pool_->queue_limit();
        res.set_content(metrics_.render(g), "text/plain; version=0.0.4; charset=utf-8");
      });
    });
    http_.Get("/v1/models", [this](const httplib::Request& req, httplib::Response& res) {
      guarded(res, [&] {
        check_auth(req);
        send_json(res, 200, json{{"object", "list"}, {"data", json::array({model_json()})}});
      });
    });
    http_.Get(R"(/v1/models/(.+))", [this](const httplib::Request& req, httplib::Response& res) {
      guarded(res, [&] {
        check_auth(req);
        const std::string id = req.matches[1];
        if (id != model_name_)
          throw ApiError(404,
                         "The model '" + id + "' does not exist (this server has '" + model_name_ + "').",
                         "model", "model_not_found");
        send_json(res, 200, model_json());
      });
    });
    for (const auto& route : {std::pair{"/v1/chat/completions", Endpoint::Chat},
                              std::pair{"/v1/completions", Endpoint::Completion}}) {
      const char* path = route.first;
      const Endpoint endpoint = route.second;  // not a structured binding: clang 14 cannot capture one
      // Bodies go through a content reader so the size limit holds for chunked and compressed
      // bodies too (cpp-httplib checks only Content-Length against its payload limit).
      http_.Post(path, [this, endpoint](const httplib::Request& req, httplib::Response& res,
                                        const httplib::ContentReader& reader) {
        guarded(res, [&] {
          std::string body;
          read_body(res, reader, body);
          handle_completion(endpoint, req, res, body);
        });
      });
      // A POST without a body does not reach content-reader handlers.
      http_.Post(path, [this, endpoint](const httplib::Request& req, httplib::Response& res) {
        guarded(res, [&] { handle_completion(endpoint, req, res, req.body); });
      });
    }
    // Known routes with the wrong method: 405 naming the right one.
    auto not_allowed = [](const char* allow) {
      return [allow](const httplib::Request& req, httplib::Response& res) {
        res.set_header("Allow", allow);
        send_error(
            res,
            ApiError(405, "Method " + req.method + " is not allowed on " + req.path + " (use " + allow + ").",
                     "", "method_not_allowed"));
      };
    };
    for (const char* path : {"/v1/chat/completions", "/v1/completions"}) {
      http_.Get(path, not_allowed("POST"));
      http_.Put(path, not_allowed("POST"));
      http_.Patch(path, not_allowed("POST"));
      http_.Delete(path, not_allowed("POST"));
      http_.Options(path, not_allowed("POST"));
    }
    for (const char* path : {"/", "/health", "/metrics", "/v1/models"}) {
      http_.Post(path, not_allowed("GET"));
      http_.Put(path, not_allowed("GET"));
      http_.Patch(path, not_allowed("GET"));
      http_.Delete(path, not_allowed("GET"));
      http_.Options(path, not_allowed("GET"));
    }
  }

  json model_json() const {
    json j = {{"id", model_name_}, {"object", "model"}, {"created", created_}, {"owned_by", "microspec"}};
    j["microspec"] = {{"n_ctx", opt_.n_ctx},
                      {"slots", pool_->size()},
                      {"spec", name_of(opt_.spec.mode)},
                      {"draft_vocab", opt_.spec.enabled() ? json(name_of(opt_.spec.draft_vocab)) : json()}};
    return j;
  }

  void read_body(httplib::Response& res, const httplib::ContentReader& reader, std::string& body) {
    // Past the limit the rest of the body is read and dropped (up to kDrainFactor times the limit)
    // rather than left on the connection, where cpp-httplib would parse it as the next request.
    constexpr size_t kDrainFactor = 16;
    bool too_large = false;
    size_t dropped = 0;
    const bool ok = reader([&](const char* data, size_t n) {
      if (!too_large && body.size() + n <= opt_.max_body_bytes) {
        body.append(data, n);
        return true;
      }
      too_large = true;
      dropped += n;
      return dropped <= kDrainFactor * opt_.max_body_bytes;
    });
    if (too_large || res.status == 413)
      throw ApiError(413,
                     "Request body too large: the limit is " + std::to_string(opt_.max_body_bytes) +
                         " bytes (--max-body).",
                     "", "body_too_large");
    if (!ok) throw ApiError(400, "Could not read the request body.", "", "bad_body");
  }

  void handle_completion(Endpoint endpoint, const httplib::Request& req, httplib::Response& res,
                         const std::string& body) {
    check_auth(req);
    if (shutting_down_) throw ApiError(503, "The server is shutting down.", "", "server_shutting_down");
    auto job = std::make_shared<Job>();
    job->request = parse_completion_request(endpoint, body, ctx_);
    job->ids.id = make_id(endpoint == Endpoint::Chat ? "chatcmpl-" : "cmpl-");
    job->ids.created = static_cast<int64_t>(std::time(nullptr));
    job->ids.model = model_name_;
    switch (pool_->acquire(&job->lease, &job->queue_seconds)) {
      case SlotPool::Status::Ok:
        break;
      case SlotPool::Status::QueueFull:
        throw ApiError(429,
                       "The server is busy: all " + std::to_string(pool_->size()) +
                           " slots are generating and " + std::to_string(pool_->queue_limit()) +
                           " requests are waiting. Retry later.",
                       "", "queue_full");
      case SlotPool::Status::ShuttingDown:
        throw ApiError(503, "The server is shutting down.", "", "server_shutting_down");
    }
    if (!job->request.stream) {
      TextCallback on_text = [&](std::string_view) {
        if (!shutting_down_) return true;
        job->stopped_for_shutdown = true;
        return false;
      };
      GenerationReport report = generate(*job, on_text);
      job->lease.reset();
      if (job->stopped_for_shutdown)
        throw ApiError(503, "The server is shutting down; the generation was stopped.", "",
                       "server_shutting_down");
      send_json(res, 200, answer_json(endpoint, job->ids, report));
      return;
    }
    res.set_header("Cache-Control", "no-cache");
    res.set_header("X-Accel-Buffering", "no");
    res.set_chunked_content_provider(
        "text/event-stream", [this, job](size_t, httplib::DataSink& sink) { return stream(*job, sink); });
  }

  // Runs the job's generation in its slot; records metrics and a log line. What fails inside the
  // generation is thrown as the ApiError of generation_error (500: the request was already validated).
  GenerationReport generate(Job& job, const TextCallback& on_text) {
    const CompletionRequest& r = job.request;
    GenerationReport report;
    report.speculative = r.speculative;
    report.spec_mode = name_of(opt_.spec.mode);
    report.draft_vocab = name_of(opt_.spec.draft_vocab);
    report.spec_note = r.spec_note;
    report.queue_seconds = job.queue_seconds;
    try {
      report.result = job.lease->slot().generate(r.prompt_ids, r.params, r.speculative, on_text);
    } catch (const std::exception& e) {
      metrics_.record_generation(report, Outcome::Failed);
      throw generation_error(e);
    }
    const Outcome outcome = job.client_gone            ? Outcome::Cancelled
                            : job.stopped_for_shutdown ? Outcome::Shutdown
                                                       : Outcome::Completed;
    metrics_.record_generation(report, outcome);
    const GenerateResult& g = report.result.gen;
    char acceptance[48] = "";
    if (report.speculative)
      std::snprintf(acceptance, sizeof acceptance, " | acceptance %.2f", report.result.stats.mean_acceptance_length());
    std::fprintf(stderr, "serve: %s %s | prompt %d | generated %zu | %.1f tok/s%s | %s\n", job.ids.id.c_str(),
                 r.stream ? "stream" : "json", g.prompt_tokens, g.tokens.size(), report.result.decode_tokens_per_second(),
                 acceptance, outcome == Outcome::Completed ? finish_reason(g) : outcome_name(outcome));
    return report;
  }

  // The content provider of a streamed answer: generates, writing one server-sent event per piece
  // of text, then the closing events. Returning false tells cpp-httplib to drop the connection.
  bool stream(Job& job, httplib::DataSink& sink) {
    if (job.started) {  // not called again after done(); kept safe regardless
      sink.done();
      return true;
    }
    job.started = true;
    const Endpoint endpoint = job.request.endpoint;
    const bool usage_null = job.request.include_usage;
    auto send = [&](const std::string& payload) { return sink.write(payload.data(), payload.size()); };
    auto event = [&](const json& j) { return send("data: " + dump_json(j) + "\n\n"); };

    if (endpoint == Endpoint::Chat && !event(chunk_json(endpoint, job.ids, "", true, nullptr, usage_null))) {
      job.lease.reset();
      return false;
    }
    TextCallback on_text = [&](std::string_view text) {
      if (shutting_down_) {
        job.stopped_for_shutdown = true;
        return false;
      }
      if (!event(chunk_json(endpoint, job.ids, std::string(text), false, nullptr, usage_null))) {
        job.client_gone = true;
        return false;
      }
      return true;
    };
    GenerationReport report;
    std::string failure;
    try {
      report = generate(job, on_text);
    } catch (const ApiError& e) {
      failure = e.what();
    }
    job.lease.reset();  // the slot is free before the closing writes
    if (job.client_gone) return false;
    if (!failure.empty()) {
      event(error_body(500, failure, "", "generation_failed"));
    } else if (job.stopped_for_shutdown) {
      event(error_body(503, "The server is shutting down; this reply was cut short.", "",
                       "server_shutting_down"));
    } else {
      event(chunk_json(endpoint, job.ids, "", false, finish_reason(report.result.gen), usage_null));
      if (job.request.include_usage) event(usage_chunk_json(endpoint, job.ids, report));
    }
    send("data: [DONE]\n\n");
    sink.done();
    return true;
  }
};

}  // namespace

void run_server(const ServerOptions& o) {
  if (o.parallel < 1) throw Error("--parallel must be >= 1");
  if (o.queue < 0) throw Error("--queue must be >= 0");
  if (o.port < 0 || o.port > 65535) throw Error("--port must be in 0..65535");
  if (o.n_ctx < 2) throw Error("-c must be >= 2");
  if (o.max_body_bytes < 1) throw Error("--max-body must be >= 1");
  o.spec.validate();
  const bool loopback = o.host == "127.0.0.1" || o.host == "localhost" || o.host == "::1";
  if (!loopback && o.api_key.empty())
    std::fprintf(stderr,
                 "serve: warning: listening on %s without --api-key: anyone who can reach it can use it\n",
                 o.host.c_str());

  // SIGINT/SIGTERM are taken by one watcher thread (sigtimedwait), so they must be blocked in every
  // thread: block them before any thread (model thread pools, HTTP workers) is created.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigset_t previous;
  pthread_sigmask(SIG_BLOCK, &signals, &previous);
  std::signal(SIGPIPE, SIG_IGN);  // a client that went away is a failed write, not a dead server

  auto file = GgufFile::open(o.model_path);
  auto tokenizer = Tokenizer::from_gguf(*file);
  ModelOptions mopt;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  mopt.n_threads = o.threads > 0 ? o.threads : std::max(1, cores / o.parallel);
  mopt.n_batch = o.n_batch;
  mopt.kernels = o.kernels;
  std::vector<std::unique_ptr<Slot>> slots;
  for (int i = 0; i < o.parallel; ++i)
    slots.push_back(std::make_unique<Slot>(*file, *tokenizer, mopt, o.n_ctx, o.spec));
  std::fprintf(
      stderr, "serve: %d slot%s x %d tokens of context, %d thread%s each%s | memory after setup: %.0f MiB\n",
      o.parallel, o.parallel == 1 ? "" : "s", o.n_ctx, mopt.n_threads, mopt.n_threads == 1 ? "" : "s",
      o.spec.enabled() ? (", speculative: " + slots[0]->decoder->describe()).c_str() : "",
      peak_memory_bytes() / (1024.0 * 1024.0));

  Server server(o, std::move(file), std::move(tokenizer),
                std::make_unique<SlotPool>(std::move(slots), o.queue));
  std::atomic<bool> watch{true};
  std::thread watcher([&] {
    const timespec tick{0, 100 * 1000 * 1000};
    bool stopping = false;
    while (watch) {
      siginfo_t info;
      const int sig = sigtimedwait(&signals, &info, &tick);
      if (sig != SIGINT && sig != SIGTERM) continue;
      if (stopping) {
        std::fprintf(stderr, "serve: %s: already shutting down\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
        continue;
      }
      stopping = true;
      std::fprintf(stderr,
                   "serve: %s: stopping in-flight generations, then closing (idle keep-alive connections "
                   "within 5 s)\n",
                   sig == SIGINT ? "SIGINT" : "SIGTERM");
      server.shutdown();
    }
  });
  auto finish = [&] {
    server.mark_serve_returned();
    watch = false;
    watcher.join();
    // Signals that arrived after the watcher's last look stay pending: take them before unblocking,
    // so a repeated Ctrl-C cannot kill the process on its way out.
    const timespec zero{0, 0};
    siginfo_t info;
    while (sigtimedwait(&signals, &info, &zero) > 0) {
    }
    pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  };
  try {
    server.serve();
  } catch (...) {
    finish();
    throw;
  }
  finish();
  std::fprintf(stderr, "serve: stopped\n");
}

}  // namespace microspec::server
