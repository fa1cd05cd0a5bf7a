#pragma once
// The chat page served at GET /: one self-contained HTML file (inline CSS and JavaScript, no
// build step) that streams replies from /v1/chat/completions and shows each reply's tok/s,
// acceptance length and active draft vocabulary.
#include <string_view>

namespace microspec::server {

std::string_view chat_page_html();

}  // namespace microspec::server
