// Built-in chat formats. Rendering follows llama.cpp's built-in templates for the same formats
// (contents trimmed for Gemma and Llama 3, verbatim for ChatML), which also agree with the
// models' own Jinja templates for ordinary conversations.
#include "tokenizer/chat.h"

#include <cctype>

#include "gguf/gguf.h"
#include "tokenizer/tokenizer.h"
#include "util/error.h"

namespace microspec {
namespace {

std::string trim(const std::string& s) {
  size_t begin = 0, end = s.size();
  while (begin < end && std::isspace(static_cast<unsigned char>(s[begin]))) ++begin;
  while (end > begin && std::isspace(static_cast<unsigned char>(s[end - 1]))) --end;
  return s.substr(begin, end - begin);
}

bool contains(std::string_view haystack, std::string_view needle) {
  return haystack.find(needle) != std::string_view::npos;
}

// Undoes the escapes of a Jinja string literal body, stopping at the closing quote.
std::string unescape_jinja_literal(std::string_view s, char quote) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (c == quote) break;
    if (c != '\\' || i + 1 == s.size()) {
      out.push_back(c);
      continue;
    }
    const char e = s[++i];
    switch (e) {
      case 'n':
        out.push_back('\n');
        break;
      case 't':
        out.push_back('\t');
        break;
      case 'r':
        out.push_back('\r');
        break;
      default:
        out.push_back(e);
        break;  // \\, \', \" and anything else: the character itself
    }
  }
  return out;
}

}  // namespace

const char* chat_format_name(ChatFormat f) {
  switch (f) {
    case ChatFormat::Gemma:
      return "gemma";
    case ChatFormat::ChatML:
      return "chatml";
    case ChatFormat::Llama3:
      return "llama3";
  }
  return "unknown";
}

ChatFormat chat_format_from_name(std::string_view name) {
  if (name == "gemma") return ChatFormat::Gemma;
  if (name == "chatml") return ChatFormat::ChatML;
  if (name == "llama3") return ChatFormat::Llama3;
  throw Error("unknown chat format '" + std::string(name) + "' (known: gemma, chatml, llama3)");
}

ChatFormat detect_chat_format(const GgufFile& file, const Tokenizer& tok) {
  if (const auto tmpl = file.get_string_opt("tokenizer.chat_template")) {
    if (contains(*tmpl, "<start_of_turn>")) return ChatFormat::Gemma;
    if (contains(*tmpl, "<|start_header_id|>")) return ChatFormat::Llama3;
    if (contains(*tmpl, "<|im_start|>")) return ChatFormat::ChatML;
  }
  // Gemma files often carry no template; the architecture names the family.
  if (const auto arch = file.get_string_opt("general.architecture"); arch && arch->starts_with("gemma")) {
    return ChatFormat::Gemma;
  }
  auto has = [&](std::string_view t) { return tok.find_token(t) >= 0; };
  if (has("<start_of_turn>") && has("<end_of_turn>")) return ChatFormat::Gemma;
  if (has("<|start_header_id|>") && has("<|end_header_id|>") && has("<|eot_id|>")) return ChatFormat::Llama3;
  if (has("<|im_start|>") && has("<|im_end|>")) return ChatFormat::ChatML;
  throw Error(file.name() + ": no built-in chat format fits this model (supported: gemma, chatml, llama3)");
}

std::string default_system_prompt(const GgufFile& file) {
  const auto tmpl = file.get_string_opt("tokenizer.chat_template");
  if (!tmpl) return "";
  // A ChatML template that hard-codes a system turn ('<|im_start|>system\n<text><|im_end|>' inside one
  // string literal) writes it when the conversation has no system message of its own.
  for (std::string_view newline : {std::string_view("\n"), std::string_view("\\n")}) {
    const std::string marker = "<|im_start|>system" + std::string(newline);
    for (size_t pos = tmpl->find(marker); pos != std::string_view::npos; pos = tmpl->find(marker, pos + 1)) {
      // Which quote opened the literal that holds the marker?
      const size_t open = tmpl->find_last_of("'\"", pos);
      if (open == std::string_view::npos) continue;
      const char quote = (*tmpl)[open];
      const std::string body = unescape_jinja_literal(tmpl->substr(pos + marker.size()), quote);
      const size_t end = body.find("<|im_end|>");
      if (end != std::string::npos && end > 0) return body.substr(0, end);
    }
  }
  return "";
}

std::string apply_chat_template(ChatFormat f, std::span<const ChatMessage> messages,
                                bool add_generation_prompt, const std::string& default_system,
                                std::vector<Tokenizer::TextRange>* content_ranges) {
  std::string out;
  // Appends what a message says (recording where it lies: text, never control tokens).
  auto content = [&](std::string_view text) {
    if (content_ranges && !text.empty()) content_ranges->push_back({out.size(), text.size()});
    out += text;
  };
  switch (f) {
    case ChatFormat::Gemma: {
      // Gemma has no system role: system text goes at the top of the next user turn.
      std::string system;
      for (const ChatMessage& m : messages) {
        if (m.role == "system") {
          system += trim(m.content);
          continue;
        }
        const std::string role = m.role == "assistant" ? "model" : m.role;
        out += "<start_of_turn>" + role + "\n";
        if (!system.empty() && role != "model") {
          content(system);
          out += "\n\n";
          system.clear();
        }
        content(trim(m.content));
        out += "<end_of_turn>\n";
      }
      if (!system.empty())
        throw Error("the gemma chat format has no system role: a system message must be followed by a user message");
      if (add_generation_prompt) out += "<start_of_turn>model\n";
      break;
    }
    case ChatFormat::ChatML: {
      if (!default_system.empty() && !messages.empty() && messages[0].role != "system") {
        out += "<|im_start|>system\n" + default_system + "<|im_end|>\n";
      }
      for (const ChatMessage& m : messages) {
        out += "<|im_start|>" + m.role + "\n";
        content(m.content);
        out += "<|im_end|>\n";
      }
      if (add_generation_prompt) out += "<|im_start|>assistant\n";
      break;
    }
    case ChatFormat::Llama3: {
      for (const ChatMessage& m : messages) {
        out += "<|start_header_id|>" + m.role + "<|end_header_id|>\n\n";
        content(trim(m.content));
        out += "<|eot_id|>";
      }
      if (add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      break;
    }
  }
  return out;
}

std::vector<int32_t> encode_chat(const Tokenizer& tok, ChatFormat f, std::span<const ChatMessage> messages,
                                 const std::string& default_system) {
  std::vector<Tokenizer::TextRange> contents;
  const std::string text = apply_chat_template(f, messages, true, default_system, &contents);
  return tok.encode_with_literals(text, tok.add_bos_default(), contents);
}

}  // namespace microspec
