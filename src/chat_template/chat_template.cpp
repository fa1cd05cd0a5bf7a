// Chat templates: the render entry points (the globals transformers installs) and the loaders.
#include "chat_template/chat_template.h"

#include <algorithm>
#include <ctime>
#include <filesystem>

#include "chat_template/jinja_parser.h"
#include "gguf/gguf.h"
#include "util/error.h"
#include "util/file.h"

namespace microspec {
namespace {

namespace fs = std::filesystem;
using jinja::CallArgs;
using jinja::Value;

std::tm to_tm(const TemplateTime& t) {
  std::tm tm{};
  tm.tm_year = t.year - 1900;
  tm.tm_mon = t.month - 1;
  tm.tm_mday = t.day;
  tm.tm_hour = t.hour;
  tm.tm_min = t.minute;
  tm.tm_sec = t.second;
  const time_t seconds = timegm(&tm);  // fills in the weekday and the day of the year
  std::tm out{};
  gmtime_r(&seconds, &out);
  return out;
}

// The functions transformers adds to jinja2's globals.
void add_transformers_globals(jinja::ValueDict& globals, const TemplateTime& now) {
  globals.set("raise_exception", Value::from_function("raise_exception", [](CallArgs& args) -> Value {
                const std::string message = args.positional.empty() ? "" : jinja::to_str(args.positional[0]);
                throw Error("the template raised an error: " + message);
              }));
  const std::tm tm = to_tm(now);
  globals.set("strftime_now", Value::from_function("strftime_now", [tm](CallArgs& args) {
                if (args.positional.size() != 1 || !args.positional[0].is_string() || !args.keyword.empty())
                  throw Error("strftime_now() takes one format string");
                const std::string& format = args.positional[0].str();
                if (format.size() > 256) throw Error("strftime_now(): format longer than 256 bytes");
                if (format.empty()) return Value::from_string("");
                char buf[4096];
                const size_t n = std::strftime(buf, sizeof(buf), format.c_str(), &tm);
                if (n == 0) throw Error("strftime_now(): cannot format '" + format + "'");
                return Value::from_string(std::string(buf, n));
              }));
}

int parse_number(std::string_view text, size_t at, size_t len, std::string_view whole) {
  int v = 0;
  for (size_t i = at; i < at + len; ++i) {
    if (i >= text.size() || text[i] < '0' || text[i] > '9')
      throw Error("invalid date '" + std::string(whole) + "' (expected YYYY-MM-DD or YYYY-MM-DDTHH:MM:SS)");
    v = v * 10 + (text[i] - '0');
  }
  return v;
}

std::string read_text(const fs::path& path) {
  return read_file_bytes(path.string());
}

nlohmann::ordered_json read_json_file(const fs::path& path) {
  try {
    return nlohmann::ordered_json::parse(read_text(path));
  } catch (const nlohmann::json::exception& e) {
    throw Error(path.string() + ": invalid JSON: " + e.what());
  }
}

void add_named(std::vector<NamedTemplate>& out, std::string name, std::string source) {
  for (const NamedTemplate& t : out)
    if (t.name == name) return;  // the first source found wins
  out.push_back(NamedTemplate{std::move(name), std::move(source)});
}

}  // namespace

TemplateTime parse_template_time(std::string_view text) {
  TemplateTime t;
  if (text.size() != 10 && text.size() != 19)
    throw Error("invalid date '" + std::string(text) + "' (expected YYYY-MM-DD or YYYY-MM-DDTHH:MM:SS)");
  t.year = parse_number(text, 0, 4, text);
  t.month = parse_number(text, 5, 2, text);
  t.day = parse_number(text, 8, 2, text);
  if (text[4] != '-' || text[7] != '-' || t.month < 1 || t.month > 12 || t.day < 1 || t.day > 31)
    throw Error("invalid date '" + std::string(text) + "' (expected YYYY-MM-DD or YYYY-MM-DDTHH:MM:SS)");
  if (text.size() == 19) {
    t.hour = parse_number(text, 11, 2, text);
    t.minute = parse_number(text, 14, 2, text);
    t.second = parse_number(text, 17, 2, text);
    if ((text[10] != 'T' && text[10] != ' ') || text[13] != ':' || text[16] != ':' || t.hour > 23 ||
        t.minute > 59 || t.second > 60)
      throw Error("invalid time in '" + std::string(text) + "'");
  }
  return t;
}

TemplateTime current_utc_time() {
  const time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  return TemplateTime{tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec};
}

ChatTemplate::ChatTemplate(std::string_view source)
    : source_(source), body_(std::make_shared<const jinja::Body>(jinja::parse_template(source))) {}

std::string ChatTemplate::render(const nlohmann::ordered_json& context,
                                 const ChatTemplateOptions& options) const {
  if (!context.is_object()) throw Error("chat template context must be a JSON object");
  jinja::ValueDict globals;
  add_transformers_globals(globals, options.now);
  for (const auto& [key, value] : context.items()) globals.set(key, jinja::from_json(value));
  return jinja::render(*body_, globals, options.limits);
}

std::string render_chat_template(std::string_view source, const nlohmann::ordered_json& context,
                                 const ChatTemplateOptions& options) {
  return ChatTemplate(source).render(context, options);
}

std::vector<NamedTemplate> chat_templates_from_gguf(const GgufFile& file) {
  std::vector<NamedTemplate> out;
  if (const auto main = file.get_string_opt("tokenizer.chat_template"))
    add_named(out, "default", std::string(*main));
  const std::string prefix = "tokenizer.chat_template.";
  for (const std::string& key : file.keys()) {
    if (!key.starts_with(prefix) || key.size() == prefix.size()) continue;
    if (const auto text = file.get_string_opt(key))
      add_named(out, key.substr(prefix.size()), std::string(*text));
  }
  return out;
}

std::vector<NamedTemplate> chat_templates_from_hf_folder(const std::string& dir) {
  const fs::path root(dir);
  std::vector<NamedTemplate> out;
  if (fs::exists(root / "chat_template.jinja"))
    add_named(out, "default", read_text(root / "chat_template.jinja"));
  if (fs::exists(root / "tokenizer_config.json")) {
    const auto config = read_json_file(root / "tokenizer_config.json");
    const auto it = config.find("chat_template");
    if (it != config.end() && it->is_string()) add_named(out, "default", it->get<std::string>());
    if (it != config.end() && it->is_array()) {
      for (const auto& named : *it) {
        if (!named.is_object() || !named.contains("name") || !named.contains("template") ||
            !named["name"].is_string() || !named["template"].is_string())
          throw Error(dir + "/tokenizer_config.json: chat_template list entries need a name and a template");
        add_named(out, named["name"].get<std::string>(), named["template"].get<std::string>());
      }
    }
  }
  if (fs::exists(root / "chat_template.json")) {
    const auto config = read_json_file(root / "chat_template.json");
    if (config.is_object() && config.contains("chat_template") && config["chat_template"].is_string())
      add_named(out, "default", config["chat_template"].get<std::string>());
  }
  const fs::path extra = root / "additional_chat_templates";
  if (fs::is_directory(extra)) {
    std::vector<fs::path> files;
    for (const auto& entry : fs::directory_iterator(extra))
      if (entry.path().extension() == ".jinja") files.push_back(entry.path());
    std::sort(files.begin(), files.end());
    for (const fs::path& f : files) add_named(out, f.stem().string(), read_text(f));
  }
  return out;
}

const NamedTemplate& select_chat_template(const std::vector<NamedTemplate>& templates, std::string_view name,
                                          const std::string& where) {
  const std::string wanted = name.empty() ? "default" : std::string(name);
  for (const NamedTemplate& t : templates)
    if (t.name == wanted) return t;
  if (templates.empty()) throw Error(where + ": no chat template");
  std::string names;
  for (const NamedTemplate& t : templates) names += (names.empty() ? "" : ", ") + t.name;
  throw Error(where + ": no chat template named '" + wanted + "' (there are: " + names + ")");
}

}  // namespace microspec
