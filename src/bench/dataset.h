#pragma once
// Benchmark prompts: SpecBench's question.jsonl (question_id, category, turns; MT-bench rows have
// two turns) and HumanEval-style JSONL (task_id, prompt), with a category filter and a limit per
// category.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace microspec::bench {

struct BenchQuestion {
  std::string id;        // question_id or task_id, as text
  std::string category;  // SpecBench category; "humaneval" for HumanEval-style rows
  std::vector<std::string>
      turns;  // user turns; turn i > 0 is asked after the model's own answer to turn i - 1
};

struct DatasetOptions {
  std::vector<std::string> categories;  // keep only these (empty = all); each must occur in the file
  int32_t per_category = 0;             // first N questions of each category (0 = all)
};

// The user turns of one row of a JSONL prompt file, by the rule every reader follows (bench and
// coverage datasets, `generate --prompts-jsonl`): "turns" (a non-empty array of strings; MT-bench
// rows have two) wins over "prompt" (a string: HumanEval and plain rows) when a row has both.
// Empty when the row has neither; throws Error when the field that wins has the wrong type.
std::vector<std::string> row_turns(const nlohmann::json& row);

// Parses JSONL text (source names the file in error messages). Questions keep the file's order.
// Throws Error for malformed lines, missing fields, unknown categories in the filter, or when no
// question is left.
std::vector<BenchQuestion> parse_questions(std::string_view text, const std::string& source,
                                           const DatasetOptions& options);
// Reads and parses a file. Throws Error when it cannot be read.
std::vector<BenchQuestion> load_questions(const std::string& path, const DatasetOptions& options);

// Categories in order of first appearance.
std::vector<std::string> categories_of(const std::vector<BenchQuestion>& questions);

}  // namespace microspec::bench
