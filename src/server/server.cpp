#include "server/server.h"

#include <boost/asio/post.hpp>
#include <boost/asio/thread_pool.hpp>
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <functional>
#include <random>
#include <thread>

#include "checkpoint/hf_folder.h"
#include "engine/cuda_generator.h"
#include "gguf/gguf.h"
#include "model/model_file.h"
#include "server/api.h"
#include "server/chat_page.h"
#include "server/metrics.h"
#include "server/batch_scheduler.h"
#include "server/slots.h"
#include "server/transport.h"
#include "tokenizer/chat.h"
#include "util/error.h"
#include "util/log.h"

namespace microspec::server {

using nlohmann::json;

namespace {

const char* const kRoutes[] = {
    "/", "/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"};

std::string_view path_of(std::string_view target) {
  return target.substr(0, target.find('?'));
}

// Metric label for a request target: a known route, or "other" so unknown paths cannot grow the
// label set.
std::string route_label(std::string_view target) {
  const std::string_view path = path_of(target);
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

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out)
    if (c >= 'A' && c <= 'Z') c = char(c - 'A' + 'a');
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

std::string header(const HttpRequest& req, boost::beast::http::field name) {
  const auto it = req.find(name);
  if (it == req.end()) return "";
  return std::string(it->value().data(), it->value().size());
}

// The answer to one request, with the headers every response to it carries (CORS).
struct Reply {
  std::shared_ptr<Exchange> ex;
  HttpHeaders headers;

  void json_answer(int status, const json& body, HttpHeaders extra = {}) const {
    HttpHeaders h = headers;
    h.insert(h.end(), extra.begin(), extra.end());
    ex->respond(status, h, "application/json", dump_json(body));
  }
  void error(const ApiError& e, HttpHeaders extra = {}) const {
    if (e.status == 401) extra.emplace_back("WWW-Authenticate", "Bearer");
    if (e.status == 429 || e.status == 503) extra.emplace_back("Retry-After", "1");
    json_answer(e.status, error_body(e.status, e.what(), e.param, e.code, e.type), std::move(extra));
  }
  void text(int status, const std::string& content_type, std::string body) const {
    ex->respond(status, headers, content_type, std::move(body));
  }
};

// Runs f, answering any error it throws as OpenAI-style JSON.
template <class F>
void guarded(const Reply& reply, F&& f) {
  try {
    f();
  } catch (const ApiError& e) {
    reply.error(e);
  } catch (const Error& e) {
    // The library's errors are about its input, which here came from the request.
    reply.error(ApiError(400, e.what()));
  } catch (const std::bad_alloc&) {
    reply.error(ApiError(503, "The server ran out of memory for this request.", "", "out_of_memory"));
  } catch (const std::exception& e) {
    reply.error(ApiError(500, std::string("Internal error: ") + e.what()));
  }
}

// One completion request on its way through a slot.
struct Job {
  Endpoint endpoint = Endpoint::Chat;
  Reply reply;
  CompletionRequest request;
  AnswerIds ids;
  std::unique_ptr<SlotLease> lease;
  double queue_seconds = 0.0;
  bool stopped_for_shutdown = false;  // the generation was ended by SIGTERM/SIGINT
  std::chrono::steady_clock::time_point started;  // reached a worker
  double first_text_seconds = -1.0;               // since `started`, at its first piece of text (< 0: none yet)
  uint64_t seed = 0;                              // the request's seed: choice i uses choice_seed(seed, i)
  void saw_text() {
    if (first_text_seconds < 0.0)
      first_text_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  }
  bool client_gone() const { return reply.ex->cancelled(); }
};

// The routes, one table: path (a trailing '*' matches any rest), the methods it takes.
enum class RouteId { Page, Health, Metrics, Models, Model, Chat, Completion, Tokenize, Detokenize };
struct Route {
  const char* path;
  RouteId id;
  boost::beast::http::verb method;
  const char* allow;  // the Allow header of a 405
};
const Route kRouteTable[] = {
    {"/", RouteId::Page, boost::beast::http::verb::get, "GET, OPTIONS"},
    {"/health", RouteId::Health, boost::beast::http::verb::get, "GET, OPTIONS"},
    {"/metrics", RouteId::Metrics, boost::beast::http::verb::get, "GET, OPTIONS"},
    {"/v1/models", RouteId::Models, boost::beast::http::verb::get, "GET, OPTIONS"},
    {"/v1/models/*", RouteId::Model, boost::beast::http::verb::get, "GET, OPTIONS"},
    {"/v1/chat/completions", RouteId::Chat, boost::beast::http::verb::post, "POST, OPTIONS"},
    {"/v1/completions", RouteId::Completion, boost::beast::http::verb::post, "POST, OPTIONS"},
    {"/tokenize", RouteId::Tokenize, boost::beast::http::verb::post, "POST, OPTIONS"},
    {"/detokenize", RouteId::Detokenize, boost::beast::http::verb::post, "POST, OPTIONS"},
};

const Route* find_route(std::string_view path) {
  for (const Route& r : kRouteTable) {
    const std::string_view p = r.path;
    if (p.back() == '*' ? (path.size() > p.size() - 1 && path.substr(0, p.size() - 1) == p.substr(0, p.size() - 1))
                        : path == p)
      return &r;
  }
  return nullptr;
}

// Media types the completion routes read as JSON. Form encoding is what `curl -d` and Python's
// urllib label a body with when not told otherwise; such bodies are read as JSON all the same.
bool json_content_type(std::string_view content_type) {
  const std::string type = lower(trim(content_type.substr(0, content_type.find(';'))));
  if (type.empty() || type == "application/json" || type == "application/x-www-form-urlencoded") return true;
  return type.rfind("application/", 0) == 0 && type.size() > 5 && type.compare(type.size() - 5, 5, "+json") == 0;
}

// What runs the generations: the batch scheduler over the CPU slots, or the CUDA backend's
// generator (one sequence at a time).
struct Backend {
  std::string device;  // "cpu" or "cuda"
  // Throws ApiError (4xx) for a validated request this backend cannot run, or adapts it (turns
  // speculation off where the backend cannot speculate on it, saying so); called before the
  // request waits for a slot.
  std::function<void(CompletionRequest&)> admit;
  // Generates the request in slot `slot` (held by the caller); throws what the generation threw.
  // reuse_prompt_rows: rows of the slot's cache it keeps, at most reusable_rows (the prefix cache,
  // and the prompt shared by a request's choices).
  std::function<SpecResult(int slot, const CompletionRequest&, const PieceCallback&, int32_t reuse_prompt_rows)>
      generate;
  // The rows of slot `slot`'s cache a generation of the request may keep (0: a backend that keeps none).
  std::function<int32_t(int slot, const CompletionRequest&)> reusable_rows;
  // The tokens slot `slot`'s cache holds after a generation (empty: a backend that keeps none).
  std::function<std::span<const int32_t>(int slot)> cached_tokens;
  std::shared_ptr<void> engine;  // what admit and generate run on, kept alive with them
};

// The CPU's backend: one model (one set of scratch buffers, one compute thread pool) for every
// slot, the batch scheduler running all sequences' steps on it. file and tokenizer must outlive it.
Backend cpu_backend(const ServerOptions& o, const GgufFile& file, const Tokenizer& tokenizer) {
  struct Engine {
    std::unique_ptr<Model> model;
    std::unique_ptr<BatchScheduler> scheduler;  // runs on model: destroyed first
  };
  auto engine = std::make_shared<Engine>();
  ModelOptions mopt;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  mopt.n_threads = o.threads > 0 ? o.threads : cores;
  mopt.n_batch = o.n_batch;
  mopt.kernels = o.kernels;
  mopt.repack = o.repack;
  engine->model = Model::load(file, mopt);
  // With --spec draft every slot's drafter runs on the first slot's draft model: one copy, and the
  // slots' tree levels drafted in one forward call (draft_together).
  std::vector<SequenceSlot> slots;
  for (int i = 0; i < o.parallel; ++i) {
    SequenceSlot slot;
    slot.gen = std::make_unique<Generator>(*engine->model, tokenizer, o.n_ctx);
    slot.decoder = std::make_unique<Decoder>(o.spec, file, *slot.gen, tokenizer,
                                             slots.empty() ? nullptr : slots.front().decoder.get(), o.parallel);
    slots.push_back(std::move(slot));
  }
  engine->scheduler = std::make_unique<BatchScheduler>(*engine->model, tokenizer, std::move(slots), o.prefill_chunk,
                                                       o.spec_max_batch);
  BatchScheduler& scheduler = *engine->scheduler;
  log::info("serve: %d slot%s x %d tokens of context, one batch, %d thread%s%s | memory after setup: %.0f MiB",
               o.parallel, o.parallel == 1 ? "" : "s", o.n_ctx, mopt.n_threads, mopt.n_threads == 1 ? "" : "s",
               o.spec.enabled() ? (", speculative: " + scheduler.slot(0).decoder->describe()).c_str() : "",
               peak_memory_bytes() / (1024.0 * 1024.0));
  return Backend{.device = "cpu",
                 .admit = [](CompletionRequest&) {},
                 .generate =
                     [&scheduler](int slot, const CompletionRequest& r, const PieceCallback& on_piece,
                                  int32_t reuse_prompt_rows) {
                       return scheduler.generate(slot, r.prompt_ids, r.params, r.speculative, on_piece,
                                                 reuse_prompt_rows);
                     },
                 .reusable_rows =
                     [&scheduler](int slot, const CompletionRequest& r) {
                       return scheduler.reusable_rows(slot, r.prompt_ids, r.speculative);
                     },
                 .cached_tokens =
                     [&scheduler](int slot) { return std::span<const int32_t>(scheduler.slot(slot).cached); },
                 .engine = engine};
}

// The GPU's backend (the CUDA backend's generator): the weights, the cache and every step on the
// device, whose one cache serves one request at a time (--parallel 1); the CPU reads only the
// file's metadata and tokenizer, which must outlive it.
Backend cuda_backend(const ServerOptions& o, const GgufFile& file, const Tokenizer& tokenizer) {
  CudaGeneratorOptions dopt;
  dopt.n_predict = o.n_ctx;  // a request may ask for the rest of its context
  dopt.n_ctx = o.n_ctx;
  dopt.n_batch = o.n_batch;
  set_cuda_speculation(o.spec, file, tokenizer, dopt);
  auto device = std::make_shared<CudaGenerator>(file, tokenizer, dopt);
  log::info("serve: 1 slot x %d tokens of context, %s | host memory after setup: %.0f MiB", o.n_ctx,
               device->describe().c_str(), peak_memory_bytes() / (1024.0 * 1024.0));
  return Backend{
      .device = "cuda",
      // Sampling is top-k's draw, speculative with the chain or tree (plain with a tree too large
      // to sample from on the device, said in the note).
      .admit =
          [plain_when_sampled = !cuda_spec_sampling_unsupported(o.spec).empty()](CompletionRequest& r) {
            if (const std::string why = cuda_params_unsupported(r.params.sampling); !why.empty())
              throw ApiError(400, "Invalid 'top_k': this server runs on a GPU, where " + why + ".", "top_k",
                             "unsupported_parameter");
            if (const char* field = first_active_penalty(r.params.penalties, r.params.sampling.min_p))
              throw ApiError(400,
                             std::string("Invalid '") + field +
                                 "': this server runs on a GPU, which applies no penalties, logit bias or "
                                 "min_p (serve on the CPU for them).",
                             field, "unsupported_parameter");
            // Several choices have never run on a GPU: refused rather than served untested.
            if (r.n > 1)
              throw ApiError(400, "Invalid 'n': this server runs on a GPU, where several choices have not been "
                                  "tested (serve on the CPU for them).",
                             "n", "unsupported_parameter");
            if (r.params.grammar)
              throw ApiError(400, "Invalid 'response_format': this server runs on a GPU, which applies no "
                                  "grammar (serve on the CPU for structured output).",
                             "response_format", "unsupported_parameter");
            // The device hands back tokens, not logits rows.
            if (r.params.logprobs.enabled)
              throw ApiError(400, "Invalid 'logprobs': this server runs on a GPU, which does not report "
                                  "log-probabilities (serve on the CPU for them).",
                             "logprobs", "unsupported_parameter");
            if (r.speculative && !r.params.sampling.greedy() && plain_when_sampled) {
              r.speculative = false;
              r.spec_note = "sampled requests decode without speculation: the GPU's draft tree draws too many "
                            "tokens a step to sample from";
            }
          },
      .generate =
          [gen = device.get()](int, const CompletionRequest& r, const PieceCallback& on_piece, int32_t) {
            const TextCallback on_text = [&](std::string_view text) { return !on_piece || on_piece(text, {}); };
            return gen->generate(r.prompt_ids, r.params, on_text,
                                 r.speculative ? Drafting::Speculative : Drafting::Plain);
          },
      .reusable_rows = [](int, const CompletionRequest&) { return 0; },  // the device prefills every prompt
      .cached_tokens = [](int) { return std::span<const int32_t>(); },
      .engine = device};
}

class Server {
 public:
  // file and tokenizer must outlive the server (the backend keeps what it runs on).
  Server(const ServerOptions& options, const GgufFile& file, const Tokenizer& tokenizer, Backend backend,
         std::unique_ptr<SlotPool> pool)
      : opt_(options),
        file_(file),
        tokenizer_(tokenizer),
        grammars_(std::make_shared<GrammarVocabulary>(tokenizer)),
        backend_(std::move(backend)),
        pool_(std::move(pool)),
        // A worker for every slot and queue place: workers wait for slots, I/O threads never do.
        max_jobs_(pool_->size() + pool_->queue_limit()),
        workers_(size_t(max_jobs_)),
        transport_(
            opt_.limits, [this](std::shared_ptr<Exchange> ex) { handle(std::move(ex)); },
            [this](std::string_view target, int status) { metrics_.count_request(route_label(target), status); },
            [](int status, const std::string& message) { return dump_json(error_body(status, message)); }) {
    model_name_ = opt_.model_name;
    if (model_name_.empty()) {
      model_name_ = std::filesystem::path(opt_.model_path).filename().string();
      if (model_name_.size() > 5 && model_name_.compare(model_name_.size() - 5, 5, ".gguf") == 0)
        model_name_.resize(model_name_.size() - 5);
    }
    ctx_.tokenizer = &tokenizer_;
    ctx_.n_ctx = opt_.n_ctx;
    ctx_.spec = &opt_.spec;
    ctx_.grammars = &grammars_;
    try {
      ctx_.chat_style = chat_style_for(file_, tokenizer_, opt_.chat_template);
      log::info("serve: chat prompts in %s", ctx_.chat_style->name.c_str());
    } catch (const Error& e) {
      if (!opt_.chat_template.empty()) throw;  // what the user named must work
      log::warning("serve: no chat format (%s); /v1/chat/completions answers 400", e.what());
    }
    created_ = static_cast<int64_t>(std::time(nullptr));
    id_salt_ = splitmix64(std::random_device{}() ^ (uint64_t(std::random_device{}()) << 32));
  }

  // Binds, then serves until shutdown() has run. Throws Error when the address cannot be bound.
  void serve() {
    const int port = transport_.listen(opt_.host, opt_.port);
    log::info("serve: listening on http://%s:%d (model %s, %d slot%s, queue %d%s)", opt_.host.c_str(), port,
              model_name_.c_str(), pool_->size(), pool_->size() == 1 ? "" : "s", pool_->queue_limit(),
              opt_.api_key.empty() ? "" : ", API key required");
    transport_.run();
  }

  // Called once, from the signal-watching thread: in-flight generations end at their next token,
  // waiting requests get 503, their answers are written, then serve() returns.
  void shutdown() {
    shutting_down_ = true;
    pool_->shutdown();
    pool_->wait_idle();
    while (jobs_.load() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    transport_.stop(std::chrono::seconds(5));
  }

 private:
  ServerOptions opt_;
  const GgufFile& file_;
  const Tokenizer& tokenizer_;
  GrammarCache grammars_;  // structured output's grammars over the model's vocabulary
  Backend backend_;
  std::unique_ptr<SlotPool> pool_;
  RequestContext ctx_;
  Metrics metrics_;
  const int max_jobs_;
  std::atomic<int> jobs_{0};  // completion requests handed to the workers and not finished
  boost::asio::thread_pool workers_;
  HttpTransport transport_;
  std::string model_name_;
  int64_t created_ = 0;
  uint64_t id_salt_ = 0;
  std::atomic<uint64_t> id_counter_{0};
  std::atomic<bool> shutting_down_{false};

  std::string make_id(const char* prefix) {
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx",
                  static_cast<unsigned long long>(splitmix64(id_salt_ + id_counter_.fetch_add(1))));
    return std::string(prefix) + hex;
  }

  // "Authorization: <scheme> <key>": the scheme in any case, the key exactly as sent (never
  // decoded), compared in constant time.
  void check_auth(const HttpRequest& req) const {
    if (opt_.api_key.empty()) return;
    const std::string value = header(req, boost::beast::http::field::authorization);
    if (value.empty())
      throw ApiError(401, "You didn't provide an API key: send the header 'Authorization: Bearer <key>'.", "",
                     "missing_api_key");
    const size_t space = value.find(' ');
    const bool bearer = space != std::string::npos && lower(std::string_view(value).substr(0, space)) == "bearer";
    const std::string key = bearer ? std::string(trim(std::string_view(value).substr(space + 1))) : std::string();
    if (!bearer || !secrets_equal(key, opt_.api_key))
      throw ApiError(401, "Incorrect API key provided.", "", "invalid_api_key");
  }

  // Cross-origin policy: a request that names an Origin other than this server's own must come
  // from one given with --cors ("*": any). Browsers send Origin on every cross-origin request, so
  // a page elsewhere cannot start a generation on a server that did not allow it. Returns the
  // headers that let the browser read the answer ("" origin: nothing to add).
  bool origin_allowed(const HttpRequest& req, HttpHeaders* cors) const {
    const std::string origin = header(req, boost::beast::http::field::origin);
    if (origin.empty()) return true;
    const std::string host = header(req, boost::beast::http::field::host);
    if (origin == "http://" + host) return true;  // the chat page, served from here
    for (const std::string& allowed : opt_.cors_origins) {
      if (allowed == "*" || allowed == origin) {
        cors->emplace_back("Access-Control-Allow-Origin", allowed == "*" ? "*" : origin);
        cors->emplace_back("Vary", "Origin");
        return true;
      }
    }
    return false;
  }

  // On an I/O thread: route, method, origin; cheap routes are answered here, completions go to a
  // worker.
  void handle(std::shared_ptr<Exchange> ex) {
    const HttpRequest& req = ex->request();
    Reply reply{ex, {}};
    const auto target = req.target();
    const std::string_view path = path_of(std::string_view(target.data(), target.size()));
    const std::string method(req.method_string().data(), req.method_string().size());
    const Route* route = find_route(path);
    if (!route)
      return reply.error(ApiError(404, "Invalid URL (" + method + " " + std::string(path) + ").", "", "not_found"));
    if (!origin_allowed(req, &reply.headers))
      return reply.error(ApiError(403,
                                  "Cross-origin requests from " + header(req, boost::beast::http::field::origin) +
                                      " are not allowed (start the server with --cors ORIGIN to allow them).",
                                  "", "origin_not_allowed"));
    if (req.method() == boost::beast::http::verb::options) {
      HttpHeaders h = reply.headers;
      h.emplace_back("Allow", route->allow);
      if (!reply.headers.empty()) {  // a preflight from an allowed origin
        h.emplace_back("Access-Control-Allow-Methods", route->allow);
        h.emplace_back("Access-Control-Allow-Headers", "Authorization, Content-Type");
        h.emplace_back("Access-Control-Max-Age", "600");
      }
      return ex->respond(204, h, "", "");
    }
    if (req.method() != route->method)
      return reply.error(ApiError(405,
                                  "Method " + method + " is not allowed on " + std::string(path) + " (use " +
                                      boost::beast::http::to_string(route->method).to_string() + ").",
                                  "", "method_not_allowed"),
                         {{"Allow", route->allow}});
    guarded(reply, [&] {
      switch (route->id) {
        case RouteId::Page:
          return reply.text(200, "text/html; charset=utf-8", std::string(chat_page_html()));
        case RouteId::Health: {
          const bool stopping = shutting_down_;
          return reply.json_answer(stopping ? 503 : 200, json{{"status", stopping ? "shutting_down" : "ok"},
                                                              {"model", model_name_},
                                                              {"slots", pool_->size()},
                                                              {"slots_busy", pool_->busy()},
                                                              {"queue_depth", pool_->waiting()}});
        }
        case RouteId::Metrics: {
          check_auth(req);
          GaugeSnapshot g;
          g.slots_total = pool_->size();
          g.slots_busy = pool_->busy();
          g.queue_depth = pool_->waiting();
          g.queue_limit = pool_->queue_limit();
          return reply.text(200, "text/plain; version=0.0.4; charset=utf-8", metrics_.render(g));
        }
        case RouteId::Models:
          check_auth(req);
          return reply.json_answer(200, json{{"object", "list"}, {"data", json::array({model_json()})}});
        case RouteId::Model: {
          check_auth(req);
          const std::string id(path.substr(std::string_view("/v1/models/").size()));
          if (id != model_name_)
            throw ApiError(404, "The model '" + id + "' does not exist (this server has '" + model_name_ + "').",
                           "model", "model_not_found");
          return reply.json_answer(200, model_json());
        }
        case RouteId::Chat:
        case RouteId::Completion:
          return admit_completion(route->id == RouteId::Chat ? Endpoint::Chat : Endpoint::Completion, reply);
        case RouteId::Tokenize:
        case RouteId::Detokenize:
          // Tokenizing a large body takes a while: on a worker, never on the I/O thread.
          return admit_to_worker(reply, [this, tokenize = route->id == RouteId::Tokenize](const Reply& r) {
            const std::string& body = r.ex->request().body();
            r.json_answer(200, tokenize ? tokenize_answer(body, tokenizer_) : detokenize_answer(body, tokenizer_));
          });
      }
    });
  }

  // Still on the I/O thread: checks what needs no parsing, then hands the request to a worker.
  void admit_completion(Endpoint endpoint, const Reply& reply) {
    admit_to_worker(reply, [this, endpoint](const Reply& r) { run_completion(endpoint, r); });
  }

  // A JSON POST route's checks (key, shutdown, content type and coding, a free worker), then
  // work(reply) on a worker thread, its errors answered as JSON.
  template <class Work>
  void admit_to_worker(const Reply& reply, Work work) {
    const HttpRequest& req = reply.ex->request();
    check_auth(req);
    if (shutting_down_) throw ApiError(503, "The server is shutting down.", "", "server_shutting_down");
    const std::string type = header(req, boost::beast::http::field::content_type);
    if (!json_content_type(type))
      throw ApiError(415, "Unsupported Content-Type '" + type.substr(0, 100) + "': send the body as application/json.",
                     "", "unsupported_media_type");
    const std::string encoding = lower(trim(header(req, boost::beast::http::field::content_encoding)));
    if (!encoding.empty() && encoding != "identity")
      throw ApiError(415, "Unsupported Content-Encoding '" + encoding.substr(0, 100) + "': send the body uncompressed.",
                     "", "unsupported_media_type");
    // Every worker busy means every slot and queue place is taken.
    if (jobs_.fetch_add(1) >= max_jobs_) {
      --jobs_;
      throw queue_full();
    }
    boost::asio::post(workers_, [this, work = std::move(work), reply] {
      guarded(reply, [&] { work(reply); });
      --jobs_;
    });
  }

  ApiError queue_full() const {
    return ApiError(429,
                    "The server is busy: all " + std::to_string(pool_->size()) + " slots are generating and " +
                        std::to_string(pool_->queue_limit()) + " requests are waiting. Retry later.",
                    "", "queue_full");
  }

  json model_json() const {
    json j = {{"id", model_name_}, {"object", "model"}, {"created", created_}, {"owned_by", "microspec"}};
    // llama-server's metadata fields (meta.vocab_type is llama.cpp's enum, left out).
    int64_t n_params = 0;
    for (const GgufTensor& t : file_.tensors()) n_params += t.n_elements();
    const ModelConfig config = read_model_config(file_);
    j["meta"] = {{"n_vocab", config.n_vocab},
                 {"n_ctx_train", config.context_length},
                 {"n_embd", config.n_embd},
                 {"n_params", n_params},
                 {"size", file_.file_size()}};
    j["microspec"] = {{"n_ctx", opt_.n_ctx},
                      {"architecture", config.arch_name},
                      {"n_layer", config.n_layer},
                      {"device", backend_.device},
                      {"slots", pool_->size()},
                      {"spec", name_of(opt_.spec.mode)},
                      {"draft_vocab", opt_.spec.enabled() ? json(name_of(opt_.spec.draft_vocab)) : json()}};
    return j;
  }

  // On a worker thread: names the request (its id starts each of its log lines), then completes it;
  // a failure is logged with the id before guarded() answers it.
  void run_completion(Endpoint endpoint, const Reply& reply) {
    Job job;
    job.started = std::chrono::steady_clock::now();
    job.endpoint = endpoint;
    job.reply = reply;
    job.ids.id = make_id(endpoint == Endpoint::Chat ? "chatcmpl-" : "cmpl-");
    const HttpRequest& req = reply.ex->request();
    log::debug("%s: %s %.*s, %zu-byte body", job.ids.id.c_str(), endpoint == Endpoint::Chat ? "chat" : "completion",
               int(req.target().size()), req.target().data(), req.body().size());
    try {
      complete(job);
    } catch (const ApiError& e) {
      (e.status >= 500 ? log::warning : log::info)("%s: answered %d: %s", job.ids.id.c_str(), e.status, e.what());
      throw;
    } catch (const std::exception& e) {
      log::warning("%s: failed: %s", job.ids.id.c_str(), e.what());
      throw;
    }
  }

  // Parse, wait for a slot, generate, answer.
  void complete(Job& job) {
    const Endpoint endpoint = job.endpoint;
    const Reply& reply = job.reply;
    job.request = parse_completion_request(endpoint, reply.ex->request().body(), ctx_);
    backend_.admit(job.request);
    job.seed = job.request.params.sampling.seed;
    job.request.params.cancel = &reply.ex->cancelled();
    job.ids.created = static_cast<int64_t>(std::time(nullptr));
    job.ids.model = model_name_;
    if (reply.ex->cancelled()) return;  // the client left while it waited for a worker
    switch (pool_->acquire(job.request.prompt_ids, &job.lease, &job.queue_seconds)) {
      case SlotPool::Status::Ok:
        break;
      case SlotPool::Status::QueueFull:
        throw queue_full();
      case SlotPool::Status::ShuttingDown:
        throw ApiError(503, "The server is shutting down.", "", "server_shutting_down");
    }
    log::debug("%s: slot %d after %.3f s in the queue, %d prompt tokens", job.ids.id.c_str(), job.lease->index(),
               job.queue_seconds, int(job.request.prompt_ids.size()));
    if (job.request.stream) return stream(job);
    PieceCallback on_piece = [&](std::string_view, std::span<const TokenLogprob>) {
      job.saw_text();
      if (!shutting_down_) return true;
      job.stopped_for_shutdown = true;
      return false;
    };
    // The choices one after another in this slot, sharing the prompt's cache rows.
    std::vector<json> answers;
    answers.reserve(size_t(job.request.n));
    for (int32_t choice = 0; choice < job.request.n; ++choice) {
      const GenerationReport report = generate(job, on_piece, choice);
      if (job.stopped_for_shutdown || job.client_gone()) break;
      const LogprobRows& rows = report.result.gen.logprobs;
      size_t text_offset = 0;
      const LogprobsOut lp{.tokenizer = &tokenizer_, .top = rows.top, .entries = rows.entries, .text_offset = &text_offset};
      answers.push_back(answer_json(endpoint, job.ids, report, job.request.params.logprobs.enabled ? &lp : nullptr,
                                    job.request.tools, choice));
    }
    release_slot(job);
    if (job.stopped_for_shutdown)
      throw ApiError(503, "The server is shutting down; the generation was stopped.", "", "server_shutting_down");
    if (job.client_gone()) return;  // nobody to answer
    reply.json_answer(200, merge_choice_answers(answers));
  }

  // Whether the job keeps and reuses cache rows across requests: the prefix cache (--no-cache-prompt
  // and the request's cache_prompt: false turn it off).
  bool caches_prompt(const Job& job) const { return opt_.cache_prompt && job.request.cache_prompt; }

  // Frees the job's slot; with the prefix cache on in the server, the pool first remembers what its
  // cache holds (whether or not this request used the cache), so that a later request that
  // continues it is given this slot.
  void release_slot(Job& job) {
    if (!job.lease) return;
    if (opt_.cache_prompt) job.lease->remember(backend_.cached_tokens(job.lease->index()));
    job.lease.reset();
  }

  // Runs the job's generation in its slot; records metrics and a log line. What fails inside the
  // generation is thrown as the ApiError of generation_error (500: the request was already validated).
  // choice: which of the request's n choices (its seed is choice_seed(job.seed, choice)). It keeps
  // the slot's cache rows it can (BatchScheduler::reusable_rows): those a previous request left
  // (the prefix cache) or, for a choice after the first, the prompt's.
  GenerationReport generate(Job& job, const PieceCallback& on_piece, int32_t choice) {
    job.request.params.sampling.seed = choice_seed(job.seed, choice);
    const CompletionRequest& r = job.request;
    const int32_t reuse =
        choice > 0 || caches_prompt(job) ? backend_.reusable_rows(job.lease->index(), r) : 0;
    GenerationReport report;
    report.prompt_rows_reused = reuse;
    report.speculative = r.speculative;
    report.spec_mode = name_of(opt_.spec.mode);
    report.draft_vocab = name_of(opt_.spec.draft_vocab);
    report.spec_note = r.spec_note;
    report.queue_seconds = job.queue_seconds;
    report.device = backend_.device;
    try {
      report.result = backend_.generate(job.lease->index(), r, on_piece, reuse);
    } catch (const std::exception& e) {
      metrics_.record_generation(report, Outcome::Failed, latency(job));
      throw generation_error(e);
    }
    const Outcome outcome = job.client_gone()          ? Outcome::Cancelled
                            : job.stopped_for_shutdown ? Outcome::Shutdown
                                                       : Outcome::Completed;
    metrics_.record_generation(report, outcome, latency(job));
    const GenerateResult& g = report.result.gen;
    char acceptance[48] = "";
    if (report.speculative)
      std::snprintf(acceptance, sizeof acceptance, " | acceptance %.2f", report.result.stats.mean_acceptance_length());
    log::info("%s: %s | prompt %d | generated %zu | %.1f tok/s%s | %s", job.ids.id.c_str(),
                 r.stream ? "stream" : "json", g.prompt_tokens, g.tokens.size(), report.result.decode_tokens_per_second(),
                 acceptance, outcome == Outcome::Completed ? finish_reason(g) : outcome_name(outcome));
    return report;
  }

  static RequestLatency latency(const Job& job) {
    return {.first_text_seconds = job.first_text_seconds,
            .total_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - job.started).count()};
  }

  // A streamed answer: one server-sent event per piece of text, then the closing events. A write
  // that fails (the client left, or stopped reading past the write deadline) stops the generation.
  // Several choices follow one another, each chunk naming its choice's index: a chat choice opens
  // with its role chunk, each ends with its own finish_reason chunk, the usage chunk comes last.
  void stream(Job& job) {
    Exchange& ex = *job.reply.ex;
    const Endpoint endpoint = job.endpoint;
    const bool usage_null = job.request.include_usage;
    HttpHeaders h = job.reply.headers;
    h.emplace_back("Cache-Control", "no-cache");
    h.emplace_back("X-Accel-Buffering", "no");
    ex.start_stream(200, h, "text/event-stream");
    auto send = [&](const std::string& payload) { return ex.write(payload); };
    int32_t choice = 0;  // the choice being generated
    auto event = [&](json j) {
      if (const auto choices = j.find("choices"); choices != j.end() && !choices->empty())
        (*choices)[0]["index"] = choice;
      return send("data: " + dump_json(j) + "\n\n");
    };
    // With logprobs each chunk carries the rows of the tokens generated since the previous one; the
    // closing chunk those of tokens whose text never came (held back, or empty).
    const LogprobSettings& want = job.request.params.logprobs;
    size_t entries_sent = 0, text_offset = 0;
    auto logprobs_of = [&](std::span<const TokenLogprob> entries) {
      entries_sent += entries.size();
      return LogprobsOut{.tokenizer = &tokenizer_, .top = want.top, .entries = entries, .text_offset = &text_offset};
    };
    PieceCallback on_piece = [&](std::string_view text, std::span<const TokenLogprob> entries) {
      job.saw_text();
      if (shutting_down_) {
        job.stopped_for_shutdown = true;
        return false;
      }
      const LogprobsOut lp = logprobs_of(entries);
      return event(chunk_json(endpoint, job.ids, std::string(text), false, nullptr, usage_null,
                              want.enabled ? &lp : nullptr));
    };
    std::vector<GenerationReport> reports;
    reports.reserve(size_t(job.request.n));
    std::string failure;
    for (; choice < job.request.n; ++choice) {
      if (endpoint == Endpoint::Chat && !event(chunk_json(endpoint, job.ids, "", true, nullptr, usage_null, nullptr)))
        break;
      entries_sent = text_offset = 0;
      try {
        reports.push_back(generate(job, on_piece, choice));
      } catch (const ApiError& e) {
        failure = e.what();
        break;
      }
      if (job.client_gone() || job.stopped_for_shutdown) break;
      const GenerationReport& report = reports.back();
      const std::vector<TokenLogprob>& all = report.result.gen.logprobs.entries;
      const LogprobsOut lp = logprobs_of(std::span<const TokenLogprob>(all).subspan(std::min(entries_sent, all.size())));
      event(chunk_json(endpoint, job.ids, "", false, finish_reason(report.result.gen), usage_null,
                       want.enabled ? &lp : nullptr));
    }
    release_slot(job);  // the slot is free before the closing writes
    if (!job.client_gone()) {
      if (!failure.empty()) {
        event(error_body(500, failure, "", "generation_failed"));
      } else if (job.stopped_for_shutdown) {
        event(error_body(503, "The server is shutting down; this reply was cut short.", "", "server_shutting_down"));
      } else if (job.request.include_usage && !reports.empty()) {
        json usage = usage_chunk_json(endpoint, job.ids, reports.front());
        count_choices_in_usage(usage["usage"], reports);
        event(std::move(usage));
      }
      send("data: [DONE]\n\n");
    }
    ex.end_stream();
  }
};

}  // namespace

void run_server(const ServerOptions& o) {
  if (o.parallel < 1) throw Error("--parallel must be >= 1");
  if (o.queue < 0) throw Error("--queue must be >= 0");
  if (o.port < 0 || o.port > 65535) throw Error("--port must be in 0..65535");
  if (o.n_ctx < 2) throw Error("-c must be >= 2");
  if (o.limits.max_body_bytes < 1) throw Error("--max-body must be >= 1");
  if (o.limits.max_connections < 1) throw Error("--max-connections must be >= 1");
  for (const auto* t : {&o.limits.request_timeout, &o.limits.idle_timeout, &o.limits.write_timeout})
    if (t->count() < 1) throw Error("timeouts must be at least 1 ms");
  o.spec.validate();
  if (o.device != "cpu" && o.device != "cuda") throw Error("--device must be cpu or cuda, got '" + o.device + "'");
  if (o.device == "cuda") {
    if (o.parallel != 1)
      throw Error("--device cuda serves one sequence at a time (the device holds one cache): --parallel 1");
    if (const std::string why = cuda_spec_unsupported(o.spec); !why.empty()) throw Error(why);
  }
  const bool loopback = o.host == "127.0.0.1" || o.host == "localhost" || o.host == "::1";
  if (!loopback && o.api_key.empty())
    log::warning("serve: listening on %s without --api-key: anyone who can reach it can use it", o.host.c_str());

  // SIGINT/SIGTERM are taken by one watcher thread (sigtimedwait), so they must be blocked in every
  // thread: block them before any thread (model thread pools, HTTP workers) is created.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigset_t previous;
  pthread_sigmask(SIG_BLOCK, &signals, &previous);
  std::signal(SIGPIPE, SIG_IGN);  // a client that went away is a failed write, not a dead server

  HfFolderOptions hf;
  if (!o.hf_type.empty()) hf.weight_type = parse_weight_type(o.hf_type);
  auto file = open_model_file(o.model_path, hf);
  auto tokenizer = Tokenizer::from_gguf(*file);
  Backend backend = o.device == "cuda" ? cuda_backend(o, *file, *tokenizer) : cpu_backend(o, *file, *tokenizer);

  Server server(o, *file, *tokenizer, std::move(backend), std::make_unique<SlotPool>(o.parallel, o.queue));
  std::atomic<bool> watch{true};
  std::thread watcher([&] {
    const timespec tick{0, 100 * 1000 * 1000};
    bool stopping = false;
    while (watch) {
      siginfo_t info;
      const int sig = sigtimedwait(&signals, &info, &tick);
      if (sig != SIGINT && sig != SIGTERM) continue;
      if (stopping) {
        log::info("serve: %s: already shutting down", sig == SIGINT ? "SIGINT" : "SIGTERM");
        continue;
      }
      stopping = true;
      log::info("serve: %s: stopping in-flight generations, then closing", sig == SIGINT ? "SIGINT" : "SIGTERM");
      server.shutdown();
    }
  });
  auto finish = [&] {
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
  log::info("serve: stopped");
}

}  // namespace microspec::server
