#pragma once
// jinja2's filters and tests, and the Python str / dict methods chat templates call, as
// ImmutableSandboxedEnvironment allows them (methods that change a list or dict are refused).
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "chat_template/jinja_value.h"

namespace microspec::jinja {

// What one render may spend: evaluation steps (each node, loop iteration, list item and 16 bytes of
// a built string count one) and the size of any one string it builds.
struct Budget {
  uint64_t max_steps = 0;
  size_t max_string_bytes = 0;
  uint64_t steps = 0;

  void step(uint64_t n = 1);
  // Counts a string of `bytes` about to be built; throws Error when it is larger than allowed.
  void built_string(size_t bytes);
  // Counts a list of `items` about to be built; throws Error beyond 1 Mi items.
  void built_list(size_t items);
  // Counts an operation that reads all of v (a string's bytes / 64, a list's or dict's items), so
  // that repeating work on a long value cannot run for hours inside the step budget.
  void read(const Value& v);
};

// The items a for loop or a filter sees: a list's items, a dict's keys, a string's characters;
// Undefined iterates as empty (as jinja2's Undefined does). Anything else is an Error naming `where`.
ValueList iterate(const Value& v, const std::string& where);

// Whether jinja2 3.1 has a filter / test of that name (whether or not microspec implements it).
bool jinja2_has_filter(const std::string& name);
bool jinja2_has_test(const std::string& name);

// Throws Error("no filter named 'x'") for an unknown filter, and an Error naming the filter for
// arguments or operands it cannot take.
Value apply_filter(const std::string& name, const Value& operand, CallArgs& args, Budget& budget);

// Throws Error("no test named 'x'") for an unknown test.
bool apply_test(const std::string& name, const Value& operand, const std::vector<Value>& args);

// A method of a str, dict or list (s.strip(), d.get(k), d.items(), ...); nullopt where the object
// has no such method (the caller then looks for an attribute). Methods that would change the object
// (append, pop, update, ...) throw Error, as the sandbox refuses them.
std::optional<Value> call_method(const Value& object, const std::string& name, CallArgs& args,
                                 Budget& budget);

// Whether Python's str, dict or list has a method of that name (d.items without a call is the
// bound method in jinja2, not the key "items").
bool has_method(const Value& object, const std::string& name);

// Python's str.strip / lstrip / rstrip: `chars` are code points; none given strips whitespace.
enum class StripSide { Both, Left, Right };
std::string strip_text(const std::string& s, const Value& chars, StripSide side);

}  // namespace microspec::jinja
