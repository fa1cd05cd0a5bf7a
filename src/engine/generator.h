#pragma once
// Plain autoregressive generation: chunked prefill, then one token per forward pass.
// This is the reference that every speculative path must reproduce token for token.
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "model/kv_cache.h"
#include "model/model.h"
#include "grammar/token_constraint.h"
#include "sampling/logprobs.h"
#include "sampling/penalties.h"
#include "sampling/sampler.h"
#include "tokenizer/tokenizer.h"

namespace microspec {

struct GenerateParams {
  int32_t max_new_tokens = 128;
  SamplingParams sampling;
  PenaltyParams penalties;  // applied to the target's row before sampling (sampling/penalties.h)
  std::vector<std::string> stop_strings;  // generation stops before the first occurrence
  bool ignore_eos = false;                // keep going past end-of-generation tokens (benchmarks)
  const std::atomic<bool>* cancel = nullptr;  // when set (the client left), generation ends at the next token
  LogprobSettings logprobs;  // record each generated token's log-probability (sampling/logprobs.h)
  // Structured output: only what this grammar allows is generated (grammar/token_constraint.h;
  // null: no constraint). Shared, so requests with the same schema share its mask cache.
  std::shared_ptr<const TokenConstraint> grammar;
};

// The grammar matcher a generation's row transform (Penalizer) applies: null without a grammar.
// It masks as much of each row as the sampling settings read: the best allowed token for greedy
// choice, the top-k for top-k sampling, the whole row for log-probabilities or top-k off.
std::unique_ptr<GrammarMatcher> grammar_matcher(const GenerateParams& params, int32_t n_vocab);

enum class FinishReason { Length, EndOfGeneration, StopString, ContextFull };
const char* finish_reason_name(FinishReason r);

struct GenerateResult {
  std::vector<int32_t> tokens;  // generated ids (the end-of-generation token is not included)
  std::string text;             // their text, cut at the stop string when one matched
  FinishReason finish = FinishReason::Length;
  int32_t prompt_tokens = 0;
  double prefill_seconds = 0.0;
  double decode_seconds = 0.0;          // from the end of prefill to the last token
  int32_t decode_forwards = 0;          // single-token forward passes after prefill
  double decode_lm_head_seconds = 0.0;  // part of decode_seconds spent in the LM head
  LogprobRows logprobs;  // with params.logprobs: one row per entry of `tokens`, else empty
};

// Receives text as it becomes final (complete UTF-8, never past a stop string). Return false to stop.
using TextCallback = std::function<bool(std::string_view text)>;

// Target features a draft head asks for at every prompt position: the residual streams entering
// `layers` (see ForwardOptions::capture_layers), written to *features as [prompt][layers][n_embd].
struct PrefillCapture {
  std::span<const int32_t> layers;
  std::vector<float>* features = nullptr;
};

class Generator {
 public:
  Generator(Model& model, const Tokenizer& tokenizer, int32_t n_ctx);

  // Runs the prompt through the model and returns the logits of its last token.
  // With top_k > 0 it also writes the target's top_k token ids (best first) at every prompt
  // position to *top_ids ([prompt.size()][top_k]); the LM head then runs on every position, a few
  // rows at a time.
  // With capture, the features of every prompt position too (at no extra forward pass).
  const float* prefill(const std::vector<int32_t>& prompt, int32_t top_k = 0,
                       std::vector<int32_t>* top_ids = nullptr, const PrefillCapture* capture = nullptr);
  // prefill() in pieces, for a caller that bounds the prompt tokens of one forward pass (the
  // batching server): begin_prefill checks the prompt, cuts the cache to its first kept_rows rows
  // and sizes the outputs; each prefill_piece then runs the next at most max_tokens prompt
  // positions (the cache holds those before) and returns the last position's logits once the
  // prompt is all in, else null. The same arguments on every call. The results are bitwise
  // prefill()'s (the kernels do not depend on how many tokens share a call).
  // kept_rows: prompt rows the cache already holds (a prefix cache; the caller vouches that rows
  // [0, kept_rows) hold prompt[0, kept_rows) and that *top_ids / the features hold those rows'
  // values); below the prompt's length, since its last row is run again for its logits.
  void begin_prefill(const std::vector<int32_t>& prompt, int32_t kept_rows, int32_t top_k,
                     std::vector<int32_t>* top_ids, const PrefillCapture* capture);
  const float* prefill_piece(const std::vector<int32_t>& prompt, int32_t max_tokens, int32_t top_k,
                             std::vector<int32_t>* top_ids, const PrefillCapture* capture);
  // prefill_piece's two halves, for a caller that runs the piece in a forward call of its own with
  // other sequences' rows (the batching server); prefill_piece is exactly prefill_rows, a call of
  // its own, prefill_taken.
  //   prefill_rows   the next piece of at most max_tokens prompt positions, as this sequence's part
  //                  of the call, which must run with prefill_options(capture);
  //   prefill_taken  after that call: commits the piece, stores its features and top-k ids, and
  //                  returns what prefill_piece returns.
  SequenceForward prefill_rows(const std::vector<int32_t>& prompt, int32_t max_tokens, int32_t top_k,
                               const PrefillCapture* capture);
  const float* prefill_taken(const std::vector<int32_t>& prompt, int32_t top_k, std::vector<int32_t>* top_ids,
                             const PrefillCapture* capture);
  // What a forward call that runs prefill_rows must ask for: logits, and the capture's layers.
  static ForwardOptions prefill_options(const PrefillCapture* capture);
  GenerateResult generate(const std::vector<int32_t>& prompt, const GenerateParams& params,
                          const TextCallback& on_text = nullptr);

  KVCache& cache() { return kv_; }
  Model& model() { return model_; }

 private:
  Model& model_;
  const Tokenizer& tokenizer_;
  KVCache kv_;
  Batch batch_;
  ForwardOutput out_;
  std::vector<float> head_rows_;  // [kHeadRows][n_vocab] logits of prompt positions (prefill with top-k)
  std::vector<float> penalised_;  // [n_vocab] the row penalties transformed (generate with penalties)
};

// Watches generated text for stop strings and releases only text that cannot be part of one.
class StopStringFilter {
 public:
  explicit StopStringFilter(const std::vector<std::string>& stops) : stops_(stops) {}
  // Appends text; returns the part that is now final. Sets *stopped when a stop string completed.
  std::string push(std::string_view text, bool* stopped);
  std::string flush();  // at the end of generation: everything held back

 private:
  const std::vector<std::string>& stops_;
  std::string held_;
};

// Everything plain decoding does with each new token, shared with the speculative generator so
// both stop at exactly the same token: end-of-generation tokens, stop strings, the token limit and
// the caller's callback. Tokens are fed one at a time, in order.
class TokenSink {
 public:
  TokenSink(const Tokenizer& tokenizer, const GenerateParams& params, const TextCallback& on_text,
            GenerateResult& result);
  // True when no token may be generated at all (max_new_tokens == 0).
  bool done() const { return done_; }
  // Takes the next generated token and the target's logits row it was chosen from (needed only
  // when params.logprobs asks for log-probabilities: a row is then recorded for each appended
  // token). Returns false when generation ends with it (result.finish is set; an
  // end-of-generation token is not appended).
  bool push(int32_t token, std::span<const float> logits = {});
  // At the end of generation: releases text held back by the UTF-8 decoder and stop-string filter.
  void finish();

 private:
  const Tokenizer& tokenizer_;
  const GenerateParams& params_;
  const TextCallback& on_text_;
  GenerateResult& r_;
  Utf8StreamDecoder utf8_;
  StopStringFilter stops_;
  bool stopped_by_callback_ = false;
  bool done_ = false;
  // Sampled requests with logprobs: the distribution each token was drawn from (made at the first
  // token, when the row's size is known) and its (id, probability) pairs ([kept tokens]).
  std::unique_ptr<Sampler> drawn_from_;
  std::vector<std::pair<int32_t, float>> drawn_dist_;
  void emit(std::string_view text);
  void record_logprobs(int32_t token, std::span<const float> logits);
};

// Peak resident memory of this process in bytes (VmHWM).
size_t peak_memory_bytes();

}  // namespace microspec
