// The Jinja lexer: template data between tags, and the expression tokens inside {{ }} and {% %}.
#include "chat_template/jinja_lexer.h"

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "chat_template/jinja_value.h"
#include "util/error.h"

namespace microspec::jinja {
namespace {

constexpr size_t kMaxSourceBytes = 1u << 20;  // real chat templates are under 20 KB

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}
bool is_name_start(char c) {
  return std::isalpha(static_cast<unsigned char>(c)) || c == '_';
}
bool is_name_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
}
bool is_digit(char c) {
  return c >= '0' && c <= '9';
}

// "\r\n" and "\r" become "\n"; one trailing newline is dropped.
std::string normalize_newlines(std::string_view source) {
  std::string out;
  out.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      out += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      out += source[i];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

class Lexer {
 public:
  explicit Lexer(std::string src) : src_(std::move(src)) {}

  std::vector<Token> run() {
    while (pos_ < src_.size()) {
      const size_t tag = find_tag(pos_);
      if (tag == std::string::npos) {
        emit_text(src_.substr(pos_));
        pos_ = src_.size();
        break;
      }
      lex_tag(tag);
    }
    tokens_.push_back(Token{TokenKind::End, line_, "", 0, 0});
    return std::move(tokens_);
  }

 private:
  std::string src_;
  size_t pos_ = 0;
  int line_ = 1;
  std::vector<Token> tokens_;

  size_t find_tag(size_t from) const {
    for (size_t p = src_.find('{', from); p != std::string::npos; p = src_.find('{', p + 1)) {
      if (p + 1 < src_.size() && (src_[p + 1] == '{' || src_[p + 1] == '%' || src_[p + 1] == '#')) return p;
    }
    return std::string::npos;
  }

  void advance_to(size_t p) {
    for (size_t i = pos_; i < p && i < src_.size(); ++i)
      if (src_[i] == '\n') ++line_;
    pos_ = p;
  }

  void emit_text(std::string text) {
    if (text.empty()) return;
    const int line = line_;
    tokens_.push_back(Token{TokenKind::Text, line, std::move(text), 0, 0});
  }

  // The data before a tag, with '-' (strip all whitespace) or lstrip_blocks applied.
  std::string data_before(size_t tag, char modifier, bool block_or_comment) const {
    std::string text = src_.substr(pos_, tag - pos_);
    if (modifier == '-') {
      size_t end = text.size();
      while (end > 0 && is_space(text[end - 1])) --end;
      text.resize(end);
    } else if (block_or_comment && modifier != '+') {
      const size_t nl = text.rfind('\n');
      const size_t line_start = nl == std::string::npos ? 0 : nl + 1;
      const bool at_line_start = line_start > 0 || pos_ == 0 || src_[pos_ - 1] == '\n';
      if (at_line_start && text.find_first_not_of(" \t", line_start) == std::string::npos)
        text.resize(line_start);
    }
    return text;
  }

  // After a tag's end: '-' strips all whitespace, else trim_blocks drops one newline.
  void after_tag(char end_modifier, bool trim_newline) {
    if (end_modifier == '-') {
      size_t p = pos_;
      while (p < src_.size() && is_space(src_[p])) ++p;
      advance_to(p);
    } else if (trim_newline && end_modifier != '+' && pos_ < src_.size() && src_[pos_] == '\n') {
      advance_to(pos_ + 1);
    }
  }

  void lex_tag(size_t tag) {
    const char type = src_[tag + 1];
    const char modifier = tag + 2 < src_.size() ? src_[tag + 2] : '\0';
    const bool has_modifier = modifier == '-' || (modifier == '+' && type != '{');  // {{+ is unary plus
    emit_text(data_before(tag, has_modifier ? modifier : '\0', type != '{'));
    advance_to(tag);
    const int open_line = line_;
    if (type == '#') {
      lex_comment(tag, has_modifier ? 3 : 2, open_line);
      return;
    }
    advance_to(tag + (has_modifier ? 3 : 2));
    if (type == '%' && lex_raw(open_line)) return;
    tokens_.push_back(Token{type == '{' ? TokenKind::VarBegin : TokenKind::BlockBegin, open_line, "", 0, 0});
    lex_expression_tokens(type == '{' ? "}}" : "%}", open_line);
  }

  void lex_comment(size_t tag, size_t open_len, int open_line) {
    const size_t end = src_.find("#}", tag + open_len);
    if (end == std::string::npos)
      throw Error("template line " + std::to_string(open_line) + ": unterminated comment '{#'");
    const char end_modifier =
        end > tag + open_len && (src_[end - 1] == '-' || src_[end - 1] == '+') ? src_[end - 1] : '\0';
    advance_to(end + 2);
    after_tag(end_modifier, true);
  }

  // {% raw %}...{% endraw %}: the text between is data. Returns false for any other tag.
  bool lex_raw(int open_line) {
    size_t p = pos_;
    while (p < src_.size() && is_space(src_[p])) ++p;
    if (src_.compare(p, 3, "raw") != 0 || (p + 3 < src_.size() && is_name_char(src_[p + 3]))) return false;
    p += 3;
    while (p < src_.size() && is_space(src_[p])) ++p;
    const bool strip_after = src_.compare(p, 3, "-%}") == 0;
    if (!strip_after && src_.compare(p, 2, "%}") != 0) return false;
    advance_to(p + (strip_after ? 3 : 2));
    after_tag(strip_after ? '-' : '+', false);
    for (size_t q = src_.find("{%", pos_); q != std::string::npos; q = src_.find("{%", q + 1)) {
      size_t r = q + 2;
      const char modifier = r < src_.size() && (src_[r] == '-' || src_[r] == '+') ? src_[r++] : '\0';
      while (r < src_.size() && is_space(src_[r])) ++r;
      if (src_.compare(r, 6, "endraw") != 0) continue;
      r += 6;
      while (r < src_.size() && is_space(src_[r])) ++r;
      const char end_modifier = r < src_.size() && (src_[r] == '-' || src_[r] == '+') ? src_[r] : '\0';
      const size_t close = r + (end_modifier ? 1 : 0);
      if (src_.compare(close, 2, "%}") != 0) continue;
      emit_text(data_before(q, modifier, true));
      advance_to(close + 2);
      after_tag(end_modifier, true);
      return true;
    }
    throw Error("template line " + std::to_string(open_line) +
                ": unterminated '{% raw %}' (no '{% endraw %}')");
  }

  void lex_expression_tokens(const char* end, int open_line) {
    int depth = 0;
    const bool block = end[0] == '%';
    while (true) {
      while (pos_ < src_.size() && is_space(src_[pos_])) advance_to(pos_ + 1);
      if (pos_ >= src_.size())
        throw Error("template line " + std::to_string(open_line) + ": unterminated '" +
                    (block ? "{%" : "{{") + "' tag");
      if (depth == 0) {
        const char c = src_[pos_];
        const bool modified = (c == '-' || (block && c == '+')) && src_.compare(pos_ + 1, 2, end) == 0;
        if (modified || src_.compare(pos_, 2, end) == 0) {
          tokens_.push_back(Token{block ? TokenKind::BlockEnd : TokenKind::VarEnd, line_, "", 0, 0});
          advance_to(pos_ + (modified ? 3 : 2));
          after_tag(modified ? c : '\0', block);
          return;
        }
      }
      lex_one_token(&depth);
    }
  }

  void lex_one_token(int* depth) {
    const char c = src_[pos_];
    if (c == '\'' || c == '"') return lex_string(c);
    if (is_digit(c)) return lex_number();
    if (is_name_start(c)) {
      size_t p = pos_;
      while (p < src_.size() && is_name_char(src_[p])) ++p;
      tokens_.push_back(Token{TokenKind::Name, line_, src_.substr(pos_, p - pos_), 0, 0});
      advance_to(p);
      return;
    }
    static const char* const kTwoChar[] = {"//", "**", "==", "!=", "<=", ">="};
    for (const char* op : kTwoChar) {
      if (src_.compare(pos_, 2, op) == 0) {
        tokens_.push_back(Token{TokenKind::Op, line_, op, 0, 0});
        advance_to(pos_ + 2);
        return;
      }
    }
    if (std::strchr("+-*/%~|.,:()[]{}=<>;", c) == nullptr || c == '\0') {
      throw Error("template line " + std::to_string(line_) + ": unexpected character '" + std::string(1, c) +
                  "' in a tag");
    }
    if (c == '(' || c == '[' || c == '{') ++*depth;
    if ((c == ')' || c == ']' || c == '}') && *depth > 0) --*depth;
    tokens_.push_back(Token{TokenKind::Op, line_, std::string(1, c), 0, 0});
    advance_to(pos_ + 1);
  }

  void lex_number() {
    size_t p = pos_;
    auto digits = [&] {
      while (p < src_.size() &&
             (is_digit(src_[p]) || (src_[p] == '_' && p + 1 < src_.size() && is_digit(src_[p + 1]))))
        ++p;
    };
    digits();
    bool is_float = false;
    const bool after_dot = pos_ > 0 && src_[pos_ - 1] == '.';  // foo.0.1 is two subscripts
    if (!after_dot && p + 1 < src_.size() && src_[p] == '.' && is_digit(src_[p + 1])) {
      ++p;
      digits();
      is_float = true;
    }
    if (!after_dot && p < src_.size() && (src_[p] == 'e' || src_[p] == 'E')) {
      size_t q = p + 1;
      if (q < src_.size() && (src_[q] == '+' || src_[q] == '-')) ++q;
      if (q < src_.size() && is_digit(src_[q])) {
        p = q;
        digits();
        is_float = true;
      }
    }
    std::string spelled;
    for (size_t i = pos_; i < p; ++i)
      if (src_[i] != '_') spelled += src_[i];
    Token t{is_float ? TokenKind::Float : TokenKind::Int, line_, spelled, 0, 0};
    if (is_float) {
      t.number = std::strtod(spelled.c_str(), nullptr);
    } else {
      errno = 0;
      t.integer = std::strtoll(spelled.c_str(), nullptr, 10);
      if (errno == ERANGE)
        throw Error("template line " + std::to_string(line_) + ": integer " + spelled +
                    " does not fit in 64 bits");
    }
    tokens_.push_back(std::move(t));
    advance_to(p);
  }

  // A string literal; escapes are undone as Python's "unicode-escape" codec does.
  void lex_string(char quote) {
    const int line = line_;
    std::string out;
    size_t p = pos_ + 1;
    auto hex_value = [&](size_t at, int n) -> uint32_t {
      uint32_t v = 0;
      for (int k = 0; k < n; ++k) {
        const char h = at + k < src_.size() ? src_[at + k] : '\0';
        if (!std::isxdigit(static_cast<unsigned char>(h)))
          throw Error("template line " + std::to_string(line) +
                      ": truncated \\x, \\u or \\U escape in a string");
        v = v * 16 + static_cast<uint32_t>(std::isdigit(static_cast<unsigned char>(h))
                                               ? h - '0'
                                               : (std::tolower(h) - 'a' + 10));
      }
      return v;
    };
    while (true) {
      if (p >= src_.size())
        throw Error("template line " + std::to_string(line) + ": unterminated string literal");
      const char c = src_[p];
      if (c == quote) break;
      if (c != '\\') {
        out += c;
        ++p;
        continue;
      }
      if (p + 1 >= src_.size())
        throw Error("template line " + std::to_string(line) + ": unterminated string literal");
      const char e = src_[p + 1];
      p += 2;
      switch (e) {
        case '\n':
          break;
        case '\\':
          out += '\\';
          break;
        case '\'':
          out += '\'';
          break;
        case '"':
          out += '"';
          break;
        case 'n':
          out += '\n';
          break;
        case 't':
          out += '\t';
          break;
        case 'r':
          out += '\r';
          break;
        case 'a':
          out += '\a';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'v':
          out += '\v';
          break;
        case 'x':
          append_utf8(hex_value(p, 2), out), p += 2;
          break;
        case 'u':
          append_utf8(hex_value(p, 4), out), p += 4;
          break;
        case 'U': {
          const uint32_t cp = hex_value(p, 8);
          if (cp > 0x10FFFF)
            throw Error("template line " + std::to_string(line) + ": \\U escape beyond U+10FFFF");
          append_utf8(cp, out);
          p += 8;
          break;
        }
        case 'N':
          throw Error("template line " + std::to_string(line) + ": \\N{...} escapes are not supported");
        default:
          if (e >= '0' && e <= '7') {
            uint32_t v = static_cast<uint32_t>(e - '0');
            for (int k = 0; k < 2 && p < src_.size() && src_[p] >= '0' && src_[p] <= '7'; ++k, ++p)
              v = v * 8 + static_cast<uint32_t>(src_[p] - '0');
            append_utf8(v, out);
          } else {
            out += '\\';
            out += e;
          }
      }
    }
    tokens_.push_back(Token{TokenKind::String, line, std::move(out), 0, 0});
    advance_to(p + 1);
  }
};

}  // namespace

std::vector<Token> lex_template(std::string_view source) {
  if (source.size() > kMaxSourceBytes) throw Error("template larger than 1 MiB");
  return Lexer(normalize_newlines(source)).run();
}

std::string describe(const Token& t) {
  switch (t.kind) {
    case TokenKind::Text:
      return "template text";
    case TokenKind::VarBegin:
      return "'{{'";
    case TokenKind::VarEnd:
      return "end of '{{ }}'";
    case TokenKind::BlockBegin:
      return "'{%'";
    case TokenKind::BlockEnd:
      return "end of '{% %}' tag";
    case TokenKind::String:
      return "string literal";
    case TokenKind::Int:
    case TokenKind::Float:
    case TokenKind::Name:
    case TokenKind::Op:
      return "'" + t.text + "'";
    case TokenKind::End:
      return "end of template";
  }
  return "?";
}

}  // namespace microspec::jinja
