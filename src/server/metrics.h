#pragma once
// Server counters and the Prometheus text exposition of GET /metrics. Thread-safe: HTTP worker
// threads record while another renders.
#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "server/api.h"

namespace microspec::server {

// How a generation ended, as the server sees it (the engine's finish reason is inside the report).
enum class Outcome { Completed, Cancelled, Shutdown, Failed };
const char* outcome_name(Outcome o);

struct GaugeSnapshot {
  int slots_total = 0;
  int slots_busy = 0;
  int queue_depth = 0;  // requests waiting for a slot
  int queue_limit = 0;
};

// A Prometheus histogram: counts per bucket of fixed upper bounds (+Inf implied), sum and count.
class Histogram {
 public:
  explicit Histogram(std::span<const double> bounds) : bounds_(bounds), buckets_(bounds.size() + 1, 0) {}
  void observe(double value);
  // The _bucket{le=...}, _sum and _count lines under `name` (HELP and TYPE written by the caller).
  void render(std::string& out, const char* name) const;

 private:
  std::span<const double> bounds_;
  std::vector<uint64_t> buckets_;  // [bounds + 1] per bucket (not cumulative), +Inf last
  double sum_ = 0.0;
};

// When a request's answer came, as the server saw it (wall clock, for the latency histograms).
struct RequestLatency {
  double first_text_seconds = -1.0;  // from reaching a worker to its first piece of text (< 0: none came)
  double total_seconds = 0.0;        // from reaching a worker to the end of its generation
};

class Metrics {
 public:
  Metrics();
  // One answered HTTP request. endpoint: a known route or "other" (keeps the label set bounded).
  void count_request(const std::string& endpoint, int status);
  void record_generation(const GenerationReport& report, Outcome outcome, const RequestLatency& latency);
  std::string render(const GaugeSnapshot& gauges) const;

 private:
  // Upper bounds of the acceptance-length histogram buckets (tokens per target pass); +Inf implied.
  static constexpr std::array<double, 12> kAcceptanceBounds = {1.0, 1.25, 1.5, 1.75, 2.0, 2.5,
                                                               3.0, 3.5,  4.0, 5.0,  6.0, 8.0};
  // Upper bounds in seconds of the latency histograms (+Inf implied).
  static constexpr std::array<double, 14> kFirstTokenBounds = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75,
                                                               1.0,  2.5,   5.0,  7.5, 10.0, 30.0, 60.0};
  static constexpr std::array<double, 13> kInterTokenBounds = {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06,
                                                               0.08,  0.1,    0.2,   0.4,  0.8,  2.0};
  static constexpr std::array<double, 13> kRequestBounds = {0.1,  0.25, 0.5,  1.0,   2.5,   5.0,  10.0,
                                                            20.0, 40.0, 60.0, 120.0, 300.0, 600.0};

  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> requests_;  // (endpoint, status) -> count
  std::map<std::string, uint64_t> generations_;               // outcome -> count
  uint64_t prompt_tokens_ = 0;
  uint64_t prompt_tokens_prefilled_ = 0;  // prompt_tokens_ less the rows taken from a slot's cache
  uint64_t prompt_tokens_cached_ = 0;     // the rows taken from a slot's cache
  uint64_t completion_tokens_ = 0;
  uint64_t decode_tokens_ = 0;   // tokens produced after prefill, over all generations
  double decode_seconds_ = 0.0;  // their decode time
  double prefill_seconds_ = 0.0;
  double last_decode_tps_ = 0.0;   // the most recent generation's decode tok/s
  uint64_t spec_generations_ = 0;  // generations that ran speculatively
  uint64_t spec_steps_ = 0;
  uint64_t drafted_tokens_ = 0;
  uint64_t shared_drafting_steps_ = 0;  // drafting steps verified together with other sequences
  uint64_t shared_draft_forwards_ = 0;  // draft forwards (tree levels) run together with other sequences'
  uint64_t accepted_draft_tokens_ = 0;
  // Per DraftSource (plain, n-gram, model): steps, and draft tokens accepted from them.
  std::array<uint64_t, kDraftSources> source_steps_{}, source_accepted_{};
  Histogram acceptance_{kAcceptanceBounds};   // per speculative generation
  Histogram first_token_{kFirstTokenBounds};  // time to first token, per request with text
  Histogram inter_token_{kInterTokenBounds};  // mean time between tokens, per request of 2+ tokens
  Histogram request_{kRequestBounds};         // end-to-end, per generation
  double last_active_vocab_ = 0.0;  // mean active draft vocabulary of the last speculative generation
};

}  // namespace microspec::server
