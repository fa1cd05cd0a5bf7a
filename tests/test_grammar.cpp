// Grammars (grammar/grammar.h), JSON Schema compilation (grammar/json_schema.h) and token masks
// (grammar/token_constraint.h): what a grammar accepts, byte by byte and token by token; that
// random sentences of a schema's grammar parse as JSON; that the partial masks choose what the
// whole mask chooses; and that the whole mask is exactly the tokens allows() accepts, on the
// SmolLM2 vocabulary.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "grammar/grammar.h"
#include "grammar/json_schema.h"
#include "grammar/token_constraint.h"
#include "math/select.h"
#include "gguf/gguf.h"
#include "support/test_helpers.h"
#include "tokenizer/tokenizer.h"
#include "util/error.h"

namespace microspec {
namespace {

using ojson = nlohmann::ordered_json;

// Whether the grammar accepts exactly `text` (all of it, and complete there).
bool accepts(const Grammar& g, std::string_view text) {
  GrammarScratch scratch;
  GrammarState state;
  g.start(state, scratch);
  return g.advance_bytes(state, text, scratch) && Grammar::complete(state);
}

// Whether `text` is a prefix of something the grammar accepts.
bool prefix_ok(const Grammar& g, std::string_view text) {
  GrammarScratch scratch;
  GrammarState state;
  g.start(state, scratch);
  return g.advance_bytes(state, text, scratch);
}

TEST(Grammar, RepetitionAlternativesAndCompletion) {
  Grammar::Builder b;
  const Symbol bc = b.alt("bc", {b.lit("b"), b.lit("c")});
  const Symbol root = b.alt("root", {b.lit("a") + Sequence{b.repeat("bcs", {bc}, 1, 3)}});
  const Grammar g = std::move(b).build(root);
  for (const char* ok : {"ab", "ac", "abc", "acbc", "accc"}) EXPECT_TRUE(accepts(g, ok)) << ok;
  for (const char* bad : {"", "a", "b", "abbbb", "abd", "aab"}) EXPECT_FALSE(accepts(g, bad)) << bad;
  EXPECT_TRUE(prefix_ok(g, "a"));
  EXPECT_FALSE(prefix_ok(g, "x"));
}

TEST(Grammar, UnboundedRightRecursionKeepsTheStateSmall) {
  Grammar::Builder b;
  const Symbol root = b.alt("root", {b.lit("<") + Sequence{b.repeat("xs", b.lit("x"), 0, -1)} + b.lit(">")});
  const Grammar g = std::move(b).build(root);
  GrammarScratch scratch;
  GrammarState state;
  g.start(state, scratch);
  ASSERT_TRUE(g.advance_bytes(state, "<", scratch));
  const size_t size = state.flat.size();
  ASSERT_TRUE(g.advance_bytes(state, std::string(10000, 'x'), scratch));
  EXPECT_EQ(state.flat.size(), size);  // the repetition is a tail call: the stacks do not grow
  EXPECT_TRUE(g.advance_bytes(state, ">", scratch));
  EXPECT_TRUE(Grammar::complete(state));
}

TEST(Grammar, RefusesLeftRecursionAndEmptyRules) {
  {
    Grammar::Builder b;
    const Symbol r = b.rule("r");
    const Symbol opt = b.alt("opt", {{}, b.lit("x")});
    b.add(r, Sequence{opt, r} + b.lit("a"));  // reaches itself after a nullable symbol
    b.add(r, b.lit("b"));
    EXPECT_THROW(std::move(b).build(r), Error);
  }
  {
    Grammar::Builder b;
    const Symbol r = b.rule("r");
    EXPECT_THROW(std::move(b).build(r), Error);
  }
}

struct SchemaCase {
  const char* schema;
  std::vector<const char*> valid;
  std::vector<const char*> invalid;
};

TEST(JsonSchemaGrammar, AcceptsWhatTheSchemaAllowsAndRefusesTheRest) {
  const SchemaCase cases[] = {
      {R"({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
           "required": ["name"]})",
       {R"({"name": "Ann"})", R"({"name":"Ann","age":31})", "{\n  \"name\": \"A\\\"b\\u00e9\",\n  \"age\": -0\n}",
        " {\"name\": \"\xc3\xa9\xe2\x82\xac\"}"},
       {R"({})", R"({"age": 3})", R"({"age": 3, "name": "x"})", R"({"name": "x", "age": 3.5})",
        R"({"name": "x", "extra": 1})", R"({"name": "x",})", "{\"name\": \"\x01\"}", "{\"name\": \"\xc3\"}",
        R"({"name": "x"} )", R"({"name": 'x'})"}},
      {R"({"enum": ["red", "green", 3, null]})", {R"("red")", "3", "null"}, {R"("blue")", "4", R"("Red")"}},
      {R"({"const": {"a": [1, true]}})", {R"({"a":[1,true]})"}, {R"({"a":[1,false]})"}},
      {R"({"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 3})",
       {"[1]", "[1, 2.5e3, -0.5]", "[ 1 ,2 ]"},
       {"[]", "[1,2,3,4]", "[01]", "[1.]", "[true]"}},
      {R"({"type": ["string", "null"]})", {R"("x")", "null"}, {"1", "true"}},
      {R"({"anyOf": [{"type": "boolean"}, {"type": "array", "maxItems": 0}]})", {"true", "[]"}, {"[1]", "null"}},
      {R"({"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"},
           "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["v", "kids"]}},
           "$ref": "#/$defs/node"})",
       {R"({"v": 1, "kids": []})", R"({"v": 1, "kids": [{"v": 2, "kids": [{"v": 3, "kids": []}]}]})"},
       {R"({"v": 1})", R"({"v": 1, "kids": [{"v": 2}]})"}},
      {R"({"type": "string", "minLength": 2, "maxLength": 3})", {R"("ab")", R"("a\nc")"}, {R"("a")", R"("abcd")"}},
      {R"({"type": "object"})", {"{}", R"({"a": {"b": [1, "x", null]}})"}, {"[]", "1"}},
      {R"({})", {"1", "[]", R"({"a": 1})", R"("s")"}, {"", "nul"}},
  };
  for (const SchemaCase& c : cases) {
    const Grammar g = json_schema_grammar(ojson::parse(c.schema));
    for (const char* v : c.valid) EXPECT_TRUE(accepts(g, v)) << c.schema << "\n  must accept: " << v;
    for (const char* v : c.invalid) EXPECT_FALSE(accepts(g, v)) << c.schema << "\n  must refuse: " << v;
  }
}

TEST(JsonSchemaGrammar, PropertiesComeInTheSchemasOrder) {
  const Grammar g = json_schema_grammar(ojson::parse(R"({"properties": {"z": {}, "a": {}}})"));
  EXPECT_TRUE(accepts(g, R"({"z": 1, "a": 2})"));
  EXPECT_FALSE(accepts(g, R"({"a": 2, "z": 1})"));
  EXPECT_TRUE(accepts(g, R"({"a": 2})"));
}

TEST(JsonSchemaGrammar, RefusesWhatItCannotExpressNamingKeywordAndPlace) {
  const std::pair<const char*, const char*> refused[] = {
      {R"({"type": "string", "pattern": "^a"})", "'pattern'"},
      {R"({"properties": {"d": {"type": "string", "format": "date"}}})", "#/properties/d"},
      {R"({"oneOf": [{"type": "string"}]})", "'oneOf'"},
      {R"({"type": "integer", "minimum": 3})", "'minimum'"},
      {R"({"$ref": "#/$defs/missing"})", "#/$defs/missing"},
      {R"({"type": "array", "maxItems": 100000})", "maxItems"},
      {R"({"properties": {"a": {}}, "required": ["b"]})", "\"b\""},
      {R"({"type": "decimal"})", "decimal"},
      {R"({"enum": [1, 2], "type": "string"})", "enum"},
      {"false", "matches nothing"},
  };
  for (const auto& [schema, words] : refused) {
    try {
      json_schema_grammar(ojson::parse(schema));
      ADD_FAILURE() << "accepted " << schema;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  }
}

TEST(JsonSchemaGrammar, TaggedCallsAloneOrInFreeText) {
  const ojson schema = ojson::parse(R"({"type": "object", "properties": {"name": {"const": "f"},
      "arguments": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
      "required": ["name", "arguments"]})");
  const JsonTags tags{"<tool_call>", "</tool_call>"};
  const std::string call = R"(<tool_call>
{"name": "f", "arguments": {"x": 1}}
</tool_call>)";
  const Grammar only = tagged_json_grammar(schema, tags, TaggedJsonMode::CallsOnly, 2);
  for (const std::string& ok : {call, "\n" + call, call + "\n" + call}) EXPECT_TRUE(accepts(only, ok)) << ok;
  for (const std::string& bad : {std::string("hello"), call + call + call, "x" + call, std::string("<tool_call>{}</tool_call>"),
                                 call.substr(0, call.size() - 1)})
    EXPECT_FALSE(accepts(only, bad)) << bad;
  const Grammar text = tagged_json_grammar(schema, tags, TaggedJsonMode::TextOrCalls, 1);
  for (const std::string& ok : {std::string(""), std::string("hello"), "Let me look. " + call + " Done.", std::string("a <tool_ca"),
                                std::string("<<tool_call"), std::string("<tool_cal<tool_cal") , call})
    EXPECT_TRUE(accepts(text, ok)) << ok;
  for (const std::string& bad : {std::string("x <tool_call>nonsense</tool_call>"), "ab" + call.substr(0, call.size() - 2),
                                 std::string("<<tool_call>{\"name\": \"g\", \"arguments\": {\"x\": 1}}</tool_call>")})
    EXPECT_FALSE(accepts(text, bad)) << bad;
}

// A random sentence of the grammar: random allowed bytes, ending as soon as the state is complete
// once past min_len. Empty when it ran past max_len.
std::string random_sentence(const Grammar& g, std::mt19937& rng, size_t min_len, size_t max_len) {
  GrammarScratch scratch;
  GrammarState state, next;
  g.start(state, scratch);
  std::string out;
  std::vector<uint8_t> allowed;
  while (out.size() < max_len) {
    if (Grammar::complete(state) && (out.size() >= min_len || rng() % 4 == 0)) return out;
    allowed.clear();
    for (int b = 0; b < 256; ++b)
      if (g.accepts(state, uint8_t(b))) allowed.push_back(uint8_t(b));
    if (allowed.empty()) return Grammar::complete(state) ? out : std::string();
    // Closing brackets and quotes first half the time, so sentences end.
    uint8_t byte = allowed[rng() % allowed.size()];
    for (uint8_t c : allowed)
      if ((c == '}' || c == ']' || c == '"') && rng() % 2 == 0) byte = c;
    out.push_back(char(byte));
    g.advance(state, byte, next, scratch);
    state.flat.swap(next.flat);
  }
  return {};
}

TEST(JsonSchemaGrammar, RandomSentencesAreJsonOfTheSchemasShape) {
  const ojson schema = ojson::parse(R"({"type": "object", "properties": {
      "id": {"type": "integer"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
      "score": {"type": ["number", "null"]}, "note": {"type": "string", "maxLength": 8},
      "meta": {"type": "object"}}, "required": ["id", "tags"]})");
  const Grammar g = json_schema_grammar(schema);
  std::mt19937 rng(7);
  int parsed = 0;
  for (int i = 0; i < 300; ++i) {
    const std::string s = random_sentence(g, rng, 0, 4000);
    if (s.empty()) continue;
    const nlohmann::json j = nlohmann::json::parse(s, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << "not JSON: " << s;
    ASSERT_TRUE(j.is_object() && j.contains("id") && j["id"].is_number_integer() && j["tags"].is_array()) << s;
    EXPECT_LE(j["tags"].size(), 2u) << s;
    if (j.contains("note")) EXPECT_LE(j["note"].get<std::string>().size(), 8u * 4) << s;
    ++parsed;
  }
  EXPECT_GT(parsed, 250);
}

// A small vocabulary over the JSON object grammar's bytes, with an end token.
GrammarVocabulary small_vocabulary() {
  const std::vector<std::string> pieces = {"{", "}", "\"", "a", "\"a", "a\"", ":", ",", " ", "1", "12",
                                           "\":", "{\"", "}}", "", "<eos>", "x\"y", "\n", "\"}"};
  return GrammarVocabulary(pieces, {15});
}

TEST(TokenConstraint, AllowsTokensWhoseBytesAllFitAndTheEndOnlyWhenComplete) {
  auto vocab = std::make_shared<GrammarVocabulary>(small_vocabulary());
  const TokenConstraint c(json_object_grammar(), vocab);
  GrammarScratch scratch;
  GrammarState s;
  c.grammar().start(s, scratch);
  EXPECT_TRUE(c.allows(s, 0, scratch));    // {
  EXPECT_TRUE(c.allows(s, 12, scratch));   // {"
  EXPECT_FALSE(c.allows(s, 1, scratch));   // }
  EXPECT_FALSE(c.allows(s, 14, scratch));  // no bytes: never
  EXPECT_FALSE(c.allows(s, 15, scratch));  // the end: not yet
  ASSERT_TRUE(c.advance(s, 12, scratch));  // {"
  EXPECT_TRUE(c.allows(s, 5, scratch));    // a"
  EXPECT_FALSE(c.allows(s, 16, scratch));  // x"y: the key closes, and y cannot follow it
  for (int32_t t : {5, 6, 9}) ASSERT_TRUE(c.advance(s, t, scratch)) << t;  // {"a":1
  EXPECT_FALSE(c.allows(s, 18, scratch));  // "}: a quote cannot follow a number
  EXPECT_FALSE(c.allows(s, 15, scratch));
  ASSERT_TRUE(c.advance(s, 1, scratch));  // }
  EXPECT_TRUE(c.allows(s, 15, scratch));  // complete: the end, and nothing else
  for (int32_t t = 0; t < 15; ++t) EXPECT_FALSE(c.allows(s, t, scratch)) << t;
}

TEST(TokenConstraint, RankedMasksChooseWhatTheWholeMaskChooses) {
  auto vocab = std::make_shared<GrammarVocabulary>(small_vocabulary());
  auto c = std::make_shared<TokenConstraint>(json_object_grammar(), vocab);
  std::mt19937 rng(3);
  std::normal_distribution<float> noise(0.0f, 2.0f);
  const int32_t V = vocab->size();
  for (int trial = 0; trial < 200; ++trial) {
    // A random history the grammar allows, then the same row masked three ways.
    GrammarMatcher full(c, 0), greedy(c, 1), top3(c, 3);
    std::vector<int32_t> history;
    for (int step = 0; step < int(rng() % 6); ++step) {
      std::vector<float> row(static_cast<size_t>(V));
      for (float& x : row) x = noise(rng);
      full.mask_row(row.data());
      const int32_t t = argmax(row.data(), V);
      if (vocab->ends(t)) break;
      for (GrammarMatcher* m : {&full, &greedy, &top3}) m->accept(t);
    }
    std::vector<float> row(static_cast<size_t>(V));
    for (float& x : row) x = std::round(noise(rng));  // ties too
    std::vector<float> a = row, b = row, d = row;
    full.mask_row(a.data());
    greedy.mask_row(b.data());
    top3.mask_row(d.data());
    EXPECT_EQ(argmax(b.data(), V), argmax(a.data(), V));
    int32_t ta[3], td[3];
    top_k_indices(a.data(), V, 3, ta);
    top_k_indices(d.data(), V, 3, td);
    const int allowed = int(std::count_if(a.begin(), a.end(), [](float x) { return std::isfinite(x); }));
    for (int i = 0; i < std::min(allowed, 3); ++i) {
      EXPECT_EQ(td[i], ta[i]);
      EXPECT_EQ(d[size_t(td[i])], a[size_t(ta[i])]);
    }
  }
}

TEST(TokenConstraint, WholeMaskIsExactlyTheAllowedTokensOfSmolLM2) {
  test::require_file(test::smollm_path());
  auto file = GgufFile::open(test::smollm_path());
  const auto tok = Tokenizer::from_gguf(*file);
  auto vocab = std::make_shared<GrammarVocabulary>(*tok);
  const TokenConstraint c(json_schema_grammar(ojson::parse(
                              R"({"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
                                  "required": ["name", "n"]})")),
                          vocab);
  GrammarScratch scratch;
  GrammarState s;
  c.grammar().start(s, scratch);
  // States along a valid text: the start, inside a key, inside a value string, in a number, done.
  const std::string text = R"({"name": "Bob \u00e9", "n": 12})";
  size_t checked_states = 0;
  for (size_t i = 0; i <= text.size(); ++i) {
    if (i == 0 || i == 3 || i == 12 || i == 27 || i == text.size()) {
      const auto mask = c.full_mask(s, scratch);
      size_t allowed = 0;
      for (int32_t id = 0; id < vocab->size(); ++id) {
        const bool bit = ((*mask)[size_t(id) >> 6] >> (id & 63)) & 1u;
        ASSERT_EQ(bit, c.allows(s, id, scratch)) << "state after " << text.substr(0, i) << ", token " << id;
        allowed += bit;
      }
      EXPECT_GT(allowed, 0u);
      ++checked_states;
    }
    if (i < text.size()) ASSERT_TRUE(c.grammar().advance_bytes(s, text.substr(i, 1), scratch)) << i;
  }
  EXPECT_EQ(checked_states, 5u);
  EXPECT_TRUE(Grammar::complete(s));
}

}  // namespace
}  // namespace microspec
