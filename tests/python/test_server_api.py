"""`microspec serve` through the official `openai` Python client.

Greedy answers, streamed and not, with speculative decoding on (the server's default here: self-
drafting with the dynamic draft vocabulary) and off (per request), must equal `microspec generate
--json` for the same prompts: chat prompts against `--chat`, plain prompts against plain prompts.
Also: stop strings, seeded sampling (equal to the CLI with the same seed), the usage extension,
/v1/models, /metrics, and API errors surfacing as the client's exception types. One Gemma check.
"""
import json
import math

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


# Log-probabilities: greedy, the log-softmax of the raw logits row each token was chosen from; sampled,
# the distribution it was drawn from (docs/server.md).
LOGPROB_PROMPT = CHAT_PROMPTS[1]


def chat_logprobs(client, spec, stream, top=5, max_tokens=24):
    """A greedy chat answer with logprobs: (text, [content entries as dicts], completion tokens)."""
    kw = dict(max_tokens=max_tokens, logprobs=True, top_logprobs=top, extra_body=None if spec else SPEC_OFF)
    if not stream:
        r = chat(client, LOGPROB_PROMPT, **kw)
        return (r.choices[0].message.content, [e.model_dump() for e in r.choices[0].logprobs.content],
                r.usage.completion_tokens)
    text, entries, usage = "", [], None
    for chunk in chat(client, LOGPROB_PROMPT, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.logprobs is not None and c.logprobs.content:
                entries += [e.model_dump() for e in c.logprobs.content]
    return text, entries, usage


def test_chat_logprobs_speculative_equal_plain_bit_for_bit(client):
    plain = chat_logprobs(client, spec=False, stream=False)
    text, entries, n = plain
    assert len(entries) == n > 0
    assert "".join(e["token"] for e in entries) == text
    for e in entries:
        assert bytes(e["bytes"]).decode("utf-8", errors="replace") == e["token"]
        tops = e["top_logprobs"]
        assert len(tops) == 5
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
        # Greedy: the chosen token is the most likely one, with the same value.
        assert tops[0]["token"] == e["token"] and tops[0]["logprob"] == e["logprob"] <= 0.0
        assert sum(2.718281828459045 ** t["logprob"] for t in tops) <= 1.0 + 1e-5
    # Speculative (self-drafting), streamed or not, and plain streamed: the same floats exactly.
    assert chat_logprobs(client, spec=True, stream=False) == plain
    assert chat_logprobs(client, spec=True, stream=True) == plain
    assert chat_logprobs(client, spec=False, stream=True) == plain
    # Without top_logprobs: the chosen tokens' values alone, the same again.
    _, bare, _ = chat_logprobs(client, spec=True, stream=False, top=None)
    assert [(e["token"], e["logprob"], e["top_logprobs"]) for e in bare] == \
        [(e["token"], e["logprob"], []) for e in entries]


def test_completions_logprobs_legacy_shape(client):
    def run(spec, stream):
        kw = dict(model="smollm2", prompt=TEXT_PROMPTS[0], max_tokens=20, temperature=0, logprobs=3,
                  extra_body=None if spec else SPEC_OFF)
        if not stream:
            c = client.completions.create(**kw).choices[0]
            lp = c.logprobs
            return c.text, lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset
        text, tokens, values, tops, offsets = "", [], [], [], []
        for chunk in client.completions.create(stream=True, **kw):
            for c in chunk.choices:
                text += c.text
                if c.logprobs is not None:
                    tokens += c.logprobs.tokens
                    values += c.logprobs.token_logprobs
                    tops += c.logprobs.top_logprobs
                    offsets += c.logprobs.text_offset
        return text, tokens, values, tops, offsets

    text, tokens, values, tops, offsets = run(spec=False, stream=False)
    assert "".join(tokens) == text and len(tokens) == 20
    assert offsets == [sum(len(t.encode()) for t in tokens[:i]) for i in range(len(tokens))]
    for tok, value, top in zip(tokens, values, tops):
        assert len(top) == 3 and max(top.values()) == value and top[tok] == value
    assert run(spec=True, stream=False) == (text, tokens, values, tops, offsets)
    assert run(spec=True, stream=True) == (text, tokens, values, tops, offsets)
    assert run(spec=False, stream=True) == (text, tokens, values, tops, offsets)


@pytest.mark.parametrize("spec", [False, True])
def test_sampled_logprobs_are_those_of_the_distribution_drawn_from(client, spec):
    """A sampled answer reports each token's log-probability in the distribution it was drawn from
    (top-k 3, top-p off, temperature 1.5): at most 3 alternatives, which are that whole
    distribution (their probabilities sum to 1), and the drawn token is one of them with the same
    value. The raw row's values would sum to less than 1 over 3 of 49,152 tokens."""
    body = {"top_k": 3, "top_p": 1.0, **({} if spec else SPEC_OFF)}
    r = chat(client, LOGPROB_PROMPT, max_tokens=16, temperature=1.5, seed=7, logprobs=True, top_logprobs=5,
             extra_body=body)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens > 0
    for e in content:
        tops = {t.token: t.logprob for t in e.top_logprobs}
        assert 1 <= len(e.top_logprobs) <= 3, e
        assert tops[e.token] == e.logprob <= 0.0, e
        assert abs(sum(math.exp(v) for v in tops.values()) - 1.0) < 1e-4, e


@pytest.mark.parametrize("body, param", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": 3}, "logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1}, "frequency_penalty"),
    ({"repeat_penalty": 1.1, "repeat_last_n": 64}, "repeat_penalty"),
    ({"min_p": 0.05}, "min_p"),
    ({"logit_bias": {"42": 5}}, "logit_bias"),
    ({"n": 2}, "n"),
    ({"typical_p": 0.9}, "typical_p"),
    ({"mirostat": 2}, "mirostat"),
    ({"n_probs": 3}, "n_probs"),
    ({"repeat_last_n": -5}, "repeat_last_n"),
])
def test_unimplemented_sampling_fields_are_refused(server, body, param):
    status, _, answer = http(server, "POST", "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body})
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer


def test_neutral_sampling_fields_are_accepted(client):
    """What clients send when they mean "off" is accepted (llama.cpp's web UI sends all of these)."""
    r = chat(client, "hi", max_tokens=2, presence_penalty=0, frequency_penalty=0, n=1, logit_bias={},
             extra_body={"repeat_penalty": 1.0, "repeat_last_n": 64, "min_p": 0, "typical_p": 1, "mirostat": 0,
                         "n_probs": 0})
    assert r.choices[0].finish_reason in ("length", "stop")


def test_tokenize_and_detokenize_round_trip_like_the_cli(server):
    import subprocess
    from repo_paths import BIN
    text = "Hello world, <|im_start|> naïve café 🙂"
    cli = subprocess.run([BIN, "tokenize", "-m", str(SMOLLM2), "-p", text, "--json"], capture_output=True, text=True,
                         timeout=120)
    assert cli.returncode == 0, cli.stderr
    want = json.loads(cli.stdout)
    status, _, answer = http(server, "POST", "/tokenize", {"content": text, "add_special": True})
    assert status == 200 and answer["tokens"] == want
    assert 1 in want  # <|im_start|> parsed as the control token by default, as the CLI does
    status, _, answer = http(server, "POST", "/detokenize", {"tokens": want})
    assert status == 200 and answer["content"] == text
    status, _, pieces = http(server, "POST", "/tokenize", {"content": text, "with_pieces": True,
                                                           "parse_special": False})
    assert status == 200 and 1 not in [p["id"] for p in pieces["tokens"]]
    joined = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode()
                      for p in pieces["tokens"])
    assert joined.decode() == text
    for bad, param in [({}, "content"), ({"content": 5}, "content"), ({"content": "x", "with_pieces": "yes"},
                                                                        "with_pieces")]:
        status, _, answer = http(server, "POST", "/tokenize", bad)
        assert status == 400 and answer["error"]["param"] == param
    status, _, answer = http(server, "POST", "/detokenize", {"tokens": [1, 49152]})
    assert status == 400 and answer["error"]["param"] == "tokens[1]"


def test_models_metadata(client):
    m = client.models.retrieve("smollm2-135m-instruct-q4_1").model_dump()
    assert m["meta"]["n_vocab"] == 49152 and m["meta"]["n_ctx_train"] == 8192 and m["meta"]["n_embd"] == 576
    assert 100e6 < m["meta"]["n_params"] < 200e6 and m["meta"]["size"] > 0
    assert m["microspec"]["n_ctx"] == 4096 and m["microspec"]["architecture"] == "llama"


def test_latency_histograms_count_requests(server, client):
    before = metrics(server)
    chat(client, CHAT_PROMPTS[0], max_tokens=8)
    stream_chat(client, CHAT_PROMPTS[0], max_tokens=8)
    after = metrics(server)
    for name in ("microspec_time_to_first_token_seconds", "microspec_inter_token_latency_seconds",
                 "microspec_request_duration_seconds"):
        assert after[f'{name}_bucket{{le="+Inf"}}'] == after[f"{name}_count"]
        assert after[f"{name}_count"] - before.get(f"{name}_count", 0) == 2, name
        assert after[f"{name}_sum"] > before.get(f"{name}_sum", 0)
        buckets = [v for k, v in after.items() if k.startswith(name + "_bucket")]
        assert buckets == sorted(buckets)  # cumulative
