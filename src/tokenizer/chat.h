#pragma once
// Chat prompts: a conversation rendered by a Jinja template (chat_template/): a built-in one
// (builtin_templates.h) chosen from the model file, the model's own, or one from a file.
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/builtin_templates.h"
#include "tokenizer/tokenizer.h"

namespace microspec {

class GgufFile;
class ChatTemplate;

struct ChatMessage {
  ChatMessage() = default;
  ChatMessage(std::string role_, std::string content_) : role(std::move(role_)), content(std::move(content_)) {}
  std::string role;  // "system", "user", "assistant", "tool"
  std::string content;
  // An assistant's tool calls in OpenAI's shape ([{id, type, function: {name, arguments}}]; null:
  // none); the template gets each call's arguments as an object, as transformers passes them.
  nlohmann::ordered_json tool_calls;
  std::string tool_call_id;  // a "tool" message: the call it answers
};

// The built-in format that fits the model: from the chat template text, the architecture and the
// vocabulary. Throws Error if none fits.
ChatFormat detect_chat_format(const GgufFile& file, const Tokenizer& tok);

// The system message the file's chat template writes when the conversation has none (SmolLM2:
// "You are a helpful AI assistant named SmolLM, trained by Hugging Face"), or "" if it writes none.
// The built-in ChatML template reads it as default_system.
std::string default_system_prompt(const GgufFile& file);

// How a front end (generate --chat, the server, bench, ...) writes a conversation: a Jinja
// template, built-in or not.
struct ChatStyle {
  std::shared_ptr<const ChatTemplate> jinja;
  std::string default_system;      // the variable default_system (passed when not empty)
  std::string bos_text, eos_text;  // bos_token, eos_token
  // "chatml", "the model's template", the file's path: for messages and logs
  std::string name;
};
// The built-in template of format f. Its bos_token and eos_token are empty: it never writes BOS,
// the tokenizer adds it.
ChatStyle builtin_chat_style(ChatFormat f, const std::string& default_system);
// chosen: "" takes the built-in template that fits the model (detect_chat_format), else the
// model's own (Error if it has none); "gemma", "chatml" or "llama3" that built-in template;
// "model" the model's own template (the GGUF's tokenizer.chat_template); anything else a template
// file. A built-in template gets the file's default_system_prompt. Throws Error naming what failed.
ChatStyle chat_style_for(const GgufFile& file, const Tokenizer& tok, const std::string& chosen);

// Whether the prompt ends with the opening of the assistant's turn (add_generation_prompt).
enum class GenerationPrompt { Add, Omit };

// The prompt's text and (content_ranges, when given) where the messages' own text lies in it, in
// order. The ranges come from a second render with each message's text replaced by a marker:
// exact wherever the template wrote the text as given or trimmed. The output of a template that
// changed the text is searched for it instead; text not found is then refused (Error) if it holds
// control-token text, so a user's "<|im_end|>" is never a control token. Throws Error for what the
// template raises (Gemma: a system message with no user message after it).
// tools: the request's tool definitions (OpenAI's shape) for the template's `tools` variable, null
// for none. Tool definitions and calls are template data, not message text: control-token text in
// them is refused (Error) rather than tokenized.
std::string render_chat(const ChatStyle& style, const Tokenizer& tok, std::span<const ChatMessage> messages,
                        std::vector<Tokenizer::TextRange>* content_ranges,
                        GenerationPrompt prompt = GenerationPrompt::Add,
                        const nlohmann::ordered_json* tools = nullptr);
// The prompt's token ids, the one way every front end turns messages into ids: render_chat's text
// with the template's markers as control tokens and the messages' text as text; BOS as the
// tokenizer adds it unless the template already wrote it.
std::vector<int32_t> encode_chat(const Tokenizer& tok, const ChatStyle& style,
                                 std::span<const ChatMessage> messages,
                                 GenerationPrompt prompt = GenerationPrompt::Add,
                                 const nlohmann::ordered_json* tools = nullptr);

}  // namespace microspec
