// `microspec dump-tensor`: dequantize rows of one tensor of a GGUF file (scalar reference kernels)
// and write them as raw little-endian f32, to check our dequantization against other readers.
// Prints a JSON summary (type, shape, rows written) on stdout.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/common.h"
#include "gguf/gguf.h"
#include "kernels/kernels.h"
#include "model/model_file.h"
#include "util/error.h"

namespace microspec::cli {

namespace {

struct DumpArgs {
  std::string model;
  std::string tensor;
  std::string rows;  // "A:B" (half-open), "A:", ":B" or empty for all
  std::string output;
};

int64_t parse_row(const std::string& s, int64_t fallback) {
  if (s.empty()) return fallback;
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != s.size() || v < 0) throw Error("--rows: '" + s + "' is not a row number");
  return v;
}

void run_dump(const DumpArgs& a) {
  const auto file = open_model_file(a.model);
  const GgufTensor* t = file->find_tensor(a.tensor);
  if (!t) throw Error(a.model + ": no tensor named '" + a.tensor + "'");
  const int64_t cols = t->ne.empty() ? 1 : t->ne[0];
  const int64_t rows = t->rows();
  int64_t begin = 0, end = rows;
  if (!a.rows.empty()) {
    const size_t colon = a.rows.find(':');
    if (colon == std::string::npos) throw Error("--rows: expected A:B, got '" + a.rows + "'");
    begin = parse_row(a.rows.substr(0, colon), 0);
    end = parse_row(a.rows.substr(colon + 1), rows);
  }
  if (begin >= end || end > rows)
    throw Error("--rows " + a.rows + ": not a non-empty range within the " + std::to_string(rows) +
                " rows of " + a.tensor);
  const size_t stride = row_bytes(t->type, cols);  // throws for types without a known block size
  FILE* out = std::fopen(a.output.c_str(), "wb");
  if (!out) throw Error(a.output + ": cannot open for writing");
  std::unique_ptr<FILE, int (*)(FILE*)> closer(out, std::fclose);
  std::vector<float> row(static_cast<size_t>(cols));
  for (int64_t r = begin; r < end; ++r) {
    dequantize_row(t->type, t->data + size_t(r) * stride, row.data(), cols);
    if (std::fwrite(row.data(), sizeof(float), row.size(), out) != row.size())
      throw Error(a.output + ": write failed");
  }
  if (std::fclose(closer.release()) != 0) throw Error(a.output + ": write failed");
  nlohmann::json j;
  j["tensor"] = a.tensor;
  j["type"] = type_name(uint32_t(t->type));
  j["ne"] = t->ne;
  j["rows"] = {begin, end};
  j["cols"] = cols;
  std::printf("%s\n", j.dump().c_str());
}

}  // namespace

void add_dump_tensor_command(CLI::App& app) {
  auto args = std::make_shared<DumpArgs>();
  CLI::App* cmd = app.add_subcommand("dump-tensor", "write dequantized rows of a tensor as raw f32");
  add_model_path_option(*cmd, args->model, "GGUF file");
  cmd->option_defaults()->group(group::kInput);
  cmd->add_option("--tensor", args->tensor, "tensor name")->required();
  cmd->add_option("--rows", args->rows, "rows A:B (half-open; A: or :B allowed; default all)");
  cmd->option_defaults()->group(group::kOutput);
  cmd->add_option("-o,--output", args->output, "output file (raw little-endian f32, row after row)")
      ->required();
  cmd->callback([args] { run_dump(*args); });
}

}  // namespace microspec::cli
