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
        chat(client, "hi", max_tokens=8, n=17)
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
    # Penalties and filters are implemented; values out of their ranges are refused.
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repeat_penalty": 0}, "repeat_penalty"),
    ({"repeat_penalty": -1.1}, "repeat_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"logit_bias": {"42": 101}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"42": "x"}}, "logit_bias.42"),
    ({"logit_bias": [[42]]}, "logit_bias"),
    ({"logit_bias": [[42, True]]}, "logit_bias"),
    ({"logit_bias": [[49152, 1]]}, "logit_bias"),
    ({"logit_bias": [["", 1]]}, "logit_bias"),
    ({"logit_bias": [[4.5, 1]]}, "logit_bias"),
    ({"logit_bias": "x"}, "logit_bias"),
    ({"n": 17}, "n"),
    ({"n": 0}, "n"),
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


PENALTY_PROMPT = "List ten fruits, one per line."


def test_penalties_through_the_openai_client(client):
    """presence/frequency penalties and logit_bias as OpenAI fields, repeat_penalty and min_p via
    extra_body: greedy answers with speculation equal those without it, equal the CLI with the same
    flags, and differ from the unpenalised answer."""
    kw = dict(max_tokens=40, presence_penalty=0.4, frequency_penalty=0.5, logit_bias={"28": 2.0})
    llama = {"repeat_penalty": 1.3, "repeat_last_n": 64, "min_p": 0.05}
    spec = chat(client, PENALTY_PROMPT, extra_body=llama, **kw)
    plain = chat(client, PENALTY_PROMPT, extra_body={**llama, **SPEC_OFF}, **kw)
    assert spec.usage.model_extra["microspec"]["speculative"] is True
    assert spec.choices[0].message.content == plain.choices[0].message.content
    unpenalised = chat(client, PENALTY_PROMPT, max_tokens=40)
    assert spec.choices[0].message.content != unpenalised.choices[0].message.content
    cli = cli_generate(SMOLLM2, [PENALTY_PROMPT], 40, chat=True,
                       extra=["--presence-penalty", "0.4", "--frequency-penalty", "0.5", "--logit-bias", "28+2",
                              "--repeat-penalty", "1.3", "--repeat-last-n", "64", "--min-p", "0.05"])[0]
    assert spec.choices[0].message.content == cli["text"]


def test_penalties_under_continuous_batching(client):
    """Concurrent requests with different penalties (speculative and plain, sharing the batched
    forward passes) each get the answer they get alone: the counts are per sequence."""
    from concurrent.futures import ThreadPoolExecutor
    asks = [dict(frequency_penalty=0.8, extra_body={"repeat_penalty": 1.2}),
            dict(presence_penalty=1.0, extra_body={**SPEC_OFF, "repeat_penalty": 1.5, "repeat_last_n": -1}),
            dict(logit_bias={"28": 3}, extra_body={"min_p": 0.1}),
            dict(frequency_penalty=-0.5, extra_body=SPEC_OFF)]
    run = lambda kw: chat(client, PENALTY_PROMPT, max_tokens=32, **kw).choices[0].message.content
    alone = [run(kw) for kw in asks]
    assert len(set(alone)) >= 3, alone  # different answers: mixing up counts would show
    with ThreadPoolExecutor(len(asks)) as pool:
        together = list(pool.map(run, asks))
    assert together == alone


def test_llama_cpp_logit_bias_arrays(server, client):
    """llama.cpp's logit_bias shape, [[token id or text, bias or false], ...]: an id pair equals
    OpenAI's object; a text biases each of its tokens; false bans them (-infinity)."""
    obj = chat(client, PENALTY_PROMPT, max_tokens=16, logit_bias={"28": 2.0})
    arr = chat(client, PENALTY_PROMPT, max_tokens=16, extra_body={"logit_bias": [[28, 2.0]]})
    assert arr.choices[0].message.content == obj.choices[0].message.content
    plain = chat(client, PENALTY_PROMPT, max_tokens=16, logprobs=True)
    first = plain.choices[0].logprobs.content[0].token
    status, _, ids = http(server, "POST", "/tokenize", {"content": first})
    assert status == 200 and ids["tokens"], ids
    banned = chat(client, PENALTY_PROMPT, max_tokens=16, logprobs=True, top_logprobs=5,
                  extra_body={"logit_bias": [[first, False]]})
    for entry in banned.choices[0].logprobs.content:
        assert entry.token != first
        assert first not in [alt.token for alt in entry.top_logprobs]  # never among the alternatives either
    by_id = chat(client, PENALTY_PROMPT, max_tokens=16, extra_body={"logit_bias": [[i, False] for i in ids["tokens"]]})
    assert by_id.choices[0].message.content == banned.choices[0].message.content


@pytest.mark.parametrize("spec", [True, False], ids=["spec", "plain"])
def test_logit_bias_forces_a_token_and_logprobs_are_penalised(client, spec):
    """A +100 bias makes one token certain: every generated token is it, and its reported
    log-probability (of the biased distribution, not the raw row) is 0."""
    r = chat(client, PENALTY_PROMPT, max_tokens=6, logit_bias={"330": 100}, logprobs=True, top_logprobs=2,
             extra_body=None if spec else SPEC_OFF)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    assert all(e.token == content[0].token and abs(e.logprob) < 1e-3 for e in content), content


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


# Several choices (n > 1): choice i is the same request with n = 1 and seed + i, token for token,
# plain and speculative, streamed and not; plain choices after the first take the prompt's cache
# rows from the previous choice (microspec_prompt_tokens_prefilled_total grows by the prompt once,
# plus one recomputed row per further choice).
N_CHOICES_PROMPT = "Name a colour and a fruit."


def streamed_choices(client, n, **kw):
    """Streams a chat answer with n choices: ([text per choice], [finish per choice], usage dict)."""
    texts, finishes, usage, roles = [""] * n, [None] * n, None, [0] * n
    for chunk in chat(client, N_CHOICES_PROMPT, n=n, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            assert not chunk.choices and all(finishes), "the usage chunk comes last"
            usage = chunk.usage.model_dump()
        for c in chunk.choices:
            assert finishes[c.index] is None, "nothing after a choice's finish_reason chunk"
            roles[c.index] += c.delta.role == "assistant"
            texts[c.index] += c.delta.content or ""
            finishes[c.index] = c.finish_reason
    assert roles == [1] * n
    return texts, finishes, usage


@pytest.mark.parametrize("spec", [True, False], ids=["spec", "plain"])
def test_several_choices_are_the_requests_with_derived_seeds(client, spec):
    kw = dict(max_tokens=24, temperature=1.0, top_p=0.95, extra_body=None if spec else SPEC_OFF)
    r = chat(client, N_CHOICES_PROMPT, n=3, seed=4242, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    singles = [chat(client, N_CHOICES_PROMPT, n=1, seed=4242 + i, **kw) for i in range(3)]
    assert [c.message.content for c in r.choices] == [s.choices[0].message.content for s in singles]
    assert [c.finish_reason for c in r.choices] == [s.choices[0].finish_reason for s in singles]
    assert len({c.message.content for c in r.choices}) > 1, "sampled choices with different seeds differ"
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    texts, finishes, usage = streamed_choices(client, 3, seed=4242, **kw)
    assert texts == [c.message.content for c in r.choices]
    assert finishes == [c.finish_reason for c in r.choices]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (r.usage.prompt_tokens, r.usage.completion_tokens)


def test_several_choices_on_completions(client):
    kw = dict(model="smollm2", prompt=TEXT_PROMPTS[0], max_tokens=12, temperature=0.8, seed=99, extra_body=SPEC_OFF)
    r = client.completions.create(n=2, **kw)
    assert [c.index for c in r.choices] == [0, 1]
    for i in range(2):
        assert r.choices[i].text == client.completions.create(**{**kw, "seed": 99 + i}).choices[0].text
    texts = ["", ""]
    for chunk in client.completions.create(n=2, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in r.choices]


def test_greedy_choices_are_identical_and_the_prompt_is_prefilled_once(server, client):
    kw = dict(max_tokens=16, extra_body=SPEC_OFF)
    one = chat(client, N_CHOICES_PROMPT, **kw)
    before = metrics(server)
    r = chat(client, N_CHOICES_PROMPT, n=2, max_tokens=16, extra_body={**SPEC_OFF, "cache_prompt": False})
    after = metrics(server)
    assert [c.message.content for c in r.choices] == [one.choices[0].message.content] * 2
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 2 * one.usage.completion_tokens
    prompt = one.usage.prompt_tokens
    grew = lambda name: after[name] - before[name]
    assert grew("microspec_prompt_tokens_total") == 2 * prompt
    # Without the prefix cache the first choice prefills the prompt; the second recomputes only
    # the prompt's last row (for its logits).
    assert grew("microspec_prompt_tokens_prefilled_total") == prompt + 1
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    # With it (the default) the first choice finds the prompt in the slot's cache as well.
    cached = chat(client, N_CHOICES_PROMPT, n=2, **kw)
    assert [c.message.content for c in cached.choices] == [c.message.content for c in r.choices]
    assert metrics(server)["microspec_prompt_tokens_prefilled_total"] - after["microspec_prompt_tokens_prefilled_total"] == 2
    assert cached.usage.prompt_tokens_details.cached_tokens == prompt - 1

