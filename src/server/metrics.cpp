#include "server/metrics.h"

#include <algorithm>
#include <cstdarg>
#include <cstdio>

namespace microspec::server {

const char* outcome_name(Outcome o) {
  switch (o) {
    case Outcome::Completed:
      return "completed";
    case Outcome::Cancelled:
      return "cancelled";
    case Outcome::Shutdown:
      return "shutdown";
    case Outcome::Failed:
      return "failed";
  }
  return "?";
}

Metrics::Metrics() {
  for (Outcome o : {Outcome::Completed, Outcome::Cancelled, Outcome::Shutdown, Outcome::Failed})
    generations_[outcome_name(o)] = 0;
}

void Metrics::count_request(const std::string& endpoint, int status) {
  std::lock_guard<std::mutex> lock(mu_);
  ++requests_[{endpoint, status}];
}

void Histogram::observe(double value) {
  size_t b = 0;
  while (b < bounds_.size() && value > bounds_[b]) ++b;
  ++buckets_[b];
  sum_ += value;
}

void Metrics::record_generation(const GenerationReport& r, Outcome outcome, const RequestLatency& latency) {
  std::lock_guard<std::mutex> lock(mu_);
  ++generations_[outcome_name(outcome)];
  const GenerateResult& g = r.result.gen;
  prompt_tokens_ += uint64_t(g.prompt_tokens);
  prompt_tokens_prefilled_ += uint64_t(std::max(0, g.prompt_tokens - r.prompt_rows_reused));
  prompt_tokens_cached_ += uint64_t(std::max(0, r.prompt_rows_reused));
  completion_tokens_ += g.tokens.size();
  prefill_seconds_ += g.prefill_seconds;
  decode_seconds_ += g.decode_seconds;
  decode_tokens_ += uint64_t(r.result.decode_tokens());
  request_.observe(latency.total_seconds);
  if (latency.first_text_seconds >= 0.0) {
    first_token_.observe(latency.first_text_seconds);
    if (g.tokens.size() >= 2)
      inter_token_.observe((latency.total_seconds - latency.first_text_seconds) / double(g.tokens.size() - 1));
  }
  if (g.decode_seconds > 0) last_decode_tps_ = r.result.decode_tokens_per_second();
  if (r.speculative && r.result.stats.steps > 0) {
    const SpecStats& st = r.result.stats;
    ++spec_generations_;
    spec_steps_ += uint64_t(st.steps);
    drafted_tokens_ += uint64_t(st.drafted);
    shared_drafting_steps_ += uint64_t(st.shared_drafting_steps);
    shared_draft_forwards_ += uint64_t(st.shared_draft_forwards);
    accepted_draft_tokens_ += uint64_t(st.accepted_draft);
    for (size_t i = 0; i < source_steps_.size(); ++i) {
      source_steps_[i] += uint64_t(st.by_source[i].steps);
      source_accepted_[i] += uint64_t(st.by_source[i].accepted);
    }
    acceptance_.observe(st.mean_acceptance_length());
    last_active_vocab_ = st.mean_active_vocab();
  }
}

namespace {

void line(std::string& out, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
void line(std::string& out, const char* fmt, ...) {
  char buf[512];
  va_list args;
  va_start(args, fmt);
  const int n = std::vsnprintf(buf, sizeof buf, fmt, args);
  va_end(args);
  if (n > 0) out.append(buf, std::min<size_t>(size_t(n), sizeof buf - 1));
  out.push_back('\n');
}

void header(std::string& out, const char* name, const char* type, const char* help) {
  line(out, "# HELP %s %s", name, help);
  line(out, "# TYPE %s %s", name, type);
}

}  // namespace

void Histogram::render(std::string& out, const char* name) const {
  uint64_t cumulative = 0;
  for (size_t b = 0; b < bounds_.size(); ++b) {
    cumulative += buckets_[b];
    line(out, "%s_bucket{le=\"%g\"} %llu", name, bounds_[b], static_cast<unsigned long long>(cumulative));
  }
  cumulative += buckets_.back();
  line(out, "%s_bucket{le=\"+Inf\"} %llu", name, static_cast<unsigned long long>(cumulative));
  line(out, "%s_sum %.6f", name, sum_);
  line(out, "%s_count %llu", name, static_cast<unsigned long long>(cumulative));
}

std::string Metrics::render(const GaugeSnapshot& gauges) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  header(out, "microspec_requests_total", "counter", "HTTP requests answered, by route and status code.");
  for (const auto& [key, count] : requests_)
    line(out, "microspec_requests_total{endpoint=\"%s\",status=\"%d\"} %llu", key.first.c_str(), key.second,
         static_cast<unsigned long long>(count));
  header(out, "microspec_generations_total", "counter",
         "Generations by outcome: completed, cancelled (client went away), shutdown, failed.");
  for (const auto& [name, count] : generations_)
    line(out, "microspec_generations_total{outcome=\"%s\"} %llu", name.c_str(),
         static_cast<unsigned long long>(count));
  header(out, "microspec_prompt_tokens_total", "counter", "Prompt tokens processed.");
  line(out, "microspec_prompt_tokens_total %llu", static_cast<unsigned long long>(prompt_tokens_));
  header(out, "microspec_prompt_tokens_prefilled_total", "counter",
         "Prompt tokens run through the model: prompt tokens less those served from a slot's cache.");
  line(out, "microspec_prompt_tokens_prefilled_total %llu", static_cast<unsigned long long>(prompt_tokens_prefilled_));
  header(
      out, "microspec_prompt_tokens_cached_total", "counter",
      "Prompt tokens served from a slot's cache: the prefix an earlier request (or an earlier choice of the "
      "same request) left there, not run through the model again.");
  line(out, "microspec_prompt_tokens_cached_total %llu",
       static_cast<unsigned long long>(prompt_tokens_cached_));
  header(out, "microspec_completion_tokens_total", "counter", "Tokens generated.");
  line(out, "microspec_completion_tokens_total %llu", static_cast<unsigned long long>(completion_tokens_));
  header(out, "microspec_prefill_seconds_total", "counter", "Time spent in prompt processing.");
  line(out, "microspec_prefill_seconds_total %.6f", prefill_seconds_);
  header(out, "microspec_decode_tokens_total", "counter", "Tokens produced after prompt processing.");
  line(out, "microspec_decode_tokens_total %llu", static_cast<unsigned long long>(decode_tokens_));
  header(out, "microspec_decode_seconds_total", "counter", "Time spent producing them.");
  line(out, "microspec_decode_seconds_total %.6f", decode_seconds_);
  header(out, "microspec_decode_tokens_per_second", "gauge", "Decode speed of the most recent generation.");
  line(out, "microspec_decode_tokens_per_second %.3f", last_decode_tps_);
  header(out, "microspec_spec_generations_total", "counter", "Generations that ran speculatively.");
  line(out, "microspec_spec_generations_total %llu", static_cast<unsigned long long>(spec_generations_));
  header(out, "microspec_spec_steps_total", "counter", "Speculative verification passes.");
  line(out, "microspec_spec_steps_total %llu", static_cast<unsigned long long>(spec_steps_));
  header(out, "microspec_spec_shared_drafting_steps_total", "counter",
         "Speculative steps whose draft tree was verified in one batched forward pass with other sequences.");
  line(out, "microspec_spec_shared_drafting_steps_total %llu", static_cast<unsigned long long>(shared_drafting_steps_));
  header(out, "microspec_spec_shared_draft_forwards_total", "counter",
         "Draft tree levels whose draft forward ran in one call with other sequences' draft rows, summed over "
         "sequences.");
  line(out, "microspec_spec_shared_draft_forwards_total %llu", static_cast<unsigned long long>(shared_draft_forwards_));
  header(out, "microspec_spec_drafted_tokens_total", "counter", "Draft tokens proposed.");
  line(out, "microspec_spec_drafted_tokens_total %llu", static_cast<unsigned long long>(drafted_tokens_));
  header(out, "microspec_spec_accepted_tokens_total", "counter", "Draft tokens accepted by the target.");
  line(out, "microspec_spec_accepted_tokens_total %llu",
       static_cast<unsigned long long>(accepted_draft_tokens_));
  header(out, "microspec_spec_steps_by_drafter_total", "counter",
         "Speculative steps by who drafted them: plain (the root alone), n-gram or model (--spec auto's choices).");
  for (size_t i = 0; i < source_steps_.size(); ++i)
    line(out, "microspec_spec_steps_by_drafter_total{drafter=\"%s\"} %llu", name_of(DraftSource(i)),
         static_cast<unsigned long long>(source_steps_[i]));
  header(out, "microspec_spec_accepted_tokens_by_drafter_total", "counter",
         "Draft tokens accepted, by who drafted them.");
  for (size_t i = 0; i < source_accepted_.size(); ++i)
    line(out, "microspec_spec_accepted_tokens_by_drafter_total{drafter=\"%s\"} %llu", name_of(DraftSource(i)),
         static_cast<unsigned long long>(source_accepted_[i]));
  header(out, "microspec_acceptance_length", "histogram",
         "Mean acceptance length (tokens per target pass) of each speculative generation.");
  acceptance_.render(out, "microspec_acceptance_length");
  header(out, "microspec_time_to_first_token_seconds", "histogram",
         "Seconds from a request reaching a worker to its first piece of generated text (requests with text).");
  first_token_.render(out, "microspec_time_to_first_token_seconds");
  header(out, "microspec_inter_token_latency_seconds", "histogram",
         "Per request of 2+ tokens: seconds from its first piece of text to its end over its tokens after the "
         "first (its mean time per output token).");
  inter_token_.render(out, "microspec_inter_token_latency_seconds");
  header(out, "microspec_request_duration_seconds", "histogram",
         "Seconds from a request reaching a worker to the end of its generation (queue, prefill, decode).");
  request_.render(out, "microspec_request_duration_seconds");
  header(out, "microspec_draft_vocab_active", "gauge",
         "Mean active draft vocabulary size (rows of the draft LM head) of the last speculative generation.");
  line(out, "microspec_draft_vocab_active %.1f", last_active_vocab_);
  header(out, "microspec_slots", "gauge", "Generation slots.");
  line(out, "microspec_slots %d", gauges.slots_total);
  header(out, "microspec_slots_busy", "gauge", "Slots generating now.");
  line(out, "microspec_slots_busy %d", gauges.slots_busy);
  header(out, "microspec_queue_depth", "gauge", "Requests waiting for a slot.");
  line(out, "microspec_queue_depth %d", gauges.queue_depth);
  header(out, "microspec_queue_limit", "gauge", "Most requests that may wait; more are answered 429.");
  line(out, "microspec_queue_limit %d", gauges.queue_limit);
  return out;
}

}  // namespace microspec::server
