#pragma once
// The speculative-decoding settings: SpecConfig, and ONE table (spec_settings()) that says, for
// every setting, its flag, the member it sets, its range or valid names, its help and its default.
// The CLI options of generate / serve / bench (cli/common.cpp), bench's per-method overrides
// ("dynamic:vocab-window=1024"), bench's recorded configuration and the parsing of every value
// are all driven by that table, so a setting means the same everywhere and is spelled once.
// The modes and the vocabulary kinds are enums, parsed once from their names; every error names
// the valid values.
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "speculative/tree.h"
#include "vocab/candidate_stream.h"

namespace microspec {

// --spec: plain decoding, the target's own first layers as the draft, a separate draft model, an
// EAGLE-3 draft head reading the target's hidden states (draft_head/), n-gram (prompt-lookup)
// drafting, or n-gram drafting first with self / draft / head as the fallback
// (speculative/ngram.h). A new "X+ngram" mode is a value here, its name in settings.cpp and a
// line in fallback_mode().
// auto (the default) weighs, step by step, an n-gram chain, a model drafter and a plain step
// (speculative/auto_drafter.h).
enum class SpecMode { None, Self, Draft, Head, Ngram, SelfNgram, DraftNgram, HeadNgram, Auto };
// --draft-vocab: the draft vocabulary kind (see vocab/draft_vocab.h).
enum class DraftVocabKind { Full, Freq, Dynamic, Hybrid };
// --vocab-source: the candidate stream's ablation (see vocab/candidate_stream.h).
using VocabSource = CandidateStreamParams::Source;

const char* name_of(SpecMode mode);
const char* name_of(DraftVocabKind kind);
const char* name_of(VocabSource source);
// Parse a name; Error lists the valid ones ("--spec must be one of none, self, draft; got 'x'").
SpecMode parse_spec_mode(const std::string& name);
// Whether name is a --spec mode, and every mode's name quoted ("'none', 'self', ...").
bool is_spec_mode_name(const std::string& name);
std::string spec_mode_names();
// Whether the mode drafts from n-gram matches (ngram, X+ngram).
bool uses_ngram(SpecMode mode);
// The model-based drafter of a mode: X for X+ngram, None for ngram, the mode itself otherwise.
// (auto's depends on the files: auto_model_mode.)
SpecMode fallback_mode(SpecMode mode);
DraftVocabKind parse_draft_vocab(const std::string& name);
VocabSource parse_vocab_source(const std::string& name);

struct SpecConfig {
  SpecMode mode = SpecMode::Auto;
  int32_t draft_layers = 0;  // self: target layers the draft runs; 0 = all but the last eighth
  std::string draft_model;   // draft: GGUF file with the target's vocabulary
  std::string draft_head;    // head: eagle3 GGUF; empty = heads/<model stem>.eagle3.gguf beside the model
  TreeParams tree;
  DraftVocabKind draft_vocab = DraftVocabKind::Dynamic;  // MicroSpec by default
  std::string freq_file;        // freq / hybrid: ranking from `microspec vocab-freq`; empty = the
                                // target's path with .freq.bin for .gguf, if it exists
  int32_t freq_top = 32768;     // freq: the K most frequent tokens
  int32_t hybrid_top = 512;     // hybrid: most frequent tokens always in the window's set
  int32_t vocab_window = 3072;  // dynamic / hybrid: W_max, candidate-stream entries kept
  int32_t vocab_kpre = 3;       // dynamic / hybrid: target top-k per prompt position
  int32_t vocab_kver = 3;       // dynamic / hybrid: target top-k per verification
  VocabSource vocab_source = VocabSource::Both;  // ctx (prompt part only) | ext (per step only) | both
  bool async_gather = true;                      // gather new LM-head rows on a helper thread
  int32_t ngram_min = 2;    // ngram: shortest suffix match that drafts
  int32_t ngram_max = 5;    // ngram / X+ngram: longest suffix match tried
  int32_t ngram_first = 3;  // X+ngram: a match this long drafts instead of the fallback drafter
  int32_t ngram_min_accept = 10;  // ngram / X+ngram: a chain's cut, percent (NgramParams)
  std::string step_costs;         // auto: the cost file to read (written first if missing); empty = the cache

  bool enabled() const { return mode != SpecMode::None; }
  // Throws Error for inconsistent settings (e.g. --draft-model without --spec draft) and values
  // outside the table's ranges.
  void validate() const;
};

// One row of the table.
struct SpecSetting {
  enum class Kind { Integer, Number, Text, Switch, Choice };
  const char* flag = "";  // without dashes: "vocab-window"; also bench's override key and JSON key
  Kind kind = Kind::Text;
  const char* help = "";
  double min = 0, max = 0;           // Integer, Number: the allowed range
  std::vector<std::string> choices;  // Choice: the valid names
  // The member's current value: a number (Integer, Number), a bool (Switch) or a string.
  std::function<nlohmann::json(const SpecConfig&)> get;
  // Parses text into the member; throws Error naming the flag and the range or valid names.
  std::function<void(SpecConfig&, const std::string&)> set;

  // The default (a default-constructed SpecConfig's value) as text.
  std::string default_text() const;
};

const std::vector<SpecSetting>& spec_settings();
// The row for a flag; Error listing every flag when there is none.
const SpecSetting& spec_setting(const std::string& flag);

// Sets one setting by its flag without dashes ("draft-vocab", "vocab-window", "tree-tokens", ...).
// Throws Error for an unknown flag or a bad value.
void apply_spec_setting(SpecConfig& config, const std::string& flag, const std::string& value);

// Every setting as {flag: value}, as recorded in bench reports.
nlohmann::json spec_config_json(const SpecConfig& config);

// auto's model drafter: draft with --draft-model, self with --draft-layers, head with --draft-head
// or when head_found (a head beside the model), else self.
SpecMode auto_model_mode(const SpecConfig& config, bool head_found);

// Self-draft layers the default (draft_layers = 0) picks for a model of n_layer layers.
int32_t default_draft_layers(int32_t n_layer);

}  // namespace microspec
