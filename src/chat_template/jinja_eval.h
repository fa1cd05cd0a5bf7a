#pragma once
// Renders a parsed template with jinja2's semantics: scopes (a for loop's body and a macro's body
// have their own; {% set %} elsewhere writes the enclosing one), the loop variable, macros and
// call blocks, namespace(), Undefined (prints as "", is false, iterates as empty, and fails when
// its attribute is read or it is called), and Python's operators.
#include <cstddef>
#include <cstdint>
#include <string>

#include "chat_template/jinja_ast.h"
#include "chat_template/jinja_value.h"

namespace microspec::jinja {

// Bounds that keep a hostile template from hanging or exhausting memory; each one exceeded is an
// Error naming it.
struct RenderLimits {
  size_t max_output_bytes = 16u << 20;  // the result, and any one string built on the way
  uint64_t max_steps = 20'000'000;      // nodes evaluated, loop iterations, list items, 16 bytes built
  int max_depth = 400;                  // nested evaluation (macro recursion included)
};

// `globals` are the variables the template sees (messages, add_generation_prompt, ...) plus the
// functions it may call (raise_exception, strftime_now, ...); range, namespace and dict are added
// here. Throws Error with the template line for anything the template does wrong.
std::string render(const Body& body, const ValueDict& globals, const RenderLimits& limits);

}  // namespace microspec::jinja
