#include "server/api.h"

#include <cmath>
#include <limits>
#include <random>

#include "chat_template/chat_template.h"
#include "grammar/json_schema.h"
#include "tokenizer/unicode.h"
#include "util/error.h"

namespace microspec::server {

using nlohmann::json;

namespace {

// Deeper JSON than any real request needs; bounds the parser's work on hostile bodies.
constexpr int kMaxJsonDepth = 64;

// A token's bytes as a JSON array of numbers (OpenAI's `bytes`, llama-server's non-UTF-8 pieces).
json bytes_json(const std::string& piece) {
  json bytes = json::array();
  for (unsigned char c : piece) bytes.push_back(int(c));
  return bytes;
}

const char* json_type_name(const json& j) {
  switch (j.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "a boolean";
    case json::value_t::string:
      return "a string";
    case json::value_t::array:
      return "an array";
    case json::value_t::object:
      return "an object";
    case json::value_t::number_float:
      return "a decimal number";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
      return "an integer";
    default:
      return "an unsupported value";
  }
}

[[noreturn]] void wrong_type(const std::string& param, const char* expected, const json& got) {
  throw ApiError(400,
                 "Invalid type for '" + param + "': expected " + expected + ", but got " +
                     json_type_name(got) + " instead.",
                 param, "invalid_type");
}

std::string number_text(double x) {
  std::string s = json(x).dump();
  if (s.size() > 2 && s.compare(s.size() - 2, 2, ".0") == 0) s.resize(s.size() - 2);
  return s;
}

// The field's value, or nullptr when it is absent or null (null means "default" in OpenAI's API).
const json* field(const json& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

// The field's value; absent or null is a 400 naming `param` (the field's path in the request).
const json& required_field(const json& obj, const char* key, const std::string& param) {
  const json* v = field(obj, key);
  if (!v) throw ApiError(400, "Missing required parameter: '" + param + "'.", param, "missing_required_parameter");
  return *v;
}

double number_field(const json& obj, const char* key, double lo, double hi, double fallback) {
  const json* v = field(obj, key);
  if (!v) return fallback;
  if (!v->is_number()) wrong_type(key, "a number", *v);
  const double x = v->get<double>();
  if (!(x >= lo))
    throw ApiError(400,
                   std::string("Invalid '") + key + "': number below minimum value. Expected a value >= " +
                       number_text(lo) + ", but got " + number_text(x) + " instead.",
                   key, "below_minimum");
  if (!(x <= hi))
    throw ApiError(400,
                   std::string("Invalid '") + key + "': number above maximum value. Expected a value <= " +
                       number_text(hi) + ", but got " + number_text(x) + " instead.",
                   key, "above_maximum");
  return x;
}

// An integer field; values past int64 (JSON allows any size) count as out of range.
int64_t integer_field(const json& obj, const char* key, int64_t lo, int64_t hi, int64_t fallback) {
  const json* v = field(obj, key);
  if (!v) return fallback;
  if (!v->is_number_integer()) wrong_type(key, "an integer", *v);
  const bool huge =
      v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max());
  const int64_t x = huge ? std::numeric_limits<int64_t>::max() : v->get<int64_t>();
  if (x < lo)
    throw ApiError(400,
                   std::string("Invalid '") + key + "': integer below minimum value. Expected a value >= " +
                       std::to_string(lo) + ", but got " + std::to_string(x) + " instead.",
                   key, "below_minimum");
  if (huge || x > hi)
    throw ApiError(400,
                   std::string("Invalid '") + key + "': integer above maximum value. Expected a value <= " +
                       std::to_string(hi) + ", but got " + v->dump() + " instead.",
                   key, "above_maximum");
  return x;
}

bool bool_field(const json& obj, const char* key, bool fallback) {
  const json* v = field(obj, key);
  if (!v) return fallback;
  if (!v->is_boolean()) wrong_type(key, "a boolean", *v);
  return v->get<bool>();
}

[[noreturn]] void unsupported(const std::string& param, const std::string& what) {
  throw ApiError(400, what + " is not supported by this server.", param, "unsupported_parameter");
}

// The text of a message's content: a string, or an array of {"type": "text", "text": ...} parts.
std::string message_content(const json& content, const std::string& param) {
  if (content.is_null()) return "";
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) wrong_type(param, "a string or an array of content parts", content);
  std::string text;
  for (size_t i = 0; i < content.size(); ++i) {
    const json& part = content[i];
    const std::string p = param + "[" + std::to_string(i) + "]";
    if (!part.is_object()) wrong_type(p, "an object", part);
    const json* type = field(part, "type");
    if (!type || !type->is_string())
      throw ApiError(400, "Missing required parameter: '" + p + ".type'.", p + ".type",
                     "missing_required_parameter");
    if (type->get<std::string>() != "text")
      throw ApiError(
          400, "Content parts of type '" + type->get<std::string>() + "' are not supported (text only).",
          p + ".type", "unsupported_content_type");
    const json* t = field(part, "text");
    if (!t || !t->is_string()) wrong_type(p + ".text", "a string", t ? *t : json());
    text += t->get<std::string>();
  }
  return text;
}

// An assistant message's tool_calls: [{"id", "type": "function", "function": {"name", "arguments"}}],
// arguments a string (OpenAI's) or an object.
void validate_tool_calls(const json& calls, const std::string& p) {
  if (!calls.is_array()) wrong_type(p, "an array", calls);
  for (size_t i = 0; i < calls.size(); ++i) {
    const std::string q = p + "[" + std::to_string(i) + "]";
    const json& call = calls[i];
    if (!call.is_object()) wrong_type(q, "an object", call);
    if (const json* id = field(call, "id"); id && !id->is_string()) wrong_type(q + ".id", "a string", *id);
    const json* fn = field(call, "function");
    if (!fn || !fn->is_object()) wrong_type(q + ".function", "an object", fn ? *fn : json());
    const json* name = field(*fn, "name");
    if (!name || !name->is_string()) wrong_type(q + ".function.name", "a string", name ? *name : json());
    const json* args = field(*fn, "arguments");
    if (!args || !(args->is_string() || args->is_object()))
      wrong_type(q + ".function.arguments", "a string or an object", args ? *args : json());
  }
}

std::vector<ChatMessage> parse_messages(const json& body) {
  const json* msgs = &required_field(body, "messages", "messages");
  if (!msgs->is_array()) wrong_type("messages", "an array", *msgs);
  if (msgs->empty())
    throw ApiError(400, "Invalid 'messages': empty array. Expected an array with minimum length 1.",
                   "messages", "empty_array");
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < msgs->size(); ++i) {
    const json& m = (*msgs)[i];
    const std::string p = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) wrong_type(p, "an object", m);
    const json* role = &required_field(m, "role", p + ".role");
    if (!role->is_string()) wrong_type(p + ".role", "a string", *role);
    std::string r = role->get<std::string>();
    if (r == "developer") r = "system";  // OpenAI's newer name for the system role
    if (r != "system" && r != "user" && r != "assistant" && r != "tool")
      throw ApiError(400,
                     "Invalid value for '" + p + ".role': '" + role->get<std::string>() +
                         "'. Supported values are: 'system', 'developer', 'user', 'assistant' and 'tool'.",
                     p + ".role", "invalid_value");
    ChatMessage msg;
    msg.role = r;
    const json* calls = field(m, "tool_calls");
    if (calls) {
      if (r != "assistant") unsupported(p + ".tool_calls", "tool_calls outside an assistant message are");
      validate_tool_calls(*calls, p + ".tool_calls");
      msg.tool_calls = nlohmann::ordered_json::parse(calls->dump());
    }
    if (r == "tool") {
      const json* id = field(m, "tool_call_id");
      if (!id || !id->is_string()) wrong_type(p + ".tool_call_id", "a string", id ? *id : json());
      msg.tool_call_id = id->get<std::string>();
    }
    auto content = m.find("content");
    if (content == m.end() && !calls)
      throw ApiError(400, "Missing required parameter: '" + p + ".content'.", p + ".content",
                     "missing_required_parameter");
    if (content != m.end()) msg.content = message_content(*content, p + ".content");
    out.push_back(std::move(msg));
  }
  return out;
}

std::vector<int32_t> parse_prompt(const json& body, const Tokenizer& tok) {
  const json* prompt = &required_field(body, "prompt", "prompt");
  auto token_ids = [&](const json& arr, const std::string& param) {
    std::vector<int32_t> ids;
    for (size_t i = 0; i < arr.size(); ++i) {
      const json& v = arr[i];
      if (!v.is_number_integer())
        wrong_type(param + "[" + std::to_string(i) + "]", "a token id (integer)", v);
      const bool huge = v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT32_MAX);
      const int64_t id = huge ? int64_t(INT32_MAX) + 1 : v.get<int64_t>();
      if (id < 0 || id >= tok.n_vocab())
        throw ApiError(400,
                       "Invalid '" + param + "[" + std::to_string(i) + "]': token id " + v.dump() +
                           " is outside the vocabulary (0.." + std::to_string(tok.n_vocab() - 1) + ").",
                       param, "invalid_token_id");
      ids.push_back(static_cast<int32_t>(id));
    }
    return ids;
  };
  if (prompt->is_string()) return tok.encode(prompt->get<std::string>(), tok.add_bos_default(), false);
  if (!prompt->is_array())
    wrong_type("prompt", "a string, an array of strings or an array of token ids", *prompt);
  if (prompt->empty()) return {};
  const json& first = (*prompt)[0];
  if (first.is_number()) return token_ids(*prompt, "prompt");  // one prompt as token ids
  if (prompt->size() > 1)
    throw ApiError(400,
                   "Batched prompts (" + std::to_string(prompt->size()) +
                       ") are not supported: send one prompt per request.",
                   "prompt", "unsupported_parameter");
  if (first.is_string()) return tok.encode(first.get<std::string>(), tok.add_bos_default(), false);
  if (first.is_array()) return token_ids(first, "prompt[0]");
  wrong_type("prompt[0]", "a string or an array of token ids", first);
}

std::vector<std::string> parse_stop(const json& body) {
  const json* stop = field(body, "stop");
  if (!stop) return {};
  std::vector<std::string> out;
  auto add = [&](const json& s, const std::string& param) {
    if (!s.is_string()) wrong_type(param, "a string", s);
    if (s.get<std::string>().empty())
      throw ApiError(400, "Invalid '" + param + "': empty string. Stop sequences must not be empty.", param,
                     "invalid_value");
    out.push_back(s.get<std::string>());
  };
  if (stop->is_string()) {
    add(*stop, "stop");
  } else if (stop->is_array()) {
    for (size_t i = 0; i < stop->size(); ++i) add((*stop)[i], "stop[" + std::to_string(i) + "]");
  } else {
    wrong_type("stop", "a string or an array of strings", *stop);
  }
  return out;
}

// Sampling options of OpenAI and llama.cpp that this server does not implement, one table: each is
// refused with 400 naming it unless it is absent, null or its neutral value (what clients send
// when they mean "off"), so a client never silently gets something other than what it asked for.
struct NeutralOnlyField {
  const char* key;
  double neutral;  // the value that changes nothing
  double lo, hi;   // the range a valid value has (outside: 400 below/above the range)
};
constexpr double kNoLimit = std::numeric_limits<double>::max();
constexpr NeutralOnlyField kNeutralOnlyFields[] = {
    {"typical_p", 1.0, 0.0, 1.0},  // llama.cpp
    {"tfs_z", 1.0, 0.0, kNoLimit},
    {"mirostat", 0.0, 0.0, 2.0},
    {"xtc_probability", 0.0, 0.0, 1.0},
    {"dry_multiplier", 0.0, 0.0, kNoLimit},
    {"n_probs", 0.0, 0.0, kNoLimit},  // llama.cpp's own logprobs field: use OpenAI's
};

void reject_non_neutral_sampling(const json& body) {
  for (const NeutralOnlyField& f : kNeutralOnlyFields)
    if (const double v = number_field(body, f.key, f.lo, f.hi, f.neutral); v != f.neutral)
      throw ApiError(400,
                     std::string("'") + f.key + "' other than " + number_text(f.neutral) +
                          " is not supported by this server (this filter is not implemented).",
                     f.key, "unsupported_parameter");
}

// A logit_bias entry's bias: a number in [-100, 100], or false (llama.cpp's: the token is never
// produced, a bias of -infinity).
float logit_bias_value(const json& value, const std::string& token, const std::string& param) {
  if (value.is_boolean() && !value.get<bool>()) return -std::numeric_limits<float>::infinity();
  if (!value.is_number()) wrong_type(param, "a number in [-100, 100] or false (never)", value);
  const double b = value.get<double>();
  if (!(b >= -100.0 && b <= 100.0))
    throw ApiError(400,
                   "Invalid 'logit_bias': the bias of token " + token + " must be in [-100, 100], got " +
                       number_text(b) + ".",
                   "logit_bias", "invalid_value");
  return float(b);
}

int32_t logit_bias_token(long long id, const std::string& shown, int32_t n_vocab) {
  if (id < 0 || id >= n_vocab)
    throw ApiError(400,
                   "Invalid 'logit_bias': " + shown + " is not a token id of this model's vocabulary (0 to " +
                       std::to_string(n_vocab - 1) + ").",
                   "logit_bias", "invalid_value");
  return int32_t(id);
}

// logit_bias in OpenAI's shape, an object mapping token ids (as strings) to biases, or llama.cpp's,
// an array of [token, bias] pairs where the token is an id or a text (each of its tokens biased).
// An empty array counts as no bias (some clients send one).
std::vector<std::pair<int32_t, float>> parse_logit_bias(const json& body, const Tokenizer& tok) {
  std::vector<std::pair<int32_t, float>> out;
  const json* bias = field(body, "logit_bias");
  const int32_t n_vocab = tok.n_vocab();
  if (!bias) return out;
  if (bias->is_object()) {
    for (const auto& [key, value] : bias->items()) {
      size_t used = 0;
      long long id = -1;
      try {
        id = std::stoll(key, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != key.size() || key.empty()) id = -1;
      out.emplace_back(logit_bias_token(id, "'" + key + "'", n_vocab),
                       logit_bias_value(value, key, "logit_bias." + key));
    }
    return out;
  }
  if (!bias->is_array())
    wrong_type("logit_bias", "an object mapping token ids to biases, or an array of [token, bias] pairs",
               *bias);
  for (const json& pair : *bias) {
    if (!pair.is_array() || pair.size() != 2 || !(pair[0].is_number_integer() || pair[0].is_string()))
      wrong_type("logit_bias", "[token id or text, bias] pairs", pair);
    if (pair[0].is_number_integer()) {
      const long long id = pair[0].get<long long>();
      out.emplace_back(logit_bias_token(id, std::to_string(id), n_vocab),
                       logit_bias_value(pair[1], std::to_string(id), "logit_bias"));
      continue;
    }
    const std::string text = pair[0].get<std::string>();
    const std::vector<int32_t> ids = tok.encode(text, /*add_bos=*/false, /*parse_special=*/false);
    if (ids.empty())
      throw ApiError(400, "Invalid 'logit_bias': the text \"" + text + "\" has no tokens.", "logit_bias",
                     "invalid_value");
    const float b = logit_bias_value(pair[1], "\"" + text + "\"", "logit_bias");
    for (const int32_t id : ids) out.emplace_back(id, b);
  }
  return out;
}

// Penalties and logit bias (OpenAI's and llama.cpp's names; sampling/penalties.h applies them).
PenaltyParams parse_penalties(const json& body, const Tokenizer& tok) {
  PenaltyParams p;
  p.presence_penalty = static_cast<float>(number_field(body, "presence_penalty", -2.0, 2.0, 0.0));
  p.frequency_penalty = static_cast<float>(number_field(body, "frequency_penalty", -2.0, 2.0, 0.0));
  const double repeat = number_field(body, "repeat_penalty", 0.0, kNoLimit, 1.0);
  if (!(repeat > 0.0))
    throw ApiError(400, "Invalid 'repeat_penalty': expected a value > 0 (1 = off), but got " + number_text(repeat) +
                            " instead.",
                   "repeat_penalty", "below_minimum");
  p.repeat_penalty = static_cast<float>(repeat);
  p.repeat_last_n = static_cast<int32_t>(integer_field(body, "repeat_last_n", -1, INT32_MAX, 64));
  p.logit_bias = parse_logit_bias(body, tok);
  return p;
}

// Options OpenAI defines that this server does not implement: refused unless left at their defaults,
// so a client never silently gets something other than what it asked for.
void reject_unsupported(Endpoint endpoint, const json& body) {
  if (endpoint == Endpoint::Completion) {
    if (bool_field(body, "echo", false)) unsupported("echo", "echo");
    if (integer_field(body, "best_of", 1, std::numeric_limits<int64_t>::max(), 1) != 1)
      unsupported("best_of", "best_of > 1");
    if (const json* suffix = field(body, "suffix")) {
      if (!suffix->is_string()) wrong_type("suffix", "a string", *suffix);
      if (!suffix->get<std::string>().empty()) unsupported("suffix", "suffix");
    }
  }
  reject_non_neutral_sampling(body);
  if (const json* f = field(body, "functions")) {  // the deprecated form of tools
    if (!f->is_array()) wrong_type("functions", "an array", *f);
    if (!f->empty()) unsupported("functions", "'functions' (deprecated; use 'tools')");
  }
  if (field(body, "function_call")) unsupported("function_call", "'function_call' (deprecated; use 'tool_choice')");
  if (const json* grammar = field(body, "grammar")) {  // llama.cpp's GBNF grammar
    if (!grammar->is_string()) wrong_type("grammar", "a string", *grammar);
    if (!grammar->get<std::string>().empty())
      unsupported("grammar", "A GBNF grammar (use response_format with a JSON Schema)");
  }
}

// tools: [{"type": "function", "function": {"name", "description"?, "parameters"?}}]; the names, in
// order, of the functions the request offers. Throws ApiError naming the first invalid field.
std::vector<std::string> validate_tools(const json& tools) {
  if (!tools.is_array()) wrong_type("tools", "an array", tools);
  std::vector<std::string> names;
  for (size_t i = 0; i < tools.size(); ++i) {
    const std::string p = "tools[" + std::to_string(i) + "]";
    const json& tool = tools[i];
    if (!tool.is_object()) wrong_type(p, "an object", tool);
    const json* type = field(tool, "type");
    if (!type || !type->is_string() || type->get<std::string>() != "function")
      throw ApiError(400, "Invalid '" + p + ".type': only 'function' tools are supported.", p + ".type", "invalid_value");
    const json* fn = field(tool, "function");
    if (!fn || !fn->is_object()) wrong_type(p + ".function", "an object", fn ? *fn : json());
    const json* name = field(*fn, "name");
    if (!name || !name->is_string()) wrong_type(p + ".function.name", "a string", name ? *name : json());
    const std::string n = name->get<std::string>();
    const bool valid = !n.empty() && n.size() <= 64 && std::all_of(n.begin(), n.end(), [](char c) {
      return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-';
    });
    if (!valid)
      throw ApiError(400, "Invalid '" + p + ".function.name': 1 to 64 letters, digits, '_' or '-'.",
                     p + ".function.name", "invalid_value");
    if (std::find(names.begin(), names.end(), n) != names.end())
      throw ApiError(400, "Invalid '" + p + ".function.name': '" + n + "' is named twice.", p + ".function.name",
                     "invalid_value");
    if (const json* d = field(*fn, "description"); d && !d->is_string())
      wrong_type(p + ".function.description", "a string", *d);
    if (const json* s = field(*fn, "parameters"); s && !s->is_object())
      wrong_type(p + ".function.parameters", "a JSON Schema object", *s);
    names.push_back(n);
  }
  return names;
}

// The function tool_choice names: "" for "auto" (the default), "*" for "required", "-" for "none",
// else the function's name (one of `names`).
std::string parse_tool_choice(const json& body, const std::vector<std::string>& names) {
  const json* choice = field(body, "tool_choice");
  if (!choice) return "";
  if (choice->is_string()) {
    const std::string c = choice->get<std::string>();
    if (c == "auto") return "";
    if (c == "required") return "*";
    if (c == "none") return "-";
    throw ApiError(400, "Invalid 'tool_choice': expected 'none', 'auto', 'required' or a function, but got '" + c + "'.",
                   "tool_choice", "invalid_value");
  }
  if (!choice->is_object()) wrong_type("tool_choice", "a string or an object", *choice);
  const json* fn = field(*choice, "function");
  const json* name = fn && fn->is_object() ? field(*fn, "name") : nullptr;
  if (!name || !name->is_string()) wrong_type("tool_choice.function.name", "a string", name ? *name : json());
  const std::string n = name->get<std::string>();
  if (std::find(names.begin(), names.end(), n) == names.end())
    throw ApiError(400, "Invalid 'tool_choice': no tool named '" + n + "' is in 'tools'.", "tool_choice.function.name",
                   "invalid_value");
  return n;
}

// Tool calling: the tools for the chat template and, unless tool_choice is "none", the grammar of
// the calls: {"name": NAME, "arguments": ARGUMENTS} between kToolCallTags, ARGUMENTS valid against
// the function's parameters; "auto" lets text come before, between and after calls, "required"
// and a named function make the answer calls only. Checked against the chat template: one that
// renders no tools, or does not teach the <tool_call> syntax, is refused.
void parse_tools(const json& body, const nlohmann::ordered_json& ordered, const RequestContext& ctx,
                 CompletionRequest& r) {
  const json* tools = field(body, "tools");
  if (!tools || (tools->is_array() && tools->empty())) {
    if (const json* choice = field(body, "tool_choice"); choice && !(choice->is_string() && (*choice == "none" || *choice == "auto")))
      throw ApiError(400, "Invalid 'tool_choice': it needs 'tools'.", "tool_choice", "invalid_value");
    return;
  }
  const std::vector<std::string> names = validate_tools(*tools);
  if (r.endpoint != Endpoint::Chat) unsupported("tools", "Tools on /v1/completions are");
  if (bool_field(body, "stream", false)) unsupported("stream", "Streaming an answer with tools");
  if (r.params.grammar)
    throw ApiError(400, "Give one of 'tools' and 'response_format'.", "response_format", "invalid_value");
  const std::string& source = ctx.chat_style ? ctx.chat_style->jinja->source() : std::string();
  const std::string style = ctx.chat_style ? ctx.chat_style->name : std::string("none");
  if (source.find("tools") == std::string::npos)
    throw ApiError(400, "The chat template (" + style + ") does not render tools: serve with --chat-template naming one that does.",
                   "tools", "tools_unsupported");
  if (source.find(kToolCallTags.open) == std::string::npos)
    throw ApiError(400, "The chat template (" + style + ") writes tool calls in a syntax this server does not read (it reads " +
                            kToolCallTags.open + " JSON " + kToolCallTags.close + ", as the Hermes and Qwen 2.5 templates teach).",
                   "tools", "tools_unsupported");
  r.tools.tools = ordered["tools"];
  const std::string choice = parse_tool_choice(body, names);
  if (choice == "-") return;  // tools shown, never called
  r.tools.parse_calls = true;
  const int32_t max_calls = bool_field(body, "parallel_tool_calls", true) ? 4 : 1;
  nlohmann::ordered_json calls = nlohmann::ordered_json::array();
  for (size_t i = 0; i < names.size(); ++i) {
    if (choice.size() > 1 && names[i] != choice) continue;
    const nlohmann::ordered_json& fn = r.tools.tools[i]["function"];
    calls.push_back({{"type", "object"},
                     {"properties", {{"name", {{"const", names[i]}}},
                                     {"arguments", fn.contains("parameters") ? fn["parameters"] : nlohmann::ordered_json{{"type", "object"}}}}},
                     {"required", {"name", "arguments"}}});
  }
  const nlohmann::ordered_json schema = calls.size() == 1 ? calls[0] : nlohmann::ordered_json{{"anyOf", calls}};
  const TaggedJsonMode mode = choice.empty() ? TaggedJsonMode::TextOrCalls : TaggedJsonMode::CallsOnly;
  const std::string key = "tools:" + std::to_string(int(mode)) + ":" + std::to_string(max_calls) + ":" + schema.dump();
  try {
    r.params.grammar = ctx.grammars->get(key, [&] { return tagged_json_grammar(schema, kToolCallTags, mode, max_calls); });
  } catch (const Error& e) {
    throw ApiError(400, std::string("Invalid 'tools': ") + e.what(), "tools", "unsupported_schema");
  }
}

// response_format (OpenAI): {"type": "text"}, {"type": "json_object"} or {"type": "json_schema",
// "json_schema": {"name", "schema", "strict"}}; llama.cpp's top-level "json_schema" too. The
// schema is read again from the body text in its written order (properties are generated in it).
std::shared_ptr<const TokenConstraint> parse_response_format(const json& body, const nlohmann::ordered_json& ordered,
                                                             const RequestContext& ctx) {
  const json* fmt = field(body, "response_format");
  const json* llama_schema = field(body, "json_schema");
  if (!fmt && !llama_schema) return nullptr;
  if (fmt && llama_schema)
    throw ApiError(400, "Give one of 'response_format' and 'json_schema'.", "json_schema", "invalid_value");
  const char* param = fmt ? "response_format" : "json_schema";
  const nlohmann::ordered_json* schema = nullptr;
  if (llama_schema) {
    if (!llama_schema->is_object()) wrong_type("json_schema", "an object", *llama_schema);
    schema = &ordered["json_schema"];
  } else {
    if (!fmt->is_object()) wrong_type("response_format", "an object", *fmt);
    const json* type = field(*fmt, "type");
    if (!type || !type->is_string()) wrong_type("response_format.type", "a string", type ? *type : json());
    const std::string kind = type->get<std::string>();
    if (kind == "text") return nullptr;
    if (kind == "json_schema") {
      const json* spec = field(*fmt, "json_schema");
      if (!spec || !spec->is_object()) wrong_type("response_format.json_schema", "an object", spec ? *spec : json());
      if (const json* strict = field(*spec, "strict"); strict && !strict->is_boolean())
        wrong_type("response_format.json_schema.strict", "a boolean", *strict);
      const json* s = field(*spec, "schema");
      if (!s || !(s->is_object() || s->is_boolean()))
        wrong_type("response_format.json_schema.schema", "a JSON Schema object", s ? *s : json());
      schema = &ordered["response_format"]["json_schema"]["schema"];
    } else if (kind != "json_object") {
      throw ApiError(400,
                     "Invalid 'response_format.type': expected 'text', 'json_object' or 'json_schema', but got '" +
                         kind + "'.",
                     "response_format.type", "invalid_value");
    }
  }
  try {
    return ctx.grammars->get(schema);
  } catch (const Error& e) {
    throw ApiError(400, std::string("Invalid '") + param + "': " + e.what(), param, "unsupported_schema");
  }
}

// Chat: "logprobs": true and "top_logprobs": 0..20 (which needs logprobs). Completions: the
// legacy "logprobs": K (0..20): the chosen token's and K alternatives.
LogprobSettings parse_logprobs(Endpoint endpoint, const json& body) {
  LogprobSettings s;
  if (endpoint == Endpoint::Chat) {
    s.enabled = bool_field(body, "logprobs", false);
    if (field(body, "top_logprobs")) {
      s.top = static_cast<int32_t>(integer_field(body, "top_logprobs", 0, kMaxTopLogprobs, 0));
      if (!s.enabled && s.top > 0)
        throw ApiError(400, "Invalid 'top_logprobs': it needs 'logprobs' to be true.", "top_logprobs",
                       "invalid_value");
    }
    return s;
  }
  if (field(body, "top_logprobs"))
    throw ApiError(400, "'top_logprobs' is a chat field: /v1/completions takes 'logprobs': K (0..20).",
                   "top_logprobs", "unsupported_parameter");
  if (field(body, "logprobs")) {
    s.enabled = true;
    s.top = static_cast<int32_t>(integer_field(body, "logprobs", 0, kMaxTopLogprobs, 0));
  }
  return s;
}

// The microspec extension object: per-request speculative settings, within what the slots were built with.
void parse_spec_extension(const json& body, const SpecConfig& server, CompletionRequest& r) {
  r.speculative = server.enabled();
  const json* ext = field(body, "microspec");
  if (ext) {
    if (!ext->is_object()) wrong_type("microspec", "an object", *ext);
    for (auto it = ext->begin(); it != ext->end(); ++it)
      if (it.key() != "spec" && it.key() != "draft_vocab")
        throw ApiError(400, "Unknown parameter: 'microspec." + it.key() + "' (known: spec, draft_vocab).",
                       "microspec." + it.key(), "unknown_parameter");
    if (const json* spec = field(*ext, "spec")) {
      if (!spec->is_string()) wrong_type("microspec.spec", "a string", *spec);
      const std::string mode = spec->get<std::string>();
      if (mode == name_of(SpecMode::None)) {
        r.speculative = false;
        if (server.enabled()) r.spec_note = "speculative decoding turned off by the request";
      } else if (is_spec_mode_name(mode)) {
        if (!server.enabled())
          throw ApiError(400,
                         "Invalid 'microspec.spec': '" + mode +
                             "': this server runs without speculative decoding (start it with --spec " +
                             mode + ").",
                         "microspec.spec", "spec_unavailable");
        if (mode != name_of(server.mode))
          throw ApiError(400,
                         "Invalid 'microspec.spec': '" + mode +
                             "': this server's slots are built for --spec " + name_of(server.mode) + " (or 'none').",
                         "microspec.spec", "spec_unavailable");
      } else {
        throw ApiError(400,
                       "Invalid value for 'microspec.spec': '" + mode +
                           "'. Supported values are " + spec_mode_names() + ".",
                       "microspec.spec", "invalid_value");
      }
    }
    if (const json* dv = field(*ext, "draft_vocab")) {
      if (!dv->is_string()) wrong_type("microspec.draft_vocab", "a string", *dv);
      // The draft vocabulary is part of each slot's drafter, built at start; a request can only ask
      // for the one the slots have (or turn speculation off).
      if (r.speculative && dv->get<std::string>() != name_of(server.draft_vocab))
        throw ApiError(400,
                       "Invalid 'microspec.draft_vocab': '" + dv->get<std::string>() +
                           "': this server's drafters use --draft-vocab " + name_of(server.draft_vocab) + ".",
                       "microspec.draft_vocab", "spec_unavailable");
    }
  }
}

}  // namespace

const char* error_type_for_status(int status) {
  switch (status) {
    case 401:
      return "authentication_error";
    case 403:
      return "permission_error";
    case 429:
      return "rate_limit_error";
    default:
      return status >= 500 ? "server_error" : "invalid_request_error";
  }
}

ApiError::ApiError(int status_, const std::string& message, std::string param_, std::string code_,
                   std::string type_)
    : std::runtime_error(message),
      status(status_),
      type(type_.empty() ? error_type_for_status(status_) : std::move(type_)),
      param(std::move(param_)),
      code(std::move(code_)) {}

ApiError generation_error(const std::exception& e) {
  if (dynamic_cast<const std::bad_alloc*>(&e))
    return ApiError(503, "The server ran out of memory for this request.", "", "out_of_memory");
  return ApiError(500, std::string("Generation failed: ") + e.what(), "", "generation_failed");
}

json error_body(int status, const std::string& message, const std::string& param, const std::string& code,
                const std::string& type) {
  json e;
  e["message"] = message;
  e["type"] = type.empty() ? error_type_for_status(status) : type;
  e["param"] = param.empty() ? json() : json(param);
  e["code"] = code.empty() ? json() : json(code);
  return json{{"error", e}};
}

namespace {

// A request body as a JSON object: 400 for invalid JSON or UTF-8, nesting past kMaxJsonDepth, or
// anything but an object.
json parse_body(const std::string& body_text) {
  json body;
  try {
    body = json::parse(body_text, [](int depth, json::parse_event_t, json&) {
      if (depth > kMaxJsonDepth)
        throw ApiError(400,
                       "Invalid JSON body: nested deeper than " + std::to_string(kMaxJsonDepth) + " levels.",
                       "", "invalid_json");
      return true;
    });
  } catch (const json::exception& e) {
    // nlohmann's lexer rejects ill-formed UTF-8 in strings too, so invalid UTF-8 lands here.
    throw ApiError(400, std::string("Invalid JSON body: ") + e.what(), "", "invalid_json");
  }
  if (!body.is_object()) wrong_type("body", "a JSON object", body);
  return body;
}

bool valid_utf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    size_t subpart = 0;
    const int n = utf8::check_sequence(reinterpret_cast<const uint8_t*>(s.data()) + i, s.size() - i, &subpart);
    if (n <= 0) return false;
    i += size_t(n);
  }
  return true;
}

}  // namespace

json tokenize_answer(const std::string& body_text, const Tokenizer& tok) {
  const json body = parse_body(body_text);
  const json* content = &required_field(body, "content", "content");
  if (!content->is_string()) wrong_type("content", "a string", *content);
  const bool add_special = bool_field(body, "add_special", false);
  const bool parse_special = bool_field(body, "parse_special", true);
  const bool with_pieces = bool_field(body, "with_pieces", false);
  const std::vector<int32_t> ids =
      tok.encode(content->get<std::string>(), add_special && tok.add_bos_default(), parse_special);
  json tokens = json::array();
  for (int32_t id : ids) {
    if (!with_pieces) {
      tokens.push_back(id);
      continue;
    }
    const std::string piece = tok.token_to_piece(id, true);
    tokens.push_back({{"id", id}, {"piece", valid_utf8(piece) ? json(piece) : bytes_json(piece)}});
  }
  return json{{"tokens", tokens}};
}

json detokenize_answer(const std::string& body_text, const Tokenizer& tok) {
  const json body = parse_body(body_text);
  const json* tokens = &required_field(body, "tokens", "tokens");
  if (!tokens->is_array()) wrong_type("tokens", "an array of token ids", *tokens);
  std::vector<int32_t> ids;
  ids.reserve(tokens->size());
  for (size_t i = 0; i < tokens->size(); ++i) {
    const json& v = (*tokens)[i];
    const std::string param = "tokens[" + std::to_string(i) + "]";
    if (!v.is_number_integer()) wrong_type(param, "a token id (integer)", v);
    const bool huge = v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT32_MAX);
    const int64_t id = huge ? int64_t(INT32_MAX) + 1 : v.get<int64_t>();
    if (id < 0 || id >= tok.n_vocab())
      throw ApiError(400,
                     "Invalid '" + param + "': token id " + v.dump() + " is outside the vocabulary (0.." +
                         std::to_string(tok.n_vocab() - 1) + ").",
                     param, "invalid_token_id");
    ids.push_back(static_cast<int32_t>(id));
  }
  return json{{"content", tok.decode(ids, true)}};
}

std::shared_ptr<const TokenConstraint> GrammarCache::get(const nlohmann::ordered_json* schema) {
  return get(schema ? "schema:" + schema->dump() : std::string("json_object"),
             [&] { return schema ? json_schema_grammar(*schema) : json_object_grammar(); });
}

std::shared_ptr<const TokenConstraint> GrammarCache::get(const std::string& key, const std::function<Grammar()>& make) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (auto it = by_schema_.find(key); it != by_schema_.end()) return it->second;
  }
  // Compiled outside the lock: a large schema does not hold up other requests.
  auto made = std::make_shared<const TokenConstraint>(make(), vocab_);
  std::lock_guard<std::mutex> lock(mutex_);
  if (by_schema_.size() >= kMaxGrammars) by_schema_.clear();
  return by_schema_.emplace(key, std::move(made)).first->second;
}

CompletionRequest parse_completion_request(Endpoint endpoint, const std::string& body_text,
                                           const RequestContext& ctx) {
  const json body = parse_body(body_text);
  if (const json* model = field(body, "model"))
    if (!model->is_string()) wrong_type("model", "a string", *model);
  reject_unsupported(endpoint, body);

  CompletionRequest r;
  r.n = static_cast<int32_t>(integer_field(body, "n", 1, kMaxChoices, 1));
  r.endpoint = endpoint;
  // Schemas are read from the body in its written order (properties are generated in it).
  const nlohmann::ordered_json ordered = nlohmann::ordered_json::parse(body_text);  // valid: parse_body read it
  r.params.grammar = parse_response_format(body, ordered, ctx);
  parse_tools(body, ordered, ctx, r);
  const Tokenizer& tok = *ctx.tokenizer;
  if (endpoint == Endpoint::Chat) {
    std::vector<ChatMessage> messages = parse_messages(body);
    if (!ctx.chat_style)
      throw ApiError(400, "This model has no chat template: use /v1/completions.", "messages",
                     "no_chat_template");
    // Message text is tokenized as text: control-token strings in it are not control tokens.
    try {
      r.prompt_ids = encode_chat(tok, *ctx.chat_style, messages, GenerationPrompt::Add,
                                 r.tools.tools.is_null() ? nullptr : &r.tools.tools);
    } catch (const Error& e) {
      throw ApiError(400, std::string("Invalid 'messages': ") + e.what(), "messages", "invalid_value");
    }
  } else {
    r.prompt_ids = parse_prompt(body, tok);
  }
  const int64_t n_prompt = int64_t(r.prompt_ids.size());
  if (n_prompt == 0) throw ApiError(400, "The prompt is empty.", "prompt", "empty_prompt");
  if (n_prompt >= ctx.n_ctx)
    throw ApiError(400,
                   "This model's maximum context length is " + std::to_string(ctx.n_ctx) +
                       " tokens. However, your prompt has " + std::to_string(n_prompt) +
                       " tokens, which leaves no room for the completion.",
                   endpoint == Endpoint::Chat ? "messages" : "prompt", "context_length_exceeded");

  // max_completion_tokens is the newer name of max_tokens in the chat API.
  const char* max_key = field(body, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  const int64_t room = ctx.n_ctx - n_prompt;
  const int64_t max_tokens = integer_field(body, max_key, 1, std::numeric_limits<int64_t>::max(), room);
  if (max_tokens > room) {
    // max_tokens may be as large as int64 allows: name it as sent, never as a sum that overflows.
    const std::string asked = field(body, max_key)->dump();
    throw ApiError(400,
                   "This model's maximum context length is " + std::to_string(ctx.n_ctx) + " tokens. However, '" +
                       max_key + "' asks for " + asked + " tokens for the completion and the prompt has " +
                       std::to_string(n_prompt) + ", which leaves " + std::to_string(room) +
                       ". Please reduce the prompt or the completion length.",
                   max_key, "context_length_exceeded");
  }
  r.params.max_new_tokens = static_cast<int32_t>(max_tokens);

  // Sampling defaults are the CLI's (`microspec generate`), so a setting means the same in both.
  r.params.sampling.temperature = static_cast<float>(number_field(body, "temperature", 0.0, 2.0, 0.0));
  r.params.sampling.top_p = static_cast<float>(number_field(body, "top_p", 0.0, 1.0, 0.95));
  r.params.sampling.top_k = static_cast<int>(integer_field(body, "top_k", 0, INT32_MAX, 40));
  r.params.sampling.min_p = static_cast<float>(number_field(body, "min_p", 0.0, 1.0, 0.0));
  r.params.penalties = parse_penalties(body, tok);
  if (const json* seed = field(body, "seed")) {
    if (!seed->is_number_integer()) wrong_type("seed", "an integer", *seed);
    r.params.sampling.seed =
        seed->is_number_unsigned() ? seed->get<uint64_t>() : uint64_t(seed->get<int64_t>());
  } else {
    r.params.sampling.seed = std::random_device{}();
  }
  r.params.stop_strings = parse_stop(body);
  r.params.logprobs = parse_logprobs(endpoint, body);

  r.stream = bool_field(body, "stream", false);
  r.cache_prompt = bool_field(body, "cache_prompt", true);
  if (const json* opts = field(body, "stream_options")) {
    if (!opts->is_object()) wrong_type("stream_options", "an object", *opts);
    r.include_usage = bool_field(*opts, "include_usage", false);
  }
  parse_spec_extension(body, *ctx.spec, r);
  return r;
}

json usage_json(const GenerationReport& r) {
  const GenerateResult& g = r.result.gen;
  json ext;
  ext["speculative"] = r.speculative;
  ext["spec_mode"] = r.speculative ? r.spec_mode : "none";
  if (r.speculative) {
    const SpecStats& st = r.result.stats;
    ext["draft_vocab"] = r.draft_vocab;
    ext["steps"] = st.steps;
    ext["drafted_tokens"] = st.drafted;
    ext["accepted_draft_tokens"] = st.accepted_draft;
    ext["mean_acceptance_length"] = st.mean_acceptance_length();
    if (r.device == "cpu") {
      json by_source = json::object();
      for (int i = 0; i < kDraftSources; ++i)
        by_source[name_of(DraftSource(i))] = {{"steps", st.by_source[size_t(i)].steps},
                                              {"accepted_draft_tokens", st.by_source[size_t(i)].accepted}};
      ext["steps_by_drafter"] = by_source;
      ext["mean_active_vocab"] = st.mean_active_vocab();
      ext["draft_seconds"] = st.draft_seconds;
      ext["verify_seconds"] = st.verify_seconds;
    }
  }
  if (r.device != "cpu") ext["device"] = r.device;
  if (!r.spec_note.empty()) ext["note"] = r.spec_note;
  ext["prefill_seconds"] = g.prefill_seconds;
  ext["decode_seconds"] = g.decode_seconds;
  ext["prefill_tokens_per_second"] = r.result.prefill_tokens_per_second();
  ext["decode_tokens_per_second"] = r.result.decode_tokens_per_second();
  ext["queue_seconds"] = r.queue_seconds;
  const int64_t completion = int64_t(g.tokens.size());
  return json{{"prompt_tokens", g.prompt_tokens},
              {"completion_tokens", completion},
              {"total_tokens", g.prompt_tokens + completion},
              {"prompt_tokens_details", {{"cached_tokens", r.prompt_rows_reused}}},
              {"microspec", ext}};
}

const char* finish_reason(const GenerateResult& r) {
  return finish_reason_name(r.finish);
}

namespace {

// JSON has no -inf: OpenAI writes -9999.0 for a token the model gives no probability.
double logprob_value(float logprob) { return logprob > -9999.0f ? double(logprob) : -9999.0; }

}  // namespace

json logprobs_json(Endpoint endpoint, const LogprobsOut& lp) {
  const size_t stride = size_t(lp.top) + 1;
  const size_t rows = lp.entries.size() / stride;
  const Tokenizer& tok = *lp.tokenizer;
  if (endpoint == Endpoint::Chat) {
    json content = json::array();
    for (size_t i = 0; i < rows; ++i) {
      const TokenLogprob* row = lp.entries.data() + i * stride;
      json top = json::array();
      for (size_t j = 1; j < stride; ++j) {
        if (row[j].token < 0) continue;  // fewer alternatives than asked for (a sampled distribution keeps fewer)
        const std::string piece = tok.token_to_piece(row[j].token);
        top.push_back({{"token", piece}, {"logprob", logprob_value(row[j].logprob)}, {"bytes", bytes_json(piece)}});
      }
      const std::string piece = tok.token_to_piece(row[0].token);
      content.push_back({{"token", piece},
                         {"logprob", logprob_value(row[0].logprob)},
                         {"bytes", bytes_json(piece)},
                         {"top_logprobs", top}});
    }
    return json{{"content", content}, {"refusal", nullptr}};
  }
  json tokens = json::array(), token_logprobs = json::array(), top_logprobs = json::array(),
       offsets = json::array();
  for (size_t i = 0; i < rows; ++i) {
    const TokenLogprob* row = lp.entries.data() + i * stride;
    const std::string piece = tok.token_to_piece(row[0].token);
    tokens.push_back(piece);
    token_logprobs.push_back(logprob_value(row[0].logprob));
    json top = json::object();
    for (size_t j = 1; j < stride; ++j)
      if (row[j].token >= 0) top[tok.token_to_piece(row[j].token)] = logprob_value(row[j].logprob);
    top_logprobs.push_back(top);
    offsets.push_back(*lp.text_offset);
    *lp.text_offset += piece.size();
  }
  return json{{"tokens", tokens}, {"token_logprobs", token_logprobs}, {"top_logprobs", top_logprobs},
              {"text_offset", offsets}};
}

namespace {

// Adds the tool calls in `text` to `message` (OpenAI's tool_calls: id, type, function.name and
// function.arguments as a JSON string) and sets its content to the text around them, null when
// only whitespace is left. A call is a complete kToolCallTags pair around {"name": string,
// "arguments": object}; anything else stays text. Returns whether a call was found.
bool add_tool_calls(const std::string& text, const std::string& id_base, json& message) {
  const JsonTags& tags = kToolCallTags;
  std::string content;
  json calls = json::array();
  size_t at = 0;
  while (at < text.size()) {
    const size_t open = text.find(tags.open, at);
    const size_t body = open == std::string::npos ? open : open + tags.open.size();
    const size_t close = open == std::string::npos ? open : text.find(tags.close, body);
    if (close == std::string::npos) break;
    const json call = json::parse(text.substr(body, close - body), nullptr, false);
    const json* name = call.is_object() ? field(call, "name") : nullptr;
    const json* args = call.is_object() ? field(call, "arguments") : nullptr;
    if (name && name->is_string() && args && args->is_object()) {
      content += text.substr(at, open - at);
      calls.push_back({{"id", id_base + std::to_string(calls.size())},
                       {"type", "function"},
                       {"function", {{"name", *name}, {"arguments", args->dump()}}}});
    } else {
      content += text.substr(at, close + tags.close.size() - at);
    }
    at = close + tags.close.size();
  }
  content += text.substr(std::min(at, text.size()));
  if (calls.empty()) return false;
  const bool blank = content.find_first_not_of(" \t\r\n") == std::string::npos;
  message["content"] = blank ? json() : json(content);
  message["tool_calls"] = std::move(calls);
  return true;
}

}  // namespace

json answer_json(Endpoint endpoint, const AnswerIds& ids, const GenerationReport& r, const LogprobsOut* logprobs,
                 const ToolCalling& tools, int32_t choice_index) {
  const GenerateResult& g = r.result.gen;
  json choice = {{"index", 0},
                 {"finish_reason", finish_reason(g)},
                 {"logprobs", logprobs ? logprobs_json(endpoint, *logprobs) : json()}};
  if (endpoint == Endpoint::Chat) {
    choice["message"] = {{"role", "assistant"}, {"content", g.text}};
    const std::string id_base = "call_" + ids.id.substr(ids.id.find('-') + 1) + "_" + std::to_string(choice_index) + "_";
    // A generation cut short keeps its finish_reason ("length"), its complete calls still listed.
    if (tools.parse_calls && add_tool_calls(g.text, id_base, choice["message"]) && g.finish == FinishReason::EndOfGeneration)
      choice["finish_reason"] = "tool_calls";
  } else {
    choice["text"] = g.text;
  }
  return json{{"id", ids.id},
              {"object", endpoint == Endpoint::Chat ? "chat.completion" : "text_completion"},
              {"created", ids.created},
              {"model", ids.model},
              {"choices", json::array({choice})},
              {"usage", usage_json(r)}};
}

json chunk_json(Endpoint endpoint, const AnswerIds& ids, const std::string& text, bool first,
                const char* finish, bool include_usage_null, const LogprobsOut* logprobs) {
  json choice = {{"index", 0},
                 {"logprobs", logprobs ? logprobs_json(endpoint, *logprobs) : json()},
                 {"finish_reason", finish ? json(finish) : json()}};
  if (endpoint == Endpoint::Chat) {
    json delta = json::object();
    if (first) delta["role"] = "assistant";
    if (first || !finish) delta["content"] = text;
    choice["delta"] = delta;
  } else {
    choice["text"] = text;
  }
  json j = {{"id", ids.id},
            {"object", endpoint == Endpoint::Chat ? "chat.completion.chunk" : "text_completion"},
            {"created", ids.created},
            {"model", ids.model},
            {"choices", json::array({choice})}};
  if (include_usage_null) j["usage"] = nullptr;
  return j;
}

json usage_chunk_json(Endpoint endpoint, const AnswerIds& ids, const GenerationReport& r) {
  return json{{"id", ids.id},
              {"object", endpoint == Endpoint::Chat ? "chat.completion.chunk" : "text_completion"},
              {"created", ids.created},
              {"model", ids.model},
              {"choices", json::array()},
              {"usage", usage_json(r)}};
}

uint64_t choice_seed(uint64_t seed, int32_t choice) { return seed + uint64_t(choice); }

void count_choices_in_usage(json& usage, std::span<const GenerationReport> reports) {
  int64_t completion = 0;
  for (const GenerationReport& r : reports) completion += int64_t(r.result.gen.tokens.size());
  usage["completion_tokens"] = completion;
  usage["total_tokens"] = usage["prompt_tokens"].get<int64_t>() + completion;
}

json merge_choice_answers(std::vector<json>& answers) {
  if (answers.empty()) throw Error("no choices to merge");
  json merged = std::move(answers.front());
  int64_t completion = merged["usage"]["completion_tokens"].get<int64_t>();
  for (size_t i = 1; i < answers.size(); ++i) {
    json& choice = answers[i]["choices"][0];
    choice["index"] = i;
    merged["choices"].push_back(std::move(choice));
    completion += answers[i]["usage"]["completion_tokens"].get<int64_t>();
  }
  json& usage = merged["usage"];
  usage["completion_tokens"] = completion;
  usage["total_tokens"] = usage["prompt_tokens"].get<int64_t>() + completion;
  return merged;
}

bool secrets_equal(const std::string& a, const std::string& b) {
  // Walks the longer length and accumulates differences without branching on the content.
  const size_t n = std::max(a.size(), b.size());
  unsigned diff = a.size() == b.size() ? 0u : 1u;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= unsigned(x ^ y);
  }
  return diff == 0;
}

std::string dump_json(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace microspec::server
