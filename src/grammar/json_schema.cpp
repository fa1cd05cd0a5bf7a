#include "grammar/json_schema.h"

#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "util/error.h"

namespace microspec {

namespace {

using json = nlohmann::ordered_json;

constexpr int32_t kMaxIndent = 20;
constexpr int32_t kMaxCount = 256;
constexpr int32_t kMaxNesting = 64;  // schemas inside schemas  // minItems/maxItems/minLength/maxLength the grammar spells out

// Keywords that describe a value without constraining it.
const std::set<std::string> kAnnotations = {"title",      "description", "default",  "examples",
                                            "$schema",    "$id",         "$comment", "deprecated",
                                            "readOnly",   "writeOnly",   "$defs",    "definitions"};

class SchemaCompiler {
 public:
  explicit SchemaCompiler(const json& root) : root_(root) {}

  Symbol compile(const json& schema, const std::string& where);
  Symbol any_object() { return object_rule(); }
  Symbol whitespace() { return ws(); }
  Grammar::Builder& builder() { return b_; }
  // A grammar whose root is `root` as it is (no leading whitespace added).
  Grammar finish_as_is(Symbol root) && { return std::move(b_).build(root); }
  // The grammar of `value` after optional leading whitespace.
  Grammar finish(Symbol value) && {
    const Symbol root = b_.alt("root", {Sequence{ws(), value}});
    return std::move(b_).build(root);
  }

 private:
  // The shared rules, made on first use.
  Symbol ws();
  Symbol string_rule();
  Symbol string_char();
  Symbol number_rule();
  Symbol integer_rule();
  Symbol value_rule();
  Symbol object_rule();
  Symbol array_rule();
  Symbol literal(const json& value);

  Symbol compile_type(const std::string& type, const json& schema, const std::string& where);
  Symbol compile_object(const json& schema, const std::string& where);
  Symbol compile_array(const json& schema, const std::string& where);
  Symbol compile_string(const json& schema, const std::string& where);
  Symbol resolve_ref(const std::string& ref, const std::string& where);
  // `count` copies of `item` separated by commas, between brackets: [min, max] items (max < 0: any).
  Symbol list_of(const std::string& name, Symbol item, int32_t min, int32_t max);
  void check_keywords(const json& schema, const std::set<std::string>& allowed, const std::string& where);
  int32_t count_field(const json& schema, const char* key, int32_t fallback, const std::string& where);

  const json& root_;
  Grammar::Builder b_;
  std::optional<Symbol> ws_, string_, char_, number_, integer_, value_, object_, array_;
  std::map<std::string, Symbol> refs_;
  int32_t counter_ = 0;
  int32_t depth_ = 0;  // compile() calls in progress
};

[[noreturn]] void refuse(const std::string& what, const std::string& where) {
  throw Error("JSON Schema at " + where + ": " + what);
}

Symbol SchemaCompiler::ws() {
  // Nothing, one space, or one line break and an indent: pretty-printed JSON fits, endless
  // padding does not.
  if (!ws_) {
    const Symbol indent = b_.repeat("indent", {b_.bytes(ByteSet{}.add(' ', ' ').add('\t', '\t'))}, 0, kMaxIndent);
    ws_ = b_.alt("ws", {{}, b_.lit(" "), b_.lit("\n") + indent});
  }
  return *ws_;
}

Symbol SchemaCompiler::string_char() {
  if (char_) return *char_;
  const Symbol cont = b_.bytes(ByteSet::range(0x80, 0xBF));
  const Symbol hex = b_.bytes(ByteSet{}.add('0', '9').add('a', 'f').add('A', 'F'));
  const Symbol escape = b_.alt("escape", {{b_.bytes(ByteSet{}
                                                        .add('"', '"')
                                                        .add('\\', '\\')
                                                        .add('/', '/')
                                                        .add('b', 'b')
                                                        .add('f', 'f')
                                                        .add('n', 'n')
                                                        .add('r', 'r')
                                                        .add('t', 't'))},
                                          b_.lit("u") + Sequence{hex, hex, hex, hex}});
  char_ = b_.alt("char", {{b_.bytes(ByteSet{}.add(0x20, 0x21).add(0x23, 0x5B).add(0x5D, 0x7F))},
                          {b_.bytes(ByteSet::range(0xC2, 0xDF)), cont},
                          {b_.bytes(ByteSet::range(0xE0, 0xEF)), cont, cont},
                          {b_.bytes(ByteSet::range(0xF0, 0xF4)), cont, cont, cont},
                          b_.lit("\\") + escape});
  return *char_;
}

Symbol SchemaCompiler::string_rule() {
  if (!string_) string_ = b_.alt("string", {b_.lit("\"") + b_.repeat("chars", {string_char()}, 0, -1) + b_.lit("\"")});
  return *string_;
}

Symbol SchemaCompiler::integer_rule() {
  if (integer_) return *integer_;
  const Symbol digit = b_.bytes(ByteSet::range('0', '9'));
  const Symbol natural = b_.alt("natural", {b_.lit("0"), Sequence{b_.bytes(ByteSet::range('1', '9')),
                                                                   b_.repeat("digits15", {digit}, 0, 15)}});
  integer_ = b_.alt("integer", {Sequence{b_.optional("minus", b_.lit("-")), natural}});
  return *integer_;
}

Symbol SchemaCompiler::number_rule() {
  if (number_) return *number_;
  const Symbol digit = b_.bytes(ByteSet::range('0', '9'));
  const Symbol frac = b_.optional("fraction", b_.lit(".") + b_.repeat("digits16", {digit}, 1, 16));
  const Symbol exp = b_.optional(
      "exponent", Sequence{b_.bytes(ByteSet{}.add('e', 'e').add('E', 'E')),
                           b_.optional("sign", {b_.bytes(ByteSet{}.add('+', '+').add('-', '-'))}),
                           b_.repeat("digits3", {digit}, 1, 3)});
  number_ = b_.alt("number", {Sequence{integer_rule(), frac, exp}});
  return *number_;
}

Symbol SchemaCompiler::value_rule() {
  if (value_) return *value_;
  value_ = b_.rule("value");  // recursive through objects and arrays: declared first
  for (Symbol s : {object_rule(), array_rule(), string_rule(), number_rule()}) b_.add(*value_, {s});
  for (const char* word : {"true", "false", "null"}) b_.add(*value_, b_.lit(word));
  return *value_;
}

Symbol SchemaCompiler::object_rule() {
  if (object_) return *object_;
  object_ = b_.rule("object");
  const Symbol member = b_.alt("member", {Sequence{string_rule(), ws()} + b_.lit(":") + Sequence{ws(), value_rule(), ws()}});
  const Symbol more = b_.repeat("members", b_.lit(",") + Sequence{ws(), member}, 0, -1);
  b_.add(*object_, b_.lit("{") + Sequence{ws(), b_.optional("object-body", {member, more})} + b_.lit("}"));
  return *object_;
}

Symbol SchemaCompiler::array_rule() {
  if (!array_) {
    array_ = b_.rule("array");
    const Symbol list = list_of("array-items", value_rule(), 0, -1);
    b_.add(*array_, {list});
  }
  return *array_;
}

Symbol SchemaCompiler::list_of(const std::string& name, Symbol item, int32_t min, int32_t max) {
  // "[" ws (item ws ("," ws item ws){min - 1, max - 1})? "]", the group required when min > 0
  const Sequence open = b_.lit("[") + Sequence{ws()};
  if (max == 0) return b_.alt(name, {open + b_.lit("]")});
  const Sequence one{item, ws()};
  const Symbol rest = b_.repeat(name + "-rest", b_.lit(",") + Sequence{ws()} + one, std::max(min, 1) - 1,
                                max < 0 ? -1 : max - 1);
  const Sequence items = one + rest;
  const Sequence body = min > 0 ? items : Sequence{b_.alt(name + "-opt", {items, {}})};
  return b_.alt(name, {open + body + b_.lit("]")});
}

Symbol SchemaCompiler::literal(const json& value) {
  return b_.alt("const" + std::to_string(counter_++), {b_.lit(value.dump())});
}

void SchemaCompiler::check_keywords(const json& schema, const std::set<std::string>& allowed, const std::string& where) {
  for (const auto& [key, v] : schema.items()) {
    if (allowed.count(key) || kAnnotations.count(key)) continue;
    refuse("the keyword '" + key + "' is not supported by structured output", where);
  }
}

int32_t SchemaCompiler::count_field(const json& schema, const char* key, int32_t fallback, const std::string& where) {
  if (!schema.contains(key)) return fallback;
  const json& v = schema[key];
  if (!v.is_number_integer() || v.get<int64_t>() < 0) refuse(std::string("'") + key + "' must be a non-negative integer", where);
  if (v.get<int64_t>() > kMaxCount)
    refuse(std::string("'") + key + "' above " + std::to_string(kMaxCount) + " is not supported", where);
  return static_cast<int32_t>(v.get<int64_t>());
}

Symbol SchemaCompiler::resolve_ref(const std::string& ref, const std::string& where) {
  if (auto it = refs_.find(ref); it != refs_.end()) return it->second;
  const json* target = nullptr;
  if (ref == "#") {
    target = &root_;
  } else {
    for (const char* prefix : {"#/$defs/", "#/definitions/"}) {
      const std::string p(prefix);
      if (ref.rfind(p, 0) != 0) continue;
      const std::string section = p.substr(2, p.size() - 3), name = ref.substr(p.size());
      if (root_.contains(section) && root_[section].is_object() && root_[section].contains(name))
        target = &root_[section][name];
    }
  }
  if (!target) refuse("'$ref' " + ref + " does not name a schema (supported: #, #/$defs/NAME, #/definitions/NAME)", where);
  const Symbol r = b_.rule("ref:" + ref);  // declared before its body: references may recurse
  refs_.emplace(ref, r);
  b_.add(r, {compile(*target, ref)});
  return r;
}

Symbol SchemaCompiler::compile_object(const json& schema, const std::string& where) {
  check_keywords(schema, {"type", "properties", "required", "additionalProperties"}, where);
  if (!schema.contains("properties")) {
    if (schema.contains("required") && !schema["required"].empty())
      refuse("'required' names properties that 'properties' does not define", where);
    if (schema.contains("additionalProperties") && schema["additionalProperties"] == false)
      return b_.alt("empty-object", {b_.lit("{") + Sequence{ws()} + b_.lit("}")});
    return object_rule();
  }
  const json& props = schema["properties"];
  if (!props.is_object()) refuse("'properties' must be an object", where);
  std::set<std::string> required;
  if (schema.contains("required")) {
    if (!schema["required"].is_array()) refuse("'required' must be an array", where);
    for (const json& r : schema["required"]) {
      if (!r.is_string() || !props.contains(r.get<std::string>()))
        refuse("'required' names " + r.dump() + ", which 'properties' does not define", where);
      required.insert(r.get<std::string>());
    }
  }
  // rest(i, emitted): the properties from i on, after `emitted` says whether one came before
  // (then each needs a comma). Built from the last property back.
  const std::string name = "obj" + std::to_string(counter_++);
  Symbol rest_after[2] = {b_.alt(name + "-end", {{}}), b_.alt(name + "-end", {{}})};  // [emitted]
  std::vector<std::pair<std::string, const json*>> list;
  for (const auto& [key, sub] : props.items()) list.emplace_back(key, &sub);
  for (size_t i = list.size(); i-- > 0;) {
    const auto& [key, sub] = list[i];
    const Symbol value = compile(*sub, where + "/properties/" + key);
    const Sequence kv = b_.lit(json(key).dump()) + Sequence{ws()} + b_.lit(":") + Sequence{ws(), value, ws()};
    Symbol next[2];
    for (int emitted = 0; emitted < 2; ++emitted) {
      const Sequence take = (emitted ? b_.lit(",") + Sequence{ws()} : Sequence{}) + kv + Sequence{rest_after[1]};
      std::vector<Sequence> alts{take};
      if (!required.count(key)) alts.push_back({rest_after[emitted]});
      next[emitted] = b_.alt(name + "-" + std::to_string(i) + (emitted ? "c" : ""), alts);
    }
    rest_after[0] = next[0];
    rest_after[1] = next[1];
  }
  return b_.alt(name, {b_.lit("{") + Sequence{ws(), rest_after[0]} + b_.lit("}")});
}

Symbol SchemaCompiler::compile_array(const json& schema, const std::string& where) {
  check_keywords(schema, {"type", "items", "minItems", "maxItems"}, where);
  const int32_t min = count_field(schema, "minItems", 0, where);
  const int32_t max = schema.contains("maxItems") ? count_field(schema, "maxItems", -1, where) : -1;
  if (max >= 0 && max < min) refuse("'maxItems' is below 'minItems'", where);
  const Symbol item = schema.contains("items") ? compile(schema["items"], where + "/items") : value_rule();
  return list_of("arr" + std::to_string(counter_++), item, min, max);
}

Symbol SchemaCompiler::compile_string(const json& schema, const std::string& where) {
  check_keywords(schema, {"type", "minLength", "maxLength"}, where);
  if (!schema.contains("minLength") && !schema.contains("maxLength")) return string_rule();
  const int32_t min = count_field(schema, "minLength", 0, where);
  const int32_t max = schema.contains("maxLength") ? count_field(schema, "maxLength", -1, where) : -1;
  if (max >= 0 && max < min) refuse("'maxLength' is below 'minLength'", where);
  const std::string name = "str" + std::to_string(counter_++);
  return b_.alt(name, {b_.lit("\"") + Sequence{b_.repeat(name + "-chars", {string_char()}, min, max)} + b_.lit("\"")});
}

Symbol SchemaCompiler::compile_type(const std::string& type, const json& schema, const std::string& where) {
  if (type == "object") return compile_object(schema, where);
  if (type == "array") return compile_array(schema, where);
  if (type == "string") return compile_string(schema, where);
  check_keywords(schema, {"type"}, where);
  if (type == "number") return number_rule();
  if (type == "integer") return integer_rule();
  if (type == "boolean") return b_.alt("boolean", {b_.lit("true"), b_.lit("false")});
  if (type == "null") return b_.alt("null", {b_.lit("null")});
  refuse("unknown type '" + type + "'", where);
}

// Whether a JSON value is of a JSON Schema type.
bool is_of_type(const json& v, const std::string& type) {
  if (type == "integer") return v.is_number_integer() || (v.is_number_float() && v.get<double>() == double(int64_t(v.get<double>())));
  if (type == "number") return v.is_number();
  if (type == "string") return v.is_string();
  if (type == "boolean") return v.is_boolean();
  if (type == "null") return v.is_null();
  if (type == "array") return v.is_array();
  if (type == "object") return v.is_object();
  return false;
}

Symbol SchemaCompiler::compile(const json& schema, const std::string& where) {
  struct Nesting {  // bounds the recursion a hostile schema can ask for
    int32_t& depth;
    explicit Nesting(int32_t& d) : depth(++d) {}
    ~Nesting() { --depth; }
  } nesting(depth_);
  if (depth_ > kMaxNesting) refuse("schemas nested deeper than " + std::to_string(kMaxNesting) + " levels", where);
  if (schema.is_boolean()) {
    if (!schema.get<bool>()) refuse("the schema 'false' matches nothing", where);
    return value_rule();
  }
  if (!schema.is_object()) refuse("a schema must be an object or a boolean", where);
  if (schema.contains("$ref")) {
    check_keywords(schema, {"$ref"}, where);
    if (!schema["$ref"].is_string()) refuse("'$ref' must be a string", where);
    return resolve_ref(schema["$ref"].get<std::string>(), where);
  }
  std::vector<std::string> types;
  if (schema.contains("type")) {
    const json& t = schema["type"];
    if (t.is_string()) types.push_back(t.get<std::string>());
    else if (t.is_array() && !t.empty() && std::all_of(t.begin(), t.end(), [](const json& x) { return x.is_string(); }))
      for (const json& x : t) types.push_back(x.get<std::string>());
    else refuse("'type' must be a string or a non-empty array of strings", where);
  }
  auto type_allows = [&](const json& v) {
    return types.empty() || std::any_of(types.begin(), types.end(), [&](const std::string& t) { return is_of_type(v, t); });
  };
  if (schema.contains("const") || schema.contains("enum")) {
    check_keywords(schema, {"type", "const", "enum"}, where);
    std::vector<Sequence> alts;
    const json values = schema.contains("const") ? json::array({schema["const"]}) : schema["enum"];
    if (!values.is_array() || values.empty()) refuse("'enum' must be a non-empty array", where);
    for (const json& v : values)
      if (type_allows(v) && (!schema.contains("const") || !schema.contains("enum") || std::find(schema["enum"].begin(), schema["enum"].end(), v) != schema["enum"].end()))
        alts.push_back({literal(v)});
    if (alts.empty()) refuse("no value of 'enum'/'const' fits the schema's 'type'", where);
    return b_.alt("enum" + std::to_string(counter_++), alts);
  }
  for (const char* key : {"anyOf", "allOf"}) {
    if (!schema.contains(key)) continue;
    check_keywords(schema, {key}, where);
    const json& list = schema[key];
    if (!list.is_array() || list.empty()) refuse(std::string("'") + key + "' must be a non-empty array", where);
    if (std::string(key) == "allOf" && list.size() != 1) refuse("'allOf' with more than one schema is not supported", where);
    std::vector<Sequence> alts;
    for (size_t i = 0; i < list.size(); ++i) alts.push_back({compile(list[i], where + "/" + key + "/" + std::to_string(i))});
    return b_.alt(std::string(key) + std::to_string(counter_++), alts);
  }
  if (types.empty()) {
    if (schema.contains("properties") || schema.contains("required") || schema.contains("additionalProperties"))
      types.push_back("object");
    else if (schema.contains("items") || schema.contains("minItems") || schema.contains("maxItems"))
      types.push_back("array");
    else if (schema.contains("minLength") || schema.contains("maxLength"))
      types.push_back("string");
  }
  if (types.empty()) {
    check_keywords(schema, {}, where);
    return value_rule();
  }
  std::vector<Sequence> alts;
  for (const std::string& t : types) alts.push_back({compile_type(t, schema, where)});
  return alts.size() == 1 ? alts[0][0] : b_.alt("types" + std::to_string(counter_++), alts);
}

}  // namespace

Grammar json_schema_grammar(const nlohmann::ordered_json& schema) {
  SchemaCompiler c(schema);
  const Symbol value = c.compile(schema, "#");
  return std::move(c).finish(value);
}

namespace {

// The tagged texts of tagged_json_grammar: open ws JSON ws close.
Sequence tagged(SchemaCompiler& c, Symbol value, const JsonTags& tags) {
  Grammar::Builder& b = c.builder();
  return b.lit(tags.open) + Sequence{c.whitespace(), value, c.whitespace()} + b.lit(tags.close);
}

// Free text that becomes a tagged text wherever `open` appears: state j has matched open[0, j) as
// the text's latest bytes; a byte moves it to the longest prefix of `open` that the text then ends
// with (the prefix function), and the last byte of `open` to the tagged text, after which the free
// text starts over.
Symbol free_text_with_calls(SchemaCompiler& c, Symbol value, const JsonTags& tags) {
  Grammar::Builder& b = c.builder();
  const std::string& open = tags.open;
  const size_t n = open.size();
  std::vector<Symbol> state;
  for (size_t j = 0; j < n; ++j) state.push_back(b.rule("text" + std::to_string(j)));
  // What follows a completed `open`: the JSON text, `close`, then free text again.
  const Symbol call = b.alt("call", {Sequence{c.whitespace(), value, c.whitespace()} + b.lit(tags.close) +
                                     Sequence{state[0]}});
  for (size_t j = 0; j < n; ++j) {
    b.add(state[j], {});  // the text may end here
    std::vector<ByteSet> to(n);  // bytes moving to state k < n
    for (int byte = 0; byte < 256; ++byte) {
      if (uint8_t(byte) == uint8_t(open[j])) continue;
      const std::string seen = open.substr(0, j) + char(byte);
      size_t k = std::min(seen.size(), n - 1);
      while (k > 0 && seen.compare(seen.size() - k, k, open, 0, k) != 0) --k;
      to[k].add(uint8_t(byte), uint8_t(byte));
    }
    for (size_t k = 0; k < n; ++k)
      if (to[k] != ByteSet{}) b.add(state[j], Sequence{b.bytes(to[k]), state[k]});
    b.add(state[j], Sequence{b.bytes(ByteSet::of(uint8_t(open[j]))), j + 1 < n ? state[j + 1] : call});
  }
  return state[0];
}

}  // namespace

Grammar tagged_json_grammar(const nlohmann::ordered_json& schema, const JsonTags& tags, TaggedJsonMode mode,
                            int32_t max_calls) {
  if (tags.open.empty() || tags.close.empty()) throw Error("tagged JSON: the tags must not be empty");
  if (max_calls < 1) throw Error("tagged JSON: max_calls must be at least 1");
  SchemaCompiler c(schema);
  const Symbol value = c.compile(schema, "#");
  Grammar::Builder& b = c.builder();
  if (mode == TaggedJsonMode::TextOrCalls) return std::move(c).finish_as_is(free_text_with_calls(c, value, tags));
  const Sequence one = tagged(c, value, tags);
  const Symbol more = b.repeat("more-calls", Sequence{c.whitespace()} + one, 0, max_calls - 1);
  return std::move(c).finish_as_is(b.alt("calls", {Sequence{c.whitespace()} + one + Sequence{more}}));
}

Grammar json_object_grammar() {
  const json none;
  SchemaCompiler c(none);
  const Symbol value = c.any_object();
  return std::move(c).finish(value);
}

}  // namespace microspec
