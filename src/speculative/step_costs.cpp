#include "speculative/step_costs.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <system_error>
#include <unistd.h>

#include "kernels/kernels.h"
#include "util/error.h"
#include "util/file.h"

namespace microspec {

namespace {

using Clock = std::chrono::steady_clock;

// What the costs depend on, readable: the model's file and weights, how it runs, the CPU.
std::string costs_key(Model& model, const GgufFile& file) {
  size_t bytes = 0;
  for (const GgufTensor& t : file.tensors()) bytes += t.n_bytes;
  const std::string name = std::filesystem::path(file.name()).filename().string();
  return name + " | " + std::to_string(file.tensors().size()) + " tensors, " + std::to_string(bytes) +
         " bytes | kernels " + model.kernels().name + " | threads " + std::to_string(model.pool().size()) +
         " | " + (model.repacks() ? "repacked" : "file layout") + " | " + cpu_model_name();
}

// FNV-1a, 64 bits: the key's file name.
std::string key_hash(const std::string& key) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : key) h = (h ^ c) * 1099511628211ULL;
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

std::string cache_dir() {
  if (const char* d = std::getenv("MICROSPEC_CACHE_DIR"); d && *d) return d;
  if (const char* d = std::getenv("XDG_CACHE_HOME"); d && *d) return std::string(d) + "/microspec";
  if (const char* d = std::getenv("HOME"); d && *d) return std::string(d) + "/.cache/microspec";
  return "";
}

// Writes text to path through a temporary file and a rename, so that a reader never sees half a
// file and two writers do not interleave. Returns an error text, empty on success.
std::string write_atomically(const std::string& path, const std::string& text) {
  std::error_code ec;
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (!dir.empty()) std::filesystem::create_directories(dir, ec);
  if (ec) return "cannot create " + dir.string() + ": " + ec.message();
  const std::string tmp = path + ".tmp" + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    if (!out) return "cannot write " + tmp;
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp, ec);
    return "cannot write " + path;
  }
  return "";
}

}  // namespace

void StepCosts::validate() const {
  if (rows.empty() || rows.size() != forward.size() || rows.size() != lm_head.size())
    throw Error("step costs: rows, forward and lm_head must be non-empty lists of one length");
  if (rows[0] != 1) throw Error("step costs: the first row count must be 1, got " + std::to_string(rows[0]));
  for (size_t i = 0; i < rows.size(); ++i) {
    if (i > 0 && rows[i] <= rows[i - 1]) throw Error("step costs: row counts must increase");
    if (!(forward[i] > 0) || !(lm_head[i] >= 0) || lm_head[i] > forward[i])
      throw Error("step costs: each forward must take positive seconds, its LM head part between 0 and it");
  }
}

double StepCosts::at(const std::vector<double>& v, double r) const {
  if (r <= 0) return 0.0;
  if (r <= 1) return v[0] * r;  // 0 rows cost nothing
  size_t i = 1;
  while (i + 1 < rows.size() && rows[i] < r) ++i;
  if (rows.size() == 1) return v[0] * r;
  const double r0 = rows[i - 1], r1 = rows[i];
  return v[i - 1] + (v[i] - v[i - 1]) * (r - r0) / (r1 - r0);
}

std::vector<int32_t> calibration_rows(int32_t max_rows) {
  std::vector<int32_t> out;
  for (int32_t r = 1; r <= std::min(max_rows, 9); ++r) out.push_back(r);
  for (int32_t r : {12, 16, 24, 32, 48})
    if (r < max_rows && r > out.back()) out.push_back(r);
  for (int32_t r = 64; r < max_rows; r *= 2) out.push_back(r);
  if (out.back() < max_rows) out.push_back(max_rows);
  return out;
}

StepCosts measure_step_costs(Model& model, int32_t max_rows, const StepCosts& known) {
  if (max_rows < 1 || max_rows > model.n_batch())
    throw Error("step costs: rows to measure must be in [1, " + std::to_string(model.n_batch()) + "], got " +
                std::to_string(max_rows));
  KVCache kv = model.make_cache(max_rows);
  Batch batch;
  ForwardOutput out;
  std::vector<int32_t> tokens(size_t(max_rows), 1);
  const ForwardOptions options{.logits = true};
  // One forward of r rows in the cache's pending region (nothing is committed): its seconds and its
  // LM head's.
  auto run = [&](int32_t r, double* head) {
    batch.set_sequence(std::span<const int32_t>(tokens.data(), size_t(r)), 0, true);
    const double head0 = model.timings().lm_head_seconds;
    const auto t0 = Clock::now();
    model.forward(batch, kv, out, options);
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    *head = model.timings().lm_head_seconds - head0;
    return s;
  };
  StepCosts c = known;
  const size_t first_new = c.rows.size();
  for (int32_t r : calibration_rows(max_rows))
    if (r > c.max_rows()) c.rows.push_back(r);
  double head = 0;
  run(1, &head);  // warm up: page in the weights, spin up the pool
  for (size_t i = first_new; i < c.rows.size(); ++i) {
    const int32_t r = c.rows[i];
    double s[3], h[3];
    for (int i = 0; i < 3; ++i) s[i] = run(r, &h[i]);
    const int median = s[0] < s[1] ? (s[1] < s[2] ? 1 : s[0] < s[2] ? 2 : 0) : (s[0] < s[2] ? 0 : s[1] < s[2] ? 2 : 1);
    c.forward.push_back(s[median]);
    c.lm_head.push_back(std::min(h[median], s[median]));
  }
  // A measured curve may dip (noise); costs must not fall with more rows.
  for (size_t i = std::max<size_t>(first_new, 1); i < c.rows.size(); ++i) {
    c.forward[i] = std::max(c.forward[i], c.forward[i - 1]);
    c.lm_head[i] = std::min(std::max(c.lm_head[i], c.lm_head[i - 1]), c.forward[i]);
  }
  return c;
}

std::string step_costs_json(const StepCosts& c, const std::string& key) {
  nlohmann::json j = {{"version", 1}, {"key", key}, {"rows", c.rows}, {"forward", c.forward}, {"lm_head", c.lm_head}};
  return j.dump(1) + "\n";
}

StepCosts parse_step_costs(const std::string& text, std::string* key) {
  StepCosts c;
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    if (j.at("version").get<int>() != 1) throw Error("step costs: unknown version");
    if (key) *key = j.at("key").get<std::string>();
    c.rows = j.at("rows").get<std::vector<int32_t>>();
    c.forward = j.at("forward").get<std::vector<double>>();
    c.lm_head = j.at("lm_head").get<std::vector<double>>();
  } catch (const nlohmann::json::exception& e) {
    throw Error(std::string("step costs: malformed file: ") + e.what());
  }
  c.validate();
  return c;
}

StepCosts cached_step_costs(Model& model, const GgufFile& file, int32_t max_rows, const std::string& path,
                            std::string* note) {
  const std::string key = costs_key(model, file);
  const std::string dir = cache_dir();
  const std::string where = !path.empty() ? path : dir.empty() ? "" : dir + "/step-costs-" + key_hash(key) + ".json";
  StepCosts known;  // the file's points, when it holds this key's
  if (!where.empty() && std::filesystem::exists(where)) {
    std::string stored;
    try {
      StepCosts c = parse_step_costs(read_file_bytes(where), &stored);
      if (stored == key && c.max_rows() >= max_rows) {
        *note = "step costs read from " + where;
        return c;
      }
      if (stored == key) known = std::move(c);
    } catch (const Error&) {
      if (!path.empty()) throw;  // a file the user named must be right; a cache file is remade
    }
  }
  const StepCosts measured = measure_step_costs(model, max_rows, known);
  // Use exactly what a later run will read back.
  const std::string text = step_costs_json(measured, key);
  StepCosts c = parse_step_costs(text, nullptr);
  if (where.empty()) {
    *note = "step costs measured (not cached: no cache directory; set MICROSPEC_CACHE_DIR)";
    return c;
  }
  const std::string err = write_atomically(where, text);
  *note = err.empty() ? "step costs measured and written to " + where : "step costs measured (not cached: " + err + ")";
  return c;
}

}  // namespace microspec
