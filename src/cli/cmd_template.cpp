// `microspec template`: renders a model's Jinja chat template (or a template file, or a built-in
// one) over a conversation and prints the text, for debugging chat formats. A JSON-lines batch mode
// renders many conversations in one process (the oracle test against Python's jinja2 uses it).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "chat_template/chat_template.h"
#include "checkpoint/hf_folder.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "gguf/gguf.h"
#include "tokenizer/builtin_templates.h"
#include "tokenizer/tokenizer.h"
#include "util/error.h"
#include "util/file.h"

namespace microspec::cli {
namespace {

using ordered_json = nlohmann::ordered_json;

struct TemplateOptions {
  std::string model;
  std::string template_file;
  std::string name;
  std::string messages_file;
  std::string tools_file;
  bool add_generation_prompt = false;
  std::optional<std::string> bos_token, eos_token;
  std::string date;
  std::string batch;
};

std::string read_stdin() {
  std::string out;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), stdin)) > 0) out.append(buf, n);
  if (std::ferror(stdin)) throw Error("cannot read standard input");
  return out;
}

ordered_json read_json(const std::string& path) {
  try {
    return ordered_json::parse(path == "-" ? read_stdin() : read_file_bytes(path));
  } catch (const nlohmann::json::exception& e) {
    throw Error(path + ": invalid JSON: " + e.what());
  }
}

// The template text and the special tokens' text, from -m or --template.
struct TemplateSource {
  std::string text;
  std::optional<std::string> bos_token, eos_token;
};

std::optional<std::string> token_text_from_config(const ordered_json& config, const char* key) {
  if (!config.contains(key)) return std::nullopt;
  const ordered_json& v = config[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string())
    return v["content"].get<std::string>();
  return std::nullopt;
}

TemplateSource load_source(const TemplateOptions& o) {
  TemplateSource source;
  if (is_builtin_template_name(o.template_file)) {
    source.text = builtin_template(chat_format_from_name(o.template_file)).source;
  } else if (!o.template_file.empty()) {
    source.text = read_file_bytes(o.template_file);
  } else if (is_hf_folder(o.model)) {
    source.text = select_chat_template(chat_templates_from_hf_folder(o.model), o.name, o.model).source;
    const std::string config_path = o.model + "/tokenizer_config.json";
    if (std::filesystem::exists(config_path)) {
      const ordered_json config = read_json(config_path);
      source.bos_token = token_text_from_config(config, "bos_token");
      source.eos_token = token_text_from_config(config, "eos_token");
    }
  } else {
    const auto file = GgufFile::open(o.model);
    source.text = select_chat_template(chat_templates_from_gguf(*file), o.name, o.model).source;
    const auto tok = Tokenizer::from_gguf(*file);
    if (tok->bos_id() >= 0) source.bos_token = tok->token_text(tok->bos_id());
    if (tok->eos_id() >= 0) source.eos_token = tok->token_text(tok->eos_id());
  }
  if (o.bos_token) source.bos_token = o.bos_token;
  if (o.eos_token) source.eos_token = o.eos_token;
  return source;
}

// The variables every render gets unless the conversation sets them itself.
void add_defaults(ordered_json& context, const TemplateSource& source) {
  if (source.bos_token && !context.contains("bos_token")) context["bos_token"] = *source.bos_token;
  if (source.eos_token && !context.contains("eos_token")) context["eos_token"] = *source.eos_token;
  if (!context.contains("add_generation_prompt")) context["add_generation_prompt"] = false;
}

// As transformers' apply_chat_template passes them: tools and documents are None when not given.
void add_transformers_defaults(ordered_json& context) {
  if (!context.contains("tools")) context["tools"] = nullptr;
  if (!context.contains("documents")) context["documents"] = nullptr;
}

void write_out(const std::string& text) {
  std::fwrite(text.data(), 1, text.size(), stdout);
}

// One JSON context per line in, one line out: {"text": ...} or {"error": ...}.
void run_batch(const TemplateOptions& o, const ChatTemplate& tmpl, const TemplateSource& source,
               const ChatTemplateOptions& render_options) {
  const std::string input = o.batch == "-" ? read_stdin() : read_file_bytes(o.batch);
  std::string out;
  size_t start = 0, line_no = 0;
  while (start < input.size()) {
    size_t end = input.find('\n', start);
    if (end == std::string::npos) end = input.size();
    const std::string line = input.substr(start, end - start);
    start = end + 1;
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    ordered_json context;
    try {
      context = ordered_json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      throw Error(o.batch + ": line " + std::to_string(line_no) + ": invalid JSON: " + e.what());
    }
    if (!context.is_object())
      throw Error(o.batch + ": line " + std::to_string(line_no) + ": expected a JSON object");
    add_defaults(context, source);
    ordered_json reply;
    try {
      reply["text"] = tmpl.render(context, render_options);
    } catch (const Error& e) {
      reply["error"] = e.what();
    }
    out += reply.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  }
  write_out(out);
}

void run_template(const TemplateOptions& o) {
  if (o.model.empty() == o.template_file.empty())
    throw Error("template: give exactly one of -m and --template");
  if (o.batch.empty() == o.messages_file.empty())
    throw Error("template: give exactly one of --messages and --batch-jsonl");
  if (!o.batch.empty() && (!o.tools_file.empty() || o.add_generation_prompt))
    throw Error("template: with --batch-jsonl, each line carries its own tools and add_generation_prompt");
  const TemplateSource source = load_source(o);
  ChatTemplateOptions render_options;
  render_options.now = o.date.empty() ? current_utc_time() : parse_template_time(o.date);
  const ChatTemplate tmpl(source.text);
  if (!o.batch.empty()) {
    run_batch(o, tmpl, source, render_options);
    return;
  }
  const ordered_json messages = read_json(o.messages_file);
  ordered_json context;
  if (messages.is_array()) {
    context["messages"] = messages;
  } else if (messages.is_object()) {
    context = messages;  // a whole context: messages plus any variables the template reads
  } else {
    throw Error(o.messages_file + ": expected a JSON array of messages (or an object of template variables)");
  }
  if (!o.tools_file.empty()) context["tools"] = read_json(o.tools_file);
  context["add_generation_prompt"] = o.add_generation_prompt || context.value("add_generation_prompt", false);
  add_defaults(context, source);
  add_transformers_defaults(context);
  write_out(tmpl.render(context, render_options));
}

}  // namespace

void add_template_command(CLI::App& app) {
  auto opts = std::make_shared<TemplateOptions>();
  CLI::App* cmd = app.add_subcommand(
      "template", "render a chat template (the model's own, or a file) over a conversation");
  cmd->option_defaults()->group(group::kModel);
  cmd->add_option("-m,--model", opts->model,
                  "GGUF model file or Hugging Face model folder: its chat template and "
                  "its BOS / EOS tokens");
  cmd->add_option(
      "--template", opts->template_file,
      "a Jinja chat template file, or a built-in one: gemma, chatml, llama3 (instead of -m; the "
      "built-in chatml writes the variable default_system when the first message is not a system one)");
  cmd->add_option("--name", opts->name,
                  "the model's named template variant, e.g. tool_use (default: the main one)");
  cmd->option_defaults()->group(group::kInput);
  cmd->add_option(
      "--messages", opts->messages_file,
      "JSON file ('-' for stdin): an array of messages {role, content, tool_calls, ...}, or an object "
      "of template variables (messages, tools, documents, enable_thinking, ...)");
  cmd->add_option("--tools", opts->tools_file, "JSON file: the tools list (OpenAI shape)");
  cmd->add_flag("--add-generation-prompt", opts->add_generation_prompt,
                "end with the assistant turn's opening");
  cmd->add_option("--bos-token", opts->bos_token,
                  "bos_token's text (default: the model's; none with --template)");
  cmd->add_option("--eos-token", opts->eos_token,
                  "eos_token's text (default: the model's; none with --template)");
  cmd->add_option("--date", opts->date,
                  "the time strftime_now() formats: YYYY-MM-DD or YYYY-MM-DDTHH:MM:SS "
                  "(default: now, UTC)");
  cmd->add_option("--batch-jsonl", opts->batch,
                  "render every line of this file ('-' for stdin), each a JSON object of template variables; "
                  "prints one JSON line per input: {\"text\": ...} or {\"error\": ...}");
  cmd->callback([opts] { run_template(*opts); });
}

}  // namespace microspec::cli
