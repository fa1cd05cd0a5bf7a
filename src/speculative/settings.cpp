#include "speculative/settings.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <type_traits>
#include <utility>

#include "util/error.h"

namespace microspec {

namespace {

// Names of an enum's values, in declaration order: name_of and parse read the same list.
const std::vector<std::string> kModeNames = {"none",       "self",        "draft",      "head", "ngram",
                                             "self+ngram", "draft+ngram", "head+ngram", "auto"};
const std::vector<std::string> kVocabNames = {"full", "freq", "dynamic", "hybrid"};
const std::vector<std::string> kSourceNames = {"both", "ctx", "ext"};

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) out += (i ? ", " : "") + names[i];
  return out;
}

size_t index_of(const std::string& flag, const std::vector<std::string>& names, const std::string& name) {
  const auto it = std::find(names.begin(), names.end(), name);
  if (it == names.end())
    throw Error("--" + flag + " must be one of " + joined(names) + "; got '" + name + "'");
  return size_t(it - names.begin());
}

int64_t parse_integer(const std::string& flag, const std::string& v) {
  size_t used = 0;
  long long x = 0;
  try {
    x = std::stoll(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (v.empty() || used != v.size()) throw Error("--" + flag + ": expected an integer, got '" + v + "'");
  return x;
}

bool parse_switch(const std::string& flag, const std::string& v) {
  if (v == "1" || v == "true" || v == "on" || v == "yes") return true;
  if (v == "0" || v == "false" || v == "off" || v == "no") return false;
  throw Error("--" + flag + ": expected true or false, got '" + v + "'");
}

double parse_number(const std::string& flag, const std::string& v) {
  size_t used = 0;
  double x = 0;
  try {
    x = std::stod(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (v.empty() || used != v.size() || !std::isfinite(x))
    throw Error("--" + flag + ": expected a number, got '" + v + "'");
  return x;
}

// A range bound or value as the user wrote it: integers without a fraction ("3072", "0.05").
std::string number_text(double x) {
  if (x == std::floor(x) && std::fabs(x) < 1e15) return std::to_string(int64_t(x));
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

void check_range(const std::string& flag, double x, double lo, double hi) {
  if (x < lo || x > hi)
    throw Error("--" + flag + " must be in [" + number_text(lo) + ", " + number_text(hi) + "], got " + number_text(x));
}

SpecSetting row(const char* flag, SpecSetting::Kind kind, const char* help) {
  SpecSetting s;
  s.flag = flag;
  s.kind = kind;
  s.help = help;
  return s;
}

// Row builders. `field` is a generic lambda returning a reference to the member, so one accessor
// serves both the const getter and the setter.

// A number in [lo, hi]: an integer setting for an integer member, a real one for a double member.
template <class Field>
SpecSetting ranged(const char* flag, Field field, double lo, double hi, const char* help) {
  using Member = std::remove_reference_t<decltype(field(std::declval<SpecConfig&>()))>;
  constexpr bool integral = std::is_integral_v<Member>;
  SpecSetting s = row(flag, integral ? SpecSetting::Kind::Integer : SpecSetting::Kind::Number, help);
  s.min = lo;
  s.max = hi;
  s.get = [field](const SpecConfig& c) { return nlohmann::json(field(const_cast<SpecConfig&>(c))); };
  s.set = [field, flag, lo, hi](SpecConfig& c, const std::string& v) {
    const double x = integral ? double(parse_integer(flag, v)) : parse_number(flag, v);
    check_range(flag, x, lo, hi);
    field(c) = static_cast<Member>(x);
  };
  return s;
}

template <class Field>
SpecSetting text(const char* flag, Field field, const char* help) {
  SpecSetting s = row(flag, SpecSetting::Kind::Text, help);
  s.get = [field](const SpecConfig& c) { return nlohmann::json(field(const_cast<SpecConfig&>(c))); };
  s.set = [field](SpecConfig& c, const std::string& v) { field(c) = v; };
  return s;
}

template <class Field>
SpecSetting on_off(const char* flag, Field field, const char* help) {
  SpecSetting s = row(flag, SpecSetting::Kind::Switch, help);
  s.get = [field](const SpecConfig& c) { return nlohmann::json(field(const_cast<SpecConfig&>(c))); };
  s.set = [field, flag](SpecConfig& c, const std::string& v) { field(c) = parse_switch(flag, v); };
  return s;
}

template <class Enum, class Field>
SpecSetting choice(const char* flag, Field field, const std::vector<std::string>& names, const char* help) {
  SpecSetting s = row(flag, SpecSetting::Kind::Choice, help);
  s.choices = names;
  s.get = [field, &names](const SpecConfig& c) {
    return nlohmann::json(names[size_t(field(const_cast<SpecConfig&>(c)))]);
  };
  s.set = [field, flag, &names](SpecConfig& c, const std::string& v) {
    field(c) = static_cast<Enum>(index_of(flag, names, v));
  };
  return s;
}

std::vector<SpecSetting> make_table() {
  using C = SpecConfig;
  constexpr int64_t kBig = int64_t(1) << 30;
  std::vector<SpecSetting> t;
  t.push_back(choice<SpecMode>(
      "spec", [](C & c) -> auto& { return c.mode; }, kModeNames,
      "speculative decoding: auto (each step picks an n-gram chain, the model drafter or a plain step by "
      "expected tokens per second), none, self (the target's first layers), draft (--draft-model), head (an "
      "EAGLE-3 head, --draft-head), ngram (prompt lookup, no weights), self+ngram, draft+ngram or head+ngram "
      "(an n-gram match drafts, else self/draft/head)"));
  t.push_back(ranged(
      "draft-layers", [](C & c) -> auto& { return c.draft_layers; }, 0, 4096,
      "--spec self: target layers the draft runs (0 = all but the last eighth)"));
  t.push_back(text(
      "draft-model", [](C & c) -> auto& { return c.draft_model; },
      "--spec draft: GGUF draft model with the same vocabulary"));
  t.push_back(text(
      "draft-head", [](C & c) -> auto& { return c.draft_head; },
      "--spec head: EAGLE-3 head GGUF (llama.cpp's eagle3 layout; default: heads/<model stem>.eagle3.gguf "
      "beside the model)"));
  t.push_back(ranged(
      "tree-depth", [](C & c) -> auto& { return c.tree.depth; }, 0, 64,
      "draft tree expansion rounds after the root level"));
  t.push_back(ranged(
      "tree-topk", [](C & c) -> auto& { return c.tree.top_k; }, 1, 64, "draft tree branching (1 = chain)"));
  t.push_back(ranged(
      "tree-tokens", [](C & c) -> auto& { return c.tree.total_tokens; }, 0, 1024,
      "draft tree nodes verified per step"));
  t.push_back(ranged(
      "draft-p-min", [](C & c) -> auto& { return c.tree.p_min; }, 0.0, 1.0,
      "self/draft/head: a draft token whose path probability (the draft's probabilities from the "
      "root multiplied) is below this probability in [0, 1] is not drafted (greedy) or not expanded "
      "(sampling); 0 = off"));
  t.push_back(choice<DraftVocabKind>(
      "draft-vocab", [](C & c) -> auto& { return c.draft_vocab; }, kVocabNames,
      "draft vocabulary: full, freq, dynamic or hybrid"));
  t.push_back(text(
      "freq-file", [](C & c) -> auto& { return c.freq_file; },
      "freq/hybrid: token ranking written by `microspec vocab-freq` (default: MODEL with .freq.bin "
      "for .gguf)"));
  t.push_back(ranged(
      "freq-top", [](C & c) -> auto& { return c.freq_top; }, 1, kBig, "freq: the K most frequent tokens"));
  t.push_back(ranged(
      "hybrid-top", [](C & c) -> auto& { return c.hybrid_top; }, 0, kBig,
      "hybrid: most frequent tokens always kept"));
  t.push_back(ranged(
      "vocab-window", [](C & c) -> auto& { return c.vocab_window; }, 1, kBig,
      "dynamic/hybrid: W_max, candidate-stream entries kept"));
  t.push_back(ranged(
      "vocab-kpre", [](C & c) -> auto& { return c.vocab_kpre; }, 0, 1024,
      "dynamic/hybrid: target top-k per prompt position (K_pre; --spec auto skips the prompt pass)"));
  t.push_back(ranged(
      "vocab-kver", [](C & c) -> auto& { return c.vocab_kver; }, 0, 1024,
      "dynamic/hybrid: target top-k per verification"));
  t.push_back(choice<VocabSource>(
      "vocab-source", [](C & c) -> auto& { return c.vocab_source; }, kSourceNames,
      "dynamic/hybrid ablation: ctx, ext or both"));
  t.push_back(on_off(
      "async-gather", [](C & c) -> auto& { return c.async_gather; },
      "gather new draft LM-head rows on a helper thread (--no-async-gather: on the calling "
      "thread)"));
  t.push_back(ranged(
      "ngram-min", [](C & c) -> auto& { return c.ngram_min; }, 1, 64,
      "ngram, X+ngram: shortest suffix match of the context that is looked up (ngram: that drafts)"));
  t.push_back(ranged(
      "ngram-max", [](C & c) -> auto& { return c.ngram_max; }, 1, 64,
      "ngram, X+ngram: longest suffix match of the context tried"));
  t.push_back(ranged(
      "ngram-first", [](C & c) -> auto& { return c.ngram_first; }, 1, 64,
      "X+ngram: a match of at least this many tokens drafts instead of X (in [ngram-min, ngram-max])"));
  t.push_back(ranged(
      "ngram-min-accept", [](C & c) -> auto& { return c.ngram_min_accept; }, 0, 100,
      "ngram, X+ngram: a chain stops before the token whose estimated chance of being accepted with "
      "all before it (counted in this generation per match length) is below this percent; 0 = the "
      "whole continuation"));
  t.push_back(text(
      "step-costs", [](C & c) -> auto& { return c.step_costs; },
      "auto: JSON file of the target's forward seconds per row count to read (measured and written "
      "first if missing; default: the cache directory, see docs/speculative.md)"));
  return t;
}

}  // namespace

const char* name_of(SpecMode mode) {
  return kModeNames[size_t(mode)].c_str();
}
const char* name_of(DraftVocabKind kind) {
  return kVocabNames[size_t(kind)].c_str();
}
const char* name_of(VocabSource source) {
  return kSourceNames[size_t(source)].c_str();
}

SpecMode parse_spec_mode(const std::string& name) {
  return SpecMode(index_of("spec", kModeNames, name));
}
DraftVocabKind parse_draft_vocab(const std::string& name) {
  return DraftVocabKind(index_of("draft-vocab", kVocabNames, name));
}
VocabSource parse_vocab_source(const std::string& name) {
  return VocabSource(index_of("vocab-source", kSourceNames, name));
}

bool is_spec_mode_name(const std::string& name) {
  return std::find(kModeNames.begin(), kModeNames.end(), name) != kModeNames.end();
}

std::string spec_mode_names() {
  std::string out;
  for (size_t i = 0; i < kModeNames.size(); ++i) out += (i ? ", '" : "'") + kModeNames[i] + "'";
  return out;
}

bool uses_ngram(SpecMode mode) {
  return mode == SpecMode::Ngram || mode == SpecMode::Auto || mode == SpecMode::SelfNgram || mode == SpecMode::DraftNgram ||
         mode == SpecMode::HeadNgram;
}

SpecMode fallback_mode(SpecMode mode) {
  switch (mode) {
    case SpecMode::Ngram: return SpecMode::None;
    case SpecMode::SelfNgram: return SpecMode::Self;
    case SpecMode::DraftNgram: return SpecMode::Draft;
    case SpecMode::HeadNgram: return SpecMode::Head;
    default: return mode;
  }
}

SpecMode auto_model_mode(const SpecConfig& config, bool head_found) {
  if (!config.draft_model.empty()) return SpecMode::Draft;
  if (config.draft_layers != 0) return SpecMode::Self;
  return !config.draft_head.empty() || head_found ? SpecMode::Head : SpecMode::Self;
}

std::string SpecSetting::default_text() const {
  const nlohmann::json v = get(SpecConfig{});
  return v.is_string() ? v.get<std::string>() : v.dump();
}

const std::vector<SpecSetting>& spec_settings() {
  static const std::vector<SpecSetting> table = make_table();
  return table;
}

const SpecSetting& spec_setting(const std::string& flag) {
  std::vector<std::string> flags;
  for (const SpecSetting& s : spec_settings()) {
    if (flag == s.flag) return s;
    flags.push_back(s.flag);
  }
  throw Error("unknown speculative setting '" + flag + "' (settings: " + joined(flags) + ")");
}

void apply_spec_setting(SpecConfig& config, const std::string& flag, const std::string& value) {
  spec_setting(flag).set(config, value);
}

nlohmann::json spec_config_json(const SpecConfig& config) {
  nlohmann::json j = nlohmann::json::object();
  for (const SpecSetting& s : spec_settings()) j[s.flag] = s.get(config);
  return j;
}

void SpecConfig::validate() const {
  for (const SpecSetting& s : spec_settings())
    if (s.kind == SpecSetting::Kind::Integer || s.kind == SpecSetting::Kind::Number)
      check_range(s.flag, s.get(*this).get<double>(), s.min, s.max);
  // An X+ngram mode takes X's settings; auto takes one model drafter's.
  if (mode == SpecMode::Auto) {
    if (int(!draft_model.empty()) + int(draft_layers != 0) + int(!draft_head.empty()) > 1)
      throw Error("--spec auto takes one model drafter: --draft-model, --draft-layers or --draft-head");
    if (ngram_min > ngram_max)
      throw Error("--ngram-min " + std::to_string(ngram_min) + " must not exceed --ngram-max " +
                  std::to_string(ngram_max));
    tree.validate();
    return;
  }
  if (!step_costs.empty()) throw Error("--step-costs applies to --spec auto");
  const SpecMode model_mode = fallback_mode(mode);
  const std::string spec = std::string("--spec ") + name_of(mode);
  if (mode == SpecMode::None && (!draft_model.empty() || draft_layers != 0 || !draft_head.empty()))
    throw Error("--draft-model/--draft-layers/--draft-head need --spec");
  if (mode == SpecMode::Ngram && (!draft_model.empty() || draft_layers != 0 || !draft_head.empty()))
    throw Error("--draft-model/--draft-layers/--draft-head do not apply to --spec ngram (it has no model)");
  if (model_mode != SpecMode::Head && !draft_head.empty())
    throw Error("--draft-head applies to --spec head or head+ngram");
  if (model_mode == SpecMode::Head && (!draft_model.empty() || draft_layers != 0))
    throw Error("--draft-model/--draft-layers do not apply to " + spec);
  if (model_mode == SpecMode::Self && !draft_model.empty())
    throw Error("--draft-model applies to --spec draft or draft+ngram");
  if (model_mode == SpecMode::Draft && draft_model.empty()) throw Error(spec + " needs --draft-model FILE");
  if (model_mode == SpecMode::Draft && draft_layers != 0)
    throw Error("--draft-layers applies to --spec self or self+ngram");
  if (uses_ngram(mode) && ngram_min > ngram_max)
    throw Error("--ngram-min " + std::to_string(ngram_min) + " must not exceed --ngram-max " +
                std::to_string(ngram_max));
  if (uses_ngram(mode) && mode != SpecMode::Ngram && (ngram_first < ngram_min || ngram_first > ngram_max))
    throw Error("--ngram-first must be in [ngram-min, ngram-max] = [" + std::to_string(ngram_min) + ", " +
                std::to_string(ngram_max) + "], got " + std::to_string(ngram_first));
  tree.validate();
}

int32_t default_draft_layers(int32_t n_layer) {
  // Measured: half the layers almost never agrees with the target (acceptance ~1.0 on Gemma 3 270M
  // and SmolLM2 135M); dropping only the last eighth accepts 1.8 (SmolLM2) to 4.3 (Gemma) tokens
  // per step with a chain of 4.
  return std::max(1, n_layer - std::max(1, n_layer / 8));
}

}  // namespace microspec
