#pragma once
// JSON Schema to grammar (grammar/grammar.h): the sentences of the grammar are JSON texts that
// validate against the schema. What structured output (`response_format`) and tool arguments use.
//
// Supported: `type` (one or a list; object, array, string, number, integer, boolean, null),
// `properties`, `required`, `items`, `minItems`/`maxItems` (at most 256), `minLength`/`maxLength`
// (at most 256), `enum`, `const`, `anyOf`, `allOf` of one schema, `$ref` to `#`, `#/$defs/...` or
// `#/definitions/...` (recursion allowed), boolean schemas, and the annotations (title,
// description, default, examples, $schema, $id, $comment, deprecated, readOnly, writeOnly).
// Anything else that constrains a value (`pattern`, `format`, `minimum`, `oneOf`, ...) is refused
// with an Error naming the keyword and where it is: never a grammar looser than the schema.
//
// What the grammar generates, within what the schema allows:
//   - an object's properties in the order `properties` lists them; required ones always, the
//     others optionally; never properties the schema does not name (additionalProperties is
//     allowed but nothing extra is generated);
//   - whitespace between tokens: none, one space, or a line break and at most 20 spaces or tabs
//     of indent (pretty-printed JSON fits; a model cannot pad forever);
//   - numbers with at most 16 integer and 16 fraction digits and a 3-digit exponent;
//   - strings of valid UTF-8 (escapes as JSON writes them), control characters escaped.
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>

#include "grammar/grammar.h"

namespace microspec {

// The grammar of JSON texts valid against `schema` (an ordered_json, so that properties keep the
// order the schema gives). Throws Error for a schema it cannot express.
Grammar json_schema_grammar(const nlohmann::ordered_json& schema);
// The grammar of any JSON object (response_format {"type": "json_object"}).
Grammar json_object_grammar();

// JSON texts between two tags, as models write tool calls (`<tool_call>` CALL `</tool_call>`).
struct JsonTags {
  std::string open, close;
};
enum class TaggedJsonMode {
  CallsOnly,    // whitespace, then 1..max_calls tagged texts separated by whitespace, then the end
  TextOrCalls,  // any text, in which every `open` begins a tagged text; text may follow each one
};
// The grammar of `mode` with each tagged text valid against `schema`. In TextOrCalls the free text
// is a matcher of `open` (the prefix-function automaton over its bytes): once the text holds
// `open`, only a valid tagged JSON text and `close` may follow. Throws Error as json_schema_grammar.
Grammar tagged_json_grammar(const nlohmann::ordered_json& schema, const JsonTags& tags, TaggedJsonMode mode,
                            int32_t max_calls);

}  // namespace microspec
