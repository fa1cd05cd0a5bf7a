#pragma once
// A model's own Jinja chat template, rendered as transformers renders it (jinja2's
// ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks and loop controls; the globals
// raise_exception and strftime_now; transformers' tojson: json.dumps(x, ensure_ascii=False, indent,
// separators, sort_keys)), and where the template text comes from: a GGUF file, a Hugging Face
// folder or a file of its own.
//
// A template from a model file is untrusted: rendering is bounded (jinja_eval.h: RenderLimits)
// and every failure, including an unsupported construct, is an Error naming it.
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "chat_template/jinja_ast.h"
#include "chat_template/jinja_eval.h"

namespace microspec {

class GgufFile;

// The moment strftime_now() formats (UTC). Renders are reproducible when the caller fixes it.
struct TemplateTime {
  int year = 2024, month = 7, day = 26, hour = 0, minute = 0, second = 0;
};
// "YYYY-MM-DD" or "YYYY-MM-DDTHH:MM:SS"; throws Error for anything else.
TemplateTime parse_template_time(std::string_view text);
TemplateTime current_utc_time();

struct ChatTemplateOptions {
  TemplateTime now;
  jinja::RenderLimits limits;
};

// A parsed template, rendered any number of times.
class ChatTemplate {
 public:
  // Throws Error (with the line) for a syntax error or an unsupported tag.
  explicit ChatTemplate(std::string_view source);

  // `context` is a JSON object whose keys become the template's variables: messages,
  // add_generation_prompt, bos_token, eos_token, tools (optional), and any other the template reads
  // (enable_thinking, documents, ...); keys keep their order, as tojson prints them. Throws Error for
  // whatever the template raises (raise_exception's message included) or a limit it exceeds.
  std::string render(const nlohmann::ordered_json& context, const ChatTemplateOptions& options = {}) const;
  // The template's text, as given.
  const std::string& source() const { return source_; }

 private:
  std::string source_;
  std::shared_ptr<const jinja::Body> body_;
};

// Parse and render in one call.
std::string render_chat_template(std::string_view source, const nlohmann::ordered_json& context,
                                 const ChatTemplateOptions& options = {});

// A template and its name: "default" for the main one, else its variant's name ("tool_use", "rag").
struct NamedTemplate {
  std::string name;
  std::string source;
};

// tokenizer.chat_template ("default") and every tokenizer.chat_template.<name>.
std::vector<NamedTemplate> chat_templates_from_gguf(const GgufFile& file);
// tokenizer_config.json's chat_template (a string, or a list of {name, template}),
// chat_template.jinja, chat_template.json's chat_template, additional_chat_templates/<name>.jinja.
std::vector<NamedTemplate> chat_templates_from_hf_folder(const std::string& dir);
// The template called `name` ("" means "default"); throws Error listing the names there are.
const NamedTemplate& select_chat_template(const std::vector<NamedTemplate>& templates, std::string_view name,
                                          const std::string& where);

}  // namespace microspec
