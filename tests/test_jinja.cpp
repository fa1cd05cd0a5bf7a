// The Jinja interpreter of src/chat_template/: each statement, expression, filter and test on small
// templates whose expected text is jinja2's (trim_blocks and lstrip_blocks on, as transformers sets
// them); hostile templates (deep nesting, unterminated tags, runaway loops, huge output) that must
// end in an Error, never a crash or a hang; and random mutations of a real template.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>

#include "chat_template/chat_template.h"
#include "gguf/gguf.h"
#include "gguf/gguf_writer.h"
#include "util/error.h"

namespace microspec {
namespace {

using ordered_json = nlohmann::ordered_json;

std::string render(std::string_view tmpl, const char* context = "{}") {
  return render_chat_template(tmpl, ordered_json::parse(context));
}

// The Error's message when rendering fails ("" when it renders).
std::string error_of(std::string_view tmpl, const char* context = "{}") {
  try {
    render(tmpl, context);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// --- statements ---------------------------------------------------------------------------------------

TEST(JinjaStatements, IfElifElse) {
  const char* t = "{% if x == 1 %}one{% elif x == 2 %}two{% else %}many{% endif %}";
  EXPECT_EQ(render(t, R"({"x": 1})"), "one");
  EXPECT_EQ(render(t, R"({"x": 2})"), "two");
  EXPECT_EQ(render(t, R"({"x": 7})"), "many");
  EXPECT_EQ(render("{% if undefined_thing %}yes{% else %}no{% endif %}"), "no");
}

TEST(JinjaStatements, ForLoopVariables) {
  EXPECT_EQ(render("{% for x in xs %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}"
                   "{{ loop.length }}{{ loop.first }}{{ loop.last }};{% endfor %}",
                   R"({"xs": ["a", "b"]})"),
            "10212TrueFalse;21102FalseTrue;");
  EXPECT_EQ(render("{% for x in [1, 2, 3] %}{{ loop.previtem }}-{{ loop.nextitem }}|{% endfor %}"),
            "-2|1-3|2-|");
  EXPECT_EQ(render("{% for x in [1, 2, 3] %}{{ loop.cycle('a', 'b') }}{% endfor %}"), "aba");
}

TEST(JinjaStatements, ForElseFilterUnpackAndControls) {
  EXPECT_EQ(render("{% for x in [] %}x{% else %}empty{% endfor %}"), "empty");
  EXPECT_EQ(render("{% for x in [1, 2, 3, 4] if x is even %}{{ x }}{{ loop.length }}{% endfor %}"), "2242");
  EXPECT_EQ(render("{% for k, v in d.items() %}{{ k }}={{ v }},{% endfor %}", R"({"d": {"b": 1, "a": 2}})"),
            "b=1,a=2,");
  EXPECT_EQ(render("{% for k in d %}{{ k }}{% endfor %}", R"({"d": {"b": 1, "a": 2}})"), "ba");
  EXPECT_EQ(
      render("{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 5 %}{% break %}"
             "{% endif %}{{ x }}{% endfor %}"),
      "0134");
  EXPECT_EQ(render("{% for c in 'héllo' %}{{ c }}.{% endfor %}"), "h.é.l.l.o.");
}

TEST(JinjaStatements, SetScopesAndNamespace) {
  // A for loop's body has its own scope: sets inside it do not survive the iteration.
  EXPECT_EQ(render("{% set c = 0 %}{% for i in range(3) %}{% set c = c + 1 %}{{ c }}{% endfor %}{{ c }}"),
            "1110");
  EXPECT_EQ(render("{% set ns = namespace(c=0) %}{% for i in range(3) %}{% set ns.c = ns.c + 1 %}{% endfor %}"
                   "{{ ns.c }}"),
            "3");
  EXPECT_EQ(render("{% if true %}{% set z = 3 %}{% endif %}{{ z }}"), "3");
  EXPECT_EQ(render("{% set a, b = [1, 2] %}{{ a }}{{ b }}"), "12");
  EXPECT_EQ(render("{% set block %}x{{ 1 + 1 }}y{% endset %}[{{ block }}]"), "[x2y]");
  EXPECT_TRUE(contains(error_of("{% set x = 1 %}{% set x.a = 2 %}"), "namespace"));
  EXPECT_TRUE(contains(error_of("{% set ns = namespace() %}{% set ns.a = namespace() %}"), "namespace"));
}

TEST(JinjaStatements, MacrosAndCallBlocks) {
  EXPECT_EQ(
      render("{% macro m(a, b=2) %}{{ a }}{{ b }}{% endmacro %}{{ m(1) }}{{ m(3, b=4) }}{{ m(b=6, a=5) }}"),
      "123456");
  EXPECT_EQ(render("{% macro m() %}{{ y }}{% endmacro %}{% set y = 5 %}{{ m() }}"), "5");
  EXPECT_EQ(render("{% macro m(x) %}<{{ caller(x) }}>{% endmacro %}{% call(v) m(7) %}v={{ v }}{% endcall %}"),
            "<v=7>");
  EXPECT_EQ(render("{% macro f(n) %}{% if n > 0 %}{{ n }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(3) }}"),
            "321");
  EXPECT_TRUE(contains(error_of("{{ m() }}{% macro m() %}x{% endmacro %}"), "'m' is undefined"));
  EXPECT_TRUE(contains(error_of("{% macro m(a) %}{% endmacro %}{{ m(q=1) }}"), "no parameter named 'q'"));
}

TEST(JinjaStatements, FilterBlockGenerationAndRaise) {
  EXPECT_EQ(render("{% filter upper %}abc{{ 'd' }}{% endfilter %}"), "ABCD");
  EXPECT_EQ(render("{%- filter trim -%}\n  padded  \n{%- endfilter -%}"), "padded");
  EXPECT_EQ(render("a{% generation %}b{% endgeneration %}c"), "abc");
  const std::string e = error_of("{{ raise_exception('Roles must alternate user/assistant') }}");
  EXPECT_TRUE(contains(e, "Roles must alternate user/assistant")) << e;
  EXPECT_EQ(render("{{ strftime_now('%d %b %Y') }}"), "26 Jul 2024");
}

// --- whitespace control --------------------------------------------------------------------------------

TEST(JinjaWhitespace, TrimAndLstripBlocks) {
  // trim_blocks drops the newline after a block tag; lstrip_blocks the indentation before it.
  EXPECT_EQ(render("{% if true %}\n  yes\n  {% endif %}\nafter"), "  yes\nafter");
  EXPECT_EQ(render("  {% if true %}x{% endif %}"), "x");
  EXPECT_EQ(render("a  {% if true %}x{% endif %}"), "a  x");  // not alone on its line: kept
  EXPECT_EQ(render("{{ 'v' }}\nnext"), "v\nnext");            // not after {{ }}
  EXPECT_EQ(render("{# comment #}\nx"), "x");
  EXPECT_EQ(render("line\n"), "line");  // one trailing newline dropped
  EXPECT_EQ(render("a\r\nb"), "a\nb");
}

TEST(JinjaWhitespace, MinusAndPlus) {
  EXPECT_EQ(render("a  \n {{- 'b' -}} \n  c"), "abc");
  EXPECT_EQ(render("a\n  {%- if true -%}\n  b  {%- endif %}"), "ab");
  EXPECT_EQ(render("x\n  {#- c -#}  \ny"), "xy");
  EXPECT_EQ(render("  {%+ if true %}x{% endif %}"), "  x");
  EXPECT_EQ(render("{% if true +%}\nx{% endif %}"), "\nx");
  EXPECT_EQ(render("{% raw %}{{ not evaluated }}{% endraw %}"), "{{ not evaluated }}");
}

// --- expressions ---------------------------------------------------------------------------------------

TEST(JinjaExpressions, Literals) {
  EXPECT_EQ(render(R"({{ 'a\n\t\'b' }}|{{ "\x41\u00e9" }}|{{ 'un\known' }})"), "a\n\t'b|Aé|un\\known");
  EXPECT_EQ(render("{{ 'ab' 'cd' }}"), "abcd");
  EXPECT_EQ(render("{{ 42 }} {{ 1.5 }} {{ 3.0 }} {{ 1e-5 }} {{ 1e20 }} {{ 0.1 + 0.2 }}"),
            "42 1.5 3.0 1e-05 1e+20 0.30000000000000004");
  EXPECT_EQ(render("{{ true }} {{ False }} {{ none }} {{ None }}"), "True False None None");
  EXPECT_EQ(render("{{ [1, 'a', none, [true]] }}"), "[1, 'a', None, [True]]");
  EXPECT_EQ(render("{{ {'k': \"it's\", 'n': 1.0} }}"), "{'k': \"it's\", 'n': 1.0}");
  EXPECT_EQ(render("{{ (1, 2) }}{{ (1,) }}{{ () }}"), "(1, 2)(1,)()");
}

TEST(JinjaExpressions, AttributesSubscriptsSlices) {
  const char* ctx = R"({"m": {"role": "user", "parts": [1, 2, 3, 4]}, "s": "héllo"})";
  EXPECT_EQ(render("{{ m.role }}{{ m['role'] }}{{ m.parts[0] }}{{ m.parts[-1] }}{{ m.parts.1 }}", ctx),
            "useruser142");
  EXPECT_EQ(render("{{ m.parts[1:3] }}{{ m.parts[::-1] }}{{ m.parts[:-1] }}{{ s[1:] }}{{ s[::2] }}", ctx),
            "[2, 3][4, 3, 2, 1][1, 2, 3]éllohlo");
  EXPECT_EQ(render("[{{ m.missing }}]{{ m.missing is defined }}{{ m.parts[10] is defined }}", ctx),
            "[]FalseFalse");
  EXPECT_EQ(render("{{ none.x is defined }}"), "False");
  EXPECT_TRUE(contains(error_of("{{ m.missing.deeper }}", ctx), "has no attribute 'missing'"));
  EXPECT_TRUE(contains(error_of("{{ nothing.x }}"), "'nothing' is undefined"));
}

TEST(JinjaExpressions, OperatorsAndPrecedence) {
  EXPECT_EQ(render("{{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 2 ** 3 ** 2 }} {{ -2 ** 2 }}"), "7 9 64 4");
  EXPECT_EQ(render("{{ 7 / 2 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7.5 % 2 }} {{ 10 / 2 }}"),
            "3.5 3 -4 2 1.5 5.0");
  EXPECT_EQ(render("{{ 'a' ~ 1 ~ none }} {{ 'ab' + 'cd' }} {{ [1] + [2] }} {{ 'ab' * 2 }}"),
            "a1None abcd [1, 2] abab");
  EXPECT_EQ(render("{{ 1 < 2 < 3 }} {{ 1 < 3 < 2 }} {{ 'b' > 'a' }} {{ 1 == 1.0 }} {{ 1 != 'a' }}"),
            "True False True True True");
  EXPECT_EQ(render("{{ 'x' in 'xyz' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 3 not in [1] }}"),
            "True True True True");
  EXPECT_EQ(render("{{ none or 'd' }} {{ 'a' and 'b' }} {{ not 0 }} {{ not x is defined }}"),
            "d b True True");
  EXPECT_EQ(render("{{ 'y' if 1 > 0 else 'n' }}{{ 'y' if false }}|{{ (1 if false) is defined }}"), "y|False");
  EXPECT_EQ(render("{{ 'a' if false else 'b' if false else 'c' }}"), "c");
  EXPECT_TRUE(contains(error_of("{{ 'a' + 1 }}"), "unsupported operand"));
  EXPECT_TRUE(contains(error_of("{{ 1 // 0 }}"), "division by zero"));
  EXPECT_TRUE(contains(error_of("{{ 9223372036854775807 + 1 }}"), "overflow"));
}

TEST(JinjaExpressions, Methods) {
  EXPECT_EQ(
      render("{{ '  a b  '.strip() }}|{{ 'xxaxx'.strip('x') }}|{{ '  a'.lstrip() }}|{{ 'a  '.rstrip() }}|"),
      "a b|a|a|a|");
  EXPECT_EQ(render("{{ 'a,b,,c'.split(',') }}{{ ' a  b '.split() }}{{ 'a-b-c'.split('-', 1) }}"),
            "['a', 'b', '', 'c']['a', 'b']['a', 'b-c']");
  EXPECT_EQ(
      render("{{ 'abc'.startswith('ab') }}{{ 'abc'.endswith(('x', 'c')) }}{{ 'aXa'.replace('a', 'b') }}"),
      "TrueTruebXb");
  EXPECT_EQ(render("{{ 'hi THERE'.upper() }}{{ 'Hi'.lower() }}{{ 'hello world'.title() }}"),
            "HI THEREhiHello World");
  EXPECT_EQ(render("{{ '<{}|{}>'.format(1, 'b') }}{{ '{0}{0}'.format('x') }}"), "<1|b>xx");
  EXPECT_EQ(
      render(
          "{{ d.get('a') }}{{ d.get('z') }}{{ d.get('z', 5) }}{{ d.keys() | list }}{{ d.values() | list }}",
          R"({"d": {"a": 1}})"),
      "1None5['a'][1]");
  EXPECT_TRUE(contains(error_of("{% set l = [] %}{{ l.append(1) }}"), "unsafe"));
  EXPECT_TRUE(contains(error_of("{{ 'a'.nomethod() }}"), "no method 'nomethod'"));
}

// --- filters and tests ---------------------------------------------------------------------------------

TEST(JinjaFilters, Strings) {
  EXPECT_EQ(render("{{ '  x  ' | trim }}|{{ 'ab' | upper }}|{{ 'AB' | lower }}|{{ 'aB c' | capitalize }}|"
                   "{{ 'ab cd' | title }}|{{ 'aba' | replace('a', 'c') }}|{{ 'a&<' | e }}|{{ 'x' | safe }}"),
            "x|AB|ab|Ab c|Ab Cd|cbc|a&amp;&lt;|x");
  EXPECT_EQ(render("{{ 5 | string }}{{ none | string }}{{ '12' | int + 1 }}{{ '3.7' | int }}{{ 'x' | int }}"
                   "{{ '2.5' | float }}{{ -3 | abs }}{{ 2.5 | round }}{{ 3.14159 | round(2) }}"),
            "5None1330"
            "2.532.03.14");
  EXPECT_EQ(render("{{ \"hello world's (x-y) ünï\" | title }}|{{ \"hello world's ünï 東京abc\".title() }}|"
                   "{{ 'ßa' | upper }}{{ 'ÄÖ' | lower }}"),
            "Hello World's (X-Y) Ünï|Hello World'S Ünï 東京Abc|SSAäö");
  EXPECT_EQ(render("{{ 'a\nb\n\nc' | indent(2) }}|{{ 'a\nb' | indent(2, first=true) }}|{{ 'a\n\nb' | "
                   "indent(1, blank=true) }}"),
            "a\n  b\n\n  c|  a\n  b|a\n \n b");
}

TEST(JinjaFilters, Sequences) {
  const char* ctx = R"({"ms": [{"role": "system", "n": 2}, {"role": "user", "n": 1}, {"role": "user"}]})";
  EXPECT_EQ(render("{{ ms | length }}{{ 'héllo' | length }}{{ ms | count }}{{ [] | first is defined }}", ctx),
            "353False");
  EXPECT_EQ(render("{{ ms | selectattr('role', 'equalto', 'user') | list | length }}"
                   "{{ ms | rejectattr('role', 'equalto', 'user') | map(attribute='role') | join(',') }}"
                   "{{ ms | selectattr('n', 'defined') | map(attribute='n') | list }}"
                   "{{ ms | selectattr('n') | list | length }}",
                   ctx),
            "2system[2, 1]2");
  EXPECT_EQ(render("{{ [1, 2, 3, 4] | select('odd') | list }}{{ ['a', 'b'] | reject('equalto', 'a') | list }}"
                   "{{ ['a', 'b'] | map('upper') | join }}"),
            "[1, 3]['b']AB");
  EXPECT_EQ(
      render(
          "{{ [3, 1, 2] | sort }}{{ ['b', 'A', 'a'] | unique | list }}{{ [3, 1, 2] | min }}{{ [3, 1] | max }}"
          "{{ ms | sort(attribute='role', reverse=true) | map(attribute='role') | first }}",
          ctx),
      "[1, 2, 3]['b', 'A']13user");
  EXPECT_EQ(render("{{ {'b': 1, 'A': 2} | dictsort }}{{ {'a': 1} | items | list }}{{ 'ab' | list }}{{ [1, 2] "
                   "| last }}"),
            "[('A', 2), ('b', 1)][('a', 1)]['a', 'b']2");
  EXPECT_EQ(render("{{ x | default('d') }}{{ '' | default('e', true) }}{{ 0 | default('f') }}{{ [1, 2] | "
                   "join('-') }}"),
            "de0"
            "1-2");
}

TEST(JinjaFilters, ToJsonMatchesTransformers) {
  const char* ctx = R"({"v": {"b": [1, 2.5, true, null], "a": "é\"\n", "e": {}, "l": []}})";
  EXPECT_EQ(render("{{ v | tojson }}", ctx),
            R"({"b": [1, 2.5, true, null], "a": "é\"\n", "e": {}, "l": []})");
  EXPECT_EQ(render("{{ v | tojson(indent=2) }}", ctx),
            "{\n  \"b\": [\n    1,\n    2.5,\n    true,\n    null\n  ],\n  \"a\": \"é\\\"\\n\",\n  \"e\": "
            "{},\n  \"l\": []\n}");
  EXPECT_EQ(
      render("{{ v.a | tojson(ensure_ascii=true) }}{{ {'b': 1, 'a': 2} | tojson(sort_keys=true) }}", ctx),
      R"("\u00e9\"\n"{"a": 2, "b": 1})");
  EXPECT_EQ(render("{{ {'a': [1, 2]} | tojson(separators=(',', ':')) }}"), R"({"a":[1,2]})");
  EXPECT_EQ(render("{{ '<tag>&' | tojson }}"), R"("<tag>&")");  // no HTML escaping (unlike jinja2's own)
  EXPECT_TRUE(contains(error_of("{{ x | tojson }}"), "not JSON serializable"));
}

TEST(JinjaTests, TypeAndValueTests) {
  const char* ctx = R"({"s": "x", "i": 1, "f": 1.5, "b": true, "n": null, "l": [1], "d": {"a": 1}})";
  EXPECT_EQ(
      render("{{ s is string }}{{ i is number }}{{ f is float }}{{ i is integer }}{{ b is boolean }}"
             "{{ n is none }}{{ l is sequence }}{{ d is mapping }}{{ l is iterable }}{{ i is iterable }}",
             ctx),
      "TrueTrueTrueTrueTrueTrueTrueTrueTrueFalse");
  EXPECT_EQ(
      render(
          "{{ q is defined }}{{ q is undefined }}{{ b is true }}{{ b is false }}{{ 3 is odd }}{{ 3 is even }}"
          "{{ 6 is divisibleby 3 }}{{ s is not none }}{{ i is eq 1 }}{{ 'x' is in 'xy' }}",
          ctx),
      "FalseTrueTrueFalseTrueFalseTrueTrueTrueTrue");
  EXPECT_TRUE(contains(error_of("{{ 1 is frobnicated }}"), "no test named 'frobnicated'"));
}

// --- hostile templates ---------------------------------------------------------------------------------

TEST(JinjaHostile, SyntaxErrorsNameTheConstruct) {
  EXPECT_TRUE(contains(error_of("{% if x %}never closed"), "not closed"));
  EXPECT_TRUE(contains(error_of("{{ x "), "unterminated"));
  EXPECT_TRUE(contains(error_of("{# comment"), "unterminated comment"));
  EXPECT_TRUE(contains(error_of("{{ 'abc }}"), "unterminated string"));
  EXPECT_TRUE(contains(error_of("{% include 'x.html' %}"), "unknown or unsupported tag 'include'"));
  EXPECT_TRUE(contains(error_of("{% endfor %}"), "without a matching opening tag"));
  EXPECT_TRUE(contains(error_of("{% break %}"), "outside of a for loop"));
  EXPECT_TRUE(contains(error_of("{{ x | no_such_filter }}"), "no filter named 'no_such_filter'"));
  EXPECT_TRUE(contains(error_of("{{ 1 + }}"), "expected an expression"));
  EXPECT_TRUE(contains(error_of("{{ a ! b }}"), "unexpected character '!'"));
  EXPECT_TRUE(contains(error_of("line1\n{{ x.y.z }}"), "template line 2"));
}

TEST(JinjaHostile, DeepNestingIsRefused) {
  const std::string parens = std::string(100000, '(') + "1" + std::string(100000, ')');
  EXPECT_TRUE(contains(error_of("{{ " + parens + " }}"), "nested more than 256"));
  EXPECT_TRUE(contains(error_of("{{ " + std::string(100000, '(') + " }}"), "unterminated '{{' tag"));
  std::string ifs;
  for (int i = 0; i < 5000; ++i) ifs += "{% if true %}";
  EXPECT_TRUE(contains(error_of(ifs), "nested more than 256"));
  const std::string lists = std::string(5000, '[') + std::string(5000, ']');
  EXPECT_TRUE(contains(error_of("{{ " + lists + " }}"), "nested more than 256"));
  std::string minus(100000, '-');  // unary operators nest too
  EXPECT_TRUE(contains(error_of("{{ " + minus + "1 }}"), "nested more than 256"));
  // Chains the parser builds in a loop nest as deeply: a + b + ..., x|f|g..., x.a.b...
  std::string plus = "{{ 1", filters = "{{ 'x'", attrs = "{{ x";
  for (int i = 0; i < 100000; ++i) plus += " + 1", filters += "|trim", attrs += ".a";
  EXPECT_TRUE(contains(error_of(plus + " }}"), "nested more than 256"));
  EXPECT_TRUE(contains(error_of(filters + " }}"), "nested more than 256"));
  EXPECT_TRUE(contains(error_of(attrs + " }}"), "nested more than 256"));
  std::string nots;
  for (int i = 0; i < 5000; ++i) nots += "not ";
  EXPECT_TRUE(contains(error_of("{{ " + nots + "x }}"), "nested more than 256"));
  // Values built deeper and deeper at run time.
  EXPECT_TRUE(
      contains(error_of("{% set ns = namespace(x=[]) %}{% for i in range(1000) %}{% set ns.x = [ns.x] %}"
                        "{% endfor %}"),
               "nested more than 256"));
  // Unbounded macro recursion.
  EXPECT_TRUE(contains(error_of("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"), "nested more than"));
}

TEST(JinjaHostile, RunawayLoopsAndOutputAreBounded) {
  EXPECT_TRUE(contains(error_of("{% for i in range(1000000) %}{% endfor %}"), "range too big"));
  EXPECT_TRUE(contains(
      error_of("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"), "steps"));
  EXPECT_TRUE(contains(error_of("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}"), "larger than"));
  EXPECT_TRUE(contains(error_of("{{ 'x' * 100000000000 }}"), "larger than"));
  EXPECT_TRUE(
      contains(error_of("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                        "{% endfor %}"),
               "larger than"));
  EXPECT_TRUE(contains(error_of("{{ [0] * 100000000 }}"), "1048576"));
  EXPECT_TRUE(contains(error_of(std::string(2 << 20, 'x')), "larger than 1 MiB"));  // the template itself
}

// A chat template of the ChatML-with-tools kind, exercising most constructs at once.
const char* kRealTemplate = R"TMPL({%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools><|im_end|>\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_user=0) %}
{%- for message in messages %}
    {%- if message.role == "user" %}{% set ns.last_user = loop.index0 %}{% endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content | trim + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls | default([]) %}
            {%- set tool_call = tool_call.function if tool_call.function is defined else tool_call %}
            {{- '\n<tool_call>\n{"name": "' ~ tool_call.name ~ '", "arguments": ' }}
            {{- tool_call.arguments | tojson(indent=2) if tool_call.arguments is mapping else tool_call.arguments }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem is not defined or loop.previtem.role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' ~ message.content ~ '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != "tool" %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- elif message.role != "system" %}
        {{- raise_exception('Unknown role: ' ~ message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
)TMPL";

const char* kRealContext = R"({"messages": [
  {"role": "system", "content": "Be brief."},
  {"role": "user", "content": " Weather in Paris? "},
  {"role": "assistant", "content": null, "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
  {"role": "tool", "content": "{\"t\": 21}"}],
  "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
  "add_generation_prompt": true})";

TEST(JinjaRealTemplate, RendersAToolConversation) {
  EXPECT_EQ(
      render(kRealTemplate, kRealContext),
      "<|im_start|>system\nBe brief.\n\n# Tools\n\n<tools>\n"
      "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": {\"type\": "
      "\"object\"}}}\n"
      "</tools><|im_end|>\n<|im_start|>user\nWeather in "
      "Paris?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
      "{\"name\": \"get_weather\", \"arguments\": {\n  \"city\": \"Paris\"\n}}\n</tool_call><|im_end|>\n"
      "<|im_start|>user\n<tool_response>\n{\"t\": 21}\n</tool_response><|im_end|>\n<|im_start|>assistant\n");
}

TEST(JinjaFuzz, MutatedTemplatesRenderOrThrowError) {
  std::mt19937 rng(1234);
  const std::string base = kRealTemplate;
  const char alphabet[] = "{}%#-+()[]'\"|.,:=~*/ \n\\abcdefghijklmnopqrstuvwxyz0123456789";
  const ordered_json context = ordered_json::parse(kRealContext);
  ChatTemplateOptions options;  // smaller bounds keep each case fast
  options.limits.max_steps = 200000;
  options.limits.max_output_bytes = 1 << 20;
  int rendered = 0, refused = 0;
  for (int round = 0; round < 3000; ++round) {
    std::string t = base;
    const int edits = 1 + static_cast<int>(rng() % 8);
    for (int k = 0; k < edits && !t.empty(); ++k) {
      const size_t at = rng() % t.size();
      switch (rng() % 4) {
        case 0:
          t[at] = alphabet[rng() % (sizeof(alphabet) - 1)];
          break;  // replace
        case 1:
          t.erase(at, 1 + rng() % 16);
          break;  // delete a run
        case 2:
          t.insert(at, 1, static_cast<char>(rng() % 256));
          break;  // insert any byte
        default:
          t.insert(at, t.substr(rng() % t.size(), rng() % 64));
          break;  // duplicate a piece
      }
    }
    try {
      render_chat_template(t, context, options);
      ++rendered;
    } catch (const Error&) {
      ++refused;
    }
  }
  EXPECT_GT(refused, 0);
  EXPECT_GT(rendered, 0);
}

// --- where templates come from -------------------------------------------------------------------------

TEST(JinjaLoader, GgufNamedTemplates) {
  GgufWriter w;
  w.add_string("tokenizer.chat_template", "main {{ x }}");
  w.add_string("tokenizer.chat_template.tool_use", "tools {{ x }}");
  const std::vector<uint8_t> bytes = w.to_bytes();
  const auto file = GgufFile::from_memory(bytes.data(), bytes.size(), "t.gguf");
  const auto templates = chat_templates_from_gguf(*file);
  ASSERT_EQ(templates.size(), 2u);
  EXPECT_EQ(select_chat_template(templates, "", "t.gguf").source, "main {{ x }}");
  EXPECT_EQ(select_chat_template(templates, "tool_use", "t.gguf").source, "tools {{ x }}");
  try {
    select_chat_template(templates, "rag", "t.gguf");
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "there are: default, tool_use")) << e.what();
  }
}

TEST(JinjaLoader, HuggingFaceFolder) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("microspec_jinja_hf_" + std::to_string(::getpid()));
  fs::create_directories(dir / "additional_chat_templates");
  std::ofstream(dir / "tokenizer_config.json")
      << R"({"chat_template": [{"name": "default", "template": "d"}, {"name": "rag", "template": "r"}]})";
  std::ofstream(dir / "additional_chat_templates" / "tool_use.jinja") << "t";
  const auto templates = chat_templates_from_hf_folder(dir.string());
  EXPECT_EQ(select_chat_template(templates, "", "dir").source, "d");
  EXPECT_EQ(select_chat_template(templates, "rag", "dir").source, "r");
  EXPECT_EQ(select_chat_template(templates, "tool_use", "dir").source, "t");
  fs::remove(dir / "tokenizer_config.json");
  std::ofstream(dir / "chat_template.jinja") << "from jinja file";
  EXPECT_EQ(select_chat_template(chat_templates_from_hf_folder(dir.string()), "", "dir").source,
            "from jinja file");
  fs::remove_all(dir);
}

TEST(JinjaLoader, TemplateTime) {
  const TemplateTime t = parse_template_time("2025-01-02T03:04:05");
  EXPECT_EQ(t.year, 2025);
  EXPECT_EQ(t.second, 5);
  ChatTemplateOptions options;
  options.now = t;
  EXPECT_EQ(
      render_chat_template("{{ strftime_now('%Y-%m-%d %H:%M:%S %A') }}", ordered_json::object(), options),
      "2025-01-02 03:04:05 Thursday");
  EXPECT_THROW(parse_template_time("yesterday"), Error);
}

}  // namespace
}  // namespace microspec
