#pragma once
// The built-in chat formats, written as Jinja chat templates (rendered by chat_template/ like any
// model's own): Gemma, ChatML and Llama 3. They write no BOS text: the tokenizer adds Gemma's <bos>
// and Llama 3's <|begin_of_text|> by its BOS rule. Besides the usual variables (messages,
// add_generation_prompt) a template may read default_system: the system message the model's file
// writes when the conversation has none (tokenizer/chat.h: default_system_prompt).
#include <span>
#include <string_view>

namespace microspec {

enum class ChatFormat { Gemma, ChatML, Llama3 };

struct BuiltinTemplate {
  ChatFormat format;
  const char* name;    // "gemma", "chatml", "llama3"
  const char* source;  // the Jinja template
  // Writes default_system as the first turn when the conversation has messages and the first is
  // not a system message (ChatML: SmolLM2's template does); the others never read it.
  bool writes_default_system;
};

// Every built-in template, in ChatFormat's order.
std::span<const BuiltinTemplate> builtin_templates();
const BuiltinTemplate& builtin_template(ChatFormat f);
const char* chat_format_name(ChatFormat f);
// "gemma", "chatml", "llama3" (as chat_format_name writes them). Throws Error for other names.
ChatFormat chat_format_from_name(std::string_view name);
bool is_builtin_template_name(std::string_view name);

}  // namespace microspec
