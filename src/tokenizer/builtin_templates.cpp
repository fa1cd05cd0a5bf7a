// The built-in chat formats as Jinja templates, written here from each format's layout. Message
// text that a format trims is trimmed of ASCII whitespace only (trim's explicit characters), as
// llama.cpp's built-in formats do; Python's trim would also take Unicode spaces.
#include "tokenizer/builtin_templates.h"

#include <string>

#include "util/error.h"

namespace microspec {
namespace {

// Turns "<start_of_turn>ROLE\nTEXT<end_of_turn>\n", the assistant called "model", the text trimmed.
// Gemma has no system role: the system messages' text opens the next user turn, then a blank line;
// a system message with no user message after it cannot be written.
constexpr const char* kGemma = R"jinja(
{%- set ns = namespace(system='') -%}
{%- for message in messages -%}
  {%- if message.role == 'system' -%}
    {%- set ns.system = ns.system + message.content | trim(' \t\n\v\f\r') -%}
  {%- else -%}
    {%- set role = 'model' if message.role == 'assistant' else message.role -%}
    {{- '<start_of_turn>' + role + '\n' -}}
    {%- if ns.system and role != 'model' -%}
      {{- ns.system + '\n\n' -}}
      {%- set ns.system = '' -%}
    {%- endif -%}
    {{- message.content | trim(' \t\n\v\f\r') + '<end_of_turn>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if ns.system -%}
  {{- raise_exception('the gemma chat format has no system role: a system message must be followed by a user message') -}}
{%- endif -%}
{%- if add_generation_prompt -%}
  {{- '<start_of_turn>model\n' -}}
{%- endif -%}
)jinja";

// Turns "<|im_start|>ROLE\nTEXT<|im_end|>\n", the text as given; default_system first when the
// conversation does not open with a system message.
constexpr const char* kChatML = R"jinja(
{%- if default_system and messages and messages[0].role != 'system' -%}
  {{- '<|im_start|>system\n' + default_system + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
  {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
)jinja";

// Turns "<|start_header_id|>ROLE<|end_header_id|>\n\nTEXT<|eot_id|>", the text trimmed.
constexpr const char* kLlama3 = R"jinja(
{%- for message in messages -%}
  {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' -}}
  {{- message.content | trim(' \t\n\v\f\r') + '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{%- endif -%}
)jinja";

constexpr BuiltinTemplate kTemplates[] = {
    {ChatFormat::Gemma, "gemma", kGemma, false},
    {ChatFormat::ChatML, "chatml", kChatML, true},
    {ChatFormat::Llama3, "llama3", kLlama3, false},
};

}  // namespace

std::span<const BuiltinTemplate> builtin_templates() {
  return kTemplates;
}

const BuiltinTemplate& builtin_template(ChatFormat f) {
  for (const BuiltinTemplate& t : kTemplates)
    if (t.format == f) return t;
  throw Error("unknown chat format " + std::to_string(static_cast<int>(f)));
}

const char* chat_format_name(ChatFormat f) {
  return builtin_template(f).name;
}

bool is_builtin_template_name(std::string_view name) {
  for (const BuiltinTemplate& t : kTemplates)
    if (name == t.name) return true;
  return false;
}

ChatFormat chat_format_from_name(std::string_view name) {
  for (const BuiltinTemplate& t : kTemplates)
    if (name == t.name) return t.format;
  throw Error("unknown chat format '" + std::string(name) + "' (known: gemma, chatml, llama3)");
}

}  // namespace microspec
