#include "bench/dataset.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "util/error.h"

namespace microspec::bench {

namespace {

std::string id_text(const nlohmann::json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_number_integer()) return std::to_string(v.get<int64_t>());
  throw Error("expected a string or integer id");
}

}  // namespace

std::vector<std::string> row_turns(const nlohmann::json& j) {
  std::vector<std::string> turns;
  if (!j.is_object()) return turns;
  if (j.contains("turns")) {
    const nlohmann::json& t = j["turns"];
    if (!t.is_array() || t.empty()) throw Error("\"turns\" must be a non-empty array of strings");
    for (const auto& x : t) {
      if (!x.is_string()) throw Error("\"turns\" must be a non-empty array of strings");
      turns.push_back(x.get<std::string>());
    }
  } else if (j.contains("prompt")) {
    if (!j["prompt"].is_string()) throw Error("\"prompt\" must be a string");
    turns.push_back(j["prompt"].get<std::string>());
  }
  return turns;
}

namespace {

BenchQuestion parse_row(const nlohmann::json& j) {
  if (!j.is_object()) throw Error("expected a JSON object");
  BenchQuestion q;
  if (j.contains("turns")) {  // SpecBench / MT-bench
    if (!j.contains("question_id")) throw Error("SpecBench row without \"question_id\"");
    if (!j.contains("category") || !j["category"].is_string())
      throw Error("SpecBench row without a string \"category\"");
    q.turns = row_turns(j);
    q.id = id_text(j["question_id"]);
    q.category = j["category"].get<std::string>();
  } else if (j.contains("task_id") && j.contains("prompt")) {  // HumanEval
    q.turns = row_turns(j);
    q.id = id_text(j["task_id"]);
    q.category = "humaneval";
  } else {
    throw Error(
        "expected a SpecBench row (question_id, category, turns) or a HumanEval row (task_id, prompt)");
  }
  if (q.category.empty()) throw Error("empty \"category\"");
  for (const std::string& t : q.turns)
    if (t.empty()) throw Error("empty turn text");
  return q;
}

}  // namespace

std::vector<BenchQuestion> parse_questions(std::string_view text, const std::string& source,
                                           const DatasetOptions& options) {
  if (options.per_category < 0) throw Error("--per-category must be >= 0");
  std::vector<BenchQuestion> all;
  std::set<std::string> ids;
  size_t start = 0;
  int line_no = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view line = text.substr(start, end - start);
    start = end + 1;
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    const std::string where = source + ":" + std::to_string(line_no) + ": ";
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded()) throw Error(where + "not valid JSON");
    try {
      all.push_back(parse_row(j));
    } catch (const Error& e) {
      throw Error(where + e.what());
    }
    if (!ids.insert(all.back().id).second)
      throw Error(where + "duplicate question id '" + all.back().id + "'");
  }
  if (all.empty()) throw Error(source + ": no questions in the file");

  const std::vector<std::string> present = categories_of(all);
  for (const std::string& c : options.categories) {
    if (std::find(present.begin(), present.end(), c) == present.end()) {
      std::string list;
      for (const std::string& p : present) list += (list.empty() ? "" : ", ") + p;
      throw Error(source + ": no category '" + c + "' (the file has: " + list + ")");
    }
  }
  std::vector<BenchQuestion> kept;
  std::map<std::string, int32_t> taken;
  for (BenchQuestion& q : all) {
    if (!options.categories.empty() && std::find(options.categories.begin(), options.categories.end(),
                                                 q.category) == options.categories.end())
      continue;
    if (options.per_category > 0 && taken[q.category] >= options.per_category) continue;
    ++taken[q.category];
    kept.push_back(std::move(q));
  }
  return kept;
}

std::vector<BenchQuestion> load_questions(const std::string& path, const DatasetOptions& options) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path + ": cannot open the dataset file");
  std::ostringstream ss;
  ss << in.rdbuf();
  return parse_questions(ss.str(), path, options);
}

std::vector<std::string> categories_of(const std::vector<BenchQuestion>& questions) {
  std::vector<std::string> out;
  for (const BenchQuestion& q : questions)
    if (std::find(out.begin(), out.end(), q.category) == out.end()) out.push_back(q.category);
  return out;
}

}  // namespace microspec::bench
