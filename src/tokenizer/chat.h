#pragma once
// Built-in chat formats, chosen from the model file.
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace microspec {

class GgufFile;

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

}  // namespace microspec
