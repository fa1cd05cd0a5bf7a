#include "bench/runner.h"

#include <algorithm>
#include <fstream>
#include <memory>
#include <optional>
#include <set>

#include "util/error.h"

namespace microspec::bench {

namespace {

using Clock = std::chrono::steady_clock;

const char* const kVocabBases[] = {"full", "freq", "dynamic", "hybrid"};

bool is_vocab_name(const std::string& name) {
  return std::find(std::begin(kVocabBases), std::end(kVocabBases), name) != std::end(kVocabBases);
}

// The drafter a method's base names: "MODE" or "MODE:VOCAB" (a --spec name), none for a bare vocabulary.
std::optional<SpecMode> mode_of_base(const std::string& base) {
  const std::string name = base.substr(0, base.find(':'));
  if (is_vocab_name(name) || name == "ar") return std::nullopt;
  try {
    return parse_spec_mode(name);
  } catch (const Error&) {
    throw Error("unknown benchmark method '" + base +
                "' (methods: ar; full, freq, dynamic, hybrid with the drafter of --spec; a --spec mode such "
                "as ngram or self+ngram, optionally with :VOCAB, e.g. self+ngram:dynamic)");
  }
}

std::string label_of(const std::string& base,
                     const std::vector<std::pair<std::string, std::string>>& settings) {
  std::string label = base;
  for (size_t i = 0; i < settings.size(); ++i)
    label += (i == 0 ? ":" : ",") + settings[i].first + "=" + settings[i].second;
  return label;
}

// Builds a method from its base name and settings over the shared configuration.
MethodSpec make_method(const std::string& base,
                       const std::vector<std::pair<std::string, std::string>>& settings,
                       const SpecConfig& shared) {
  const std::optional<SpecMode> named_mode = mode_of_base(base);
  MethodSpec m;
  m.settings = settings;
  m.info.label = label_of(base, settings);
  m.info.base = base;
  if (base == "ar") {
    if (!settings.empty()) throw Error("method ar takes no settings");
    m.info.description = "plain autoregressive decoding";
    return m;
  }
  m.info.speculative = true;
  m.config = shared;
  if (named_mode) {
    // "MODE" or "MODE:VOCAB": the drafter from the name, the vocabulary from it or from the shared one.
    if (*named_mode == SpecMode::None) throw Error("method " + base + ": spec none is the ar method");
    m.config.mode = *named_mode;
    // The shared --draft-model / --draft-layers belong to the shared drafter, not to this one's.
    if (fallback_mode(m.config.mode) != SpecMode::Draft) m.config.draft_model.clear();
    if (fallback_mode(m.config.mode) != SpecMode::Self) m.config.draft_layers = 0;
    const size_t colon = base.find(':');
    if (colon != std::string::npos) {
      if (*named_mode == SpecMode::Ngram) throw Error("method " + base + ": ngram has no draft vocabulary");
      m.config.draft_vocab = parse_draft_vocab(base.substr(colon + 1));
    }
  } else {
    // A bare vocabulary is a model drafter's: the self-draft unless --spec names another (auto, the
    // default, weighs drafters and is a method of its own).
    if (m.config.mode == SpecMode::None || m.config.mode == SpecMode::Auto) m.config.mode = SpecMode::Self;
    m.config.draft_vocab = parse_draft_vocab(base);
  }
  for (const auto& [key, value] : settings) {
    if (key == "draft-vocab") throw Error(m.info.label + ": the method name sets the draft vocabulary");
    if (key == "spec" && named_mode) throw Error(m.info.label + ": the method name sets the drafter");
    try {
      apply_spec_setting(m.config, key, value);
    } catch (const Error& e) {
      throw Error("method " + m.info.label + ": " + e.what());
    }
  }
  if (m.config.mode == SpecMode::None) throw Error("method " + m.info.label + ": spec=none is the ar method");
  if (m.config.mode != SpecMode::Auto) m.config.step_costs.clear();  // the shared --step-costs is auto's
  try {
    m.config.validate();
  } catch (const Error& e) {
    throw Error("method " + m.info.label + ": " + e.what());
  }
  m.info.config = spec_config_json(m.config);
  return m;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    const size_t end = s.find(sep, start);
    out.push_back(s.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return out;
}

std::pair<std::string, std::string> parse_setting(const std::string& item, const std::string& context) {
  const size_t eq = item.find('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == item.size())
    throw Error(context + ": expected key=value, got '" + item + "'");
  return {item.substr(0, eq), item.substr(eq + 1)};
}

void check_unique(const std::vector<MethodSpec>& methods) {
  std::set<std::string> labels;
  for (const MethodSpec& m : methods)
    if (!labels.insert(m.info.label).second)
      throw Error("benchmark method '" + m.info.label + "' given twice");
}

// Whether the template trims the assistant's text: a reply with spaces around it, rendered.
bool template_trims_answers(const ChatStyle& style, const Tokenizer& tok) {
  const std::string reply = " " + BenchRunner::placeholder(0) + " ";
  const std::vector<ChatMessage> probe = {{"user", "Hi"}, {"assistant", reply}, {"user", "Again"}};
  return render_chat(style, tok, probe, nullptr).find(reply) == std::string::npos;
}

}  // namespace

std::vector<MethodSpec> parse_methods(const std::string& list, const SpecConfig& shared) {
  struct Pending {
    std::string base;
    std::vector<std::pair<std::string, std::string>> settings;
  };
  std::vector<Pending> items;
  for (const std::string& raw : split(list, ',')) {
    if (raw.empty()) throw Error("--methods: empty item in '" + list + "'");
    const size_t colon = raw.find(':');
    if (colon == std::string::npos && raw.find('=') != std::string::npos) {
      if (items.empty() || items.back().settings.empty())
        throw Error("--methods: setting '" + raw +
                    "' follows no method with settings (write method:key=value)");
      items.back().settings.push_back(parse_setting(raw, "--methods"));
      continue;
    }
    Pending p;
    p.base = raw.substr(0, colon);
    if (colon != std::string::npos) {
      // "MODE:VOCAB[:key=value]": a part without "=" after the first colon is the vocabulary.
      std::string rest = raw.substr(colon + 1);
      const size_t next = rest.find(':');
      const std::string part = rest.substr(0, next);
      if (!part.empty() && part.find('=') == std::string::npos) {
        p.base += ":" + part;
        rest = next == std::string::npos ? std::string() : rest.substr(next + 1);
        if (next != std::string::npos && rest.empty())
          throw Error("--methods: expected key=value after '" + p.base + ":'");
      }
      if (!rest.empty() || (next == std::string::npos && part.empty()))
        p.settings.push_back(parse_setting(rest, "--methods"));
    }
    items.push_back(std::move(p));
  }
  std::vector<MethodSpec> methods;
  for (const Pending& p : items) methods.push_back(make_method(p.base, p.settings, shared));
  check_unique(methods);
  return methods;
}

std::vector<MethodSpec> sweep_methods(const std::vector<MethodSpec>& methods, const std::string& key,
                                      const std::vector<std::string>& values) {
  if (key.empty() || values.empty()) throw Error("--sweep: expected key=v1,v2,...");
  bool any = false;
  std::vector<MethodSpec> out;
  for (const MethodSpec& m : methods) {
    if (!m.info.speculative) {
      out.push_back(m);
      continue;
    }
    any = true;
    for (const std::string& v : values) {
      if (v.empty()) throw Error("--sweep " + key + ": empty value");
      MethodSpec s = m;
      s.settings.emplace_back(key, v);
      if (key == "draft-vocab")
        throw Error("--sweep draft-vocab: list the vocabularies in --methods instead");
      try {
        apply_spec_setting(s.config, key, v);
        s.config.validate();
      } catch (const Error& e) {
        throw Error("--sweep " + key + "=" + v + " on " + m.info.label + ": " + e.what());
      }
      s.info.label = label_of(m.info.base, s.settings);
      s.info.study_key = key;
      s.info.study_value = v;
      s.info.config = spec_config_json(s.config);
      out.push_back(std::move(s));
    }
  }
  if (!any) throw Error("--sweep needs a speculative method in --methods");
  check_unique(out);
  return out;
}

std::vector<MethodSpec> ablation_methods(const std::vector<MethodSpec>& methods) {
  struct Row {
    const char* name;
    const char* source;
    const char* async;
  };
  const Row rows[] = {{"ctx only", "ctx", "true"},
                      {"ext only", "ext", "true"},
                      {"both, sync gather", "both", "false"},
                      {"both, async gather", "both", "true"}};
  bool any = false;
  std::vector<MethodSpec> out;
  for (const MethodSpec& m : methods) {
    if (!m.info.speculative) {
      out.push_back(m);
      continue;
    }
    any = true;
    for (const Row& row : rows) {
      MethodSpec s = m;
      s.settings.emplace_back("vocab-source", row.source);
      s.settings.emplace_back("async-gather", row.async);
      apply_spec_setting(s.config, "vocab-source", row.source);
      apply_spec_setting(s.config, "async-gather", row.async);
      s.info.label = label_of(m.info.base, s.settings);
      s.info.study_key = "ablation";
      s.info.study_value = row.name;
      s.info.config = spec_config_json(s.config);
      out.push_back(std::move(s));
    }
  }
  if (!any) throw Error("--ablation needs a speculative method in --methods");
  check_unique(out);
  return out;
}

bool reset_peak_memory() {
  // Writing 5 to clear_refs resets VmHWM to the current resident size (Linux >= 4.0).
  std::ofstream f("/proc/self/clear_refs");
  if (!f) return false;
  f << "5";
  f.flush();
  return static_cast<bool>(f);
}

struct BenchRunner::Method {
  MethodSpec spec;
  std::unique_ptr<Decoder> decoder;  // ar: without a drafter
  double tps_sum = 0.0;              // per-prompt tok/s summed, for the progress line
  int32_t done = 0;
};

BenchRunner::BenchRunner(const GgufFile& file, Model& model, const Tokenizer& tokenizer, int32_t n_ctx,
                         const std::vector<MethodSpec>& methods, ChatStyle chat_style)
    : tokenizer_(tokenizer),
      gen_(model, tokenizer, n_ctx),
      chat_style_(std::move(chat_style)),
      trims_contents_(template_trims_answers(chat_style_, tokenizer)) {
  if (methods.empty()) throw Error("benchmark: no methods");
  check_unique(methods);
  methods_.reserve(methods.size());
  for (const MethodSpec& spec : methods) {
    Method m;
    m.spec = spec;
    try {
      m.decoder = std::make_unique<Decoder>(spec.config, file, gen_, tokenizer);
    } catch (const Error& e) {
      throw Error("method " + spec.info.label + ": " + e.what());
    }
    if (spec.info.speculative)
      m.spec.info.description =
          m.decoder->describe() + ", draft vocabulary " + name_of(spec.config.draft_vocab);
    methods_.push_back(std::move(m));
  }
}

BenchRunner::~BenchRunner() = default;

std::vector<MethodInfo> BenchRunner::methods() const {
  std::vector<MethodInfo> out;
  for (const Method& m : methods_) out.push_back(m.spec.info);
  return out;
}

std::string BenchRunner::placeholder(size_t i) {
  return "\x01MICROSPEC_ANSWER_" + std::to_string(i) + "\x01";
}

std::string BenchRunner::render_with_placeholders(const BenchQuestion& q, size_t turn) const {
  std::vector<ChatMessage> messages;
  for (size_t i = 0; i <= turn; ++i) {
    messages.push_back({"user", q.turns[i]});
    if (i < turn) messages.push_back({"assistant", placeholder(i)});
  }
  return render_chat(chat_style_, tokenizer_, messages, nullptr);
}

std::vector<int32_t> BenchRunner::encode_turn(const BenchQuestion& q, size_t turn,
                                              const std::vector<std::string>& answers) const {
  std::vector<ChatMessage> messages;
  for (size_t i = 0; i <= turn; ++i) {
    messages.push_back({"user", q.turns[i]});
    if (i < turn) messages.push_back({"assistant", answers.at(i)});
  }
  return encode_chat(tokenizer_, chat_style_, messages);
}

PromptRecord BenchRunner::run_one(Method& m, const BenchQuestion& q, int32_t index,
                                  const GenerateParams& params) {
  PromptRecord r;
  r.method = m.spec.info.label;
  r.index = index;
  r.question_id = q.id;
  r.category = q.category;
  std::vector<std::string> answers;
  const bool peak_reset = reset_peak_memory();
  for (size_t t = 0; t < q.turns.size(); ++t) {
    const std::vector<int32_t> prompt = encode_turn(q, t, answers);
    const auto t0 = Clock::now();
    const SpecResult sr = m.decoder->generate(prompt, params);
    const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
    const GenerateResult& g = sr.gen;
    const SpecStats& st = sr.stats;
    r.turns.push_back({g.tokens, g.text, finish_reason_name(g.finish), g.prompt_tokens});
    answers.push_back(g.text);
    r.new_tokens += static_cast<int64_t>(g.tokens.size());
    r.wall_seconds += wall;
    r.prefill_seconds += g.prefill_seconds;
    r.decode_seconds += g.decode_seconds;
    r.decode_tokens += sr.decode_tokens();
    if (m.decoder->speculative()) {
      r.steps += st.steps;
      r.accepted_draft += st.accepted_draft;
      r.drafted += st.drafted;
      r.drafting_steps += st.drafting_steps;
      r.active_vocab_sum += st.active_vocab_sum;
      r.draft_backbone_seconds += st.draft_backbone_seconds();
      r.draft_lm_head_seconds += st.draft_lm_head_seconds;
      r.target_seconds += st.verify_seconds;
      r.target_lm_head_seconds += st.verify_lm_head_seconds;
      r.bookkeeping_seconds += st.bookkeeping_seconds;
    } else {
      r.target_seconds += g.decode_seconds;
      r.target_lm_head_seconds += g.decode_lm_head_seconds;
    }
  }
  r.peak_memory_bytes = peak_reset ? static_cast<int64_t>(peak_memory_bytes()) : 0;
  return r;
}

std::vector<PromptRecord> BenchRunner::run(const std::vector<BenchQuestion>& questions,
                                           const RunOptions& options,
                                           const std::function<void(const Progress&)>& on_progress,
                                           const std::function<void(const PromptRecord&)>& on_record) {
  if (questions.empty()) throw Error("benchmark: no questions");
  if (options.repeats < 1) throw Error("--repeats must be >= 1");
  // Warm-up: one untimed generation per method (pages in the weights, sizes buffers, and reports a
  // method that cannot run, e.g. speculative sampling before it exists, before any timing).
  if (options.warmup_tokens > 0) {
    GenerateParams warm = options.params;
    warm.max_new_tokens = std::min(options.warmup_tokens, options.params.max_new_tokens);
    BenchQuestion first = questions.front();
    first.turns.resize(1);
    for (Method& m : methods_) {
      try {
        run_one(m, first, 0, warm);
      } catch (const Error& e) {
        throw Error("method " + m.spec.info.label + ": " + e.what());
      }
    }
  }
  std::vector<PromptRecord> records;
  const int32_t n = static_cast<int32_t>(questions.size());
  const int32_t total = n * static_cast<int32_t>(methods_.size()) * options.repeats;
  int32_t done = 0;
  const auto start = Clock::now();
  for (int32_t i = 0; i < n; ++i) {
    const BenchQuestion& q = questions[i];
    GenerateParams params = options.params;
    params.sampling.seed = options.params.sampling.seed + static_cast<uint64_t>(i);  // equal for every method
    std::vector<std::vector<PromptRecord>> runs(methods_.size());
    for (int32_t rep = 0; rep < options.repeats; ++rep) {
      for (size_t k = 0; k < methods_.size(); ++k) {
        Method& m = methods_[k];
        try {
          runs[k].push_back(run_one(m, q, i, params));
        } catch (const Error& e) {
          throw Error("method " + m.spec.info.label + ", question " + q.id + ": " + e.what());
        }
        ++done;
        if (rep + 1 == options.repeats) {
          // Keep the run with the median wall time (the lower middle one for an even count).
          std::vector<PromptRecord>& v = runs[k];
          std::sort(v.begin(), v.end(), [](const PromptRecord& a, const PromptRecord& b) {
            return a.wall_seconds < b.wall_seconds;
          });
          PromptRecord kept = std::move(v[(v.size() - 1) / 2]);
          m.tps_sum += kept.tokens_per_second();
          ++m.done;
          if (on_record) on_record(kept);
          records.push_back(std::move(kept));
        }
        if (on_progress) {
          const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
          on_progress({m.spec.info.label, i, n, done, total, m.done ? m.tps_sum / m.done : 0.0, elapsed,
                       elapsed / done * (total - done)});
        }
      }
    }
  }
  return records;
}

}  // namespace microspec::bench
