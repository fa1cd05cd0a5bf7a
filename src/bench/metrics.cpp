#include "bench/metrics.h"

#include <algorithm>
#include <cstdio>
#include <set>

#include "util/error.h"

namespace microspec::bench {

namespace {

const PromptRecord* find_record(const std::vector<PromptRecord>& records, const std::string& method,
                                int32_t index) {
  for (const PromptRecord& r : records)
    if (r.method == method && r.index == index) return &r;
  return nullptr;
}

// First index where a and b differ, or -1 when they are identical.
int32_t first_difference(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  const size_t n = std::min(a.size(), b.size());
  for (size_t i = 0; i < n; ++i)
    if (a[i] != b[i]) return static_cast<int32_t>(i);
  return a.size() == b.size() ? -1 : static_cast<int32_t>(n);
}

// Accumulates one method's records of one group (a category or all prompts).
GroupStats aggregate(const std::vector<const PromptRecord*>& rs) {
  GroupStats g;
  double tps_sum = 0.0;
  int64_t decode_tokens = 0, accepted = 0, drafting_steps = 0, vocab_sum = 0;
  for (const PromptRecord* r : rs) {
    ++g.prompts;
    g.new_tokens += r->new_tokens;
    g.wall_seconds += r->wall_seconds;
    tps_sum += r->tokens_per_second();
    decode_tokens += r->decode_tokens;
    g.prefill_seconds += r->prefill_seconds;
    g.decode_seconds += r->decode_seconds;
    g.draft_backbone_seconds += r->draft_backbone_seconds;
    g.draft_lm_head_seconds += r->draft_lm_head_seconds;
    g.target_seconds += r->target_seconds;
    g.target_lm_head_seconds += r->target_lm_head_seconds;
    g.bookkeeping_seconds += r->bookkeeping_seconds;
    g.steps += r->steps;
    accepted += r->accepted_draft;
    drafting_steps += r->drafting_steps;
    vocab_sum += r->active_vocab_sum;
  }
  if (g.prompts) g.tokens_per_second = tps_sum / g.prompts;
  if (g.decode_seconds > 0) g.decode_tokens_per_second = decode_tokens / g.decode_seconds;
  if (g.steps) g.mean_acceptance_length = double(accepted + g.steps) / g.steps;
  if (drafting_steps) g.mean_active_vocab = double(vocab_sum) / drafting_steps;
  return g;
}

// The reference method's aggregate over exactly the questions in rs.
GroupStats reference_on(const std::vector<PromptRecord>& records, const std::string& reference,
                        const std::vector<const PromptRecord*>& rs, bool* complete) {
  std::vector<const PromptRecord*> ref;
  *complete = true;
  for (const PromptRecord* r : rs) {
    const PromptRecord* x = find_record(records, reference, r->index);
    if (x)
      ref.push_back(x);
    else
      *complete = false;
  }
  return aggregate(ref);
}

void set_speedups(GroupStats& g, const GroupStats& ref, bool complete) {
  if (!complete) return;
  if (ref.tokens_per_second > 0) g.speedup = g.tokens_per_second / ref.tokens_per_second;
  if (ref.decode_tokens_per_second > 0)
    g.decode_speedup = g.decode_tokens_per_second / ref.decode_tokens_per_second;
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

// Milliseconds per generated token.
std::string ms_per_token(double seconds, int64_t tokens) {
  return tokens > 0 ? fmt("%.2f", 1000.0 * seconds / tokens) : "-";
}

}  // namespace

std::vector<Mismatch> compare_outputs(const std::vector<PromptRecord>& records,
                                      const std::string& reference) {
  std::vector<Mismatch> out;
  for (const PromptRecord& r : records) {
    if (r.method == reference) continue;
    const PromptRecord* ref = find_record(records, reference, r.index);
    if (!ref) continue;
    const size_t turns = std::max(r.turns.size(), ref->turns.size());
    for (size_t t = 0; t < turns; ++t) {
      static const std::vector<int32_t> none;
      const std::vector<int32_t>& a = t < ref->turns.size() ? ref->turns[t].tokens : none;
      const std::vector<int32_t>& b = t < r.turns.size() ? r.turns[t].tokens : none;
      const bool missing_turn = t >= ref->turns.size() || t >= r.turns.size();
      const int32_t at = missing_turn ? 0 : first_difference(a, b);
      if (at < 0) continue;
      out.push_back({r.method, r.question_id, static_cast<int32_t>(t), at, static_cast<int32_t>(a.size()),
                     static_cast<int32_t>(b.size())});
      break;  // later turns depend on this one's answer
    }
  }
  return out;
}

Agreement agreement_with(const std::vector<PromptRecord>& records, const std::string& method,
                         const std::string& reference) {
  Agreement a;
  for (const PromptRecord& r : records) {
    if (r.method != method) continue;
    const PromptRecord* ref = find_record(records, reference, r.index);
    if (!ref) continue;
    ++a.compared;
    bool same = r.turns.size() == ref->turns.size();
    for (size_t t = 0; t < ref->turns.size(); ++t) {
      const std::vector<int32_t>& x = ref->turns[t].tokens;
      a.reference_tokens += static_cast<int64_t>(x.size());
      if (t >= r.turns.size()) {
        same = false;
        continue;
      }
      const int32_t d = first_difference(x, r.turns[t].tokens);
      a.agreeing_prefix_tokens += d < 0 ? static_cast<int64_t>(x.size()) : d;
      if (d >= 0) same = false;
    }
    if (same) ++a.identical;
  }
  return a;
}

Summary summarize(const std::vector<MethodInfo>& methods, const std::vector<PromptRecord>& records,
                  const std::vector<std::string>& categories, const std::string& reference) {
  Summary s;
  s.reference = reference;
  s.categories = categories;
  for (const PromptRecord& r : records)
    if (std::find(s.categories.begin(), s.categories.end(), r.category) == s.categories.end())
      s.categories.push_back(r.category);
  std::set<std::string> labels;
  for (const MethodInfo& m : methods)
    if (!labels.insert(m.label).second) throw Error("benchmark: duplicate method '" + m.label + "'");
  for (const PromptRecord& r : records)
    if (!labels.count(r.method)) throw Error("benchmark: record of unknown method '" + r.method + "'");

  for (const MethodInfo& m : methods) {
    MethodSummary ms;
    ms.info = m;
    std::vector<const PromptRecord*> mine;
    for (const PromptRecord& r : records)
      if (r.method == m.label) {
        mine.push_back(&r);
        ms.peak_memory_bytes = std::max(ms.peak_memory_bytes, r.peak_memory_bytes);
      }
    bool complete = false;
    ms.overall = aggregate(mine);
    const GroupStats ref_all = reference_on(records, reference, mine, &complete);
    set_speedups(ms.overall, ref_all, complete);
    for (const std::string& c : s.categories) {
      std::vector<const PromptRecord*> in;
      for (const PromptRecord* r : mine)
        if (r->category == c) in.push_back(r);
      if (in.empty()) continue;
      GroupStats g = aggregate(in);
      const GroupStats ref = reference_on(records, reference, in, &complete);
      set_speedups(g, ref, complete);
      ms.by_category[c] = g;
    }
    if (m.label != reference) ms.agreement = agreement_with(records, m.label, reference);
    s.methods.push_back(std::move(ms));
  }
  s.mismatches = compare_outputs(records, reference);
  return s;
}

std::vector<Mismatch> failing_mismatches(const Summary& summary, bool greedy) {
  std::vector<Mismatch> out;
  if (!greedy) return out;
  for (const Mismatch& x : summary.mismatches) {
    bool peer = false;
    for (const MethodSummary& m : summary.methods)
      if (m.info.label == x.method) peer = m.info.peer;
    if (!peer) out.push_back(x);
  }
  return out;
}

nlohmann::json to_json(const PromptRecord& r) {
  nlohmann::json turns = nlohmann::json::array();
  for (const TurnOutput& t : r.turns)
    turns.push_back(
        {{"tokens", t.tokens}, {"text", t.text}, {"finish", t.finish}, {"prompt_tokens", t.prompt_tokens}});
  return {{"method", r.method},
          {"index", r.index},
          {"question_id", r.question_id},
          {"category", r.category},
          {"turns", turns},
          {"new_tokens", r.new_tokens},
          {"wall_seconds", r.wall_seconds},
          {"tokens_per_second", r.tokens_per_second()},
          {"prefill_seconds", r.prefill_seconds},
          {"decode_seconds", r.decode_seconds},
          {"decode_tokens", r.decode_tokens},
          {"steps", r.steps},
          {"accepted_draft", r.accepted_draft},
          {"drafted", r.drafted},
          {"drafting_steps", r.drafting_steps},
          {"active_vocab_sum", r.active_vocab_sum},
          {"mean_acceptance_length", r.steps ? double(r.accepted_draft + r.steps) / r.steps : 0.0},
          {"draft_backbone_seconds", r.draft_backbone_seconds},
          {"draft_lm_head_seconds", r.draft_lm_head_seconds},
          {"target_seconds", r.target_seconds},
          {"target_lm_head_seconds", r.target_lm_head_seconds},
          {"bookkeeping_seconds", r.bookkeeping_seconds},
          {"peak_memory_bytes", r.peak_memory_bytes}};
}

PromptRecord record_from_json(const nlohmann::json& j) {
  auto need = [&](const char* key) -> const nlohmann::json& {
    if (!j.is_object() || !j.contains(key))
      throw Error(std::string("benchmark record without \"") + key + "\"");
    return j[key];
  };
  PromptRecord r;
  try {
    r.method = need("method").get<std::string>();
    r.index = need("index").get<int32_t>();
    r.question_id = need("question_id").get<std::string>();
    r.category = need("category").get<std::string>();
    for (const auto& t : need("turns")) {
      TurnOutput o;
      o.tokens = t.at("tokens").get<std::vector<int32_t>>();
      o.text = t.value("text", "");
      o.finish = t.value("finish", "");
      o.prompt_tokens = t.value("prompt_tokens", 0);
      r.turns.push_back(std::move(o));
    }
    r.new_tokens = need("new_tokens").get<int64_t>();
    r.wall_seconds = need("wall_seconds").get<double>();
    r.prefill_seconds = j.value("prefill_seconds", 0.0);
    r.decode_seconds = j.value("decode_seconds", 0.0);
    r.decode_tokens = j.value("decode_tokens", int64_t(0));
    r.steps = j.value("steps", int64_t(0));
    r.accepted_draft = j.value("accepted_draft", int64_t(0));
    r.drafted = j.value("drafted", int64_t(0));
    r.drafting_steps = j.value("drafting_steps", int64_t(0));
    r.active_vocab_sum = j.value("active_vocab_sum", int64_t(0));
    r.draft_backbone_seconds = j.value("draft_backbone_seconds", 0.0);
    r.draft_lm_head_seconds = j.value("draft_lm_head_seconds", 0.0);
    r.target_seconds = j.value("target_seconds", 0.0);
    r.target_lm_head_seconds = j.value("target_lm_head_seconds", 0.0);
    r.bookkeeping_seconds = j.value("bookkeeping_seconds", 0.0);
    r.peak_memory_bytes = j.value("peak_memory_bytes", int64_t(0));
  } catch (const nlohmann::json::exception& e) {
    throw Error(std::string("benchmark record: ") + e.what());
  }
  if (r.wall_seconds < 0 || r.new_tokens < 0) throw Error("benchmark record: negative time or token count");
  return r;
}

nlohmann::json to_json(const MethodInfo& m) {
  return {{"label", m.label},
          {"base", m.base},
          {"description", m.description},
          {"speculative", m.speculative},
          {"peer", m.peer},
          {"study_key", m.study_key},
          {"study_value", m.study_value},
          {"config", m.config}};
}

nlohmann::json to_json(const GroupStats& g) {
  return {{"prompts", g.prompts},
          {"new_tokens", g.new_tokens},
          {"wall_seconds", g.wall_seconds},
          {"tokens_per_second", g.tokens_per_second},
          {"speedup", g.speedup},
          {"decode_tokens_per_second", g.decode_tokens_per_second},
          {"decode_speedup", g.decode_speedup},
          {"mean_acceptance_length", g.mean_acceptance_length},
          {"mean_active_vocab", g.mean_active_vocab},
          {"prefill_seconds", g.prefill_seconds},
          {"decode_seconds", g.decode_seconds},
          {"draft_backbone_seconds", g.draft_backbone_seconds},
          {"draft_lm_head_seconds", g.draft_lm_head_seconds},
          {"target_seconds", g.target_seconds},
          {"target_lm_head_seconds", g.target_lm_head_seconds},
          {"bookkeeping_seconds", g.bookkeeping_seconds},
          {"steps", g.steps}};
}

nlohmann::json to_json(const Summary& s) {
  nlohmann::json methods = nlohmann::json::array();
  for (const MethodSummary& m : s.methods) {
    nlohmann::json cats = nlohmann::json::object();
    for (const auto& [c, g] : m.by_category) cats[c] = to_json(g);
    nlohmann::json j = {{"info", to_json(m.info)},
                        {"overall", to_json(m.overall)},
                        {"by_category", cats},
                        {"peak_memory_bytes", m.peak_memory_bytes}};
    if (m.info.label != s.reference)
      j["agreement"] = {{"compared", m.agreement.compared},
                        {"identical", m.agreement.identical},
                        {"reference_tokens", m.agreement.reference_tokens},
                        {"agreeing_prefix_tokens", m.agreement.agreeing_prefix_tokens}};
    methods.push_back(j);
  }
  nlohmann::json mism = nlohmann::json::array();
  for (const Mismatch& x : s.mismatches)
    mism.push_back({{"method", x.method},
                    {"question_id", x.question_id},
                    {"turn", x.turn},
                    {"position", x.position},
                    {"reference_length", x.reference_length},
                    {"length", x.length}});
  return {
      {"reference", s.reference}, {"categories", s.categories}, {"methods", methods}, {"mismatches", mism}};
}

std::string summary_markdown(const Summary& s, bool greedy) {
  std::string md;
  auto row = [&](const std::vector<std::string>& cells) {
    md += "|";
    for (const std::string& c : cells) md += " " + c + " |";
    md += "\n";
  };
  auto rule = [&](size_t n) {
    md += "|";
    for (size_t i = 0; i < n; ++i) md += "---|";
    md += "\n";
  };
  auto speedup = [](double x) { return x > 0 ? fmt("%.2fx", x) : std::string("-"); };
  auto agreement = [&](const MethodSummary& m) -> std::string {
    if (m.info.label == s.reference) return "reference";
    const Agreement& a = m.agreement;
    if (a.compared == 0) return "-";
    std::string out = std::to_string(a.identical) + "/" + std::to_string(a.compared) + " identical";
    if (a.identical != a.compared && a.reference_tokens > 0)
      out += fmt(" (%.0f%% of tokens before the first difference)",
                 100.0 * a.agreeing_prefix_tokens / a.reference_tokens);
    return out;
  };

  md += "### Overall\n\n";
  const std::vector<std::string> head = {"method",
                                         "prompts",
                                         "new tokens",
                                         "tok/s",
                                         "speedup",
                                         "decode tok/s",
                                         "decode speedup",
                                         "accept length",
                                         "draft vocab",
                                         "peak MiB",
                                         "outputs vs " + s.reference};
  row(head);
  rule(head.size());
  for (const MethodSummary& m : s.methods) {
    const GroupStats& g = m.overall;
    row({m.info.label, std::to_string(g.prompts), std::to_string(g.new_tokens),
         fmt("%.1f", g.tokens_per_second), speedup(g.speedup), fmt("%.1f", g.decode_tokens_per_second),
         speedup(g.decode_speedup), g.steps ? fmt("%.2f", g.mean_acceptance_length) : "-",
         g.mean_active_vocab > 0 ? fmt("%.0f", g.mean_active_vocab) : "-",
         m.peak_memory_bytes > 0 ? fmt("%.0f", m.peak_memory_bytes / (1024.0 * 1024.0)) : "-", agreement(m)});
  }

  md += "\n### Where the time goes (ms per generated token)\n\n";
  const std::vector<std::string> thead = {"method",           "total",         "prefill",
                                          "draft backbone",   "draft LM head", "target forward",
                                          "of which LM head", "bookkeeping",   "other"};
  row(thead);
  rule(thead.size());
  for (const MethodSummary& m : s.methods) {
    const GroupStats& g = m.overall;
    const double other = g.wall_seconds - g.prefill_seconds - g.draft_backbone_seconds -
                         g.draft_lm_head_seconds - g.target_seconds - g.bookkeeping_seconds;
    const bool split = !m.info.peer;
    row({m.info.label, ms_per_token(g.wall_seconds, g.new_tokens),
         ms_per_token(g.prefill_seconds, g.new_tokens),
         m.info.speculative ? ms_per_token(g.draft_backbone_seconds, g.new_tokens) : "-",
         m.info.speculative ? ms_per_token(g.draft_lm_head_seconds, g.new_tokens) : "-",
         split ? ms_per_token(g.target_seconds, g.new_tokens) : "-",
         split ? ms_per_token(g.target_lm_head_seconds, g.new_tokens) : "-",
         m.info.speculative ? ms_per_token(g.bookkeeping_seconds, g.new_tokens) : "-",
         split ? ms_per_token(std::max(0.0, other), g.new_tokens) : "-"});
  }

  md += "\n### Speedup over " + s.reference + " per category (mean acceptance length)\n\n";
  std::vector<std::string> chead = {"category", "prompts"};
  for (const MethodSummary& m : s.methods)
    if (m.info.label != s.reference) chead.push_back(m.info.label);
  row(chead);
  rule(chead.size());
  for (const std::string& c : s.categories) {
    std::vector<std::string> cells = {c, "-"};
    for (const MethodSummary& m : s.methods) {
      auto it = m.by_category.find(c);
      if (m.info.label == s.reference) {
        if (it != m.by_category.end()) cells[1] = std::to_string(it->second.prompts);
        continue;
      }
      if (it == m.by_category.end()) {
        cells.push_back("-");
        continue;
      }
      std::string cell = speedup(it->second.speedup);
      if (it->second.steps) cell += fmt(" (%.2f)", it->second.mean_acceptance_length);
      cells.push_back(cell);
    }
    row(cells);
  }

  bool study = false;
  for (const MethodSummary& m : s.methods) study = study || !m.info.study_key.empty();
  if (study) {
    md += "\n### Study\n\n";
    const std::vector<std::string> shead = {"setting", "value",         "method",      "tok/s",
                                            "speedup", "accept length", "draft vocab", "draft ms/token"};
    row(shead);
    rule(shead.size());
    for (const MethodSummary& m : s.methods) {
      if (m.info.study_key.empty()) continue;
      const GroupStats& g = m.overall;
      row({m.info.study_key, m.info.study_value, m.info.label, fmt("%.1f", g.tokens_per_second),
           speedup(g.speedup), g.steps ? fmt("%.2f", g.mean_acceptance_length) : "-",
           g.mean_active_vocab > 0 ? fmt("%.0f", g.mean_active_vocab) : "-",
           ms_per_token(g.draft_backbone_seconds + g.draft_lm_head_seconds, g.new_tokens)});
    }
  }

  const std::vector<Mismatch> failing = failing_mismatches(s, greedy);
  md += "\n### Outputs\n\n";
  if (s.mismatches.empty()) {
    md += "Every method's output tokens equal " + s.reference + "'s on every prompt.\n";
  } else {
    if (!failing.empty())
      md += "**FAILURE: " + std::to_string(failing.size()) + " prompt(s) differ from " + s.reference +
            " under greedy decoding.**\n\n";
    else if (!greedy)
      md += "Sampling run: outputs are not expected to equal " + s.reference + "'s.\n\n";
    else
      md += "Only peers differ from " + s.reference + " (a different engine rounds differently).\n\n";
    row({"method", "question", "turn", "first difference at token", s.reference + " tokens", "tokens"});
    rule(6);
    for (const Mismatch& x : s.mismatches)
      row({x.method, x.question_id, std::to_string(x.turn + 1), std::to_string(x.position),
           std::to_string(x.reference_length), std::to_string(x.length)});
  }
  return md;
}

}  // namespace microspec::bench
