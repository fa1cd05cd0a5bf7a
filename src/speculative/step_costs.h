#pragma once
// What a target forward costs per row count: the cost model `--spec auto` weighs its options with.
//
// Measured once per machine and model (model file, kernel table, threads, weight layout, CPU) and
// cached on disk as JSON, so that every later run reads the very same numbers: auto's choices then
// depend only on the generation's tokens, and a fixed seed gives the same text on every run. The
// first run on a machine measures (about a second: each row count's forward, median of three) and
// writes the file; runs after it read it.
#include <cstdint>
#include <string>
#include <vector>

#include "gguf/gguf.h"
#include "model/model.h"

namespace microspec {

struct StepCosts {
  // Measured row counts, increasing from 1, and the seconds of a forward of that many rows of one
  // sequence (every row's logits), and of its LM-head part.
  std::vector<int32_t> rows;     // [points]
  std::vector<double> forward;   // [points] seconds
  std::vector<double> lm_head;   // [points] seconds, part of forward

  // Seconds of r rows (r >= 0; 0 costs nothing), interpolated linearly between measured counts and
  // extrapolated from the last two beyond them.
  double forward_at(double r) const { return at(forward, r); }
  double lm_head_at(double r) const { return at(lm_head, r); }
  double body_at(double r) const { return forward_at(r) - lm_head_at(r); }
  int32_t max_rows() const { return rows.empty() ? 0 : rows.back(); }
  // Throws Error unless the points are non-empty, increasing from 1 and non-negative.
  void validate() const;

 private:
  double at(const std::vector<double>& v, double r) const;
};

// The row counts a calibration up to max_rows measures: every count to 9, then 12, 16, 24, 32, 48,
// 64, ... up to max_rows (which is always included).
std::vector<int32_t> calibration_rows(int32_t max_rows);

// Measures `model` on a scratch cache of its own (the live cache is not touched) at the row counts
// of calibration_rows(max_rows) above `known`'s last, and returns `known`'s points followed by
// them (costs never fall with more rows).
StepCosts measure_step_costs(Model& model, int32_t max_rows, const StepCosts& known = {});

// The costs file for this model on this machine: `path` when not empty (written there if it does
// not exist), else <cache dir>/step-costs-<key>.json, where the cache dir is $MICROSPEC_CACHE_DIR,
// else $XDG_CACHE_HOME/microspec, else $HOME/.cache/microspec. A file whose rows stop short of
// max_rows (a server with more sequences than any run before) is extended, its points kept, so
// what earlier runs read does not change; a file of another key (another model or machine) is
// measured anew. *note says what happened (read from / measured and written to / measured, not
// cached because ...). Throws Error for a `path` that exists but does not parse.
StepCosts cached_step_costs(Model& model, const GgufFile& file, int32_t max_rows, const std::string& path,
                            std::string* note);

// StepCosts to and from the file's JSON text (throws Error for malformed text).
std::string step_costs_json(const StepCosts& costs, const std::string& key);
StepCosts parse_step_costs(const std::string& text, std::string* key);

}  // namespace microspec
