// `microspec tokenize`: token ids of a text, plus a JSON-lines batch mode that the conformance
// tests use to run many encode/decode/chat requests in one process.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/common.h"
#include "gguf/gguf.h"
#include "model/model_file.h"
#include "tokenizer/chat.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"
#include "util/error.h"

namespace microspec::cli {
namespace {

using nlohmann::json;

struct TokenizeOptions {
  std::string model;
  std::optional<std::string> prompt;
  std::string file;
  bool use_stdin = false;
  std::string batch;
  bool no_bos = false;
  bool no_special = false;
  bool ids = false;
  bool pieces = false;
  bool json_out = false;
};

std::string read_stream(std::FILE* f, const std::string& what) {
  std::string out;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
  if (std::ferror(f)) throw Error("cannot read " + what);
  return out;
}

constexpr char kB64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

std::string base64_encode(std::string_view in) {
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    const uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8) | uint8_t(in[i + 2]);
    out += {kB64[v >> 18], kB64[(v >> 12) & 63], kB64[(v >> 6) & 63], kB64[v & 63]};
  }
  if (i + 1 == in.size()) {
    const uint32_t v = uint8_t(in[i]) << 16;
    out += {kB64[v >> 18], kB64[(v >> 12) & 63], '=', '='};
  } else if (i + 2 == in.size()) {
    const uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8);
    out += {kB64[v >> 18], kB64[(v >> 12) & 63], kB64[(v >> 6) & 63], '='};
  }
  return out;
}

std::string base64_decode(std::string_view in) {
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    if (c == '=') break;
    const int v = value(c);
    if (v < 0) throw Error("invalid base64 text");
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xFF));
    }
  }
  return out;
}

// A piece made printable on a terminal: valid UTF-8 kept, control characters and bytes that are
// not valid UTF-8 written as escapes.
std::string escape_piece(std::string_view s) {
  std::string out;
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  for (size_t i = 0; i < s.size();) {
    const uint8_t b = p[i];
    if (b == '\n') {
      out += "\\n", ++i;
    } else if (b == '\t') {
      out += "\\t", ++i;
    } else if (b == '\r') {
      out += "\\r", ++i;
    } else if (b == '\\') {
      out += "\\\\", ++i;
    } else if (b >= 0x20 && b < 0x7F) {
      out.push_back(static_cast<char>(b)), ++i;
    } else {
      size_t subpart = 0;
      const int len = b >= 0x80 ? utf8::check_sequence(p + i, s.size() - i, &subpart) : 0;
      if (len > 0) {
        out.append(s.substr(i, static_cast<size_t>(len)));
        i += static_cast<size_t>(len);
      } else {
        char hex[8];
        std::snprintf(hex, sizeof(hex), "\\x%02X", b);
        out += hex;
        ++i;
      }
    }
  }
  return out;
}

std::string dump_json(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::vector<int32_t> ids_from_json(const json& j) {
  std::vector<int32_t> ids;
  for (const json& v : j) ids.push_back(v.get<int32_t>());
  return ids;
}

json handle_batch_request(const json& req, const GgufFile& file, const Tokenizer& tok) {
  const std::string op = req.value("op", "encode");
  if (op == "encode") {
    std::string text;
    if (req.contains("text_b64")) {
      text = base64_decode(req.at("text_b64").get<std::string>());
    } else {
      text = req.at("text").get<std::string>();
    }
    const bool add_bos = req.value("add_bos", tok.add_bos_default());
    const bool special = req.value("special", true);
    return json{{"ids", tok.encode(text, add_bos, special)}};
  }
  if (op == "decode") {
    const std::vector<int32_t> ids = ids_from_json(req.at("ids"));
    return json{{"text_b64", base64_encode(tok.decode(ids, req.value("special", false)))}};
  }
  if (op == "pieces") {
    json pieces = json::array();
    const bool special = req.value("special", false);
    for (int32_t id : ids_from_json(req.at("ids")))
      pieces.push_back(base64_encode(tok.token_to_piece(id, special)));
    return json{{"pieces_b64", pieces}};
  }
  if (op == "chat") {
    std::vector<ChatMessage> messages;
    for (const json& m : req.at("messages")) {
      messages.push_back(ChatMessage{m.at("role").get<std::string>(), m.at("content").get<std::string>()});
    }
    const ChatStyle style = chat_style_for(file, tok, req.value("format", std::string()));
    const GenerationPrompt prompt =
        req.value("add_generation_prompt", true) ? GenerationPrompt::Add : GenerationPrompt::Omit;
    return json{{"format", style.name}, {"text", render_chat(style, tok, messages, nullptr, prompt)}};
  }
  if (op == "info") {
    json info{{"n_vocab", tok.n_vocab()},
              {"bos", tok.bos_id()},
              {"eos", tok.eos_id()},
              {"add_bos", tok.add_bos_default()},
              {"eog", tok.end_of_generation_ids()},
              {"default_system", default_system_prompt(file)}};
    try {
      info["chat_format"] = chat_format_name(detect_chat_format(file, tok));
    } catch (const Error&) {
      info["chat_format"] = nullptr;
    }
    return info;
  }
  throw Error("unknown op '" + op + "' (encode, decode, pieces, chat, info)");
}

void run_batch(const TokenizeOptions& o, const GgufFile& file, const Tokenizer& tok) {
  std::string input = o.batch == "-" ? read_stream(stdin, "standard input") : read_file_bytes(o.batch);
  size_t line_no = 0;
  size_t start = 0;
  std::string out;
  while (start < input.size()) {
    size_t end = input.find('\n', start);
    if (end == std::string::npos) end = input.size();
    const std::string_view line(input.data() + start, end - start);
    start = end + 1;
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    try {
      const json req = json::parse(line);
      out += dump_json(handle_batch_request(req, file, tok));
      out += '\n';
    } catch (const json::exception& e) {
      throw Error(o.batch + ": line " + std::to_string(line_no) + ": " + e.what());
    } catch (const Error& e) {
      throw Error(o.batch + ": line " + std::to_string(line_no) + ": " + e.what());
    }
  }
  std::fwrite(out.data(), 1, out.size(), stdout);
}

void run_tokenize(const TokenizeOptions& o) {
  const int sources =
      (o.prompt ? 1 : 0) + (o.file.empty() ? 0 : 1) + (o.use_stdin ? 1 : 0) + (o.batch.empty() ? 0 : 1);
  if (sources != 1) throw Error("tokenize: give exactly one of -p, -f, --stdin, --batch-jsonl");
  if (o.ids && o.pieces) throw Error("tokenize: --ids and --pieces exclude each other");
  const auto file = open_model_file(o.model);
  const auto tok = Tokenizer::from_gguf(*file);
  if (!o.batch.empty()) {
    run_batch(o, *file, *tok);
    return;
  }
  const std::string text = o.prompt      ? *o.prompt
                           : o.use_stdin ? read_stream(stdin, "standard input")
                                         : read_file_bytes(o.file);
  const std::vector<int32_t> ids = tok->encode(text, !o.no_bos && tok->add_bos_default(), !o.no_special);

  std::string out;
  if (o.json_out) {
    json j = json::array();
    for (int32_t id : ids) {
      if (o.pieces) {
        j.push_back(json{{"id", id}, {"piece", tok->token_to_piece(id, true)}});
      } else {
        j.push_back(id);
      }
    }
    out = dump_json(j) + "\n";
  } else if (o.pieces) {
    for (int32_t id : ids)
      out += std::to_string(id) + "\t" + escape_piece(tok->token_to_piece(id, true)) + "\n";
  } else {
    for (size_t i = 0; i < ids.size(); ++i) {
      if (i) out += ' ';
      out += std::to_string(ids[i]);
    }
    out += '\n';
  }
  std::fwrite(out.data(), 1, out.size(), stdout);
}

}  // namespace

void add_tokenize_command(CLI::App& app) {
  auto opts = std::make_shared<TokenizeOptions>();
  CLI::App* cmd = app.add_subcommand("tokenize", "print the token ids of a text");
  add_model_path_option(*cmd, opts->model, "GGUF model file");
  cmd->option_defaults()->group(group::kInput);
  cmd->add_option("-p,--prompt", opts->prompt, "text to tokenize");
  cmd->add_option("-f,--file", opts->file, "read the text from this file (bytes kept exactly)");
  cmd->add_flag("--stdin", opts->use_stdin, "read the text from standard input");
  cmd->add_option("--batch-jsonl", opts->batch,
                  "run JSON-lines requests from this file ('-' for stdin), one JSON reply per line. "
                  "Requests: {\"op\":\"encode\",\"text_b64\"|\"text\",\"add_bos\",\"special\"}, "
                  "{\"op\":\"decode\"|\"pieces\",\"ids\",\"special\"}, "
                  "{\"op\":\"chat\",\"messages\",\"add_generation_prompt\",\"format\"}, {\"op\":\"info\"}");
  cmd->add_flag("--no-bos", opts->no_bos, "do not add BOS even where the model file asks for it");
  cmd->add_flag("--no-special", opts->no_special, "treat special-token strings in the text as plain text");
  cmd->option_defaults()->group(group::kOutput);
  cmd->add_flag("--ids", opts->ids, "print ids on one line, space separated (default)");
  cmd->add_flag("--pieces", opts->pieces, "print one token per line: id, tab, the token's text (escaped)");
  cmd->add_flag("--json", opts->json_out, "print a JSON array (of ids, or of {id, piece} with --pieces)");
  cmd->callback([opts] { run_tokenize(*opts); });
}

}  // namespace microspec::cli
