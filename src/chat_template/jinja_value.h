#pragma once
// The values a Jinja template computes with, shaped like the Python objects jinja2 sees when
// transformers renders a chat template: None, bool, int, float, str, list (and tuple), dict (keys
// in insertion order), namespace(), and callables (macros, globals). Printing, truthiness, equality,
// ordering and json.dumps follow Python's rules, since chat templates print values directly.
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace microspec::jinja {

struct Value;
using ValueList = std::vector<Value>;

// A dict in insertion order (Python's dict); small, so lookups are linear. Keys are strings
// (every JSON object, every scope) or any other value Python can hash (ints, floats, bools, None,
// tuples): 1, 1.0 and True are one key, as in Python.
struct ValueDict {
  std::vector<std::pair<Value, Value>> items;

  const Value* find(std::string_view key) const;
  // Throws Error for a key Python cannot hash (a list or a dict).
  const Value* find(const Value& key) const;
  void set(const std::string& key, Value value);
  void set(Value key, Value value);
};

// Arguments of a call: positional, then keyword (in the order written).
struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

struct Function {
  std::string name;
  std::function<Value(CallArgs&)> call;
};

enum class Kind { Undefined, None, Bool, Int, Float, String, List, Dict, Namespace, Function };

// A value is cheap to copy: lists, dicts and functions are shared (templates cannot change lists
// or dicts; a namespace is the one shared thing a template changes, as in jinja2).
struct Value {
  Kind kind = Kind::Undefined;
  bool boolean = false;
  bool is_tuple = false;  // a list that prints as a Python tuple: (a, b)
  // A list that stands for a Python iterator or view (what map / select return, d.items()): its
  // Python type name is in `string` ("generator", "dict_items"); tojson refuses it, and a generator
  // has no len() and is always true.
  bool is_lazy = false;
  // A string marked safe (markupsafe's Markup, from |safe or |escape): adding a plain string to it
  // escapes that string's HTML characters, as jinja2 does even with autoescape off.
  bool is_markup = false;
  // Nesting of lists and dicts (at most 256), and whether a namespace is inside: a namespace may
  // not hold another one, so values never form cycles and never nest without bound.
  uint16_t depth = 0;
  bool holds_namespace = false;
  int64_t integer = 0;
  double number = 0;
  // String: the text; Undefined: the name that was looked up (for error messages). Shared, so a
  // copy of a long string costs nothing.
  std::shared_ptr<const std::string> string;
  std::shared_ptr<ValueList> list;
  std::shared_ptr<ValueDict> dict;  // Dict and Namespace
  std::shared_ptr<const Function> function;

  static Value undefined(std::string name = "");
  static Value none();
  static Value from_bool(bool b);
  static Value from_int(int64_t i);
  static Value from_float(double d);
  static Value from_string(std::string s);
  static Value from_list(ValueList items);
  static Value tuple(ValueList items);
  static Value lazy(ValueList items, std::string python_type);
  static Value from_dict(ValueDict d);
  static Value namespace_of(ValueDict d);
  static Value from_function(std::string name, std::function<Value(CallArgs&)> call);

  const std::string& str() const;
  bool is_undefined() const { return kind == Kind::Undefined; }
  bool is_none() const { return kind == Kind::None; }
  bool is_string() const { return kind == Kind::String; }
  bool is_number() const { return kind == Kind::Int || kind == Kind::Float || kind == Kind::Bool; }
  bool is_list() const { return kind == Kind::List; }
  bool is_dict() const { return kind == Kind::Dict; }
};

// ns.key = value for a namespace (throws Error for a value that holds a namespace).
void set_namespace_attribute(const Value& ns, const std::string& key, Value value);

// markupsafe's escape: & < > " ' as &amp; &lt; &gt; &#34; &#39;.
std::string html_escape(std::string_view s);
// The text of v as it joins a Markup: a Markup as is, anything else escaped.
std::string markup_text(const Value& v);

// Python's type name of the value ("str", "int", "list", "dict", "NoneType", "Undefined"...).
const char* type_name(const Value& v);

// Python's bool(v) (Undefined is false).
bool truthy(const Value& v);
// Python's str(v) (what {{ v }} prints; Undefined prints ""), and repr(v).
std::string to_str(const Value& v);
std::string to_repr(const Value& v);
// Python's repr of a float: the shortest text that reads back to the same double.
std::string float_repr(double d);

// Python's ==, and the order of < (numbers with numbers, strings with strings, lists with lists;
// anything else is a TypeError in Python and an Error here).
bool equal(const Value& a, const Value& b);
int compare(const Value& a, const Value& b);

// One code point of UTF-8 text at s[i]; returns its byte length (1 for a byte that starts no valid
// sequence, which then stands for itself). append_utf8 writes a code point as UTF-8.
size_t decode_utf8(std::string_view s, size_t i, uint32_t* cp);
void append_utf8(uint32_t cp, std::string& out);

// Number of Unicode code points of UTF-8 text (Python's len of a str).
size_t utf8_length(std::string_view s);
// The UTF-8 text split into code points, each as its bytes.
std::vector<std::string> utf8_chars(std::string_view s);

// json.dumps(v, ensure_ascii, indent, separators, sort_keys) exactly as Python writes it.
struct JsonDumpOptions {
  bool ensure_ascii = false;
  bool indent_set = false;  // indent=None when false
  std::string indent;       // indent=N is N spaces
  bool separators_set = false;
  std::string item_separator, key_separator;
  bool sort_keys = false;
};
std::string json_dumps(const Value& v, const JsonDumpOptions& options);

// Values from and to JSON (template inputs: messages, tools). Objects keep their key order.
Value from_json(const nlohmann::ordered_json& j);

}  // namespace microspec::jinja
