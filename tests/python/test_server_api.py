"""`microspec serve` through the official `openai` Python client.

Greedy answers, streamed and not, with speculative decoding on (the server's default here: self-
drafting with the dynamic draft vocabulary) and off (per request), must equal `microspec generate
--json` for the same prompts: chat prompts against `--chat`, plain prompts against plain prompts.
Also: stop strings, seeded sampling (equal to the CLI with the same seed), the usage extension,
/v1/models, /metrics, and API errors surfacing as the client's exception types. One Gemma check.
"""
import json

import openai
import pytest

from server_helpers import GEMMA, SMOLLM2, SPEC_ARGS, ServerProcess, cli_generate, http, metrics

CHAT_PROMPTS = [
    "Write a haiku about rain.",
    "What is the capital of France? Answer in one sentence.",
    "List three uses of a paperclip.",
]
TEXT_PROMPTS = ["The capital of France is", "def fibonacci(n):\n   "]
N_CHAT = 48
N_TEXT = 32
SPEC_OFF = {"microspec": {"spec": "none"}}


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(SMOLLM2, *SPEC_ARGS, "--parallel", "2")
    yield s
    assert s.terminate() == 0, s.stderr_text()


@pytest.fixture(scope="module")
def client(server):
    # Closed before the server stops, so no idle keep-alive connection delays its exit.
    with openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def cli_chat():
    plain = cli_generate(SMOLLM2, CHAT_PROMPTS, N_CHAT, chat=True)
    spec = cli_generate(SMOLLM2, CHAT_PROMPTS, N_CHAT, chat=True, extra=SPEC_ARGS)
    # The CLI's own speculative run is lossless; the server is compared against both.
    assert [r["tokens"] for r in plain] == [r["tokens"] for r in spec]
    return plain


@pytest.fixture(scope="module")
def cli_text():
    return cli_generate(SMOLLM2, TEXT_PROMPTS, N_TEXT, chat=False)


def chat(client, prompt, **kw):
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": prompt}], **kw)


def stream_chat(client, prompt, **kw):
    """Streams a chat answer: (text, finish_reason, usage dict or None, number of content chunks)."""
    text, finish, usage, pieces = "", None, None, 0
    stream = chat(client, prompt, stream=True, stream_options={"include_usage": True}, **kw)
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for c in chunk.choices:
            if c.delta.content:
                text += c.delta.content
                pieces += 1
            if c.finish_reason:
                finish = c.finish_reason
    return text, finish, usage, pieces


@pytest.mark.parametrize("spec", [True, False], ids=["spec", "plain"])
def test_chat_greedy_equals_cli(client, cli_chat, spec):
    for prompt, want in zip(CHAT_PROMPTS, cli_chat):
        r = chat(client, prompt, max_tokens=N_CHAT, extra_body=None if spec else SPEC_OFF)
        assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == want["text"], prompt
        assert r.choices[0].finish_reason == want["finish_reason"]
        u = r.usage.model_dump()
        assert u["prompt_tokens"] == want["prompt_tokens"]
        assert u["completion_tokens"] == len(want["tokens"])
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        ext = u["microspec"]
        assert ext["speculative"] is spec
        if spec:
            assert ext["spec_mode"] == "self" and ext["draft_vocab"] == "dynamic"
            assert ext["steps"] > 0 and 1.0 <= ext["mean_acceptance_length"] <= 1 + ext["drafted_tokens"]
            assert 0 < ext["mean_active_vocab"] < 49152
        else:
            assert "steps" not in ext and ext["note"] == "speculative decoding turned off by the request"


@pytest.mark.parametrize("spec", [True, False], ids=["spec", "plain"])
def test_chat_stream_equals_cli(client, cli_chat, spec):
    for prompt, want in zip(CHAT_PROMPTS, cli_chat):
        text, finish, usage, pieces = stream_chat(client, prompt, max_tokens=N_CHAT,
                                                  extra_body=None if spec else SPEC_OFF)
        assert text == want["text"] and finish == want["finish_reason"]
        assert pieces > 1  # really streamed, not one block
        assert usage["completion_tokens"] == len(want["tokens"])
        assert usage["microspec"]["speculative"] is spec


@pytest.mark.parametrize("spec", [True, False], ids=["spec", "plain"])
def test_completions_equal_cli(client, cli_text, spec):
    extra = None if spec else SPEC_OFF
    for prompt, want in zip(TEXT_PROMPTS, cli_text):
        r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=N_TEXT, temperature=0,
                                      extra_body=extra)
        assert r.object == "text_completion" and r.id.startswith("cmpl-")
        assert r.choices[0].text == want["text"] and r.choices[0].finish_reason == want["finish_reason"]
        assert r.usage.prompt_tokens == want["prompt_tokens"]
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="smollm2", prompt=prompt, max_tokens=N_TEXT, temperature=0, stream=True, extra_body=extra)
            if c.choices)
        assert streamed == want["text"]
    # A prompt given as token ids is used as is.
    r = client.completions.create(model="smollm2", prompt=cli_text[0]["prompt_ids"], max_tokens=N_TEXT,
                                  temperature=0, extra_body=extra)
    assert r.choices[0].text == cli_text[0]["text"]


def test_stop_strings(client, cli_chat):
    full = cli_chat[0]["text"]
    words = full.split()
    assert len(words) > 4
    stop = words[3]
    r = chat(client, CHAT_PROMPTS[0], max_tokens=N_CHAT, stop=stop)
    assert r.choices[0].message.content == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    # A list: the earliest match wins; streamed the same.
    stops = ["no such text", words[2], stop]
    want = full[:min(full.index(s) for s in stops if s in full)]
    assert chat(client, CHAT_PROMPTS[0], max_tokens=N_CHAT, stop=stops).choices[0].message.content == want
    text, finish, _, _ = stream_chat(client, CHAT_PROMPTS[0], max_tokens=N_CHAT, stop=stops)
    assert text == want and finish == "stop"
    r = client.completions.create(model="smollm2", prompt=TEXT_PROMPTS[0], max_tokens=N_TEXT, temperature=0,
                                  stop=["\n"])
    assert "\n" not in r.choices[0].text


@pytest.mark.parametrize("spec", [True, False], ids=["spec", "plain"])
def test_seeded_sampling(client, spec):
    prompt = CHAT_PROMPTS[2]
    kw = dict(model="smollm2", messages=[{"role": "user", "content": prompt}], max_tokens=32,
              temperature=0.9, top_p=0.95, extra_body={"top_k": 40, **({} if spec else SPEC_OFF)})
    a = client.chat.completions.create(seed=1234, **kw)
    b = client.chat.completions.create(seed=1234, **kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.model_dump()["microspec"]["speculative"] is spec
    # Same seed and settings as the CLI (speculative sampling draws differently from plain sampling
    # with the same seed, so each is compared with its own CLI run).
    cli_args = ["--temp", "0.9", "--top-p", "0.95", "--top-k", "40", "--seed", "1234"] + (SPEC_ARGS if spec else [])
    want = cli_generate(SMOLLM2, [prompt], 32, chat=True, extra=cli_args)[0]
    assert a.choices[0].message.content == want["text"]
    others = {client.chat.completions.create(seed=s, **kw).choices[0].message.content for s in (1, 2, 3)}
    assert len(others | {a.choices[0].message.content}) > 1


def test_models(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == ["smollm2-135m-instruct-q4_1"]
    assert client.models.retrieve("smollm2-135m-instruct-q4_1").id == "smollm2-135m-instruct-q4_1"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_errors_are_client_exceptions(client):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "hi", max_tokens=8, n=2)
    assert e.value.body["param"] == "n" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "hi", max_tokens=100000)
    assert e.value.body["code"] == "context_length_exceeded" and "4096" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        chat(client, "hi", max_tokens=8, temperature=5)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="smollm2", prompt="x", max_tokens=8, extra_body={"microspec": {"spec": "draft"}})
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="smollm2", prompt="x", max_tokens=8,
                                  extra_body={"microspec": {"draft_vocab": "freq"}})
    with pytest.raises(openai.NotFoundError):
        client.post("/nothing-here", cast_to=object, body={})


def test_metrics(server, client):
    chat(client, CHAT_PROMPTS[0], max_tokens=8)
    with pytest.raises(openai.BadRequestError):
        chat(client, "hi", max_tokens=0)
    m = metrics(server)
    assert m['microspec_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 1
    assert m['microspec_requests_total{endpoint="/v1/chat/completions",status="400"}'] >= 1
    assert m["microspec_completion_tokens_total"] >= 8 and m["microspec_prompt_tokens_total"] > 0
    assert m["microspec_decode_tokens_per_second"] > 0 and m["microspec_decode_seconds_total"] > 0
    assert m["microspec_spec_generations_total"] >= 1
    assert m['microspec_acceptance_length_bucket{le="+Inf"}'] == m["microspec_acceptance_length_count"] >= 1
    assert m["microspec_acceptance_length_sum"] >= m["microspec_acceptance_length_count"]
    assert 0 < m["microspec_draft_vocab_active"] < 49152
    assert m["microspec_slots"] == 2 and m["microspec_slots_busy"] == 0 and m["microspec_queue_depth"] == 0
    assert m['microspec_generations_total{outcome="completed"}'] >= 1
    status, _, health = http(server, "GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["slots"] == 2


def test_gemma_chat_equals_cli():
    prompt = "Explain speculative decoding in two sentences."
    want = cli_generate(GEMMA, [prompt], 40, chat=True)[0]
    s = ServerProcess(GEMMA, *SPEC_ARGS)
    try:
        with openai.OpenAI(base_url=s.url("/v1"), api_key="unused", max_retries=0, timeout=120) as client:
            r = chat(client, prompt, max_tokens=40)
            assert r.choices[0].message.content == want["text"]
            ext = r.usage.model_extra["microspec"]  # the extension as README shows it
            assert ext["speculative"] and ext["mean_acceptance_length"] > 1.0
            text, finish, _, _ = stream_chat(client, prompt, max_tokens=40, extra_body=SPEC_OFF)
            assert text == want["text"] and finish == want["finish_reason"]
    finally:
        assert s.terminate() == 0, s.stderr_text()
