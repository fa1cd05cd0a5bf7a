// The tree-walking evaluator: statements write to an output string, expressions give Values.
#include "chat_template/jinja_eval.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <string_view>
#include <unordered_map>

#include "chat_template/jinja_builtins.h"
#include "util/error.h"

namespace microspec::jinja {
namespace {

// A scope's variables, found by hashing: a template may set many.
struct Vars {
  std::unordered_map<std::string, Value> map;

  const Value* find(const std::string& name) const {
    const auto it = map.find(name);
    return it == map.end() ? nullptr : &it->second;
  }
  void set(const std::string& name, Value value) { map.insert_or_assign(name, std::move(value)); }
};

struct Scope {
  std::shared_ptr<Scope> parent;
  Vars vars;
};
using ScopePtr = std::shared_ptr<Scope>;

enum class Flow { Normal, Break, Continue };

constexpr int64_t kMaxRange = 100000;       // jinja2's sandbox refuses larger ranges
constexpr uint64_t kStepsPerIteration = 8;  // a loop iteration allocates a scope and the loop variable

Value undefined_name(const std::string& name) {
  return Value::undefined("'" + name + "' is undefined");
}

[[noreturn]] void fail_undefined(const Value& v) {
  throw Error(v.str().empty() ? "use of an undefined value" : v.str());
}

int64_t to_index(const Value& v, const char* what) {
  if (v.kind == Kind::Int) return v.integer;
  if (v.kind == Kind::Bool) return v.boolean;
  throw Error(std::string(what) + " must be an integer, not " + type_name(v));
}

// --- arithmetic, as Python does it ----------------------------------------------------------------

double as_double(const Value& v) {
  return v.kind == Kind::Float ? v.number : v.kind == Kind::Int ? static_cast<double>(v.integer) : v.boolean;
}

[[noreturn]] void unsupported(const std::string& op, const Value& a, const Value& b) {
  if (a.is_undefined()) fail_undefined(a);
  if (b.is_undefined()) fail_undefined(b);
  throw Error("unsupported operand type(s) for " + op + ": '" + type_name(a) + "' and '" + type_name(b) +
              "'");
}

// x op y for + - *, or an Error where the result does not fit in 64 bits.
Value checked_int_op(const std::string& op, int64_t x, int64_t y) {
  int64_t r = 0;
  const bool overflow = op == "+"   ? __builtin_add_overflow(x, y, &r)
                        : op == "-" ? __builtin_sub_overflow(x, y, &r)
                                    : __builtin_mul_overflow(x, y, &r);
  if (overflow) throw Error("integer overflow in template arithmetic");
  return Value::from_int(r);
}

Value repeat(const Value& seq, int64_t times, Budget& budget) {
  const int64_t n = std::max<int64_t>(times, 0);
  if (seq.is_string()) {
    if (n > 0 && seq.str().size() > 0 && static_cast<uint64_t>(n) > (uint64_t{1} << 40) / seq.str().size())
      throw Error("string repetition too large");
    budget.built_string(seq.str().size() * static_cast<size_t>(n));
    std::string out;
    for (int64_t i = 0; i < n; ++i) out += seq.str();
    return Value::from_string(std::move(out));
  }
  if (n > 0 && static_cast<uint64_t>(n) > (uint64_t{1} << 40) / std::max<size_t>(seq.list->size(), 1))
    throw Error("list repetition too large");
  budget.built_list(seq.list->size() * static_cast<size_t>(n));
  ValueList out;
  for (int64_t i = 0; i < n; ++i) out.insert(out.end(), seq.list->begin(), seq.list->end());
  return Value::from_list(std::move(out));
}

Value arithmetic(const std::string& op, const Value& a, const Value& b, Budget& budget) {
  if (op == "+" && a.is_string() && b.is_string() && (a.is_markup || b.is_markup)) {  // Markup + str escapes
    std::string text = markup_text(a) + markup_text(b);
    budget.built_string(text.size());
    Value out = Value::from_string(std::move(text));
    out.is_markup = true;
    return out;
  }
  if (op == "+" && a.is_string() && b.is_string()) {
    budget.built_string(a.str().size() + b.str().size());
    return Value::from_string(a.str() + b.str());
  }
  if (op == "+" && a.is_list() && b.is_list() && !a.is_lazy && !b.is_lazy) {
    budget.built_list(a.list->size() + b.list->size());
    ValueList out = *a.list;
    out.insert(out.end(), b.list->begin(), b.list->end());
    return Value::from_list(std::move(out));
  }
  if (op == "*" && (a.is_string() || a.is_list()) && (b.kind == Kind::Int || b.kind == Kind::Bool))
    return repeat(a, to_index(b, "a repeat count"), budget);
  if (op == "*" && (b.is_string() || b.is_list()) && (a.kind == Kind::Int || a.kind == Kind::Bool))
    return repeat(b, to_index(a, "a repeat count"), budget);
  if (op == "%" && a.is_string())
    throw Error("string formatting with '%' is not supported (use ~ or format())");
  if (!a.is_number() || !b.is_number()) unsupported(op, a, b);
  const bool floats = a.kind == Kind::Float || b.kind == Kind::Float;
  if (op == "/") {
    if (as_double(b) == 0) throw Error("division by zero");
    return Value::from_float(as_double(a) / as_double(b));
  }
  if (floats) {
    const double x = as_double(a), y = as_double(b);
    if (op == "+") return Value::from_float(x + y);
    if (op == "-") return Value::from_float(x - y);
    if (op == "*") return Value::from_float(x * y);
    if (op == "**") return Value::from_float(std::pow(x, y));
    if (y == 0) throw Error(op == "%" ? "float modulo by zero" : "float floor division by zero");
    if (op == "//") return Value::from_float(std::floor(x / y));
    double m = std::fmod(x, y);
    if (m != 0 && ((m < 0) != (y < 0))) m += y;
    return Value::from_float(m);
  }
  const int64_t x = to_index(a, "an operand"), y = to_index(b, "an operand");
  if (op == "+" || op == "-" || op == "*") return checked_int_op(op, x, y);
  if (op == "**") {
    if (y < 0) return Value::from_float(std::pow(static_cast<double>(x), static_cast<double>(y)));
    int64_t result = 1;
    for (int64_t i = 0; i < y; ++i) {
      if (__builtin_mul_overflow(result, x, &result)) throw Error("integer overflow in template arithmetic");
      if (result == 0 || result == 1) break;
    }
    return Value::from_int(result);
  }
  if (y == 0) throw Error(op == "%" ? "integer modulo by zero" : "integer division by zero");
  if (x == INT64_MIN && y == -1) throw Error("integer overflow in template arithmetic");
  int64_t q = x / y, m = x % y;
  if (m != 0 && ((m < 0) != (y < 0))) --q, m += y;  // Python floors
  return Value::from_int(op == "//" ? q : m);
}

bool contains(const Value& container, const Value& item) {
  switch (container.kind) {
    case Kind::Undefined:
      return false;
    case Kind::String:
      if (!item.is_string())
        throw Error(std::string("'in <string>' requires string as left operand, not ") + type_name(item));
      return container.str().find(item.str()) != std::string::npos;
    case Kind::List:
      for (const Value& x : *container.list)
        if (equal(x, item)) return true;
      return false;
    case Kind::Dict:
      return item.is_string() && container.dict->find(item.str()) != nullptr;
    default:
      throw Error(std::string("argument of type '") + type_name(container) + "' is not iterable");
  }
}

bool compare_op(const std::string& op, const Value& a, const Value& b, Budget& budget) {
  budget.read(a);
  budget.read(b);
  if (op == "==") return equal(a, b);
  if (op == "!=") return !equal(a, b);
  if (op == "in") return contains(b, a);
  if (op == "notin") return !contains(b, a);
  if (a.is_undefined()) fail_undefined(a);
  if (b.is_undefined()) fail_undefined(b);
  const int c = compare(a, b);
  if (op == "<") return c < 0;
  if (op == "<=") return c <= 0;
  if (op == ">") return c > 0;
  return c >= 0;
}

// --- attribute and item access --------------------------------------------------------------------

Value call_method_or_fail(const Value& obj, const std::string& name, CallArgs& args, Budget& budget) {
  if (auto result = call_method(obj, name, args, budget)) return *result;
  throw Error(std::string(type_name(obj)) + "." + name + "() is not supported");
}

// obj.name as jinja2 reads it: a method of a str, dict or list first (d.items is the bound method,
// as Python's getattr finds it), then a dict's or namespace's key; anything else is Undefined.
Value get_attr(const Value& obj, const std::string& name, Budget& budget) {
  if (obj.is_undefined()) fail_undefined(obj);
  if (has_method(obj, name)) {
    Budget* b = &budget;
    return Value::from_function(std::string(type_name(obj)) + "." + name, [obj, name, b](CallArgs& args) {
      return call_method_or_fail(obj, name, args, *b);
    });
  }
  if (obj.is_dict() || obj.kind == Kind::Namespace) {
    if (const Value* v = obj.dict->find(name)) return *v;
  }
  return Value::undefined(std::string("'") + type_name(obj) + " object' has no attribute '" + name + "'");
}

// obj[key] as jinja2 reads it: a dict's key or a sequence's index first; missing is Undefined.
Value get_item(const Value& obj, const Value& key, Budget& budget) {
  if (obj.is_undefined()) fail_undefined(obj);
  if (key.is_string() && (obj.is_dict() || obj.kind == Kind::Namespace)) {
    if (const Value* v = obj.dict->find(key.str())) return *v;
    return Value::undefined(std::string("'") + type_name(obj) + " object' has no attribute '" + key.str() +
                            "'");
  }
  if (key.is_string()) return get_attr(obj, key.str(), budget);
  if (obj.is_dict()) {
    if (const Value* v = obj.dict->find(key)) return *v;
    return Value::undefined("'dict object' has no item " + to_repr(key));
  }
  if ((key.kind == Kind::Int || key.kind == Kind::Bool) &&
      ((obj.is_list() && !obj.is_lazy) || obj.is_string())) {
    int64_t i = to_index(key, "an index");
    if (obj.is_list()) {
      const auto n = static_cast<int64_t>(obj.list->size());
      if (i < 0) i += n;
      if (i >= 0 && i < n) return (*obj.list)[static_cast<size_t>(i)];
    } else {
      budget.read(obj);
      const auto chars = utf8_chars(obj.str());
      const auto n = static_cast<int64_t>(chars.size());
      if (i < 0) i += n;
      if (i >= 0 && i < n) return Value::from_string(chars[static_cast<size_t>(i)]);
    }
    return Value::undefined(std::string(type_name(obj)) + " index " + std::to_string(key.integer) +
                            " out of range");
  }
  return Value::undefined(std::string("'") + type_name(obj) + " object' has no item " + to_repr(key));
}

// Python's seq[start:stop:step] over a list or a string's code points.
Value slice(const Value& obj, const Value* start_v, const Value* stop_v, const Value* step_v,
            Budget& budget) {
  if (obj.is_undefined()) fail_undefined(obj);
  if (obj.is_lazy)
    return Value::undefined(std::string("'") + type_name(obj) + "' object is not subscriptable");
  if (!obj.is_list() && !obj.is_string()) throw Error(std::string("cannot slice a ") + type_name(obj));
  budget.read(obj);
  const std::vector<std::string> chars = obj.is_string() ? utf8_chars(obj.str()) : std::vector<std::string>{};
  const auto n = static_cast<int64_t>(obj.is_list() ? obj.list->size() : chars.size());
  auto given = [](const Value* v) { return v && !v->is_none(); };
  const int64_t step = given(step_v) ? to_index(*step_v, "a slice step") : 1;
  if (step == 0) throw Error("slice step cannot be zero");
  auto bound = [&](const Value* v, int64_t fallback) {
    if (!given(v)) return fallback;
    int64_t i = to_index(*v, "a slice index");
    if (i < 0) i += n;
    return step > 0 ? std::clamp<int64_t>(i, 0, n) : std::clamp<int64_t>(i, -1, n - 1);
  };
  const int64_t start = bound(start_v, step > 0 ? 0 : n - 1), stop = bound(stop_v, step > 0 ? n : -1);
  std::vector<size_t> picked;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) picked.push_back(static_cast<size_t>(i));
  budget.built_list(picked.size());
  if (obj.is_string()) {
    std::string out;
    for (size_t i : picked) out += chars[i];
    return Value::from_string(std::move(out));
  }
  ValueList out;
  for (size_t i : picked) out.push_back((*obj.list)[i]);
  return Value::from_list(std::move(out));
}

// --- the interpreter ------------------------------------------------------------------------------

class Interpreter {
 public:
  explicit Interpreter(const RenderLimits& limits) : limits_(limits) {
    budget_.max_steps = limits.max_steps;
    budget_.max_string_bytes = limits.max_output_bytes;
  }

  std::string run(const Body& body, const ValueDict& globals) {
    auto root = std::make_shared<Scope>();
    add_builtin_globals(root->vars);
    for (const auto& [key, value] : globals.items) root->vars.set(to_str(key), value);
    std::string out;
    exec_body(body, root, out);
    return out;
  }

 private:
  const RenderLimits& limits_;
  Budget budget_;
  int depth_ = 0;

  struct DepthGuard {
    Interpreter& in;
    explicit DepthGuard(Interpreter& interpreter) : in(interpreter) {
      if (++in.depth_ > in.limits_.max_depth)
        throw Error("template evaluation nested more than " + std::to_string(in.limits_.max_depth) +
                    " levels deep (runaway macro recursion?)");
    }
    ~DepthGuard() { --in.depth_; }
  };

  void emit(std::string& out, std::string_view text) {
    if (out.size() + text.size() > limits_.max_output_bytes)
      throw Error("template output larger than " + std::to_string(limits_.max_output_bytes >> 20) + " MiB");
    budget_.step(1 + text.size() / 16);
    out += text;
  }

  static Value lookup(const ScopePtr& scope, const std::string& name) {
    for (const Scope* s = scope.get(); s; s = s->parent.get())
      if (const Value* v = s->vars.find(name)) return *v;
    return undefined_name(name);
  }

  // --- globals: range, namespace, dict --------------------------------------------------------------

  void add_builtin_globals(Vars& vars) {
    Budget* budget = &budget_;
    vars.set("range", Value::from_function("range", [budget](CallArgs& args) {
               if (!args.keyword.empty() || args.positional.empty() || args.positional.size() > 3)
                 throw Error("range() takes 1 to 3 integer arguments");
               int64_t start = 0, stop = 0, step = 1;
               if (args.positional.size() == 1) {
                 stop = to_index(args.positional[0], "range()'s argument");
               } else {
                 start = to_index(args.positional[0], "range()'s argument");
                 stop = to_index(args.positional[1], "range()'s argument");
                 if (args.positional.size() == 3) step = to_index(args.positional[2], "range()'s argument");
               }
               if (step == 0) throw Error("range() step must not be zero");
               const long double count =
                   std::max<long double>(0, std::ceil(((long double)stop - start) / step));
               if (count > kMaxRange) throw Error("range too big: the sandbox allows at most 100000 items");
               budget->built_list(static_cast<size_t>(count));
               ValueList items;
               for (int64_t i = 0; i < static_cast<int64_t>(count); ++i)
                 items.push_back(Value::from_int(start + i * step));
               return Value::from_list(std::move(items));
             }));
    auto keyword_dict = [](CallArgs& args, const char* what) {
      ValueDict d;
      if (args.positional.size() > 1 || (args.positional.size() == 1 && !args.positional[0].is_dict()))
        throw Error(std::string(what) + "() takes at most one dict and keyword arguments");
      if (args.positional.size() == 1) d = *args.positional[0].dict;
      for (auto& [k, v] : args.keyword) d.set(k, v);
      return d;
    };
    vars.set("namespace", Value::from_function("namespace", [keyword_dict](CallArgs& args) {
               return Value::namespace_of(keyword_dict(args, "namespace"));
             }));
    vars.set("dict", Value::from_function("dict", [keyword_dict](CallArgs& args) {
               return Value::from_dict(keyword_dict(args, "dict"));
             }));
  }

  // --- statements -------------------------------------------------------------------------------------

  Flow exec_body(const Body& body, const ScopePtr& scope, std::string& out) {
    for (const NodePtr& node : body) {
      const Flow flow = exec(*node, scope, out);
      if (flow != Flow::Normal) return flow;
    }
    return Flow::Normal;
  }

  Flow exec(const Node& node, const ScopePtr& scope, std::string& out) {
    budget_.step();
    DepthGuard guard(*this);
    try {
      return exec_node(node, scope, out);
    } catch (const Error& e) {
      if (std::string_view(e.what()).starts_with("template line ")) throw;
      throw Error("template line " + std::to_string(node.line) + ": " + e.what());
    }
  }

  Flow exec_node(const Node& node, const ScopePtr& scope, std::string& out) {
    switch (node.kind) {
      case NodeKind::Text:
        emit(out, node.text);
        return Flow::Normal;
      case NodeKind::Output:
        emit(out, to_str(eval(*node.expr, scope)));
        return Flow::Normal;
      case NodeKind::If:
        for (const Branch& b : node.branches)
          if (truthy(eval(*b.condition, scope))) return exec_body(b.body, scope, out);
        return exec_body(node.else_body, scope, out);
      case NodeKind::For:
        return exec_for(node, scope, out);
      case NodeKind::Set:
        exec_set(node, scope);
        return Flow::Normal;
      case NodeKind::SetBlock: {
        std::string text;
        exec_body(node.body, scope, text);
        scope->vars.set(node.targets[0], Value::from_string(std::move(text)));
        return Flow::Normal;
      }
      case NodeKind::Macro:
        scope->vars.set(node.name, make_macro(node, scope));
        return Flow::Normal;
      case NodeKind::CallBlock:
        emit(out, to_str(exec_call_block(node, scope)));
        return Flow::Normal;
      case NodeKind::FilterBlock: {
        std::string text;
        exec_body(node.body, scope, text);
        const Value block = Value::from_string(std::move(text));
        emit(out, to_str(eval_filter(*node.expr, scope, &block)));
        return Flow::Normal;
      }
      case NodeKind::Break:
        return Flow::Break;
      case NodeKind::Continue:
        return Flow::Continue;
      case NodeKind::Scope: {  // transformers renders {% generation %} as a call block: its own scope
        auto inner = std::make_shared<Scope>();
        inner->parent = scope;
        return exec_body(node.body, inner, out);
      }
    }
    return Flow::Normal;
  }

  static void bind_targets(Scope& scope, const std::vector<std::string>& targets, const Value& item) {
    if (targets.size() == 1) {
      scope.vars.set(targets[0], item);
      return;
    }
    if (!item.is_list())
      throw Error(std::string("cannot unpack a ") + type_name(item) + " into " +
                  std::to_string(targets.size()) + " variables");
    if (item.list->size() != targets.size())
      throw Error("cannot unpack " + std::to_string(item.list->size()) + " values into " +
                  std::to_string(targets.size()) + " variables");
    for (size_t i = 0; i < targets.size(); ++i) scope.vars.set(targets[i], (*item.list)[i]);
  }

  // loop.index, loop.first, ... for item i; `cycle` is the loop's loop.cycle, which reads *position.
  static Value loop_variable(const ValueList& items, size_t i, const Value& cycle) {
    // Built once: the keys and the missing neighbours are shared by every iteration.
    static const Value kKeys[] = {
        Value::from_string("index"),     Value::from_string("index0"),   Value::from_string("revindex"),
        Value::from_string("revindex0"), Value::from_string("first"),    Value::from_string("last"),
        Value::from_string("length"),    Value::from_string("depth"),    Value::from_string("depth0"),
        Value::from_string("previtem"),  Value::from_string("nextitem"), Value::from_string("cycle")};
    static const Value kNoPrevious = Value::undefined("there is no previous item");
    static const Value kNoNext = Value::undefined("there is no next item");
    const auto n = static_cast<int64_t>(items.size()), k = static_cast<int64_t>(i);
    const Value values[] = {Value::from_int(k + 1),
                            Value::from_int(k),
                            Value::from_int(n - k),
                            Value::from_int(n - k - 1),
                            Value::from_bool(k == 0),
                            Value::from_bool(k == n - 1),
                            Value::from_int(n),
                            Value::from_int(1),
                            Value::from_int(0),
                            i > 0 ? items[i - 1] : kNoPrevious,
                            i + 1 < items.size() ? items[i + 1] : kNoNext,
                            cycle};
    ValueDict loop;
    loop.items.reserve(std::size(kKeys));
    for (size_t j = 0; j < std::size(kKeys); ++j) loop.items.emplace_back(kKeys[j], values[j]);
    return Value::from_dict(std::move(loop));
  }

  Flow exec_for(const Node& node, const ScopePtr& scope, std::string& out) {
    const Value iterable = eval(*node.expr, scope);
    budget_.read(iterable);
    ValueList items = iterate(iterable, "for loop");
    if (node.condition) {
      ValueList kept;
      for (const Value& item : items) {
        budget_.step();
        auto test_scope = std::make_shared<Scope>();
        test_scope->parent = scope;
        bind_targets(*test_scope, node.targets, item);
        if (truthy(eval(*node.condition, test_scope))) kept.push_back(item);
      }
      items = std::move(kept);
    }
    if (items.empty()) return exec_body(node.else_body, scope, out);
    auto position = std::make_shared<size_t>(0);
    const Value cycle = Value::from_function("loop.cycle", [position](CallArgs& args) {
      if (args.positional.empty()) throw Error("loop.cycle() needs at least one argument");
      return args.positional[*position % args.positional.size()];
    });
    for (size_t i = 0; i < items.size(); ++i) {
      budget_.step(kStepsPerIteration);
      *position = i;
      auto iteration = std::make_shared<Scope>();
      iteration->parent = scope;
      bind_targets(*iteration, node.targets, items[i]);
      iteration->vars.set("loop", loop_variable(items, i, cycle));
      if (exec_body(node.body, iteration, out) == Flow::Break) break;
    }
    return Flow::Normal;
  }

  void exec_set(const Node& node, const ScopePtr& scope) {
    Value value = eval(*node.expr, scope);
    if (!node.attr.empty()) {
      const Value target = lookup(scope, node.targets[0]);
      if (target.kind != Kind::Namespace)
        throw Error("cannot set '" + node.targets[0] + "." + node.attr + "': only namespace() objects have " +
                    "attributes a template can set");
      set_namespace_attribute(target, node.attr, std::move(value));
      return;
    }
    Scope unpacked;
    bind_targets(unpacked, node.targets, value);
    for (auto& [k, v] : unpacked.vars.map) scope->vars.set(k, std::move(v));
  }

  // --- macros -----------------------------------------------------------------------------------------

  // The scope is held weakly: a macro lives in the scope it was defined in, so holding it strongly
  // would make a cycle.
  Value make_macro(const Node& node, const ScopePtr& scope) {
    const Node* def = &node;
    std::weak_ptr<Scope> home = scope;
    return Value::from_function(node.name,
                                [this, def, home](CallArgs& args) { return call_macro(*def, home, args); });
  }

  Value call_macro(const Node& def, const std::weak_ptr<Scope>& home, CallArgs& args) {
    ScopePtr parent = home.lock();
    if (!parent) throw Error("macro '" + def.name + "' called after the scope it was defined in ended");
    auto scope = std::make_shared<Scope>();
    scope->parent = parent;
    if (args.positional.size() > def.params.size())
      throw Error("macro '" + def.name + "' takes " + std::to_string(def.params.size()) + " argument(s), " +
                  std::to_string(args.positional.size()) + " given");
    std::vector<bool> given(def.params.size(), false);
    for (size_t i = 0; i < args.positional.size(); ++i) {
      scope->vars.set(def.params[i].first, args.positional[i]);
      given[i] = true;
    }
    for (auto& [key, value] : args.keyword) {
      size_t i = 0;
      while (i < def.params.size() && def.params[i].first != key) ++i;
      if (i == def.params.size()) {
        if (key == "caller") {
          scope->vars.set(key, value);
          continue;
        }
        throw Error("macro '" + def.name + "' has no parameter named '" + key + "'");
      }
      if (given[i]) throw Error("macro '" + def.name + "' got multiple values for '" + key + "'");
      scope->vars.set(key, value);
      given[i] = true;
    }
    for (size_t i = 0; i < def.params.size(); ++i) {
      if (given[i]) continue;
      const auto& [name, default_value] = def.params[i];
      scope->vars.set(name, default_value ? eval(*default_value, scope) : undefined_name(name));
    }
    std::string out;
    exec_body(def.body, scope, out);
    return Value::from_string(std::move(out));
  }

  Value exec_call_block(const Node& node, const ScopePtr& scope) {
    const Node* def = &node;
    std::weak_ptr<Scope> home = scope;
    // The call block's body, with its parameters, is the caller() the macro may call.
    Value caller = Value::from_function(
        "caller", [this, def, home](CallArgs& args) { return call_caller(*def, home, args); });
    const Expr& call = *node.expr;
    CallArgs args = eval_arguments(call, scope);
    args.keyword.emplace_back("caller", caller);
    return call_value(eval(*call.args[0], scope), args);
  }

  Value call_caller(const Node& block, const std::weak_ptr<Scope>& home, CallArgs& args) {
    ScopePtr parent = home.lock();
    if (!parent) throw Error("caller() called after its call block ended");
    auto scope = std::make_shared<Scope>();
    scope->parent = parent;
    if (!args.keyword.empty() || args.positional.size() > block.params.size())
      throw Error("caller() takes " + std::to_string(block.params.size()) + " positional argument(s)");
    for (size_t i = 0; i < block.params.size(); ++i) {
      const auto& [name, default_value] = block.params[i];
      scope->vars.set(name, i < args.positional.size() ? args.positional[i]
                            : default_value            ? eval(*default_value, scope)
                                                       : undefined_name(name));
    }
    std::string out;
    exec_body(block.body, scope, out);
    return Value::from_string(std::move(out));
  }

  // --- expressions ------------------------------------------------------------------------------------

  CallArgs eval_arguments(const Expr& e, const ScopePtr& scope) {
    CallArgs args;
    for (size_t i = 1; i < e.args.size(); ++i) args.positional.push_back(eval(*e.args[i], scope));
    for (const auto& [name, value] : e.keywords) args.keyword.emplace_back(name, eval(*value, scope));
    return args;
  }

  Value call_value(const Value& f, CallArgs& args) {
    if (f.is_undefined()) fail_undefined(f);
    if (f.kind != Kind::Function) throw Error(std::string("'") + type_name(f) + "' object is not callable");
    DepthGuard guard(*this);
    return f.function->call(args);
  }

  Value eval_call(const Expr& e, const ScopePtr& scope) {
    const Expr& callee = *e.args[0];
    if (callee.kind == ExprKind::Attr) {
      const Value object = eval(*callee.args[0], scope);
      if (object.is_undefined()) fail_undefined(object);
      CallArgs args = eval_arguments(e, scope);
      if (has_method(object, callee.name)) return call_method_or_fail(object, callee.name, args, budget_);
      const Value f = get_attr(object, callee.name, budget_);
      if (f.is_undefined() && (object.is_string() || object.is_list() || object.is_dict()))
        throw Error(std::string("'") + type_name(object) + "' object has no method '" + callee.name + "'");
      return call_value(f, args);
    }
    const Value f = eval(callee, scope);
    CallArgs args = eval_arguments(e, scope);
    return call_value(f, args);
  }

  // A filter; in a {% filter %} block the innermost operand is the block's output.
  Value eval_filter(const Expr& e, const ScopePtr& scope, const Value* block_output) {
    Value operand;
    if (!e.args[0])
      operand = *block_output;
    else if (block_output && e.args[0]->kind == ExprKind::Filter)
      operand = eval_filter(*e.args[0], scope, block_output);
    else
      operand = eval(*e.args[0], scope);
    CallArgs args = eval_arguments(e, scope);
    return apply_filter(e.name, operand, args, budget_);
  }

  Value eval(const Expr& e, const ScopePtr& scope) {
    budget_.step();
    DepthGuard guard(*this);
    switch (e.kind) {
      case ExprKind::Literal:
        return e.value;
      case ExprKind::Name:
        return lookup(scope, e.name);
      case ExprKind::List: {
        ValueList items;
        for (const ExprPtr& a : e.args) items.push_back(eval(*a, scope));
        return e.is_tuple ? Value::tuple(std::move(items)) : Value::from_list(std::move(items));
      }
      case ExprKind::Dict: {
        ValueDict d;
        for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
          budget_.step(d.items.size() / 2);  // each new key is compared with those before it
          Value key = eval(*e.args[i], scope);
          d.set(std::move(key), eval(*e.args[i + 1], scope));
        }
        return Value::from_dict(std::move(d));
      }
      case ExprKind::Attr:
        return get_attr(eval(*e.args[0], scope), e.name, budget_);
      case ExprKind::Index: {
        const Value obj = eval(*e.args[0], scope);
        return get_item(obj, eval(*e.args[1], scope), budget_);
      }
      case ExprKind::Slice: {
        const Value obj = eval(*e.args[0], scope);
        Value parts[3];
        for (int i = 0; i < 3; ++i)
          if (e.args[1 + i]) parts[i] = eval(*e.args[1 + i], scope);
        return slice(obj, e.args[1] ? &parts[0] : nullptr, e.args[2] ? &parts[1] : nullptr,
                     e.args[3] ? &parts[2] : nullptr, budget_);
      }
      case ExprKind::Call:
        return eval_call(e, scope);
      case ExprKind::Filter:
        return eval_filter(e, scope, nullptr);
      case ExprKind::Test: {
        const Value operand = eval(*e.args[0], scope);
        std::vector<Value> args;
        for (size_t i = 1; i < e.args.size(); ++i) args.push_back(eval(*e.args[i], scope));
        for (const auto& kw : e.keywords) args.push_back(eval(*kw.second, scope));
        return Value::from_bool(apply_test(e.name, operand, args) != e.negated);
      }
      case ExprKind::Unary:
        return eval_unary(e, scope);
      case ExprKind::Binary:
        return eval_binary(e, scope);
      case ExprKind::Compare: {
        Value left = eval(*e.args[0], scope);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          Value right = eval(*e.args[i + 1], scope);
          if (!compare_op(e.ops[i], left, right, budget_)) return Value::from_bool(false);
          left = std::move(right);
        }
        return Value::from_bool(true);
      }
      case ExprKind::Cond:
        if (truthy(eval(*e.args[1], scope))) return eval(*e.args[0], scope);
        if (e.args[2]) return eval(*e.args[2], scope);
        return Value::undefined("the inline if expression was false and has no else branch");
    }
    return Value::undefined();
  }

  Value eval_unary(const Expr& e, const ScopePtr& scope) {
    const Value v = eval(*e.args[0], scope);
    if (e.name == "not") return Value::from_bool(!truthy(v));
    if (v.is_undefined()) fail_undefined(v);
    if (!v.is_number()) throw Error("bad operand type for unary " + e.name + ": '" + type_name(v) + "'");
    if (e.name == "+") return v.kind == Kind::Bool ? Value::from_int(v.boolean) : v;
    if (v.kind == Kind::Float) return Value::from_float(-v.number);
    const int64_t i = to_index(v, "an operand");
    if (i == INT64_MIN) throw Error("integer overflow in template arithmetic");
    return Value::from_int(-i);
  }

  Value eval_binary(const Expr& e, const ScopePtr& scope) {
    if (e.name == "and" || e.name == "or") {
      Value left = eval(*e.args[0], scope);
      if (truthy(left) == (e.name == "or")) return left;
      return eval(*e.args[1], scope);
    }
    const Value left = eval(*e.args[0], scope);
    const Value right = eval(*e.args[1], scope);
    if (e.name == "~") {
      std::string a = to_str(left), b = to_str(right);
      budget_.built_string(a.size() + b.size());
      return Value::from_string(a + b);
    }
    return arithmetic(e.name, left, right, budget_);
  }
};

}  // namespace

std::string render(const Body& body, const ValueDict& globals, const RenderLimits& limits) {
  return Interpreter(limits).run(body, globals);
}

}  // namespace microspec::jinja
