#pragma once
// Template text to tokens, with jinja2's whitespace rules as transformers configures them:
// trim_blocks (the first newline after a block or comment tag is removed), lstrip_blocks (spaces
// and tabs before a block or comment tag on its own line are removed), '-' on a tag strips all
// whitespace on that side, '+' turns the two options off for that side, newlines are normalized
// to "\n" and a single trailing newline is dropped (keep_trailing_newline=False).
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace microspec::jinja {

enum class TokenKind { Text, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, End };

struct Token {
  TokenKind kind;
  int line = 1;
  std::string text;  // Text and String: the content (escapes undone); Name, Op: the spelling
  int64_t integer = 0;
  double number = 0;
};

// Throws Error for an unterminated tag, comment or string, an unknown character or a number that
// does not fit in 64 bits.
std::vector<Token> lex_template(std::string_view source);

// A token as the error messages name it ("'endfor'", "end of tag").
std::string describe(const Token& t);

}  // namespace microspec::jinja
