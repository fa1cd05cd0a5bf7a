#pragma once
// Server counters and the Prometheus text exposition of GET /metrics. Thread-safe: HTTP worker
// threads record while another renders.
#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

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

class Metrics {
 public:
  Metrics();
  // One answered HTTP request. endpoint: a known route or "other" (keeps the label set bounded).
  void count_request(const std::string& endpoint, int status);
  void record_generation(const GenerationReport& report, Outcome outcome);
  std::string render(const GaugeSnapshot& gauges) const;

 private:
  // Upper bounds of the acceptance-length histogram buckets (tokens per target pass); +Inf implied.
  static constexpr std::array<double, 12> kAcceptanceBounds = {1.0, 1.25, 1.5, 1.75, 2.0, 2.5,
                                                               3.0, 3.5,  4.0, 5.0,  6.0, 8.0};

  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> requests_;  // (endpoint, status) -> count
  std::map<std::string, uint64_t> generations_;               // outcome -> count
  uint64_t prompt_tokens_ = 0;
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
  std::array<uint64_t, kAcceptanceBounds.size() + 1> acceptance_buckets_{};  // per bucket, +Inf last
  double acceptance_sum_ = 0.0;
  double last_active_vocab_ = 0.0;  // mean active draft vocabulary of the last speculative generation
};

}  // namespace microspec::server
