#pragma once
// The OpenAI-compatible request and response shapes of `microspec serve`: parsing and validating
// /v1/chat/completions and /v1/completions bodies into what the engine takes, OpenAI-style error
// bodies, and the JSON of answers and stream chunks. No HTTP and no model here, so every rule about
// what a request may contain lives in one place.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/generator.h"
#include "grammar/json_schema.h"
#include "grammar/token_constraint.h"
#include "engine/speculative_decoder.h"
#include "sampling/logprobs.h"
#include "speculative/settings.h"
#include "tokenizer/chat.h"
#include "tokenizer/tokenizer.h"

namespace microspec::server {

// A request the server answers with an error: HTTP status and OpenAI's error fields.
class ApiError : public std::runtime_error {
 public:
  ApiError(int status, const std::string& message, std::string param = "", std::string code = "",
           std::string type = "");
  int status;
  std::string type;   // "invalid_request_error", "authentication_error", ... (from status if not given)
  std::string param;  // offending field ("" when none)
  std::string code;   // machine-readable reason ("" when none)
};

// {"error": {"message", "type", "param", "code"}}; param and code are null when empty.
nlohmann::json error_body(int status, const std::string& message, const std::string& param = "",
                          const std::string& code = "", const std::string& type = "");
// OpenAI's error type for an HTTP status.
const char* error_type_for_status(int status);

enum class Endpoint { Chat, Completion };

// Structured output's grammars over the model's vocabulary: each distinct schema compiled once and
// shared, with its cache of token masks, by every request that asks for it. Thread-safe.
class GrammarCache {
 public:
  explicit GrammarCache(std::shared_ptr<const GrammarVocabulary> vocab) : vocab_(std::move(vocab)) {}
  // The grammar of a JSON Schema, or of any JSON object when schema is null. Throws Error (from
  // grammar/json_schema.h) for a schema it cannot express.
  std::shared_ptr<const TokenConstraint> get(const nlohmann::ordered_json* schema);
  // The grammar `make` builds, compiled once per key.
  std::shared_ptr<const TokenConstraint> get(const std::string& key, const std::function<Grammar()>& make);

 private:
  static constexpr size_t kMaxGrammars = 64;  // then the cache starts over
  std::shared_ptr<const GrammarVocabulary> vocab_;
  std::mutex mutex_;
  std::map<std::string, std::shared_ptr<const TokenConstraint>> by_schema_;  // key: the schema's JSON text
};

// What the server knows that request validation needs.
struct RequestContext {
  const Tokenizer* tokenizer = nullptr;
  std::optional<ChatStyle> chat_style;  // none: the model has no chat template
  int32_t n_ctx = 0;                      // tokens per slot
  const SpecConfig* spec = nullptr;       // the slots' speculative setup (mode "none": off)
  GrammarCache* grammars = nullptr;       // structured output (response_format)
};

// `n`: choices per request, 1..kMaxChoices (outside: 400 naming `n`).
constexpr int32_t kMaxChoices = 16;

// The seed of choice `choice` of a request with seed `seed`: seed + choice (mod 2^64), so choice 0
// is the request with n = 1 and the same seed, and choice i the request with n = 1 and seed + i.
uint64_t choice_seed(uint64_t seed, int32_t choice);

// How models write a tool call, the syntax of the Hermes and Qwen 2.5 templates:
// <tool_call>{"name": ..., "arguments": {...}}</tool_call>. A chat template that renders tools is
// served when it teaches this syntax.
inline const JsonTags kToolCallTags{"<tool_call>", "</tool_call>"};

// A chat request's tool calling (OpenAI's tools, tool_choice, parallel_tool_calls).
struct ToolCalling {
  nlohmann::ordered_json tools;  // the request's "tools" as the chat template receives them (null: none)
  bool parse_calls = false;      // tool_choice is not "none": calls in the text become message.tool_calls
};

struct CompletionRequest {
  Endpoint endpoint = Endpoint::Chat;
  int32_t n = 1;  // choices, each generated from params with its own choice_seed
  std::vector<int32_t> prompt_ids;
  GenerateParams params;  // max_new_tokens: the request's max_tokens, else the rest of the context
  bool stream = false;
  // llama.cpp's cache_prompt: false keeps no rows an earlier request left (--no-cache-prompt for one request).
  bool cache_prompt = true;
  bool include_usage = false;  // stream_options.include_usage: a last chunk carrying usage
  bool speculative = false;    // run through the slot's speculative decoder
  std::string spec_note;       // why speculation is off although the server has it ("" if on or never)
  ToolCalling tools;
};

// Parses and validates a request body. Throws ApiError (400, with the offending param) for invalid
// JSON or UTF-8, wrong types, out-of-range numbers (n outside 1..kMaxChoices ...), unsupported
// options (logprobs, tools, penalties ...) and prompts that do not fit the context; unknown top-level fields are ignored as
// OpenAI clients send many optional ones.
CompletionRequest parse_completion_request(Endpoint endpoint, const std::string& body,
                                           const RequestContext& ctx);

// POST /tokenize, llama-server's shape: {"content": text, "add_special": false (BOS where the
// model adds one), "parse_special": true (control-token strings are control tokens), "with_pieces":
// false} -> {"tokens": [ids]}, or with pieces [{"id", "piece"}] (piece: a string when it is valid
// UTF-8, else its bytes). Throws ApiError 400 naming the field.
nlohmann::json tokenize_answer(const std::string& body, const Tokenizer& tokenizer);
// POST /detokenize: {"tokens": [ids]} -> {"content": text} (control tokens written as their text).
nlohmann::json detokenize_answer(const std::string& body, const Tokenizer& tokenizer);

// The answer to an exception thrown while a request's generation runs. The request was validated
// before it got a slot, so what fails inside the generation is the server's fault: 500
// server_error ("generation_failed"); running out of memory is 503. (Problems of the request itself
// are found by parse_completion_request and answered 400 before any generation starts.)
ApiError generation_error(const std::exception& e);

// Everything one generation reports back, for usage fields, metrics and logs.
struct GenerationReport {
  SpecResult result;  // result.stats is all zero when the request ran without speculation
  bool speculative = false;
  std::string spec_mode;    // a --spec name: "none", "self", "draft", "ngram", "self+ngram", ...
  std::string draft_vocab;  // the slot's draft vocabulary when speculative
  std::string spec_note;
  double queue_seconds = 0.0;  // waiting for a free slot
  std::string device = "cpu";  // "cuda": the CUDA backend ran it (it counts a step's parts, never times them)
  // Prompt rows the slot's cache already held (prefix cache, an earlier choice): not prefilled.
  int32_t prompt_rows_reused = 0;
};

// "usage" with the microspec extension (speculative statistics, timings).
nlohmann::json usage_json(const GenerationReport& r);
// finish_reason of an answer whose generation ran to its end.
const char* finish_reason(const GenerateResult& r);

struct AnswerIds {
  std::string id;       // "chatcmpl-..." / "cmpl-..."
  int64_t created = 0;  // unix seconds
  std::string model;
};

// The log-probabilities an answer or a chunk carries: rows of 1 + top entries (sampling/logprobs.h),
// one per generated token. text_offset (completions' legacy shape): the byte offset of the first
// row's token in the completion's text; advanced past the rows, so a stream's chunks continue it.
struct LogprobsOut {
  const Tokenizer* tokenizer = nullptr;
  int32_t top = 0;
  std::span<const TokenLogprob> entries;
  size_t* text_offset = nullptr;
};
// choices[i].logprobs: chat {"content": [{token, logprob, bytes, top_logprobs}]}, completions
// {tokens, token_logprobs, top_logprobs, text_offset}. -inf (a NaN or -inf logit) is written -9999.0.
nlohmann::json logprobs_json(Endpoint endpoint, const LogprobsOut& lp);

// Non-streamed answer: chat.completion or text_completion. logprobs: null for "logprobs": null.
// With tool calling, the calls in a chat choice's text become its message's tool_calls and its
// finish_reason "tool_calls"; choice_index keeps the calls' ids distinct between choices.
nlohmann::json answer_json(Endpoint endpoint, const AnswerIds& ids, const GenerationReport& r,
                           const LogprobsOut* logprobs = nullptr, const ToolCalling& tools = {},
                           int32_t choice_index = 0);
// Stream chunks. `text` chunk; the first chat chunk carries the role; the last carries finish_reason.
// logprobs: those of the tokens since the previous chunk (null: "logprobs": null).
nlohmann::json chunk_json(Endpoint endpoint, const AnswerIds& ids, const std::string& text, bool first,
                          const char* finish, bool include_usage_null, const LogprobsOut* logprobs = nullptr);
// The extra last chunk of stream_options.include_usage: no choices, usage filled.
nlohmann::json usage_chunk_json(Endpoint endpoint, const AnswerIds& ids, const GenerationReport& r);

// Several choices (n > 1): answer_json of each choice in order (moved from), merged into one answer
// whose choices[i] has index i. usage counts the prompt once and sums the completion tokens; its
// microspec extension is choice 0's.
nlohmann::json merge_choice_answers(std::vector<nlohmann::json>& answers);
// usage (of usage_json) made to count every choice: completion_tokens summed over reports, the
// prompt once.
void count_choices_in_usage(nlohmann::json& usage, std::span<const GenerationReport> reports);

// Constant-time comparison (time depends on the lengths only), for API keys.
bool secrets_equal(const std::string& a, const std::string& b);

// Serializes JSON for the wire: compact, invalid UTF-8 in generated text replaced by U+FFFD.
std::string dump_json(const nlohmann::json& j);

}  // namespace microspec::server
