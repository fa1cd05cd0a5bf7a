// `microspec info -m FILE`: the GGUF header of a model: version, metadata (long arrays summarised),
// one line per tensor and totals per tensor type. Parsing validates the whole file, so this is also
// the quickest way to see why a file is refused.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "cli/common.h"
#include "gguf/gguf.h"
#include "kernels/types.h"
#include "model/model_file.h"
#include "util/error.h"

namespace microspec::cli {

namespace {

struct InfoArgs {
  std::string model_path;
  uint64_t array_limit = 8;   // arrays longer than this are summarised
  size_t string_limit = 120;  // strings longer than this are cut
  bool no_tensors = false;
};

// Quoted, with control characters, quotes and backslashes escaped; cut after `limit` bytes.
std::string quote(std::string_view s, size_t limit) {
  std::string out = "\"";
  const size_t n = std::min(s.size(), limit);
  for (size_t i = 0; i < n; ++i) {
    const unsigned char ch = static_cast<unsigned char>(s[i]);
    switch (ch) {
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      default:
        if (ch < 0x20 || ch == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\x%02x", ch);
          out += buf;
        } else {
          out += static_cast<char>(ch);  // UTF-8 passes through
        }
    }
  }
  out += '"';
  if (n < s.size()) out += "... (" + std::to_string(s.size()) + " bytes)";
  return out;
}

template <typename T>
std::string shortest(T v) {
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

template <typename T>
T element(const uint8_t* p, uint64_t i) {
  T v;
  std::memcpy(&v, p + i * sizeof(T), sizeof(T));
  return v;
}

// One element of a fixed-size array, as text.
std::string array_element(GgufType t, const uint8_t* p, uint64_t i) {
  switch (t) {
    case GgufType::U8:
      return std::to_string(element<uint8_t>(p, i));
    case GgufType::I8:
      return std::to_string(element<int8_t>(p, i));
    case GgufType::U16:
      return std::to_string(element<uint16_t>(p, i));
    case GgufType::I16:
      return std::to_string(element<int16_t>(p, i));
    case GgufType::U32:
      return std::to_string(element<uint32_t>(p, i));
    case GgufType::I32:
      return std::to_string(element<int32_t>(p, i));
    case GgufType::U64:
      return std::to_string(element<uint64_t>(p, i));
    case GgufType::I64:
      return std::to_string(element<int64_t>(p, i));
    case GgufType::F32:
      return shortest(element<float>(p, i));
    case GgufType::F64:
      return shortest(element<double>(p, i));
    case GgufType::BOOL:
      return element<uint8_t>(p, i) ? "true" : "false";
    default:
      return "?";
  }
}

std::string format_value(const GgufValue& v, const InfoArgs& a) {
  switch (v.type) {
    case GgufType::STRING:
      return quote(v.strings[0], a.string_limit);
    case GgufType::BOOL:
      return v.i ? "true" : "false";
    case GgufType::F32:
      return shortest(static_cast<float>(v.f));
    case GgufType::F64:
      return shortest(v.f);
    case GgufType::U64:
      return std::to_string(v.u);
    case GgufType::ARRAY: {
      if (v.count > a.array_limit)
        return "[array of " + std::to_string(v.count) + " " + gguf_type_name(v.elem_type) + "]";
      std::string out = "[";
      for (uint64_t i = 0; i < v.count; ++i) {
        if (i) out += ", ";
        out += v.elem_type == GgufType::STRING ? quote(v.strings[i], a.string_limit)
                                               : array_element(v.elem_type, v.array_data, i);
      }
      return out + "]";
    }
    default:
      return std::to_string(v.i);
  }
}

std::string shape(const std::vector<int64_t>& ne) {
  std::string s = "[";
  for (size_t i = 0; i < ne.size(); ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
  return s + "]";
}

std::string mib(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f MiB", bytes / (1024.0 * 1024.0));
  return buf;
}

void run_info(const InfoArgs& a) {
  auto f = open_model_file(a.model_path);
  uint64_t data_bytes = 0;
  for (const GgufTensor& t : f->tensors()) data_bytes += t.n_bytes;
  const std::vector<std::string> keys = f->keys();
  std::printf("file: %s\n", f->name().c_str());
  std::printf("GGUF version %u, %zu bytes, alignment %zu, %zu metadata keys, %zu tensors\n", f->version(),
              f->file_size(), f->alignment(), keys.size(), f->tensors().size());
  std::printf("tensor data: %s at file offset %zu (tensor offsets below are relative to it)\n",
              mib(data_bytes).c_str(), f->data_offset());

  size_t key_width = 0;
  for (const std::string& k : keys) key_width = std::max(key_width, k.size());
  std::printf("\nmetadata:\n");
  for (const std::string& k : keys) {
    const GgufValue& v = *f->find(k);
    const std::string type = v.type == GgufType::ARRAY ? "array" : gguf_type_name(v.type);
    std::printf("  %-*s  %-6s  %s\n", static_cast<int>(key_width), k.c_str(), type.c_str(),
                format_value(v, a).c_str());
  }

  struct Total {
    int tensors = 0;
    uint64_t elements = 0, bytes = 0;
  };
  std::map<std::string, Total> totals;
  size_t name_width = 4;
  for (const GgufTensor& t : f->tensors()) name_width = std::max(name_width, t.name.size());
  if (!a.no_tensors) {
    std::printf("\ntensors:\n  %4s  %-*s  %-5s  %-20s  %12s  %12s\n", "#", static_cast<int>(name_width),
                "name", "type", "shape", "bytes", "data offset");
  }
  for (size_t i = 0; i < f->tensors().size(); ++i) {
    const GgufTensor& t = f->tensors()[i];
    const char* tname = type_traits(t.type).name;
    Total& tot = totals[tname];
    ++tot.tensors;
    tot.elements += static_cast<uint64_t>(t.n_elements());
    tot.bytes += t.n_bytes;
    if (!a.no_tensors)
      std::printf("  %4zu  %-*s  %-5s  %-20s  %12zu  %12llu\n", i, static_cast<int>(name_width),
                  t.name.c_str(), tname, shape(t.ne).c_str(), t.n_bytes,
                  static_cast<unsigned long long>(t.offset));
  }

  std::printf("\ntotals by type:\n  %-6s  %7s  %14s  %14s  %12s  %s\n", "type", "tensors", "elements",
              "bytes", "", "bits/weight");
  Total all;
  auto row = [](const char* name, const Total& t) {
    const double bpw = t.elements ? 8.0 * t.bytes / t.elements : 0.0;
    std::printf("  %-6s  %7d  %14llu  %14llu  %12s  %.3f\n", name, t.tensors,
                static_cast<unsigned long long>(t.elements), static_cast<unsigned long long>(t.bytes),
                mib(t.bytes).c_str(), bpw);
  };
  for (const auto& [name, t] : totals) {
    row(name.c_str(), t);
    all.tensors += t.tensors;
    all.elements += t.elements;
    all.bytes += t.bytes;
  }
  row("total", all);
}

}  // namespace

void add_info_command(CLI::App& app) {
  auto args = std::make_shared<InfoArgs>();
  CLI::App* cmd = app.add_subcommand("info", "print the metadata and tensor table of a GGUF file");
  add_model_path_option(*cmd, args->model_path, "GGUF file or Hugging Face folder (shown as translated)");
  cmd->option_defaults()->group(group::kOutput);
  cmd->add_option("--array-limit", args->array_limit, "print arrays of up to this many elements in full")
      ->capture_default_str();
  cmd->add_option("--string-limit", args->string_limit, "cut strings after this many bytes")
      ->capture_default_str();
  cmd->add_flag("--no-tensors", args->no_tensors, "omit the per-tensor table (totals are still printed)");
  cmd->callback([args] { run_info(*args); });
}

}  // namespace microspec::cli
