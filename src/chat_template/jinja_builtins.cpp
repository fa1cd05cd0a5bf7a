// Filters, tests and methods. Each follows what jinja2 3.1 (filters.py, tests.py) and Python do for
// the same arguments; what chat templates do not need is refused with an Error naming it.
#include "chat_template/jinja_builtins.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <initializer_list>

#include "util/error.h"

namespace microspec::jinja {

ValueList iterate(const Value& v, const std::string& where) {
  switch (v.kind) {
    case Kind::Undefined:
      return {};
    case Kind::List:
      return *v.list;
    case Kind::Dict: {
      ValueList keys;
      for (const auto& kv : v.dict->items) keys.push_back(kv.first);
      return keys;
    }
    case Kind::String: {
      if (v.str().size() > (1u << 20)) throw Error(where + ": iterating over a string longer than 1 MiB");
      ValueList chars;
      for (auto& c : utf8_chars(v.str())) chars.push_back(Value::from_string(std::move(c)));
      return chars;
    }
    default:
      throw Error(where + ": '" + std::string(type_name(v)) + "' object is not iterable");
  }
}

namespace {

// Positional and keyword arguments bound to named parameters, in Python's way.
class Params {
 public:
  Params(std::string where, CallArgs& args, std::initializer_list<const char*> names)
      : where_(std::move(where)), names_(names), values_(names.size()), given_(names.size(), false) {
    if (args.positional.size() > names_.size())
      throw Error(where_ + " takes at most " + std::to_string(names_.size()) + " argument(s), " +
                  std::to_string(args.positional.size()) + " given");
    for (size_t i = 0; i < args.positional.size(); ++i) values_[i] = args.positional[i], given_[i] = true;
    for (auto& [key, value] : args.keyword) {
      const std::string& name = key;  // clang 14 cannot capture a structured binding in a lambda
      const auto it = std::find_if(names_.begin(), names_.end(), [&](const char* n) { return name == n; });
      if (it == names_.end()) throw Error(where_ + " got an unexpected keyword argument '" + key + "'");
      const size_t i = static_cast<size_t>(it - names_.begin());
      if (given_[i]) throw Error(where_ + " got multiple values for argument '" + key + "'");
      values_[i] = value, given_[i] = true;
    }
  }
  bool has(size_t i) const { return given_[i]; }
  const Value& get(size_t i) const { return values_[i]; }
  bool flag(size_t i, bool fallback) const { return given_[i] ? truthy(values_[i]) : fallback; }
  int64_t integer(size_t i, int64_t fallback) const {
    if (!given_[i]) return fallback;
    if (values_[i].kind == Kind::Int) return values_[i].integer;
    if (values_[i].kind == Kind::Bool) return values_[i].boolean;
    throw Error(where_ + ": argument '" + names_[i] + "' must be an integer, not " + type_name(values_[i]));
  }
  std::string text(size_t i, const std::string& fallback) const {
    if (!given_[i]) return fallback;
    if (!values_[i].is_string())
      throw Error(where_ + ": argument '" + names_[i] + "' must be a string, not " + type_name(values_[i]));
    return values_[i].str();
  }

 private:
  std::string where_;
  std::vector<const char*> names_;
  std::vector<Value> values_;
  std::vector<bool> given_;
};

// Python's case mapping for the scripts chat templates meet (ASCII, Latin-1, Latin Extended-A,
// Greek, Cyrillic, full-width Latin); other code points have no case here.
uint32_t upper_of(uint32_t c) {
  if (c < 0x80) return c >= 'a' && c <= 'z' ? c - 32 : c;
  if (c == 0xB5) return 0x39C;
  if (c >= 0xE0 && c <= 0xFE && c != 0xF7) return c - 0x20;
  if (c == 0xFF) return 0x178;
  if ((c >= 0x100 && c <= 0x137) || (c >= 0x14A && c <= 0x177)) return c & ~1u;
  if ((c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17E)) return (c % 2 == 0) ? c - 1 : c;
  if (c == 0x17F) return 'S';
  if (c == 0x3C2) return 0x3A3;
  if (c >= 0x3B1 && c <= 0x3C9) return c - 0x20;
  if (c == 0x3AC) return 0x386;
  if (c >= 0x3AD && c <= 0x3AF) return c - 0x25;
  if (c == 0x3CC) return 0x38C;
  if (c == 0x3CD || c == 0x3CE) return c - 0x3F;
  if (c >= 0x430 && c <= 0x44F) return c - 0x20;
  if (c >= 0x450 && c <= 0x45F) return c - 0x50;
  if (c >= 0xFF41 && c <= 0xFF5A) return c - 0x20;
  return c;
}

uint32_t lower_of(uint32_t c) {
  if (c < 0x80) return c >= 'A' && c <= 'Z' ? c + 32 : c;
  if (c >= 0xC0 && c <= 0xDE && c != 0xD7) return c + 0x20;
  if (c == 0x178) return 0xFF;
  if ((c >= 0x100 && c <= 0x137) || (c >= 0x14A && c <= 0x177)) return c | 1u;
  if ((c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17E)) return (c % 2 == 1) ? c + 1 : c;
  if (c >= 0x391 && c <= 0x3A9 && c != 0x3A2) return c + 0x20;
  if (c == 0x386) return 0x3AC;
  if (c >= 0x388 && c <= 0x38A) return c + 0x25;
  if (c == 0x38C) return 0x3CC;
  if (c == 0x38E || c == 0x38F) return c + 0x3F;
  if (c >= 0x410 && c <= 0x42F) return c + 0x20;
  if (c >= 0x400 && c <= 0x40F) return c + 0x50;
  if (c >= 0xFF21 && c <= 0xFF3A) return c + 0x20;
  return c;
}

bool is_cased(uint32_t c) {
  return upper_of(c) != c || lower_of(c) != c || c == 0xDF;
}

enum class CaseMap { Upper, Lower, Title, Capitalize };

// str.upper / lower / title / capitalize.
std::string map_case(const std::string& s, CaseMap mode) {
  std::string out;
  out.reserve(s.size());
  bool previous_cased = false, first = true;
  for (size_t i = 0; i < s.size();) {
    uint32_t c;
    i += decode_utf8(s, i, &c);
    bool up = mode == CaseMap::Upper;
    if (mode == CaseMap::Title) up = !previous_cased;
    if (mode == CaseMap::Capitalize) up = first;
    if (up && c == 0xDF) {
      out += mode == CaseMap::Upper ? "SS" : "Ss";
    } else {
      append_utf8(up ? upper_of(c) : lower_of(c), out);
    }
    previous_cased = is_cased(c);
    first = false;
  }
  return out;
}

// jinja2's title filter (not str.title): each run after whitespace, '-', '(', '{', '[' or '<' gets
// its first character upper-cased and the rest lower-cased.
std::string jinja_title(const std::string& s) {
  std::string out;
  bool word_start = true;
  for (size_t i = 0; i < s.size();) {
    uint32_t c;
    i += decode_utf8(s, i, &c);
    const bool separator = c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v' ||
                           c == '-' || c == '(' || c == '{' || c == '[' || c == '<';
    if (separator) {
      append_utf8(c, out);
    } else if (word_start && c == 0xDF) {
      out += "SS";
    } else {
      append_utf8(word_start ? upper_of(c) : lower_of(c), out);
    }
    word_start = separator;
  }
  return out;
}

std::string lower_text(const std::string& s) {
  return map_case(s, CaseMap::Lower);
}
std::string upper_text(const std::string& s) {
  return map_case(s, CaseMap::Upper);
}

// item.a.b as jinja2's attribute getters read it (dict keys, list indices); missing is Undefined.
Value get_path(const Value& item, const std::string& path) {
  Value v = item;
  size_t start = 0;
  while (start <= path.size()) {
    const size_t dot = std::min(path.find('.', start), path.size());
    const std::string part = path.substr(start, dot - start);
    if (v.is_undefined()) throw Error("attribute '" + part + "' of an undefined value");
    Value next =
        Value::undefined(std::string("'") + type_name(v) + " object' has no attribute '" + part + "'");
    if ((v.is_dict() || v.kind == Kind::Namespace) && v.dict->find(part)) {
      next = *v.dict->find(part);
    } else if (v.is_list() && !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit)) {
      const size_t i = std::strtoul(part.c_str(), nullptr, 10);
      if (i < v.list->size()) next = (*v.list)[i];
    }
    v = std::move(next);
    start = dot + 1;
  }
  return v;
}

// The key sort, unique, min, max and dictsort compare by: strings lowered unless case_sensitive.
Value sort_key(const Value& v, bool case_sensitive) {
  if (!case_sensitive && v.is_string()) return Value::from_string(lower_text(v.str()));
  return v;
}

int64_t checked_int(double d, const std::string& where) {
  if (!std::isfinite(d) || std::fabs(d) >= 9.2e18)
    throw Error(where + ": cannot convert " + float_repr(d) + " to int");
  return static_cast<int64_t>(d);
}

// Python's int(text): optional whitespace and sign, digits (with single underscores between).
std::optional<int64_t> parse_int(const std::string& s) {
  const std::string t = strip_text(s, Value::undefined(), StripSide::Both);
  size_t i = 0;
  bool negative = false;
  if (i < t.size() && (t[i] == '+' || t[i] == '-')) negative = t[i++] == '-';
  if (i == t.size()) return std::nullopt;
  int64_t v = 0;
  for (; i < t.size(); ++i) {
    if (t[i] == '_' && i + 1 < t.size() && std::isdigit(static_cast<unsigned char>(t[i + 1])) && i > 0 &&
        std::isdigit(static_cast<unsigned char>(t[i - 1])))
      continue;
    if (!std::isdigit(static_cast<unsigned char>(t[i]))) return std::nullopt;
    if (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, t[i] - '0', &v)) return std::nullopt;
  }
  return negative ? -v : v;
}

std::optional<double> parse_float(const std::string& s) {
  const std::string t = strip_text(s, Value::undefined(), StripSide::Both);
  if (t.empty()) return std::nullopt;
  char* end = nullptr;
  const double d = std::strtod(t.c_str(), &end);
  if (end != t.c_str() + t.size()) return std::nullopt;
  return d;
}

Value filter_tojson(const Value& v, CallArgs& args, Budget& budget) {
  // transformers' tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)
  Params p("filter 'tojson'", args, {"ensure_ascii", "indent", "separators", "sort_keys"});
  JsonDumpOptions o;
  o.ensure_ascii = p.flag(0, false);
  if (p.has(1) && !p.get(1).is_none()) {
    o.indent_set = true;
    if (p.get(1).is_string()) {
      o.indent = p.get(1).str();
    } else {
      const int64_t n = p.integer(1, 0);
      o.indent = std::string(static_cast<size_t>(std::clamp<int64_t>(n, 0, 64)), ' ');
    }
  }
  if (p.has(2) && !p.get(2).is_none()) {
    const Value& sep = p.get(2);
    if (!sep.is_list() || sep.list->size() != 2 || !(*sep.list)[0].is_string() || !(*sep.list)[1].is_string())
      throw Error("filter 'tojson': separators must be a pair of strings");
    o.separators_set = true;
    o.item_separator = (*sep.list)[0].str();
    o.key_separator = (*sep.list)[1].str();
  }
  o.sort_keys = p.flag(3, false);
  std::string out = json_dumps(v, o);
  budget.built_string(out.size());
  return Value::from_string(std::move(out));
}

Value filter_indent(const Value& v, CallArgs& args, Budget& budget) {
  Params p("filter 'indent'", args, {"width", "first", "blank"});
  const std::string indention =
      p.has(0) && p.get(0).is_string()
          ? p.get(0).str()
          : std::string(static_cast<size_t>(std::clamp<int64_t>(p.integer(0, 4), 0, 1024)), ' ');
  std::vector<std::string> lines;
  const std::string s = to_str(v) + "\n";
  for (size_t start = 0; start < s.size();) {
    size_t end = s.find('\n', start);
    lines.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  budget.built_string(s.size() + lines.size() * indention.size());
  std::string out;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (i) out += '\n';
    const bool indent_line = i == 0 ? false : (p.flag(2, false) || !lines[i].empty());
    if (indent_line) out += indention;
    out += lines[i];
  }
  if (p.flag(1, false)) out = indention + out;
  return Value::from_string(std::move(out));
}

// select / reject / selectattr / rejectattr: positional args after the attribute are the test name
// and its arguments; no test keeps truthy items.
Value filter_select(const std::string& name, const Value& v, CallArgs& args) {
  const bool by_attr = name == "selectattr" || name == "rejectattr";
  const bool keep_if = name == "select" || name == "selectattr";
  if (!args.keyword.empty()) throw Error("filter '" + name + "' takes no keyword arguments");
  size_t i = 0;
  std::string attr;
  if (by_attr) {
    if (args.positional.empty() || !args.positional[0].is_string())
      throw Error("filter '" + name + "' needs an attribute name");
    attr = args.positional[i++].str();
  }
  std::string test;
  if (i < args.positional.size()) {
    if (!args.positional[i].is_string()) throw Error("filter '" + name + "': the test name must be a string");
    test = args.positional[i++].str();
  }
  const std::vector<Value> test_args(args.positional.begin() + static_cast<std::ptrdiff_t>(i),
                                     args.positional.end());
  ValueList out;
  if (!truthy(v)) return Value::lazy({}, "generator");  // jinja2 yields nothing for a false value
  for (const Value& item : iterate(v, "filter '" + name + "'")) {
    const Value subject = by_attr ? get_path(item, attr) : item;
    const bool passed = test.empty() ? truthy(subject) : apply_test(test, subject, test_args);
    if (passed == keep_if) out.push_back(item);
  }
  return Value::lazy(std::move(out), "generator");
}

Value filter_map(const Value& v, CallArgs& args, Budget& budget) {
  ValueList out;
  const ValueList items = truthy(v) ? iterate(v, "filter 'map'") : ValueList{};  // false: nothing
  if (args.positional.empty()) {
    Params p("filter 'map'", args, {"attribute", "default"});
    if (!p.has(0)) throw Error("filter 'map' needs a filter name or attribute=");
    const std::string attr = p.text(0, "");
    for (const Value& item : items) {
      Value x = get_path(item, attr);
      if (x.is_undefined() && p.has(1)) x = p.get(1);
      out.push_back(std::move(x));
    }
    return Value::lazy(std::move(out), "generator");
  }
  if (!args.positional[0].is_string()) throw Error("filter 'map': the filter name must be a string");
  const std::string filter = args.positional[0].str();
  for (const Value& item : items) {
    CallArgs rest{std::vector<Value>(args.positional.begin() + 1, args.positional.end()), args.keyword};
    out.push_back(apply_filter(filter, item, rest, budget));
  }
  return Value::lazy(std::move(out), "generator");
}

Value filter_sort(const std::string& name, const Value& v, CallArgs& args) {
  Params p("filter '" + name + "'", args, {"reverse", "case_sensitive", "attribute"});
  const bool reverse = p.flag(0, false), case_sensitive = p.flag(1, false);
  const std::string attr = p.text(2, "");
  ValueList items = iterate(v, "filter '" + name + "'");
  auto key = [&](const Value& item) {
    return sort_key(attr.empty() ? item : get_path(item, attr), case_sensitive);
  };
  std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
    return reverse ? compare(key(b), key(a)) < 0 : compare(key(a), key(b)) < 0;
  });
  return Value::from_list(std::move(items));
}

Value filter_min_max(const std::string& name, const Value& v, CallArgs& args) {
  Params p("filter '" + name + "'", args, {"case_sensitive", "attribute"});
  const bool case_sensitive = p.flag(0, false);
  const std::string attr = p.text(1, "");
  const ValueList items = iterate(v, "filter '" + name + "'");
  if (items.empty()) return Value::undefined("'" + name + "' of an empty sequence");
  auto key = [&](const Value& item) {
    return sort_key(attr.empty() ? item : get_path(item, attr), case_sensitive);
  };
  size_t best = 0;
  for (size_t i = 1; i < items.size(); ++i) {
    const int c = compare(key(items[i]), key(items[best]));
    if (name == "min" ? c < 0 : c > 0) best = i;
  }
  return items[best];
}

Value filter_unique(const Value& v, CallArgs& args) {
  Params p("filter 'unique'", args, {"case_sensitive", "attribute"});
  const bool case_sensitive = p.flag(0, false);
  const std::string attr = p.text(1, "");
  ValueList out, seen;
  for (const Value& item : iterate(v, "filter 'unique'")) {
    Value k = sort_key(attr.empty() ? item : get_path(item, attr), case_sensitive);
    if (std::any_of(seen.begin(), seen.end(), [&](const Value& s) { return equal(s, k); })) continue;
    seen.push_back(std::move(k));
    out.push_back(item);
  }
  return Value::lazy(std::move(out), "generator");
}

Value filter_dictsort(const Value& v, CallArgs& args) {
  Params p("filter 'dictsort'", args, {"case_sensitive", "by", "reverse"});
  if (!v.is_dict()) throw Error("filter 'dictsort' needs a dict, not " + std::string(type_name(v)));
  const bool case_sensitive = p.flag(0, false), reverse = p.flag(2, false);
  const std::string by = p.text(1, "key");
  if (by != "key" && by != "value") throw Error("filter 'dictsort': 'by' must be 'key' or 'value'");
  ValueList pairs;
  for (const auto& [k, val] : v.dict->items) pairs.push_back(Value::tuple({k, val}));
  const size_t at = by == "key" ? 0 : 1;
  std::stable_sort(pairs.begin(), pairs.end(), [&](const Value& a, const Value& b) {
    const Value ka = sort_key((*a.list)[at], case_sensitive), kb = sort_key((*b.list)[at], case_sensitive);
    return reverse ? compare(kb, ka) < 0 : compare(ka, kb) < 0;
  });
  return Value::from_list(std::move(pairs));
}

Value filter_int(const Value& v, CallArgs& args) {
  Params p("filter 'int'", args, {"default", "base"});
  const Value fallback = p.has(0) ? p.get(0) : Value::from_int(0);
  if (p.has(1) && p.integer(1, 10) != 10) throw Error("filter 'int': only base 10 is supported");
  switch (v.kind) {
    case Kind::Int:
      return v;
    case Kind::Bool:
      return Value::from_int(v.boolean);
    case Kind::Float:
      return Value::from_int(checked_int(v.number, "filter 'int'"));
    case Kind::String: {
      if (auto i = parse_int(v.str())) return Value::from_int(*i);
      if (auto d = parse_float(v.str())) return Value::from_int(checked_int(*d, "filter 'int'"));
      return fallback;
    }
    case Kind::Undefined:
      throw Error("filter 'int' of an undefined value");
    default:
      return fallback;
  }
}

Value filter_float(const Value& v, CallArgs& args) {
  Params p("filter 'float'", args, {"default"});
  const Value fallback = p.has(0) ? p.get(0) : Value::from_float(0.0);
  switch (v.kind) {
    case Kind::Int:
      return Value::from_float(static_cast<double>(v.integer));
    case Kind::Bool:
      return Value::from_float(v.boolean);
    case Kind::Float:
      return v;
    case Kind::String: {
      if (auto d = parse_float(v.str())) return Value::from_float(*d);
      return fallback;
    }
    case Kind::Undefined:
      throw Error("filter 'float' of an undefined value");
    default:
      return fallback;
  }
}

Value filter_round(const Value& v, CallArgs& args) {
  Params p("filter 'round'", args, {"precision", "method"});
  const int64_t precision = std::clamp<int64_t>(p.integer(0, 0), -20, 20);
  const std::string method = p.text(1, "common");
  if (!v.is_number()) throw Error("filter 'round' needs a number, not " + std::string(type_name(v)));
  const double x = v.kind == Kind::Float ? v.number
                   : v.kind == Kind::Int ? static_cast<double>(v.integer)
                                         : v.boolean;
  const double scale = std::pow(10.0, static_cast<double>(precision));
  double r;
  if (method == "common")
    r = std::nearbyint(x * scale) / scale;  // Python's round: half to even
  else if (method == "ceil")
    r = std::ceil(x * scale) / scale;
  else if (method == "floor")
    r = std::floor(x * scale) / scale;
  else
    throw Error("filter 'round': method must be 'common', 'ceil' or 'floor'");
  if (v.kind != Kind::Float && method == "common") return Value::from_int(checked_int(r, "filter 'round'"));
  return Value::from_float(r);
}

std::string replace_all(const std::string& s, const std::string& from, const std::string& to, int64_t count,
                        Budget& budget) {
  std::string out;
  int64_t done = 0;
  if (from.empty()) {
    // Python inserts `to` before every character and at the end.
    const auto chars = utf8_chars(s);
    budget.built_string(s.size() + (chars.size() + 1) * to.size());
    for (const auto& c : chars) {
      if (count < 0 || done < count) out += to, ++done;
      out += c;
    }
    if (count < 0 || done < count) out += to;
    return out;
  }
  size_t start = 0;
  while (true) {
    const size_t at = (count >= 0 && done >= count) ? std::string::npos : s.find(from, start);
    if (at == std::string::npos) break;
    out.append(s, start, at - start);
    out += to;
    budget.built_string(out.size());
    start = at + from.size();
    ++done;
  }
  out.append(s, start, std::string::npos);
  budget.built_string(out.size());
  return out;
}

// Python's len(): code points of a str, items of a list, keys of a dict; Undefined is 0.
Value length_of(const Value& v, const std::string& where) {
  switch (v.kind) {
    case Kind::Undefined:
      return Value::from_int(0);
    case Kind::String:
      return Value::from_int(static_cast<int64_t>(utf8_length(v.str())));
    case Kind::List:
      if (v.is_lazy && !v.str().starts_with("dict_"))
        throw Error(where + ": object of type '" + v.str() + "' has no len()");
      return Value::from_int(static_cast<int64_t>(v.list->size()));
    case Kind::Dict:
      return Value::from_int(static_cast<int64_t>(v.dict->items.size()));
    default:
      throw Error(where + ": object of type '" + std::string(type_name(v)) + "' has no len()");
  }
}

Value filter_join(const Value& v, CallArgs& args, Budget& budget) {
  Params p("filter 'join'", args, {"d", "attribute"});
  const std::string sep = p.has(0) ? to_str(p.get(0)) : "";
  const std::string attr = p.text(1, "");
  std::string out;
  bool first = true;
  for (const Value& item : iterate(v, "filter 'join'")) {
    if (!first) out += sep;
    first = false;
    out += to_str(attr.empty() ? item : get_path(item, attr));
    budget.built_string(out.size());
  }
  return Value::from_string(std::move(out));
}

// Filters that take no arguments.
std::optional<Value> simple_filter(const std::string& name, const Value& v, Budget& budget) {
  if (name == "upper") return Value::from_string(upper_text(to_str(v)));
  if (name == "lower") return Value::from_string(lower_text(to_str(v)));
  if (name == "capitalize") return Value::from_string(map_case(to_str(v), CaseMap::Capitalize));
  if (name == "title") return Value::from_string(jinja_title(to_str(v)));
  if (name == "length" || name == "count") return length_of(v, "filter '" + name + "'");
  if (name == "string") return Value::from_string(to_str(v));
  if (name == "safe" || name == "e" || name == "escape") {
    if (v.is_string() && v.is_markup) return v;
    Value marked = Value::from_string(name == "safe" ? to_str(v) : html_escape(to_str(v)));
    marked.is_markup = true;
    return marked;
  }
  if (name == "list") return Value::from_list(iterate(v, "filter 'list'"));
  if (name == "items") {
    if (v.is_undefined()) return Value::lazy({}, "generator");
    if (!v.is_dict()) throw Error("filter 'items' needs a dict, not " + std::string(type_name(v)));
    ValueList pairs;
    for (const auto& [k, val] : v.dict->items) pairs.push_back(Value::tuple({k, val}));
    return Value::lazy(std::move(pairs), "generator");
  }
  if (name == "first" || name == "last") {
    const ValueList items = iterate(v, "filter '" + name + "'");
    if (items.empty()) return Value::undefined("'" + name + "' of an empty sequence");
    return name == "first" ? items.front() : items.back();
  }
  if (name == "reverse") {
    if (v.is_string()) {
      auto chars = utf8_chars(v.str());
      std::string out;
      for (auto it = chars.rbegin(); it != chars.rend(); ++it) out += *it;
      return Value::from_string(std::move(out));
    }
    ValueList items = iterate(v, "filter 'reverse'");
    std::reverse(items.begin(), items.end());
    return Value::lazy(std::move(items), "list_reverseiterator");
  }
  if (name == "abs") {
    if (v.kind == Kind::Int) {
      if (v.integer == INT64_MIN) throw Error("filter 'abs': integer overflow");
      return Value::from_int(std::llabs(v.integer));
    }
    if (v.kind == Kind::Float) return Value::from_float(std::fabs(v.number));
    if (v.kind == Kind::Bool) return Value::from_int(v.boolean);
    throw Error("filter 'abs' needs a number, not " + std::string(type_name(v)));
  }
  (void)budget;
  return std::nullopt;
}

}  // namespace

bool jinja2_has_filter(const std::string& name) {
  static const char* const kFilters[] = {
      "abs",    "attr",       "batch",       "capitalize", "center",   "count",
      "d",      "default",    "dictsort",    "e",          "escape",   "filesizeformat",
      "first",  "float",      "forceescape", "format",     "groupby",  "indent",
      "int",    "items",      "join",        "last",       "length",   "list",
      "lower",  "map",        "max",         "min",        "pprint",   "random",
      "reject", "rejectattr", "replace",     "reverse",    "round",    "safe",
      "select", "selectattr", "slice",       "sort",       "string",   "striptags",
      "sum",    "title",      "tojson",      "trim",       "truncate", "unique",
      "upper",  "urlencode",  "urlize",      "wordcount",  "wordwrap", "xmlattr"};
  return std::find(std::begin(kFilters), std::end(kFilters), name) != std::end(kFilters);
}

bool jinja2_has_test(const std::string& name) {
  static const char* const kTests[] = {
      "boolean", "callable", "defined",  "divisibleby", "eq",       "equalto",     "escaped",
      "even",    "false",    "filter",   "float",       "ge",       "greaterthan", "gt",
      "in",      "integer",  "iterable", "le",          "lessthan", "lower",       "lt",
      "mapping", "ne",       "none",     "number",      "odd",      "sameas",      "sequence",
      "string",  "test",     "true",     "undefined",   "upper"};
  return std::find(std::begin(kTests), std::end(kTests), name) != std::end(kTests);
}

void Budget::step(uint64_t n) {
  steps += n;
  if (steps > max_steps)
    throw Error("template evaluation exceeded " + std::to_string(max_steps) + " steps (a runaway loop?)");
}

void Budget::built_string(size_t bytes) {
  if (bytes > max_string_bytes)
    throw Error("template built a string larger than " + std::to_string(max_string_bytes >> 20) + " MiB");
  step(1 + bytes / 16);
}

void Budget::built_list(size_t items) {
  if (items > (1u << 20)) throw Error("template built a list of more than 1048576 items");
  step(items);
}

void Budget::read(const Value& v) {
  if (v.is_string()) step(v.str().size() / 64);
  if (v.is_list()) step(v.list->size());
  if (v.is_dict()) step(v.dict->items.size());
}

std::string strip_text(const std::string& s, const Value& chars, StripSide side) {
  const auto cps = utf8_chars(s);
  std::vector<std::string> set;
  if (!chars.is_undefined() && !chars.is_none()) {
    if (!chars.is_string()) throw Error("strip: the characters must be a string");
    set = utf8_chars(chars.str());
  }
  auto strips = [&](const std::string& c) {
    if (!set.empty() || (!chars.is_undefined() && !chars.is_none()))
      return std::find(set.begin(), set.end(), c) != set.end();
    if (c.size() == 1)
      return c == " " || c == "\t" || c == "\n" || c == "\r" || c == "\f" || c == "\v" ||
             (c[0] >= 0x1c && c[0] <= 0x1f);
    static const char* const kUnicodeSpaces[] = {
        "\u0085", "\u00a0", "\u1680", "\u2000", "\u2001", "\u2002", "\u2003", "\u2004", "\u2005", "\u2006",
        "\u2007", "\u2008", "\u2009", "\u200a", "\u2028", "\u2029", "\u202f", "\u205f", "\u3000"};
    return std::any_of(std::begin(kUnicodeSpaces), std::end(kUnicodeSpaces),
                       [&](const char* u) { return c == u; });
  };
  size_t begin = 0, end = cps.size();
  if (side != StripSide::Right)
    while (begin < end && strips(cps[begin])) ++begin;
  if (side != StripSide::Left)
    while (end > begin && strips(cps[end - 1])) --end;
  std::string out;
  for (size_t i = begin; i < end; ++i) out += cps[i];
  return out;
}

namespace {

Value filter_value(const std::string& name, const Value& v, CallArgs& args, Budget& budget) {
  budget.step();
  budget.read(v);
  for (const Value& a : args.positional) budget.read(a);
  if (args.positional.empty() && args.keyword.empty())
    if (auto r = simple_filter(name, v, budget)) return *r;
  if (name == "trim") {
    Params p("filter 'trim'", args, {"chars"});
    return Value::from_string(strip_text(to_str(v), p.has(0) ? p.get(0) : Value::none(), StripSide::Both));
  }
  if (name == "default" || name == "d") {
    Params p("filter 'default'", args, {"default_value", "boolean"});
    const bool use_default = v.is_undefined() || (p.flag(1, false) && !truthy(v));
    return use_default ? (p.has(0) ? p.get(0) : Value::from_string("")) : v;
  }
  if (name == "tojson") return filter_tojson(v, args, budget);
  if (name == "join") return filter_join(v, args, budget);
  if (name == "replace") {
    Params p("filter 'replace'", args, {"old", "new", "count"});
    const std::string out = replace_all(to_str(v), to_str(p.get(0)), to_str(p.get(1)),
                                        p.has(2) && !p.get(2).is_none() ? p.integer(2, -1) : -1, budget);
    return Value::from_string(out);
  }
  if (name == "indent") return filter_indent(v, args, budget);
  if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr")
    return filter_select(name, v, args);
  if (name == "map") return filter_map(v, args, budget);
  if (name == "sort") return filter_sort(name, v, args);
  if (name == "min" || name == "max") return filter_min_max(name, v, args);
  if (name == "unique") return filter_unique(v, args);
  if (name == "dictsort") return filter_dictsort(v, args);
  if (name == "int") return filter_int(v, args);
  if (name == "float") return filter_float(v, args);
  if (name == "round") return filter_round(v, args);
  static const char* const kNoArguments[] = {"upper",  "lower", "capitalize", "title",  "length", "count",
                                             "string", "safe",  "e",          "escape", "list",   "items",
                                             "first",  "last",  "reverse",    "abs"};
  for (const char* n : kNoArguments)
    if (name == n) throw Error("filter '" + name + "' takes no arguments");
  if (jinja2_has_filter(name)) throw Error("filter '" + name + "' is not supported");
  throw Error("no filter named '" + name + "'");
}

}  // namespace

Value apply_filter(const std::string& name, const Value& v, CallArgs& args, Budget& budget) {
  Value result = filter_value(name, v, args, budget);
  // markupsafe's str methods keep a Markup a Markup (jinja2's soft_str keeps it too).
  static const char* const kKeepMarkup[] = {"trim",  "upper",  "lower", "capitalize",
                                            "title", "string", "indent"};
  if (v.is_string() && v.is_markup && result.is_string() &&
      std::find(std::begin(kKeepMarkup), std::end(kKeepMarkup), name) != std::end(kKeepMarkup))
    result.is_markup = true;
  return result;
}

bool apply_test(const std::string& name, const Value& v, const std::vector<Value>& args) {
  auto arg = [&](size_t i) -> const Value& {
    if (i >= args.size()) throw Error("test '" + name + "' needs an argument");
    return args[i];
  };
  auto int_of = [&](const Value& x) -> int64_t {
    if (x.kind == Kind::Int) return x.integer;
    if (x.kind == Kind::Bool) return x.boolean;
    throw Error("test '" + name + "' needs an integer, not " + std::string(type_name(x)));
  };
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_none();
  if (name == "string") return v.is_string();
  if (name == "number") return v.is_number();
  if (name == "integer") return v.kind == Kind::Int;
  if (name == "float") return v.kind == Kind::Float;
  if (name == "boolean") return v.kind == Kind::Bool;
  if (name == "true") return v.kind == Kind::Bool && v.boolean;
  if (name == "false") return v.kind == Kind::Bool && !v.boolean;
  if (name == "mapping") return v.is_dict();
  if (name == "iterable") return v.is_string() || v.is_list() || v.is_dict() || v.is_undefined();
  if (name == "sequence")
    return v.is_string() || (v.is_list() && !v.is_lazy) || v.is_dict() || v.is_undefined();
  if (name == "callable") return v.kind == Kind::Function;
  if (name == "odd") return int_of(v) % 2 != 0;
  if (name == "even") return int_of(v) % 2 == 0;
  if (name == "divisibleby") {
    const int64_t d = int_of(arg(0));
    if (d == 0) throw Error("test 'divisibleby': division by zero");
    return int_of(v) % d == 0;
  }
  if (name == "eq" || name == "equalto" || name == "==") return equal(v, arg(0));
  if (name == "ne" || name == "!=") return !equal(v, arg(0));
  if (name == "lt" || name == "lessthan" || name == "<") return compare(v, arg(0)) < 0;
  if (name == "le" || name == "<=") return compare(v, arg(0)) <= 0;
  if (name == "gt" || name == "greaterthan" || name == ">") return compare(v, arg(0)) > 0;
  if (name == "ge" || name == ">=") return compare(v, arg(0)) >= 0;
  if (name == "sameas") {
    const Value& o = arg(0);
    if (v.kind != o.kind) return false;
    if (v.is_none() || v.kind == Kind::Bool) return v.kind == Kind::None || v.boolean == o.boolean;
    return v.list == o.list && v.dict == o.dict && v.function == o.function && v.string == o.string;
  }
  if (name == "in") {
    const Value& c = arg(0);
    if (c.is_string()) return v.is_string() && c.str().find(v.str()) != std::string::npos;
    if (c.is_list())
      return std::any_of(c.list->begin(), c.list->end(), [&](const Value& x) { return equal(x, v); });
    if (c.is_dict()) return c.dict->find(v) != nullptr;
    throw Error("test 'in' needs a container, not " + std::string(type_name(c)));
  }
  if (name == "lower" || name == "upper") {
    const std::string s = to_str(v);
    return s == (name == "lower" ? lower_text(s) : upper_text(s)) &&
           s != (name == "lower" ? upper_text(s) : lower_text(s));
  }
  if (jinja2_has_test(name)) throw Error("test '" + name + "' is not supported");
  throw Error("no test named '" + name + "'");
}

namespace {

std::vector<std::string> split_text(const std::string& s, const Value& sep, int64_t maxsplit) {
  std::vector<std::string> parts;
  if (sep.is_undefined() || sep.is_none()) {  // runs of whitespace; no empty parts
    size_t i = 0;
    while (true) {
      while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
      if (i >= s.size()) break;
      if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) >= maxsplit) {
        std::string rest = s.substr(i);
        while (!rest.empty() && std::isspace(static_cast<unsigned char>(rest.back()))) rest.pop_back();
        parts.push_back(rest);
        break;
      }
      size_t j = i;
      while (j < s.size() && !std::isspace(static_cast<unsigned char>(s[j]))) ++j;
      parts.push_back(s.substr(i, j - i));
      i = j;
    }
    return parts;
  }
  if (!sep.is_string()) throw Error("split: the separator must be a string");
  const std::string& d = sep.str();
  if (d.empty()) throw Error("split: empty separator");
  size_t start = 0;
  while (true) {
    const size_t at = (maxsplit >= 0 && static_cast<int64_t>(parts.size()) >= maxsplit) ? std::string::npos
                                                                                        : s.find(d, start);
    if (at == std::string::npos) break;
    parts.push_back(s.substr(start, at - start));
    start = at + d.size();
  }
  parts.push_back(s.substr(start));
  return parts;
}

// Python's str.format with {} / {0} / {name} fields (no format specs or conversions).
std::string format_text(const std::string& s, CallArgs& args, Budget& budget) {
  std::string out;
  size_t auto_index = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '}') {
      if (i + 1 < s.size() && s[i + 1] == '}') {
        out += '}', ++i;
        continue;
      }
      throw Error("format: single '}' encountered in format string");
    }
    if (c != '{') {
      out += c;
      continue;
    }
    if (i + 1 < s.size() && s[i + 1] == '{') {
      out += '{', ++i;
      continue;
    }
    const size_t close = s.find('}', i);
    if (close == std::string::npos) throw Error("format: single '{' encountered in format string");
    const std::string field = s.substr(i + 1, close - i - 1);
    if (field.find_first_of(":!.[") != std::string::npos)
      throw Error("format: field '{" + field + "}' (format specs and conversions) is not supported");
    const Value* v = nullptr;
    if (field.empty() || std::all_of(field.begin(), field.end(), ::isdigit)) {
      const size_t index = field.empty() ? auto_index++ : std::strtoul(field.c_str(), nullptr, 10);
      if (index >= args.positional.size())
        throw Error("format: replacement index " + std::to_string(index) + " out of range");
      v = &args.positional[index];
    } else {
      for (const auto& [k, val] : args.keyword)
        if (k == field) v = &val;
      if (!v) throw Error("format: no argument named '" + field + "'");
    }
    out += to_str(*v);
    budget.built_string(out.size());
    i = close;
  }
  return out;
}

bool starts_or_ends(const std::string& s, const Value& affix, bool at_start, const std::string& where) {
  auto test = [&](const Value& a) {
    if (!a.is_string()) throw Error(where + ": the argument must be a string or a tuple of strings");
    const std::string& t = a.str();
    if (t.size() > s.size()) return false;
    return at_start ? s.compare(0, t.size(), t) == 0 : s.compare(s.size() - t.size(), t.size(), t) == 0;
  };
  if (affix.is_list()) return std::any_of(affix.list->begin(), affix.list->end(), test);
  return test(affix);
}

std::optional<Value> string_method(const std::string& s, const std::string& name, CallArgs& args,
                                   Budget& budget) {
  const std::string where = "str." + name + "()";
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    Params p(where, args, {"chars"});
    const StripSide side = name == "strip"    ? StripSide::Both
                           : name == "lstrip" ? StripSide::Left
                                              : StripSide::Right;
    return Value::from_string(strip_text(s, p.has(0) ? p.get(0) : Value::none(), side));
  }
  if (name == "split") {
    Params p(where, args, {"sep", "maxsplit"});
    ValueList parts;
    auto pieces = split_text(s, p.has(0) ? p.get(0) : Value::none(), p.integer(1, -1));
    budget.built_list(pieces.size());
    for (auto& part : pieces) parts.push_back(Value::from_string(std::move(part)));
    return Value::from_list(std::move(parts));
  }
  if (name == "startswith" || name == "endswith") {
    Params p(where, args, {"prefix"});
    if (!p.has(0)) throw Error(where + " needs an argument");
    return Value::from_bool(starts_or_ends(s, p.get(0), name == "startswith", where));
  }
  if (name == "upper" || name == "lower" || name == "title" || name == "capitalize") {
    Params p(where, args, {});
    if (name == "upper") return Value::from_string(upper_text(s));
    if (name == "lower") return Value::from_string(lower_text(s));
    if (name == "title") return Value::from_string(map_case(s, CaseMap::Title));
    return Value::from_string(map_case(s, CaseMap::Capitalize));
  }
  if (name == "replace") {
    Params p(where, args, {"old", "new", "count"});
    if (!p.get(0).is_string() || !p.get(1).is_string()) throw Error(where + " needs two strings");
    return Value::from_string(replace_all(s, p.get(0).str(), p.get(1).str(), p.integer(2, -1), budget));
  }
  if (name == "format") return Value::from_string(format_text(s, args, budget));
  if (name == "join") {
    Params p(where, args, {"iterable"});
    std::string out;
    bool first = true;
    for (const Value& item : iterate(p.get(0), where)) {
      if (!item.is_string()) throw Error(where + ": sequence item is " + type_name(item) + ", not str");
      if (!first) out += s;
      first = false;
      out += item.str();
      budget.built_string(out.size());
    }
    return Value::from_string(std::move(out));
  }
  if (name == "find" || name == "count") {
    Params p(where, args, {"sub"});
    if (!p.get(0).is_string()) throw Error(where + " needs a string");
    const std::string& sub = p.get(0).str();
    if (name == "find") {
      const size_t at = s.find(sub);
      return Value::from_int(at == std::string::npos ? -1
                                                     : static_cast<int64_t>(utf8_length(s.substr(0, at))));
    }
    int64_t n = 0;
    if (sub.empty()) return Value::from_int(static_cast<int64_t>(utf8_length(s)) + 1);
    for (size_t at = s.find(sub); at != std::string::npos; at = s.find(sub, at + sub.size())) ++n;
    return Value::from_int(n);
  }
  if (name == "isdigit" || name == "isspace" || name == "isalpha" || name == "isalnum") {
    Params p(where, args, {});
    if (s.empty()) return Value::from_bool(false);
    auto all = [&](int (*pred)(int)) {
      return std::all_of(s.begin(), s.end(),
                         [&](char c) { return pred(static_cast<unsigned char>(c)) != 0; });
    };
    if (name == "isdigit") return Value::from_bool(all(::isdigit));
    if (name == "isspace") return Value::from_bool(all(::isspace));
    if (name == "isalpha") return Value::from_bool(all(::isalpha));
    return Value::from_bool(all(::isalnum));
  }
  return std::nullopt;
}

// A Markup's method: string arguments are escaped first and a string result stays a Markup, as
// markupsafe wraps str's methods.
std::optional<Value> markup_method(const std::string& s, const std::string& name, CallArgs& args,
                                   Budget& budget) {
  auto escaped = [](const Value& v) {
    if (!v.is_string() || v.is_markup) return v;
    Value e = Value::from_string(html_escape(v.str()));
    e.is_markup = true;
    return e;
  };
  if (name == "replace" || name == "format") {
    for (Value& a : args.positional) a = escaped(a);
    for (auto& kw : args.keyword) kw.second = escaped(kw.second);
  }
  if (name == "join" && !args.positional.empty()) {
    ValueList items;
    for (const Value& item : iterate(args.positional[0], "Markup.join()")) items.push_back(escaped(item));
    args.positional[0] = Value::from_list(std::move(items));
  }
  std::optional<Value> result = string_method(s, name, args, budget);
  if (result && result->is_string()) result->is_markup = true;
  if (result && result->is_list() && name == "split")
    for (Value& part : *result->list) part.is_markup = true;
  return result;
}

std::optional<Value> dict_method(const Value& d, const std::string& name, CallArgs& args) {
  const std::string where = "dict." + name + "()";
  if (name == "get") {
    if (!args.keyword.empty()) throw Error(where + " takes no keyword arguments");
    if (args.positional.empty() || args.positional.size() > 2) throw Error(where + " takes 1 or 2 arguments");
    const Value& key = args.positional[0];
    const Value* found = d.dict->find(key);
    if (found) return *found;
    return args.positional.size() == 2 ? args.positional[1] : Value::none();
  }
  if (name == "items" || name == "keys" || name == "values") {
    Params p(where, args, {});
    ValueList out;
    for (const auto& [k, v] : d.dict->items) {
      if (name == "items")
        out.push_back(Value::tuple({k, v}));
      else if (name == "keys")
        out.push_back(k);
      else
        out.push_back(v);
    }
    return Value::lazy(std::move(out), "dict_" + name);
  }
  return std::nullopt;
}

const char* const kMutating[] = {"append", "extend",     "insert",  "pop",  "remove", "clear",
                                 "update", "setdefault", "popitem", "sort", "reverse"};
const char* const kStringMethods[] = {"strip",    "lstrip",  "rstrip",  "split",  "startswith",
                                      "endswith", "upper",   "lower",   "title",  "capitalize",
                                      "replace",  "format",  "join",    "find",   "count",
                                      "isdigit",  "isspace", "isalpha", "isalnum"};
const char* const kDictMethods[] = {"get", "items", "keys", "values", "copy", "fromkeys"};
const char* const kListMethods[] = {"index", "count", "copy"};

template <size_t N>
bool in_table(const std::string& name, const char* const (&table)[N]) {
  return std::find(std::begin(table), std::end(table), name) != std::end(table);
}
}  // namespace

bool has_method(const Value& object, const std::string& name) {
  if (object.is_string()) return in_table(name, kStringMethods);
  if (object.is_dict()) return in_table(name, kDictMethods) || in_table(name, kMutating);
  if (object.is_list()) return in_table(name, kListMethods) || in_table(name, kMutating);
  return false;
}

std::optional<Value> call_method(const Value& object, const std::string& name, CallArgs& args,
                                 Budget& budget) {
  budget.step();
  budget.read(object);
  for (const Value& a : args.positional) budget.read(a);
  if (object.is_string() && object.is_markup) return markup_method(object.str(), name, args, budget);
  if (object.is_string()) return string_method(object.str(), name, args, budget);
  if (object.is_dict() || object.is_list()) {
    if (in_table(name, kMutating))
      throw Error("access to attribute '" + name + "' of '" + type_name(object) +
                  "' object is unsafe (the sandbox forbids changing lists and dicts)");
  }
  if (object.is_dict()) return dict_method(object, name, args);
  return std::nullopt;
}

}  // namespace microspec::jinja
