"""microspec's Jinja interpreter (src/chat_template/) against Python's jinja2, configured as transformers
configures it for chat templates, on every template llama.cpp ships in models/templates (from the
llama-cpp-python 0.3.36 sdist, fetched by scripts/fetch_llama_cpp_sdist.sh).

The oracle mirrors transformers' `_compile_jinja_template` and `render_jinja_template`:
ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True) with loop controls and a
`{% generation %}` tag rendered as a call block (transformers' AssistantTracker when no assistant
mask is asked for); the globals raise_exception and strftime_now (here at a fixed date); the tojson
filter json.dumps(x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys);
and the variables messages, tools (None when there are none), documents (None),
add_generation_prompt, bos_token and eos_token.

Every template renders every conversation with both engines (microspec: one `microspec template
--batch-jsonl` process per template). Where jinja2 renders, microspec must give the same text byte
for byte; where jinja2 raises (the template rejects the conversation), microspec must fail too. A
template may be left out only by naming it in SKIPPED with the reason."""
import datetime
import json
import subprocess

import jinja2
import jinja2.ext
import jinja2.nodes
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from repo_paths import BIN, llama_cpp_templates

DATE = "2024-07-26"
BOS, EOS = "<s>", "</s>"

# Templates left out, with the reason. The test fails for any other template that does not match.
SKIPPED = {}


TEMPLATE_DIR = llama_cpp_templates()
TEMPLATES = sorted(p.name for p in TEMPLATE_DIR.glob("*.jinja"))


# --- the oracle: jinja2 as transformers sets it up ----------------------------------------------------

class _GenerationTag(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: a call block whose method returns the body unchanged."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


def _environment():
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.strptime(DATE, "%Y-%m-%d").strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


ENV = _environment()


def _jinja2_renderer(source):
    """A function from a context to (text, None) or (None, the exception's text)."""
    try:
        template = ENV.from_string(source)
    except Exception as e:  # noqa: BLE001 - a template jinja2 cannot compile fails every render
        message = f"{type(e).__name__}: {e}"
        return lambda context: (None, message)

    def render(context):
        try:
            return template.render(**context), None
        except Exception as e:  # noqa: BLE001 - any failure of the template is an expected outcome
            return None, f"{type(e).__name__}: {e}"
    return render


def _jinja2_render(source, context):
    return _jinja2_renderer(source)(context)


# --- the conversations ---------------------------------------------------------------------------------

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "The city, e.g. \"Paris\""},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "description": "How many days ahead"},
            },
            "required": ["location"],
        },
    },
}, {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"},
            "sites": {"type": "array", "items": {"type": "string"}, "description": "Only these sites"},
            "max_results": {"type": ["integer", "null"], "default": 5},
        }, "required": ["query"]},
    },
}]

SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly."}
USER = {"role": "user", "content": "What's the weather like in \"Paris\" today? Ünïcödé: 東京 🌧\n  Thanks!"}
ASSISTANT = {"role": "assistant", "content": "It is sunny and 24 °C in Paris."}
USER_2 = {"role": "user", "content": "And tomorrow?"}
TOOL_CALL = {"role": "assistant", "content": None, "tool_calls": [{
    "id": "call_1", "type": "function",
    "function": {"name": "get_weather", "arguments": {"location": "Paris", "days": 1, "threshold": 0.5,
                                                      "options": {"units": "metric", "sources": ["a<b>", "c&d"]}}},
}]}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
               "content": "{\"temperature\": 21.5, \"sky\": \"cloudy\"}"}
FINAL = {"role": "assistant", "content": "Tomorrow: cloudy, 21.5 °C."}

CONVERSATIONS = {
    "user": [USER],
    "system+user": [SYSTEM, USER],
    "multi-turn": [SYSTEM, USER, ASSISTANT, USER_2],
    "multi-turn, no system": [USER, ASSISTANT, USER_2],
    "tool call": [SYSTEM, USER, TOOL_CALL, TOOL_RESULT],
    "tool call and answer": [SYSTEM, USER, TOOL_CALL, TOOL_RESULT, FINAL, USER_2],
}


def _contexts():
    """(label, context) pairs: every conversation with and without a generation prompt, with tools
    where the conversation calls them; plus one render where tools and documents are not defined."""
    out = []
    for label, messages in CONVERSATIONS.items():
        tools = TOOLS if "tool" in label else None
        for add_generation_prompt in (True, False):
            out.append((f"{label}, add_generation_prompt={add_generation_prompt}", {
                "messages": messages, "tools": tools, "documents": None,
                "add_generation_prompt": add_generation_prompt, "bos_token": BOS, "eos_token": EOS}))
    out.append(("user, tools and documents undefined", {
        "messages": [SYSTEM, USER], "add_generation_prompt": True, "bos_token": BOS, "eos_token": EOS}))
    out.append(("system+user with tools offered", {
        "messages": [SYSTEM, USER], "tools": TOOLS, "documents": None, "add_generation_prompt": True,
        "bos_token": BOS, "eos_token": EOS}))
    # Variables some templates read besides the usual ones: firefunction-v2's `functions` (a JSON
    # string) and `datetime`, Qwen 3's and others' enable_thinking.
    out.append(("tool call and answer, functions given", {
        "messages": CONVERSATIONS["tool call and answer"], "tools": TOOLS, "documents": None,
        "functions": json.dumps([t["function"] for t in TOOLS], indent=2), "datetime": "2024-07-26 12:00",
        "add_generation_prompt": True,
        "bos_token": BOS, "eos_token": EOS}))
    out.append(("multi-turn, enable_thinking=False", {
        "messages": CONVERSATIONS["multi-turn"], "tools": None, "documents": None, "enable_thinking": False,
        "add_generation_prompt": True, "bos_token": BOS, "eos_token": EOS}))
    return out


CONTEXTS = _contexts()


def _microspec_render_all(path, contexts):
    """microspec's result for each context: (text, None) or (None, error)."""
    lines = "".join(json.dumps(c, ensure_ascii=False) + "\n" for _, c in contexts)
    proc = subprocess.run([BIN, "template", "--template", str(path), "--batch-jsonl", "-", "--date", DATE],
                          input=lines.encode(), capture_output=True, timeout=60)
    if proc.returncode != 0:  # the template itself does not parse: every render fails
        return [(None, proc.stderr.decode(errors="replace").strip())] * len(contexts)
    replies = [json.loads(line) for line in proc.stdout.decode().splitlines()]
    assert len(replies) == len(contexts), proc.stdout
    return [(r.get("text"), r.get("error")) for r in replies]


def _first_difference(expected, got):
    i = next((k for k in range(min(len(expected), len(got))) if expected[k] != got[k]), min(len(expected), len(got)))
    return (f"first difference at offset {i}:\n  jinja2:    {expected[max(0, i - 80):i + 80]!r}\n"
            f"  microspec: {got[max(0, i - 80):i + 80]!r}")


def test_the_templates_are_there():
    assert len(TEMPLATES) >= 70, f"only {len(TEMPLATES)} templates under {TEMPLATE_DIR}"
    assert set(SKIPPED) <= set(TEMPLATES), f"SKIPPED names unknown templates: {set(SKIPPED) - set(TEMPLATES)}"


@pytest.mark.parametrize("name", TEMPLATES)
def test_template_matches_jinja2(name):
    if name in SKIPPED:
        pytest.skip(SKIPPED[name])
    path = TEMPLATE_DIR / name
    source = path.read_text(encoding="utf-8")
    ours = _microspec_render_all(path, CONTEXTS)
    oracle = _jinja2_renderer(source)
    failures = []
    for (label, context), (text, error) in zip(CONTEXTS, ours):
        expected, expected_error = oracle(context)
        if expected_error is not None:
            if error is None:
                failures.append(f"[{label}] jinja2 raised ({expected_error}) but microspec rendered {text[:200]!r}")
        elif error is not None:
            failures.append(f"[{label}] jinja2 rendered but microspec failed: {error}")
        elif text != expected:
            failures.append(f"[{label}] {_first_difference(expected, text)}")
    assert not failures, f"{name}: {len(failures)} of {len(CONTEXTS)} renders differ\n" + "\n".join(failures)


def test_single_render_command_line(tmp_path):
    """The plain command line: --messages, --tools and --add-generation-prompt, printed as is."""
    name = "Qwen-Qwen2.5-7B-Instruct.jinja"
    messages, tools = tmp_path / "messages.json", tmp_path / "tools.json"
    messages.write_text(json.dumps([SYSTEM, USER, TOOL_CALL, TOOL_RESULT]), encoding="utf-8")
    tools.write_text(json.dumps(TOOLS), encoding="utf-8")
    out = subprocess.run([BIN, "template", "--template", str(TEMPLATE_DIR / name), "--messages", str(messages),
                          "--tools", str(tools), "--add-generation-prompt", "--date", DATE,
                          "--bos-token", BOS, "--eos-token", EOS], capture_output=True, check=True, timeout=60)
    expected, error = _jinja2_render((TEMPLATE_DIR / name).read_text(encoding="utf-8"), {
        "messages": [SYSTEM, USER, TOOL_CALL, TOOL_RESULT], "tools": TOOLS, "documents": None,
        "add_generation_prompt": True, "bos_token": BOS, "eos_token": EOS})
    assert error is None
    assert out.stdout.decode() == expected


def test_raise_exception_fails_the_command(tmp_path):
    """A conversation the template rejects: non-zero exit and the template's own message."""
    tmpl = tmp_path / "t.jinja"
    tmpl.write_text("{% if messages[0].role != 'user' %}{{ raise_exception('first message must be the user') }}"
                    "{% endif %}ok", encoding="utf-8")
    messages = tmp_path / "m.json"
    messages.write_text(json.dumps([ASSISTANT]), encoding="utf-8")
    proc = subprocess.run([BIN, "template", "--template", str(tmpl), "--messages", str(messages)],
                          capture_output=True, timeout=60)
    assert proc.returncode != 0
    assert "first message must be the user" in proc.stderr.decode()


def test_model_file_template_and_tokens():
    """-m: the GGUF's own template with the tokenizer's BOS / EOS text."""
    from repo_paths import MODELS
    model = MODELS["smollm2"]
    if not model.exists():
        pytest.skip(f"{model} missing (scripts/fetch_models.sh)")
    import gguf
    reader = gguf.GGUFReader(str(model))
    field = reader.fields["tokenizer.chat_template"]
    source = bytes(field.parts[field.data[0]]).decode("utf-8")
    tokens = reader.fields["tokenizer.ggml.tokens"]
    def token(key):
        f = reader.fields[key]
        return bytes(tokens.parts[tokens.data[int(f.parts[f.data[0]][0])]]).decode("utf-8")
    context = {"messages": [SYSTEM, USER], "tools": None, "documents": None, "add_generation_prompt": True,
               "bos_token": token("tokenizer.ggml.bos_token_id"), "eos_token": token("tokenizer.ggml.eos_token_id")}
    expected, error = _jinja2_render(source, context)
    assert error is None
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".json", encoding="utf-8") as f:
        json.dump([SYSTEM, USER], f)
        f.flush()
        out = subprocess.run([BIN, "template", "-m", str(model), "--messages", f.name, "--add-generation-prompt",
                              "--date", DATE], capture_output=True, check=True, timeout=60)
    assert out.stdout.decode() == expected
