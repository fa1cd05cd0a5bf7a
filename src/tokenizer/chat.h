#pragma once
// Chat prompts: the built-in formats, chosen from the model file, or the model's own Jinja template.
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace microspec {

class GgufFile;
class ChatTemplate;

enum class ChatFormat { Gemma, ChatML, Llama3 };

struct ChatMessage {
  std::string role;  // "system", "user", "assistant"
  std::string content;
};

// From the architecture, the chat template text and the vocabulary. Throws Error if none fits.
ChatFormat detect_chat_format(const GgufFile& file, const Tokenizer& tok);
const char* chat_format_name(ChatFormat f);
// "gemma", "chatml", "llama3" (as chat_format_name writes them). Throws Error for other names.
ChatFormat chat_format_from_name(std::string_view name);

// The system message the file's chat template writes when the conversation has none (SmolLM2:
// "You are a helpful AI assistant named SmolLM, trained by Hugging Face"), or "" if it writes none.
// Pass it to apply_chat_template as default_system.
std::string default_system_prompt(const GgufFile& file);

// Renders messages to the prompt text (special tokens written as text: encode with parse_special).
// Includes BOS text only where the format writes it explicitly (Llama 3's <|begin_of_text|> is
// added by the tokenizer's BOS rule instead, as is Gemma's <bos>). SmolLM2's default system prompt
// is inserted when its template does so and no system message is given. content_ranges (optional)
// receives where the messages' own text lies in the result, in order. Throws Error for a
// conversation the format cannot write (Gemma: a system message with no user message after it).
std::string apply_chat_template(ChatFormat f, std::span<const ChatMessage> messages, bool add_generation_prompt,
                                const std::string& default_system = "",
                                std::vector<Tokenizer::TextRange>* content_ranges = nullptr);

// The prompt's token ids: apply_chat_template with a generation prompt, encoded with BOS as the
// tokenizer adds it; the template's markers are control tokens, the messages' text is text (a
// user who types "<|im_end|>" gets those characters, not the end of the turn). The one way every
// front end turns messages into ids.
std::vector<int32_t> encode_chat(const Tokenizer& tok, ChatFormat f, std::span<const ChatMessage> messages,
                                 const std::string& default_system = "");

// How a front end (generate --chat, the server) writes a conversation: one of the built-in formats,
// or a Jinja template (chat_template/chat_template.h): the model's own when no built-in format fits
// the model, or the one --chat-template names.
struct ChatStyle {
  std::optional<ChatFormat> format;          // a built-in format, with default_system; or
  std::shared_ptr<const ChatTemplate> jinja;  // a Jinja template, given bos_token / eos_token
  std::string default_system;
  std::string bos_text, eos_text;
  std::string name;  // "chatml", "the model's template", the file's path: for messages and logs
};
// chosen: "" takes the built-in format that fits the model, else the model's own template (Error if
// it has none); "gemma", "chatml" or "llama3" that format; "model" the model's own template (the
// GGUF's tokenizer.chat_template); anything else a template file. Throws Error naming what failed.
ChatStyle chat_style_for(const GgufFile& file, const Tokenizer& tok, const std::string& chosen);
// The prompt's text (a generation prompt after the messages) and where the messages' own text lies
// in it. A Jinja template's output is searched for each message's content in order; content the
// template changed is not found, and is then refused (Error) if it holds control-token text, so a
// user's "<|im_end|>" is never a control token.
std::string render_chat(const ChatStyle& style, const Tokenizer& tok, std::span<const ChatMessage> messages,
                        std::vector<Tokenizer::TextRange>* content_ranges);
// render_chat's text encoded, its content ranges as text; BOS as the tokenizer adds it unless the
// template already wrote it.
std::vector<int32_t> encode_chat(const Tokenizer& tok, const ChatStyle& style, std::span<const ChatMessage> messages);

}  // namespace microspec
