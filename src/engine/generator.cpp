#include "engine/generator.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "math/select.h"
#include "util/error.h"

namespace microspec {

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::Length:
      return "length";
    case FinishReason::EndOfGeneration:
      return "stop";
    case FinishReason::StopString:
      return "stop";
    case FinishReason::ContextFull:
      return "length";
  }
  return "?";
}

size_t peak_memory_bytes() {
  FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  size_t kb = 0;
  while (std::fgets(line, sizeof line, f))
    if (std::strncmp(line, "VmHWM:", 6) == 0) kb = std::strtoull(line + 6, nullptr, 10);
  std::fclose(f);
  return kb * 1024;
}

std::string StopStringFilter::push(std::string_view text, bool* stopped) {
  *stopped = false;
  held_.append(text);
  size_t cut = std::string::npos;
  for (const std::string& s : stops_) {
    if (s.empty()) continue;
    size_t at = held_.find(s);
    if (at != std::string::npos) cut = std::min(cut, at);
  }
  if (cut != std::string::npos) {
    *stopped = true;
    std::string out = held_.substr(0, cut);
    held_.clear();
    return out;
  }
  // Hold back the longest tail that is a proper prefix of some stop string.
  size_t keep = 0;
  for (const std::string& s : stops_)
    for (size_t len = std::min(s.size() - (s.empty() ? 0 : 1), held_.size()); len > keep; --len)
      if (held_.compare(held_.size() - len, len, s, 0, len) == 0) {
        keep = len;
        break;
      }
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

std::string StopStringFilter::flush() {
  std::string out;
  out.swap(held_);
  return out;
}

Generator::Generator(Model& model, const Tokenizer& tokenizer, int32_t n_ctx)
    : model_(model), tokenizer_(tokenizer), kv_(model.make_cache(n_ctx)) {
  if (tokenizer.n_vocab() != model.config().n_vocab)
    throw Error("tokenizer vocabulary (" + std::to_string(tokenizer.n_vocab()) +
                ") does not match the model's (" + std::to_string(model.config().n_vocab) + ")");
  out_.logits.reserve(size_t(model.config().n_vocab));
  out_.hidden.reserve(size_t(model.n_batch()) * model.config().n_embd);
}

const float* Generator::prefill(const std::vector<int32_t>& prompt, int32_t top_k,
                                std::vector<int32_t>* top_ids, const PrefillCapture* capture) {
  begin_prefill(prompt, /*kept_rows=*/0, top_k, top_ids, capture);
  for (;;)
    if (const float* logits = prefill_piece(prompt, model_.n_batch(), top_k, top_ids, capture)) return logits;
}

void Generator::begin_prefill(const std::vector<int32_t>& prompt, int32_t kept_rows, int32_t top_k,
                              std::vector<int32_t>* top_ids, const PrefillCapture* capture) {
  if (top_k < 0) throw Error("prefill: negative top-k");
  if (top_k > 0 && !top_ids) throw Error("prefill: top-k ids requested without an output vector");
  const bool capturing = capture && !capture->layers.empty();
  if (capturing && !capture->features) throw Error("prefill: features requested without an output vector");
  if (prompt.empty()) throw Error("the prompt is empty");
  if (int64_t(prompt.size()) >= kv_.n_ctx())
    throw Error("the prompt has " + std::to_string(prompt.size()) + " tokens; the context holds " +
                std::to_string(kv_.n_ctx()) + " (raise -c)");
  if (kept_rows < 0 || kept_rows >= int32_t(prompt.size()) || kept_rows > kv_.n_past())
    throw Error("prefill: " + std::to_string(kept_rows) + " kept rows of a " + std::to_string(prompt.size()) +
                "-token prompt in a cache of " + std::to_string(kv_.n_past()) + " rows");
  kv_.truncate(kept_rows);
  if (capturing)
    capture->features->resize(prompt.size() * capture->layers.size() * size_t(model_.config().n_embd));
  if (top_k > 0) top_ids->resize(prompt.size() * size_t(top_k));
}

const float* Generator::prefill_piece(const std::vector<int32_t>& prompt, int32_t max_tokens, int32_t top_k,
                                      std::vector<int32_t>* top_ids, const PrefillCapture* capture) {
  const SequenceForward rows = prefill_rows(prompt, max_tokens, top_k, capture);
  model_.forward(std::span<const SequenceForward>(&rows, 1), prefill_options(capture));
  return prefill_taken(prompt, top_k, top_ids, capture);
}

ForwardOptions Generator::prefill_options(const PrefillCapture* capture) {
  return {.logits = true, .capture_layers = capture ? capture->layers : std::span<const int32_t>{}};
}

SequenceForward Generator::prefill_rows(const std::vector<int32_t>& prompt, int32_t max_tokens, int32_t top_k,
                                        const PrefillCapture* capture) {
  const int32_t n = static_cast<int32_t>(prompt.size());
  const int32_t at = kv_.n_past();
  if (max_tokens < 1 || at >= n) throw Error("prefill: no prompt piece to run");
  const int32_t len = std::min({max_tokens, model_.n_batch(), n - at});
  const bool last = at + len == n;
  // Every position's hidden state when its features or its top-k ids are wanted, else the last's.
  const bool every_row = top_k > 0 || (capture && !capture->layers.empty());
  batch_.set_sequence(std::span<const int32_t>(prompt.data() + at, len), at, every_row);
  // Logits of the prompt's last position once it is in; the top-k pass computes its own (below).
  const int32_t n_out = static_cast<int32_t>(batch_.output_rows.size());
  return {.batch = &batch_, .kv = &kv_, .out = &out_, .logits_from = last && top_k == 0 ? n_out - 1 : n_out};
}

const float* Generator::prefill_taken(const std::vector<int32_t>& prompt, int32_t top_k,
                                      std::vector<int32_t>* top_ids, const PrefillCapture* capture) {
  const int32_t at = kv_.n_past(), len = batch_.size();
  const bool last = at + len == static_cast<int32_t>(prompt.size());
  const int32_t V = model_.config().n_vocab, E = model_.config().n_embd;
  kv_.commit_prefix(len);
  if (capture && !capture->layers.empty()) {
    const size_t feature_row = capture->layers.size() * size_t(E);
    if (out_.layer_inputs.size() != size_t(len) * feature_row)
      throw Error("prefill: the forward call did not capture the prompt's features");
    std::copy(out_.layer_inputs.begin(), out_.layer_inputs.end(),
              capture->features->begin() + ptrdiff_t(size_t(at) * feature_row));
  }
  if (top_k == 0) return last ? out_.logits.data() : nullptr;
  // The LM head over every position a few rows at a time: the whole piece's logits would take
  // n_batch * n_vocab floats (512 MiB for Gemma's 262k vocabulary). 64 rows a call: the AMX
  // table's tiles take Q8_0 LM heads from 32 tokens, and at 64 the Gemma head's product runs 1.84x
  // as fast as at 16 (Xeon, 2 threads); the rows cost 64 x n_vocab floats (64 MiB for Gemma).
  constexpr int32_t kHeadRows = 64;
  head_rows_.resize(size_t(kHeadRows) * V);
  for (int32_t r = 0; r < len; r += kHeadRows) {
    const int32_t rows = std::min(kHeadRows, len - r);
    model_.lm_head(out_.hidden.data() + size_t(r) * E, rows, head_rows_.data());
    for (int32_t i = 0; i < rows; ++i)
      top_k_indices(head_rows_.data() + size_t(i) * V, V, top_k, top_ids->data() + size_t(at + r + i) * top_k);
    if (last && r + rows == len)
      out_.logits.assign(head_rows_.data() + size_t(rows - 1) * V, head_rows_.data() + size_t(rows) * V);
  }
  return last ? out_.logits.data() : nullptr;
}

TokenSink::TokenSink(const Tokenizer& tokenizer, const GenerateParams& params, const TextCallback& on_text,
                     GenerateResult& result)
    : tokenizer_(tokenizer), params_(params), on_text_(on_text), r_(result), stops_(params.stop_strings) {
  r_.finish = FinishReason::Length;
  done_ = params.max_new_tokens <= 0;
  // Room for every row the generation may record, so recording allocates nothing per token (and a
  // reader on another thread never sees the storage move). Longer generations (a CLI run past
  // this) grow it as a vector grows.
  constexpr int64_t kMaxReservedRows = int64_t(1) << 16;
  if (params.logprobs.enabled)
    r_.logprobs.reset(params.logprobs.top,
                      size_t(std::clamp<int64_t>(params.max_new_tokens, 0, kMaxReservedRows)));
}

// One logprobs row (sampling/logprobs.h says which values): the raw row's for greedy decoding,
// the drawn-from distribution's for sampling.
void TokenSink::record_logprobs(int32_t token, std::span<const float> logits) {
  if (logits.empty()) throw Error("log-probabilities asked for, but no logits row came with the token");
  const int64_t n = int64_t(logits.size());
  if (params_.sampling.greedy()) {
    append_logprob_row(logits.data(), n, token, r_.logprobs);
    return;
  }
  if (!drawn_from_) {
    drawn_from_ = std::make_unique<Sampler>(params_.sampling, n);
    drawn_dist_.reserve(size_t(n));
  }
  drawn_from_->distribution(logits.data(), n, drawn_dist_);
  append_drawn_logprob_row(drawn_dist_, token, r_.logprobs);
}

void TokenSink::emit(std::string_view text) {
  if (text.empty() || stopped_by_callback_) return;
  r_.text.append(text);
  if (on_text_ && !on_text_(text)) stopped_by_callback_ = true;
}

bool TokenSink::push(int32_t token, std::span<const float> logits) {
  if (done_) return false;
  if (params_.cancel && params_.cancel->load(std::memory_order_relaxed)) {  // nobody waits for the rest
    stopped_by_callback_ = true;
    done_ = true;
    return false;
  }
  if (!params_.ignore_eos && tokenizer_.is_end_of_generation(token)) {
    r_.finish = FinishReason::EndOfGeneration;
    done_ = true;
    return false;
  }
  r_.tokens.push_back(token);
  if (params_.logprobs.enabled) record_logprobs(token, logits);
  bool stop_hit = false;
  emit(stops_.push(utf8_.push(tokenizer_.token_to_piece(token)), &stop_hit));
  if (stop_hit) {
    r_.finish = FinishReason::StopString;
    done_ = true;
  } else if (stopped_by_callback_ || int64_t(r_.tokens.size()) >= params_.max_new_tokens) {
    done_ = true;
  }
  return !done_;
}

void TokenSink::finish() {
  if (r_.finish != FinishReason::StopString) {
    bool ignored = false;
    emit(stops_.push(utf8_.flush(), &ignored));
    emit(stops_.flush());
  }
}

std::unique_ptr<GrammarMatcher> grammar_matcher(const GenerateParams& params, int32_t n_vocab) {
  if (!params.grammar) return nullptr;
  if (params.grammar->vocab().size() != n_vocab)
    throw Error("grammar: made for a vocabulary of " + std::to_string(params.grammar->vocab().size()) +
                " tokens, but the model has " + std::to_string(n_vocab));
  constexpr int32_t kMaxRankedKeep = 64;  // a larger top-k masks the whole row instead
  const SamplingParams& s = params.sampling;
  int32_t keep = 0;
  if (!params.logprobs.enabled) {
    if (s.greedy()) keep = 1;
    else if (s.top_k > 0 && s.top_k <= kMaxRankedKeep) keep = s.top_k;
  }
  return std::make_unique<GrammarMatcher>(params.grammar, keep);
}

GenerateResult Generator::generate(const std::vector<int32_t>& prompt, const GenerateParams& params,
                                   const TextCallback& on_text) {
  using clock = std::chrono::steady_clock;
  GenerateResult r;
  r.prompt_tokens = static_cast<int32_t>(prompt.size());
  const int32_t V = model_.config().n_vocab;
  Sampler sampler(params.sampling, V);
  Penalizer penalizer(params.penalties, V, grammar_matcher(params, V));
  penalizer.begin(prompt, kv_.n_ctx() + 1);
  if (penalizer.active()) penalised_.resize(size_t(V));
  TokenSink sink(tokenizer_, params, on_text, r);

  auto t0 = clock::now();
  const float* logits = prefill(prompt);
  auto t1 = clock::now();
  r.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
  model_.timings().reset();

  while (!sink.done()) {
    if (penalizer.active()) {  // the sampler and the logprobs see the transformed row
      std::copy(logits, logits + V, penalised_.begin());
      penalizer.apply(penalised_.data());
      logits = penalised_.data();
    }
    const int32_t token = sampler.sample(logits);
    if (!sink.push(token, {logits, size_t(V)})) break;
    penalizer.accept(token);
    if (kv_.n_past() + 1 >= kv_.n_ctx()) {
      r.finish = FinishReason::ContextFull;
      break;
    }
    batch_.set_sequence(std::span<const int32_t>(&token, 1), kv_.n_past(), false);
    model_.forward(batch_, kv_, out_, {.logits = true});
    kv_.commit_prefix(1);
    ++r.decode_forwards;
    logits = out_.logits.data();
  }
  sink.finish();
  r.decode_seconds = std::chrono::duration<double>(clock::now() - t1).count();
  r.decode_lm_head_seconds = model_.timings().lm_head_seconds;
  return r;
}

}  // namespace microspec
