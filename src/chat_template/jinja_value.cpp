// Python's rules for printing, comparing and serializing the values of a chat template.
#include "chat_template/jinja_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "util/error.h"

namespace microspec::jinja {
namespace {

constexpr int kMaxNesting = 256;  // deeper values are refused

void check_depth(int depth) {
  if (depth > kMaxNesting) throw Error("value nested more than 256 levels deep");
}

std::string hex_escape(const char* prefix, uint32_t v, int digits) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%s%0*x", prefix, digits, v);
  return buf;
}

std::string repr_string(const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos;
  const bool has_double = s.find('"') != std::string::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    const size_t len = decode_utf8(s, i, &cp);
    if (cp == static_cast<uint32_t>(quote) || cp == '\\') {
      out += '\\';
      out += static_cast<char>(cp);
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (cp < 0x20 || (cp >= 0x7F && cp <= 0xA0) || cp == 0xAD) {
      out += hex_escape("\\x", cp, 2);
    } else {
      out.append(s, i, len);
    }
    i += len;
  }
  out += quote;
  return out;
}

std::string json_string(const std::string& s, bool ensure_ascii) {
  std::string out = "\"";
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    const size_t len = decode_utf8(s, i, &cp);
    switch (cp) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (cp < 0x20 || (ensure_ascii && cp >= 0x7F && cp < 0x10000)) {
          out += hex_escape("\\u", cp, 4);
        } else if (ensure_ascii && cp >= 0x10000) {
          const uint32_t v = cp - 0x10000;
          out += hex_escape("\\u", 0xD800 + (v >> 10), 4) + hex_escape("\\u", 0xDC00 + (v & 0x3FF), 4);
        } else {
          out.append(s, i, len);
        }
    }
    i += len;
  }
  return out + "\"";
}

std::string json_float(double d) {
  if (std::isnan(d)) return "NaN";
  if (std::isinf(d)) return d > 0 ? "Infinity" : "-Infinity";
  return float_repr(d);
}

// json.dumps turns keys that are not strings into strings; other keys are a TypeError.
std::string json_key(const Value& k) {
  switch (k.kind) {
    case Kind::String:
      return k.str();
    case Kind::Int:
      return std::to_string(k.integer);
    case Kind::Float:
      return json_float(k.number);
    case Kind::Bool:
      return k.boolean ? "true" : "false";
    case Kind::None:
      return "null";
    default:
      throw Error(std::string("tojson: keys must be str, int, float, bool or None, not ") + type_name(k));
  }
}

void dump(const Value& v, const JsonDumpOptions& o, int depth, std::string& out) {
  check_depth(depth);
  const std::string item_sep = o.separators_set ? o.item_separator : o.indent_set ? "," : ", ";
  const std::string key_sep = o.separators_set ? o.key_separator : ": ";
  auto newline = [&](int level) {
    if (!o.indent_set) return;
    out += '\n';
    for (int k = 0; k < level; ++k) out += o.indent;
  };
  switch (v.kind) {
    case Kind::None:
      out += "null";
      return;
    case Kind::Bool:
      out += v.boolean ? "true" : "false";
      return;
    case Kind::Int:
      out += std::to_string(v.integer);
      return;
    case Kind::Float:
      out += json_float(v.number);
      return;
    case Kind::String:
      out += json_string(v.str(), o.ensure_ascii);
      return;
    case Kind::List: {
      if (v.is_lazy) throw Error("tojson: Object of type " + v.str() + " is not JSON serializable");
      if (v.list->empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < v.list->size(); ++i) {
        if (i) out += item_sep;
        newline(depth + 1);
        dump((*v.list)[i], o, depth + 1, out);
      }
      newline(depth);
      out += ']';
      return;
    }
    case Kind::Dict: {
      if (v.dict->items.empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<Value, Value>*> items;
      for (const auto& kv : v.dict->items) items.push_back(&kv);
      if (o.sort_keys)
        std::stable_sort(items.begin(), items.end(),
                         [](auto* a, auto* b) { return compare(a->first, b->first) < 0; });
      out += '{';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += item_sep;
        newline(depth + 1);
        out += json_string(json_key(items[i]->first), o.ensure_ascii) + key_sep;
        dump(items[i]->second, o, depth + 1, out);
      }
      newline(depth);
      out += '}';
      return;
    }
    default:
      throw Error(std::string("tojson: Object of type ") + type_name(v) + " is not JSON serializable");
  }
}

std::string str_of(const Value& v, bool as_repr, int depth) {
  check_depth(depth);
  switch (v.kind) {
    case Kind::Undefined:
      return "";
    case Kind::None:
      return "None";
    case Kind::Bool:
      return v.boolean ? "True" : "False";
    case Kind::Int:
      return std::to_string(v.integer);
    case Kind::Float:
      return float_repr(v.number);
    case Kind::String:
      return as_repr ? repr_string(v.str()) : v.str();
    case Kind::List: {
      if (v.is_lazy && !v.str().starts_with("dict_")) return "<" + v.str() + " object>";
      if (v.is_lazy) {  // dict_items([('a', 1)])
        Value plain = v;
        plain.is_lazy = false;
        return v.str() + "(" + str_of(plain, true, depth) + ")";
      }
      std::string out = v.is_tuple ? "(" : "[";
      for (size_t i = 0; i < v.list->size(); ++i) {
        if (i) out += ", ";
        out += str_of((*v.list)[i], true, depth + 1);
      }
      if (v.is_tuple && v.list->size() == 1) out += ',';
      return out + (v.is_tuple ? ")" : "]");
    }
    case Kind::Dict:
    case Kind::Namespace: {
      std::string out = v.kind == Kind::Namespace ? "<Namespace {" : "{";
      for (size_t i = 0; i < v.dict->items.size(); ++i) {
        if (i) out += ", ";
        out += str_of(v.dict->items[i].first, true, depth + 1) + ": " +
               str_of(v.dict->items[i].second, true, depth + 1);
      }
      return out + (v.kind == Kind::Namespace ? "}>" : "}");
    }
    case Kind::Function:
      return "<function " + v.function->name + ">";
  }
  return "";
}

double as_double(const Value& v) {
  return v.kind == Kind::Float ? v.number : v.kind == Kind::Int ? static_cast<double>(v.integer) : v.boolean;
}

int64_t as_int(const Value& v) {
  return v.kind == Kind::Int ? v.integer : v.boolean ? 1 : 0;
}

}  // namespace

size_t decode_utf8(std::string_view s, size_t i, uint32_t* cp) {
  const auto b = static_cast<unsigned char>(s[i]);
  size_t len = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 0;
  if (len == 0 || i + len > s.size()) {
    *cp = b;
    return 1;
  }
  uint32_t v = len == 1 ? b : len == 2 ? (b & 0x1F) : len == 3 ? (b & 0x0F) : (b & 0x07);
  for (size_t k = 1; k < len; ++k) {
    const auto c = static_cast<unsigned char>(s[i + k]);
    if ((c >> 6) != 2) {
      *cp = b;
      return 1;
    }
    v = (v << 6) | (c & 0x3F);
  }
  *cp = v;
  return len;
}

void append_utf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

const Value* ValueDict::find(std::string_view key) const {
  for (const auto& kv : items)
    if (kv.first.kind == Kind::String && kv.first.str() == key) return &kv.second;
  return nullptr;
}

const Value* ValueDict::find(const Value& key) const {
  if ((key.kind == Kind::List && !key.is_tuple) || key.kind == Kind::Dict)
    throw Error(std::string("unhashable type: '") + type_name(key) + "'");
  if (key.is_string()) return find(std::string_view(key.str()));
  for (const auto& kv : items)
    if (equal(kv.first, key)) return &kv.second;
  return nullptr;
}

void ValueDict::set(const std::string& key, Value value) {
  set(Value::from_string(key), std::move(value));
}

void ValueDict::set(Value key, Value value) {
  if ((key.kind == Kind::List && !key.is_tuple) || key.kind == Kind::Dict)
    throw Error(std::string("unhashable type: '") + type_name(key) + "'");
  for (auto& kv : items) {
    if (equal(kv.first, key)) {
      kv.second = std::move(value);
      return;
    }
  }
  items.emplace_back(std::move(key), std::move(value));
}

const std::string& Value::str() const {
  static const std::string empty;
  return string ? *string : empty;
}

Value Value::undefined(std::string name) {
  Value v;
  v.string = std::make_shared<const std::string>(std::move(name));
  return v;
}
Value Value::none() {
  Value v;
  v.kind = Kind::None;
  return v;
}
Value Value::from_bool(bool b) {
  Value v;
  v.kind = Kind::Bool;
  v.boolean = b;
  return v;
}
Value Value::from_int(int64_t i) {
  Value v;
  v.kind = Kind::Int;
  v.integer = i;
  return v;
}
Value Value::from_float(double d) {
  Value v;
  v.kind = Kind::Float;
  v.number = d;
  return v;
}
Value Value::from_string(std::string s) {
  Value v;
  v.kind = Kind::String;
  v.string = std::make_shared<const std::string>(std::move(s));
  return v;
}
Value Value::from_list(ValueList items) {
  Value v;
  v.kind = Kind::List;
  int depth = 0;
  for (const Value& item : items) {
    depth = std::max<int>(depth, item.depth);
    v.holds_namespace = v.holds_namespace || item.holds_namespace;
  }
  check_depth(depth + 1);
  v.depth = static_cast<uint16_t>(depth + 1);
  v.list = std::make_shared<ValueList>(std::move(items));
  return v;
}
Value Value::tuple(ValueList items) {
  Value v = from_list(std::move(items));
  v.is_tuple = true;
  return v;
}
Value Value::lazy(ValueList items, std::string python_type) {
  Value v = from_list(std::move(items));
  v.is_lazy = true;
  v.string = std::make_shared<const std::string>(std::move(python_type));
  return v;
}
Value Value::from_dict(ValueDict d) {
  Value v;
  v.kind = Kind::Dict;
  int depth = 0;
  for (const auto& kv : d.items) {
    depth = std::max<int>({depth, kv.first.depth, kv.second.depth});
    v.holds_namespace = v.holds_namespace || kv.second.holds_namespace;
  }
  check_depth(depth + 1);
  v.depth = static_cast<uint16_t>(depth + 1);
  v.dict = std::make_shared<ValueDict>(std::move(d));
  return v;
}
Value Value::namespace_of(ValueDict d) {
  Value v = from_dict(std::move(d));
  if (v.holds_namespace) throw Error("namespace(): a namespace cannot hold another namespace");
  v.kind = Kind::Namespace;
  v.holds_namespace = true;
  return v;
}

void set_namespace_attribute(const Value& ns, const std::string& key, Value value) {
  if (value.holds_namespace) throw Error("a namespace cannot hold another namespace ('" + key + "')");
  ns.dict->set(key, std::move(value));
}
Value Value::from_function(std::string name, std::function<Value(CallArgs&)> call) {
  Value v;
  v.kind = Kind::Function;
  v.function = std::make_shared<const Function>(Function{std::move(name), std::move(call)});
  return v;
}

std::string html_escape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string markup_text(const Value& v) {
  return v.is_string() && v.is_markup ? v.str() : html_escape(to_str(v));
}

const char* type_name(const Value& v) {
  switch (v.kind) {
    case Kind::Undefined:
      return "Undefined";
    case Kind::None:
      return "NoneType";
    case Kind::Bool:
      return "bool";
    case Kind::Int:
      return "int";
    case Kind::Float:
      return "float";
    case Kind::String:
      return "str";
    case Kind::List:
      return v.is_lazy ? v.str().c_str() : v.is_tuple ? "tuple" : "list";
    case Kind::Dict:
      return "dict";
    case Kind::Namespace:
      return "Namespace";
    case Kind::Function:
      return "function";
  }
  return "?";
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Kind::Undefined:
    case Kind::None:
      return false;
    case Kind::Bool:
      return v.boolean;
    case Kind::Int:
      return v.integer != 0;
    case Kind::Float:
      return v.number != 0;
    case Kind::String:
      return !v.str().empty();
    case Kind::List:
      return (v.is_lazy && !v.str().starts_with("dict_")) || !v.list->empty();
    case Kind::Dict:
      return !v.dict->items.empty();
    case Kind::Namespace:
    case Kind::Function:
      return true;
  }
  return false;
}

std::string to_str(const Value& v) {
  return str_of(v, false, 0);
}
std::string to_repr(const Value& v) {
  return str_of(v, true, 0);
}

std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  const std::string sci(buf, res.ptr);  // "-1.2345e+17": shortest round-trip digits
  const size_t e_pos = sci.find('e');
  const bool negative = sci[0] == '-';
  std::string digits;
  for (size_t i = negative ? 1 : 0; i < e_pos; ++i)
    if (sci[i] != '.') digits += sci[i];
  const int exponent = std::stoi(sci.substr(e_pos + 1));
  std::string out = negative ? "-" : "";
  if (exponent < -4 || exponent >= 16) {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out.append(".").append(digits, 1, std::string::npos);
    char exp_buf[16];
    std::snprintf(exp_buf, sizeof(exp_buf), "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    return out + exp_buf;
  }
  if (exponent < 0) return out + "0." + std::string(static_cast<size_t>(-exponent - 1), '0') + digits;
  const size_t int_digits = static_cast<size_t>(exponent) + 1;
  if (digits.size() <= int_digits) return out + digits + std::string(int_digits - digits.size(), '0') + ".0";
  return out + digits.substr(0, int_digits) + "." + digits.substr(int_digits);
}

bool equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind == Kind::Float || b.kind == Kind::Float) return as_double(a) == as_double(b);
    return as_int(a) == as_int(b);
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Kind::Undefined:
    case Kind::None:
      return true;
    case Kind::String:
      return a.str() == b.str();
    case Kind::List: {
      if (a.is_tuple != b.is_tuple || a.list->size() != b.list->size()) return false;
      for (size_t i = 0; i < a.list->size(); ++i)
        if (!equal((*a.list)[i], (*b.list)[i])) return false;
      return true;
    }
    case Kind::Dict: {
      if (a.dict->items.size() != b.dict->items.size()) return false;
      for (const auto& kv : a.dict->items) {
        const Value* other = b.dict->find(kv.first);
        if (!other || !equal(kv.second, *other)) return false;
      }
      return true;
    }
    case Kind::Namespace:
      return a.dict == b.dict;
    case Kind::Function:
      return a.function == b.function;
    default:
      return false;
  }
}

int compare(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind == Kind::Float || b.kind == Kind::Float) {
      const double x = as_double(a), y = as_double(b);
      return x < y ? -1 : x > y ? 1 : 0;
    }
    const int64_t x = as_int(a), y = as_int(b);
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.is_string() && b.is_string()) return a.str() < b.str() ? -1 : a.str() > b.str() ? 1 : 0;
  if (a.is_list() && b.is_list()) {
    for (size_t i = 0; i < a.list->size() && i < b.list->size(); ++i)
      if (const int c = compare((*a.list)[i], (*b.list)[i])) return c;
    return a.list->size() < b.list->size() ? -1 : a.list->size() > b.list->size() ? 1 : 0;
  }
  throw Error(std::string("'<' not supported between instances of '") + type_name(a) + "' and '" +
              type_name(b) + "'");
}

size_t utf8_length(std::string_view s) {
  size_t n = 0;
  for (size_t i = 0; i < s.size(); ++n) {
    uint32_t cp;
    i += decode_utf8(s, i, &cp);
  }
  return n;
}

std::vector<std::string> utf8_chars(std::string_view s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    const size_t len = decode_utf8(s, i, &cp);
    out.emplace_back(s.substr(i, len));
    i += len;
  }
  return out;
}

std::string json_dumps(const Value& v, const JsonDumpOptions& options) {
  std::string out;
  dump(v, options, 0, out);
  return out;
}

namespace {
Value from_json_at(const nlohmann::ordered_json& j, int depth) {
  check_depth(depth);
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return Value::none();
    case nlohmann::ordered_json::value_t::boolean:
      return Value::from_bool(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Value::from_int(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) return Value::from_float(static_cast<double>(u));
      return Value::from_int(static_cast<int64_t>(u));
    }
    case nlohmann::ordered_json::value_t::number_float:
      return Value::from_float(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value::from_string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      ValueList items;
      for (const auto& e : j) items.push_back(from_json_at(e, depth + 1));
      return Value::from_list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      ValueDict d;
      for (const auto& [key, e] : j.items())
        d.items.emplace_back(Value::from_string(key), from_json_at(e, depth + 1));
      return Value::from_dict(std::move(d));
    }
    default:
      throw Error("template input: unsupported JSON value (binary)");
  }
}
}  // namespace

Value from_json(const nlohmann::ordered_json& j) {
  return from_json_at(j, 0);
}

}  // namespace microspec::jinja
