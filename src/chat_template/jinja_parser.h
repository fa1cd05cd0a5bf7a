#pragma once
// Tokens to the syntax tree, with jinja2's grammar and operator precedence.
#include <string_view>

#include "chat_template/jinja_ast.h"

namespace microspec::jinja {

// The whole template. Throws Error naming the line and the construct for a syntax error, an
// unknown tag, an unclosed block, or nesting deeper than 256 levels.
Body parse_template(std::string_view source);

}  // namespace microspec::jinja
