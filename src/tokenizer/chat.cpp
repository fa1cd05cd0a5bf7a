// Built-in chat formats. Rendering follows llama.cpp's built-in templates for the same formats
// (contents trimmed for Gemma and Llama 3, verbatim for ChatML), which also agree with the
// models' own Jinja templates for ordinary conversations.
#include "tokenizer/chat.h"

#include <cctype>
#include <nlohmann/json.hpp>

#include "chat_template/chat_template.h"
#include "gguf/gguf.h"
#include "tokenizer/tokenizer.h"
#include "util/error.h"
#include "util/file.h"

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

namespace {

ChatStyle jinja_style(const std::string& source, const std::string& name, const Tokenizer& tok) {
  ChatStyle style;
  style.jinja = std::make_shared<const ChatTemplate>(source);
  style.name = name;
  if (tok.bos_id() >= 0) style.bos_text = tok.token_text(tok.bos_id());
  if (tok.eos_id() >= 0) style.eos_text = tok.token_text(tok.eos_id());
  return style;
}

ChatStyle model_template_style(const GgufFile& file, const Tokenizer& tok) {
  const std::vector<NamedTemplate> templates = chat_templates_from_gguf(file);
  return jinja_style(select_chat_template(templates, "", file.name()).source, "the model's template", tok);
}

// True when encoding `text` with control-token strings parsed gives other tokens than as text.
bool holds_control_text(const Tokenizer& tok, std::string_view text) {
  return tok.encode(text, false, true) != tok.encode(text, false, false);
}

}  // namespace

ChatStyle chat_style_for(const GgufFile& file, const Tokenizer& tok, const std::string& chosen) {
  auto builtin = [&](ChatFormat f) {
    ChatStyle style;
    style.format = f;
    style.default_system = default_system_prompt(file);
    style.name = chat_format_name(f);
    return style;
  };
  if (chosen == "gemma" || chosen == "chatml" || chosen == "llama3") return builtin(chat_format_from_name(chosen));
  if (chosen == "model") return model_template_style(file, tok);
  if (!chosen.empty()) return jinja_style(read_file_bytes(chosen), chosen, tok);
  try {
    return builtin(detect_chat_format(file, tok));
  } catch (const Error& no_builtin) {
    if (!file.get_string_opt("tokenizer.chat_template")) throw;
    return model_template_style(file, tok);
  }
}

std::string render_chat(const ChatStyle& style, const Tokenizer& tok, std::span<const ChatMessage> messages,
                        std::vector<Tokenizer::TextRange>* content_ranges) {
  if (style.format) return apply_chat_template(*style.format, messages, true, style.default_system, content_ranges);
  nlohmann::ordered_json context;
  context["messages"] = nlohmann::ordered_json::array();
  for (const ChatMessage& m : messages)
    context["messages"].push_back({{"role", m.role}, {"content", m.content}});
  context["add_generation_prompt"] = true;
  context["bos_token"] = style.bos_text;
  context["eos_token"] = style.eos_text;
  ChatTemplateOptions options;
  options.now = current_utc_time();
  const std::string text = style.jinja->render(context, options);
  // Each message's text where the template wrote it, in order.
  size_t from = 0;
  for (const ChatMessage& m : messages) {
    if (m.content.empty()) continue;
    const size_t at = text.find(m.content, from);
    if (at == std::string::npos) {
      if (holds_control_text(tok, m.content))
        throw Error("the chat template (" + style.name + ") changed a " + m.role +
                    " message that holds control-token text, which would then be read as control tokens");
      continue;
    }
    if (content_ranges) content_ranges->push_back({at, m.content.size()});
    from = at + m.content.size();
  }
  return text;
}

std::vector<int32_t> encode_chat(const Tokenizer& tok, const ChatStyle& style, std::span<const ChatMessage> messages) {
  std::vector<Tokenizer::TextRange> contents;
  const std::string text = render_chat(style, tok, messages, &contents);
  const bool wrote_bos = !style.format && !style.bos_text.empty() && text.starts_with(style.bos_text);
  return tok.encode_with_literals(text, tok.add_bos_default() && !wrote_bos, contents);
}

}  // namespace microspec
