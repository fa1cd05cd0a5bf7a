// Chat prompts through Jinja templates, and where the messages' text lies in the result.
#include "tokenizer/chat.h"

#include <charconv>
#include <nlohmann/json.hpp>
#include <optional>

#include "chat_template/chat_template.h"
#include "gguf/gguf.h"
#include "tokenizer/tokenizer.h"
#include "util/error.h"
#include "util/file.h"

namespace microspec {
namespace {

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

// A message as the template sees it: role and content, an assistant's tool_calls with each call's
// arguments as an object where they parse as one (OpenAI sends a JSON string), a tool result's
// tool_call_id.
nlohmann::ordered_json message_value(const ChatMessage& m) {
  nlohmann::ordered_json v{{"role", m.role}, {"content", m.content}};
  if (!m.tool_calls.is_null()) {
    nlohmann::ordered_json calls = m.tool_calls;
    for (auto& call : calls) {
      if (!call.is_object() || !call.contains("function") || !call["function"].is_object()) continue;
      auto& fn = call["function"];
      if (fn.contains("arguments") && fn["arguments"].is_string()) {
        const auto parsed = nlohmann::ordered_json::parse(fn["arguments"].get<std::string>(), nullptr, false);
        if (parsed.is_object()) fn["arguments"] = parsed;
      }
    }
    v["tool_calls"] = std::move(calls);
  }
  if (!m.tool_call_id.empty()) v["tool_call_id"] = m.tool_call_id;
  return v;
}

nlohmann::ordered_json chat_context(const ChatStyle& style, std::span<const ChatMessage> messages,
                                    GenerationPrompt prompt, const nlohmann::ordered_json* tools) {
  nlohmann::ordered_json context;
  context["messages"] = nlohmann::ordered_json::array();
  for (const ChatMessage& m : messages) context["messages"].push_back(message_value(m));
  if (tools) context["tools"] = *tools;
  context["add_generation_prompt"] = prompt == GenerationPrompt::Add;
  context["bos_token"] = style.bos_text;
  context["eos_token"] = style.eos_text;
  if (!style.default_system.empty()) context["default_system"] = style.default_system;
  return context;
}

// True when encoding `text` with control-token strings parsed gives other tokens than as text.
bool holds_control_text(const Tokenizer& tok, std::string_view text) {
  return tok.encode(text, false, true) != tok.encode(text, false, false);
}

constexpr const char* kAsciiSpace = " \t\n\v\f\r";

// The ranges from a second render in which each message's text, less the whitespace at its ends,
// is a marker "\x01<index>\x02". Put back in place of its marker, the texts must give `text`
// itself (each marker at most once), and then they lie exactly where the markers were; otherwise
// (a template that changed the text or wrote it twice) nothing.
std::optional<std::vector<Tokenizer::TextRange>> ranges_by_markers(const ChatStyle& style,
                                                                   std::span<const ChatMessage> messages,
                                                                   GenerationPrompt prompt,
                                                                   const nlohmann::ordered_json* tools,
                                                                   const ChatTemplateOptions& options,
                                                                   const std::string& text) {
  std::vector<ChatMessage> marked(messages.begin(), messages.end());
  std::vector<std::string_view> cores(messages.size());
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& c = messages[i].content;
    const size_t begin = c.find_first_not_of(kAsciiSpace);
    if (begin == std::string::npos) continue;  // whitespace alone: never control-token text
    const size_t end = c.find_last_not_of(kAsciiSpace) + 1;
    cores[i] = std::string_view(c).substr(begin, end - begin);
    marked[i].content = c.substr(0, begin) + "\x01" + std::to_string(i) + "\x02" + c.substr(end);
  }
  std::string with_markers;
  try {
    with_markers = style.jinja->render(chat_context(style, marked, prompt, tools), options);
  } catch (const Error&) {
    return std::nullopt;  // the template looks at the text itself
  }
  std::string rebuilt;
  std::vector<Tokenizer::TextRange> ranges;
  std::vector<bool> seen(messages.size(), false);
  size_t at = 0;
  for (size_t open = with_markers.find('\x01'); open != std::string::npos;
       open = with_markers.find('\x01', open + 1)) {
    const size_t close = with_markers.find('\x02', open);
    if (close == std::string::npos) break;
    size_t i = 0;
    const char* first = with_markers.data() + open + 1;
    const char* last = with_markers.data() + close;
    const auto [end, error] = std::from_chars(first, last, i);
    if (error != std::errc() || end != last || i >= messages.size() || cores[i].empty()) continue;
    if (seen[i]) return std::nullopt;
    seen[i] = true;
    rebuilt.append(with_markers, at, open - at);
    ranges.push_back({rebuilt.size(), cores[i].size()});
    rebuilt += cores[i];
    at = close + 1;
    open = close;
  }
  rebuilt.append(with_markers, at);
  if (rebuilt != text) return std::nullopt;
  return ranges;
}

// The ranges found by searching `text` for each message's text in order, for a template that
// changed some of it: text not found that holds control-token text is refused.
std::vector<Tokenizer::TextRange> ranges_by_search(const ChatStyle& style, const Tokenizer& tok,
                                                   std::span<const ChatMessage> messages,
                                                   const std::string& text) {
  std::vector<Tokenizer::TextRange> ranges;
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
    ranges.push_back({at, m.content.size()});
    from = at + m.content.size();
  }
  return ranges;
}

}  // namespace

ChatStyle builtin_chat_style(ChatFormat f, const std::string& default_system) {
  const BuiltinTemplate& t = builtin_template(f);
  ChatStyle style;
  style.jinja = std::make_shared<const ChatTemplate>(t.source);
  if (t.writes_default_system) style.default_system = default_system;
  style.name = t.name;
  return style;
}

ChatStyle chat_style_for(const GgufFile& file, const Tokenizer& tok, const std::string& chosen) {
  if (is_builtin_template_name(chosen))
    return builtin_chat_style(chat_format_from_name(chosen), default_system_prompt(file));
  if (chosen == "model") return model_template_style(file, tok);
  if (!chosen.empty()) return jinja_style(read_file_bytes(chosen), chosen, tok);
  try {
    return builtin_chat_style(detect_chat_format(file, tok), default_system_prompt(file));
  } catch (const Error& no_builtin) {
    if (!file.get_string_opt("tokenizer.chat_template")) throw;
    return model_template_style(file, tok);
  }
}

// Tool definitions and calls are rendered as template data, and so tokenized with control tokens
// parsed: control-token text in them is refused.
void refuse_control_text_in_tools(const Tokenizer& tok, std::span<const ChatMessage> messages,
                                  const nlohmann::ordered_json* tools) {
  if (tools && holds_control_text(tok, tools->dump()))
    throw Error("the tool definitions hold control-token text");
  for (const ChatMessage& m : messages)
    if (!m.tool_calls.is_null() && holds_control_text(tok, m.tool_calls.dump()))
      throw Error("a message's tool calls hold control-token text");
}

std::string render_chat(const ChatStyle& style, const Tokenizer& tok, std::span<const ChatMessage> messages,
                        std::vector<Tokenizer::TextRange>* content_ranges, GenerationPrompt prompt,
                        const nlohmann::ordered_json* tools) {
  refuse_control_text_in_tools(tok, messages, tools);
  ChatTemplateOptions options;
  options.now = current_utc_time();
  const std::string text = style.jinja->render(chat_context(style, messages, prompt, tools), options);
  if (!content_ranges) return text;
  if (auto exact = ranges_by_markers(style, messages, prompt, tools, options, text)) {
    content_ranges->insert(content_ranges->end(), exact->begin(), exact->end());
  } else {
    const std::vector<Tokenizer::TextRange> found = ranges_by_search(style, tok, messages, text);
    content_ranges->insert(content_ranges->end(), found.begin(), found.end());
  }
  return text;
}

std::vector<int32_t> encode_chat(const Tokenizer& tok, const ChatStyle& style,
                                 std::span<const ChatMessage> messages, GenerationPrompt prompt,
                                 const nlohmann::ordered_json* tools) {
  std::vector<Tokenizer::TextRange> contents;
  const std::string text = render_chat(style, tok, messages, &contents, prompt, tools);
  const bool wrote_bos = !style.bos_text.empty() && text.starts_with(style.bos_text);
  return tok.encode_with_literals(text, tok.add_bos_default() && !wrote_bos, contents);
}

}  // namespace microspec
