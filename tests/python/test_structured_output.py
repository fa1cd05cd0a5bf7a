"""Structured output: `response_format` (json_object, json_schema) and `generate --json-schema`.

- Lossless: constrained greedy output is identical token for token with and without speculation
  (n-gram, self-draft chain and tree, the EAGLE-3 head with the dynamic vocabulary), on both
  models, and the schema changes the output at all (else the comparison proves nothing).
- Valid: 200 generations through the `openai` client over ten varied schemas, greedy and
  sampled, with speculation in the batching server; every one ends by itself and validates
  against its schema with `jsonschema`.
- Refused: what the compiler cannot express is a 400 naming the keyword.
(The sampled distribution under a grammar is proved in tests/test_spec_sampling_power.cpp.)
"""
import concurrent.futures
import json

import jsonschema
import openai
import pytest

from repo_paths import llama_cpp_templates
from server_helpers import GEMMA, SMOLLM2, SPEC_ARGS, ServerProcess, cli_generate
from spec_bench import first_turns

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
    "skills": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3}},
    "required": ["name", "age", "skills"]}

SPECS = {
    "ngram": ["--spec", "ngram"],
    "self-chain": ["--spec", "self", "--tree-topk", "1"],
    "self-tree": ["--spec", "self", "--tree-depth", "3", "--tree-topk", "2", "--tree-tokens", "8"],
    "head-dynamic": ["--spec", "head", "--draft-vocab", "dynamic"],
}
N_PREDICT = 64


@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("model", [SMOLLM2, GEMMA], ids=["smollm2", "gemma"])
def test_constrained_greedy_is_identical_with_speculation(model, spec):
    prompts = ["Describe a fictional software engineer as JSON."] + first_turns(3)
    schema = ["--json-schema", json.dumps(PERSON)]
    plain = cli_generate(model, prompts, N_PREDICT, chat=True, extra=["--spec", "none", *schema])
    free = cli_generate(model, prompts, N_PREDICT, chat=True, extra=["--spec", "none"])
    assert [r["tokens"] for r in plain] != [r["tokens"] for r in free], "the schema changed nothing"
    got = cli_generate(model, prompts, N_PREDICT, chat=True, extra=[*SPECS[spec], *schema])
    for want, have in zip(plain, got):
        assert have["tokens"] == want["tokens"]
    assert sum(r["spec"]["accepted_draft_tokens"] for r in got) > 0
    for r in plain:  # what ended by itself is valid
        if r["finish_reason"] != "length":
            jsonschema.validate(json.loads(r["text"]), PERSON)


SCHEMAS = [
    PERSON,
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "confidence": {"type": "number"}},
     "required": ["color", "confidence"]},
    {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 2, "maxItems": 3},
    {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 60},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
        "meta": {"type": "object", "properties": {"pages": {"type": "integer"}, "draft": {"type": "boolean"}},
                 "required": ["pages", "draft"]}},
     "required": ["title", "tags", "meta"]},
    {"type": "object", "properties": {"answer": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                                      "reason": {"type": "string", "maxLength": 80}},
     "required": ["answer", "reason"]},
    {"$defs": {"step": {"type": "object", "properties": {"n": {"type": "integer"},
                                                         "text": {"type": "string", "maxLength": 50}},
                        "required": ["n", "text"]}},
     "type": "object", "properties": {"steps": {"type": "array", "items": {"$ref": "#/$defs/step"},
                                                "minItems": 1, "maxItems": 3}},
     "required": ["steps"]},
    {"type": "object", "properties": {"version": {"const": 2}, "ok": {"type": "boolean"}},
     "required": ["version", "ok"]},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                      "kind": {"enum": ["animal", "place", "thing", "idea"]}},
     "required": ["name", "kind"]},
    {"type": "array", "items": {"type": "number"}, "maxItems": 5},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                      "population": {"type": ["integer", "null"]}},
     "required": ["city", "population"]},
]
TOPICS = ["a city", "a book", "a planet", "a recipe", "a sports team", "a river", "a painter", "a bird",
          "a programming language", "a mountain"]


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(SMOLLM2, *SPEC_ARGS, "--parallel", "4")
    yield s
    assert s.terminate() == 0, s.stderr_text()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=300) as c:
        yield c


def response_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_two_hundred_generations_validate_against_their_schemas(client):
    jobs = []
    for i, schema in enumerate(SCHEMAS):
        for j, topic in enumerate(TOPICS):
            for sampled in (False, True):
                jobs.append((schema, f"Answer in JSON. Tell me about {topic}.", sampled, 100 * i + 10 * j))

    def run(job):
        schema, prompt, sampled, seed = job
        r = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": prompt}], max_tokens=256,
            response_format=response_format(schema), temperature=0.8 if sampled else 0, seed=seed)
        return job, r.choices[0]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, jobs))
    assert len(results) == 200
    unfinished = [f"{prompt!r} sampled={sampled} seed={seed}: {choice.message.content!r}"
                  for (schema, prompt, sampled, seed), choice in results if choice.finish_reason != "stop"]
    assert not unfinished, f"{len(unfinished)} generations ran out of tokens:\n" + "\n".join(unfinished)
    for (schema, prompt, sampled, seed), choice in results:
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_gives_objects(client):
    """{"type": "json_object"}: any object. Free-form objects may run past max_tokens (SmolLM2 keeps
    adding keys); those that end must parse as objects, and most do."""
    ended = 0
    for topic in TOPICS[:4]:
        r = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": f"Give {topic} a name, as a JSON object."}],
            max_tokens=120, temperature=0, response_format={"type": "json_object"})
        text = r.choices[0].message.content
        assert text.lstrip().startswith("{"), text
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict), text
            ended += 1
    assert ended >= 2


def test_llama_cpp_json_schema_field_and_plain_completions(client, server):
    import urllib.request
    body = {"prompt": "A JSON list of three prime numbers:", "max_tokens": 40, "temperature": 0,
            "json_schema": {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 3}}
    req = urllib.request.Request(server.url("/v1/completions"), data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        answer = json.loads(resp.read())
    text = answer["choices"][0]["text"]
    value = json.loads(text)
    assert isinstance(value, list) and len(value) == 3 and all(isinstance(x, int) for x in value), text


def test_properties_come_in_the_schemas_order(client):
    schema = {"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "integer"}},
              "required": ["zeta", "alpha"]}
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Two numbers."}],
                                       max_tokens=40, temperature=0, response_format=response_format(schema))
    text = r.choices[0].message.content
    assert text.index('"zeta"') < text.index('"alpha"'), text


def test_unsupported_schema_is_a_400_naming_the_keyword(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "x"}], max_tokens=8,
            response_format=response_format({"type": "object", "properties": {"d": {"type": "string",
                                                                                   "format": "date"}}}))
    assert "'format'" in str(e.value) and "#/properties/d" in str(e.value)


# --- Tools -------------------------------------------------------------------------------------
# SmolLM2 writes ChatML, as Qwen 2.5 does: served with Qwen 2.5's template (from the llama.cpp
# sources the setup fetched), which renders tools and teaches the <tool_call> syntax.
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                        "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two numbers",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                       "required": ["a", "b"]}}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTIONS = ["What is the weather in Paris?", "Add 17 and 25.", "Is it raining in Tokyo right now?",
             "What is 3.5 plus 4?"]


@pytest.fixture(scope="module")
def tool_client():
    s = ServerProcess(SMOLLM2, *SPEC_ARGS, "--chat-template", llama_cpp_templates() / "Qwen-Qwen2.5-7B-Instruct.jinja")
    with openai.OpenAI(base_url=s.url("/v1"), api_key="unused", max_retries=0, timeout=300) as c:
        yield c
    assert s.terminate() == 0, s.stderr_text()


def ask(client, question, **kw):
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                          tools=TOOLS, max_tokens=96, **kw)


def check_calls(message):
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_required_and_named_tool_choice_give_valid_calls(tool_client):
    for q in QUESTIONS:
        r = ask(tool_client, q, tool_choice="required", parallel_tool_calls=False)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
        assert choice.message.content is None
        check_calls(choice.message)
        named = ask(tool_client, q, tool_choice={"type": "function", "function": {"name": "add"}},
                    parallel_tool_calls=False, temperature=0.7, seed=5)
        assert [c.function.name for c in named.choices[0].message.tool_calls] == ["add"]
        check_calls(named.choices[0].message)


def test_auto_answers_text_or_valid_calls_and_none_never_calls(tool_client):
    for q in QUESTIONS:
        auto = ask(tool_client, q).choices[0]
        if auto.message.tool_calls:
            check_calls(auto.message)
        else:
            assert auto.message.content and "<tool_call>" not in auto.message.content
        none = ask(tool_client, q, tool_choice="none").choices[0]
        assert not none.message.tool_calls


def test_tool_calls_are_identical_with_and_without_speculation(tool_client):
    for q in QUESTIONS:
        spec = ask(tool_client, q, tool_choice="required")
        plain = ask(tool_client, q, tool_choice="required", extra_body={"microspec": {"spec": "none"}})
        assert spec.usage.model_extra["microspec"]["speculative"]
        assert [(c.function.name, c.function.arguments) for c in spec.choices[0].message.tool_calls] == \
            [(c.function.name, c.function.arguments) for c in plain.choices[0].message.tool_calls]
        assert spec.choices[0].message.content == plain.choices[0].message.content


def test_a_tool_round_trip_renders(tool_client):
    r = tool_client.chat.completions.create(model="smollm2", max_tokens=24, temperature=0, tools=TOOLS, messages=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}])
    assert r.choices[0].message.content


def test_tool_requests_that_cannot_be_served_are_400s(tool_client, client):
    with pytest.raises(openai.BadRequestError) as e:  # SmolLM2's built-in template renders no tools
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "x"}], tools=TOOLS)
    assert "does not render tools" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        ask(tool_client, "x", tool_choice={"type": "function", "function": {"name": "nope"}})
    assert "nope" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        ask(tool_client, "x", stream=True)
    assert "streaming" in str(e.value).lower()
    with pytest.raises(openai.BadRequestError) as e:
        ask(tool_client, "x", response_format={"type": "json_object"})
    assert "response_format" in str(e.value)
