// libFuzzer target for the parsers structured output and chat prompts take from clients and model
// files: the first byte picks one.
//   0: a JSON Schema (src/grammar/json_schema.h): the rest, cut at the first NUL, is the schema;
//      the bytes after the NUL are fed to the compiled grammar's recognizer one by one. Checks that
//      compiling ends in a grammar or an Error, that the recognizer never accepts a byte that
//      accepts() refused (and accepts every byte accepts() allows), an Error being the only other
//      outcome (a grammar past the recognizer's bounds).
//   1: a chat template (src/chat_template/chat_template.h): the rest is the template text, rendered
//      with a fixed conversation, tools included, under the default render limits. It must end in
//      text or an Error.
// Anything else (a crash, a sanitizer report, another exception, a hang past -timeout) is a bug.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "chat_template/chat_template.h"
#include "grammar/grammar.h"
#include "grammar/json_schema.h"
#include "util/error.h"

namespace {

void require(bool ok) {
  if (!ok) __builtin_trap();
}

void fuzz_schema(std::string_view input) {
  const size_t nul = input.find('\0');
  const std::string_view schema_text = input.substr(0, nul);
  const std::string_view text = nul == std::string_view::npos ? std::string_view() : input.substr(nul + 1);
  const auto schema = nlohmann::ordered_json::parse(schema_text, nullptr, false);
  if (schema.is_discarded()) return;
  microspec::Grammar grammar = [&] {
    try {
      return microspec::json_schema_grammar(schema);
    } catch (const microspec::Error&) {
      return microspec::json_schema_grammar(nlohmann::ordered_json::object());
    }
  }();
  microspec::GrammarScratch scratch;
  microspec::GrammarState state, next;
  grammar.start(state, scratch);
  try {
    for (char c : text) {
      const bool accepted = grammar.accepts(state, uint8_t(c));
      grammar.advance(state, uint8_t(c), next, scratch);
      require(accepted == !next.dead());
      if (next.dead()) return;
      state.flat.swap(next.flat);
    }
  } catch (const microspec::Error&) {  // a grammar past the recognizer's bounds
  }
}

void fuzz_template(std::string_view source) {
  try {
    const microspec::ChatTemplate tmpl(source);
    nlohmann::ordered_json context;
    context["messages"] = nlohmann::ordered_json::parse(R"([
      {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <b>there</b>"},
      {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
        "function": {"name": "f", "arguments": {"x": [1, 2.5, null, true]}}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "42"}])");
    context["tools"] = nlohmann::ordered_json::parse(
        R"([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])");
    context["add_generation_prompt"] = true;
    context["bos_token"] = "<s>";
    context["eos_token"] = "</s>";
    (void)tmpl.render(context);
  } catch (const microspec::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0)
    fuzz_schema(rest);
  else
    fuzz_template(rest);
  return 0;
}
