#pragma once
// Benchmark records and their aggregation, computed as SpecBench / EAGLE do: a prompt's speed is
// its new tokens over the wall time of its whole generation (prefill included, all turns summed);
// a method's speed is the mean of its prompts' speeds; speedup is that mean over the reference
// method's (`ar`) mean on the same prompts of the same run; mean acceptance length is pooled over
// all verification steps (accepted draft tokens + 1 per step).
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace microspec::bench {

// One turn of one prompt, as generated.
struct TurnOutput {
  std::vector<int32_t> tokens;  // generated ids
  std::string text;
  std::string finish;  // finish_reason_name()
  int32_t prompt_tokens = 0;
};

// One method on one question (all turns).
struct PromptRecord {
  std::string method;  // the method's label
  int32_t index = 0;   // position of the question in the run's list
  std::string question_id;
  std::string category;
  std::vector<TurnOutput> turns;
  int64_t new_tokens = 0;     // generated tokens over all turns
  double wall_seconds = 0.0;  // whole generations, prefill included, over all turns
  double prefill_seconds = 0.0;
  double decode_seconds = 0.0;
  int64_t decode_tokens = 0;  // tokens produced after the prefills
  // Speculative statistics, summed over turns (zero for plain decoding and peers).
  int64_t steps = 0;
  int64_t accepted_draft = 0;
  int64_t drafted = 0;
  int64_t drafting_steps = 0;
  int64_t active_vocab_sum = 0;
  double draft_backbone_seconds = 0.0;
  double draft_lm_head_seconds = 0.0;
  // Target forward passes after the prefill: verification for speculative methods, every decode
  // step for plain decoding; its LM head included.
  double target_seconds = 0.0;
  double target_lm_head_seconds = 0.0;  // part of target_seconds
  double bookkeeping_seconds = 0.0;
  int64_t peak_memory_bytes = 0;  // resident set high-water mark during this prompt (0 = unknown)

  double tokens_per_second() const { return wall_seconds > 0 ? new_tokens / wall_seconds : 0.0; }
};

// What a method is, for the report.
struct MethodInfo {
  std::string label;        // unique name in this run ("ar", "dynamic", "dynamic:vocab-window=1024")
  std::string base;         // ar | full | freq | dynamic | hybrid | a peer's name
  std::string description;  // drafter and tree, one line
  bool speculative = false;
  bool peer = false;        // another engine: its outputs are compared but never fail the run
  std::string study_key;    // sweep key, or "ablation"
  std::string study_value;  // sweep value, or the ablation row's name
  nlohmann::json config = nlohmann::json::object();  // the speculative settings
};

// Aggregates of one method over a set of prompts.
struct GroupStats {
  int32_t prompts = 0;
  int64_t new_tokens = 0;
  double wall_seconds = 0.0;
  double tokens_per_second = 0.0;  // mean over prompts of new tokens / wall time
  double speedup = 0.0;  // tokens_per_second / the reference's on the same prompts (0 = no reference)
  double decode_tokens_per_second = 0.0;  // pooled: decode tokens / decode seconds
  double decode_speedup = 0.0;
  double mean_acceptance_length = 0.0;  // pooled over steps (0 for plain decoding)
  double mean_active_vocab = 0.0;       // pooled over drafting steps
  double prefill_seconds = 0.0;
  double decode_seconds = 0.0;
  double draft_backbone_seconds = 0.0;
  double draft_lm_head_seconds = 0.0;
  double target_seconds = 0.0;
  double target_lm_head_seconds = 0.0;
  double bookkeeping_seconds = 0.0;
  int64_t steps = 0;
};

// Where a method's output differs from the reference's on one question.
struct Mismatch {
  std::string method;
  std::string question_id;
  int32_t turn = 0;      // first differing turn
  int32_t position = 0;  // first differing token index in that turn
  int32_t reference_length = 0;
  int32_t length = 0;
};

struct Agreement {
  int32_t compared = 0;   // prompts present for both the method and the reference
  int32_t identical = 0;  // prompts whose every turn has identical tokens
  int64_t reference_tokens = 0;
  int64_t agreeing_prefix_tokens = 0;  // tokens before the first difference, summed over turns
};

struct MethodSummary {
  MethodInfo info;
  GroupStats overall;
  std::map<std::string, GroupStats> by_category;
  int64_t peak_memory_bytes = 0;  // largest per-prompt high-water mark
  Agreement agreement;            // against the reference (not filled for the reference itself)
};

struct Summary {
  std::string reference;                // "ar"
  std::vector<std::string> categories;  // in the order of the questions
  std::vector<MethodSummary> methods;   // in the order given
  std::vector<Mismatch> mismatches;     // every method's first difference per prompt (peers included)
};

// Compares every record's turns with the reference method's record of the same question.
std::vector<Mismatch> compare_outputs(const std::vector<PromptRecord>& records, const std::string& reference);
Agreement agreement_with(const std::vector<PromptRecord>& records, const std::string& method,
                         const std::string& reference);

// Aggregates per method, per category and overall. categories gives the report's order.
Summary summarize(const std::vector<MethodInfo>& methods, const std::vector<PromptRecord>& records,
                  const std::vector<std::string>& categories, const std::string& reference = "ar");

// Mismatches that fail the run: those of non-peer methods, and only under greedy decoding.
std::vector<Mismatch> failing_mismatches(const Summary& summary, bool greedy);

nlohmann::json to_json(const PromptRecord& r);
PromptRecord record_from_json(const nlohmann::json& j);  // throws Error on missing fields
nlohmann::json to_json(const MethodInfo& m);
nlohmann::json to_json(const GroupStats& g);
nlohmann::json to_json(const Summary& s);

// The report's tables: overall per method, per-category speedup, time breakdown, mismatches.
std::string summary_markdown(const Summary& s, bool greedy);

}  // namespace microspec::bench
