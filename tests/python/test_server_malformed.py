"""`microspec serve` against malformed and hostile requests.

Every case must get the right 4xx status with an OpenAI-style JSON error body
({"error": {"message", "type", "param", "code"}}), and the server must keep answering: /health
and a valid completion after each case, and no crash at the end. Cases cover invalid JSON and
UTF-8, wrong types, absurd numbers, negative and huge max_tokens, prompts and completions that do
not fit the context, unsupported options (n > 1, tools, penalties), bad logprobs, bad extension
fields, oversized bodies (with Content-Length and chunked), unknown routes and methods, missing
and wrong API keys, and broken HTTP.
"""
import json

import pytest

from server_helpers import SMOLLM2, ServerProcess, http, raw_request

KEY = "sk-malformed-test"
AUTH = {"Authorization": "Bearer " + KEY, "Content-Type": "application/json"}
N_CTX = 256
MAX_BODY = 65536
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(SMOLLM2, "--api-key", KEY, "--max-body", MAX_BODY, "-c", N_CTX, "--queue", "4")
    yield s
    assert s.alive(), s.stderr_text()
    assert s.terminate() == 0


def chat(**kw):
    return dict({"model": "m", "messages": MSG, "max_tokens": 4}, **kw)


def comp(**kw):
    return dict({"model": "m", "prompt": "hi", "max_tokens": 4}, **kw)


def raw_post(path, body: bytes, extra_headers=b""):
    return (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
            b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n" +
            extra_headers + b"\r\n" + body)


LONG_TEXT = "The quick brown fox jumps over the lazy dog. " * 40  # ~400 tokens > N_CTX

# (id, method, path, body (dict: JSON, bytes: as is), headers, expected status, expected param or None)
CASES = [
    ("invalid-json", "POST", CHAT, b"{", AUTH, 400, None),
    ("empty-body", "POST", CHAT, b"", AUTH, 400, None),
    ("body-is-array", "POST", CHAT, b"[]", AUTH, 400, "body"),
    ("body-is-string", "POST", COMP, b'"hello"', AUTH, 400, "body"),
    ("invalid-utf8", "POST", COMP, b'{"prompt": "a\xff\xfeb", "max_tokens": 1}', AUTH, 400, None),
    ("truncated-utf8", "POST", COMP, b'{"prompt": "\xe2\x82", "max_tokens": 1}', AUTH, 400, None),
    ("overlong-utf8", "POST", CHAT, b'{"messages": [{"role": "user", "content": "\xc0\xaf"}]}', AUTH, 400, None),
    ("nested-100k", "POST", CHAT, b"[" * 60000, AUTH, 400, None),  # invalid too; the limit: see below
    ("messages-missing", "POST", CHAT, {"model": "m"}, AUTH, 400, "messages"),
    ("messages-string", "POST", CHAT, chat(messages="hi"), AUTH, 400, "messages"),
    ("messages-empty", "POST", CHAT, chat(messages=[]), AUTH, 400, "messages"),
    ("message-number", "POST", CHAT, chat(messages=[5]), AUTH, 400, "messages[0]"),
    ("role-invalid", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), AUTH, 400, "messages[0].role"),
    ("role-missing", "POST", CHAT, chat(messages=[{"content": "x"}]), AUTH, 400, "messages[0].role"),
    ("content-number", "POST", CHAT, chat(messages=[{"role": "user", "content": 7}]), AUTH, 400,
     "messages[0].content"),
    ("content-image", "POST", CHAT,
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), AUTH, 400,
     "messages[0].content[0].type"),
    ("prompt-missing", "POST", COMP, {"model": "m"}, AUTH, 400, "prompt"),
    ("prompt-object", "POST", COMP, comp(prompt={"a": 1}), AUTH, 400, "prompt"),
    ("prompt-id-too-big", "POST", COMP, comp(prompt=[1, 999999999]), AUTH, 400, "prompt"),
    ("prompt-id-negative", "POST", COMP, comp(prompt=[-1]), AUTH, 400, "prompt"),
    ("prompt-id-float", "POST", COMP, comp(prompt=[1.5]), AUTH, 400, "prompt[0]"),
    ("prompt-batch", "POST", COMP, comp(prompt=["a", "b"]), AUTH, 400, "prompt"),
    ("prompt-empty-ids", "POST", COMP, comp(prompt=[]), AUTH, 400, "prompt"),
    ("prompt-over-context", "POST", COMP, comp(prompt=LONG_TEXT), AUTH, 400, "prompt"),
    ("max-tokens-negative", "POST", CHAT, chat(max_tokens=-5), AUTH, 400, "max_tokens"),
    ("max-tokens-zero", "POST", CHAT, chat(max_tokens=0), AUTH, 400, "max_tokens"),
    ("max-tokens-2^64", "POST", COMP, comp(max_tokens=2 ** 64 - 1), AUTH, 400, "max_tokens"),
    ("max-tokens-1e30", "POST", COMP, b'{"prompt": "hi", "max_tokens": 1000000000000000000000000000000}', AUTH, 400,
     "max_tokens"),
    ("max-tokens-string", "POST", CHAT, chat(max_tokens="10"), AUTH, 400, "max_tokens"),
    ("max-tokens-fraction", "POST", CHAT, chat(max_tokens=10.5), AUTH, 400, "max_tokens"),
    ("max-tokens-over-context", "POST", COMP, comp(max_tokens=N_CTX), AUTH, 400, "max_tokens"),
    ("max-completion-tokens-huge", "POST", CHAT, chat(max_completion_tokens=10 ** 9), AUTH, 400,
     "max_completion_tokens"),
    ("temperature-negative", "POST", CHAT, chat(temperature=-1), AUTH, 400, "temperature"),
    ("temperature-1e308", "POST", CHAT, chat(temperature=1e308), AUTH, 400, "temperature"),
    ("temperature-overflow", "POST", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e999}',
     AUTH, 400, None),
    ("temperature-string", "POST", CHAT, chat(temperature="hot"), AUTH, 400, "temperature"),
    ("top-p-above-1", "POST", CHAT, chat(top_p=1.5), AUTH, 400, "top_p"),
    ("top-k-negative", "POST", COMP, comp(top_k=-3), AUTH, 400, "top_k"),
    ("seed-fraction", "POST", COMP, comp(seed=1.5), AUTH, 400, "seed"),
    ("stop-number", "POST", COMP, comp(stop=5), AUTH, 400, "stop"),
    ("stop-empty-string", "POST", COMP, comp(stop=["a", ""]), AUTH, 400, "stop[1]"),
    ("stop-list-number", "POST", COMP, comp(stop=["a", 3]), AUTH, 400, "stop[1]"),
    ("stream-string", "POST", CHAT, chat(stream="yes"), AUTH, 400, "stream"),
    ("stream-options-list", "POST", CHAT, chat(stream=True, stream_options=[1]), AUTH, 400, "stream_options"),
    ("n-17", "POST", CHAT, chat(n=17), AUTH, 400, "n"),
    ("n-0", "POST", COMP, comp(n=0), AUTH, 400, "n"),
    ("logprobs-string", "POST", CHAT, chat(logprobs="yes"), AUTH, 400, "logprobs"),
    ("echo", "POST", COMP, comp(echo=True), AUTH, 400, "echo"),
    ("tools", "POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), AUTH, 400, "tools"),
    ("frequency-penalty-out-of-range", "POST", CHAT, chat(frequency_penalty=2.5), AUTH, 400, "frequency_penalty"),
    ("logit-bias-string", "POST", CHAT, chat(logit_bias="x"), AUTH, 400, "logit_bias"),
    ("response-format-type", "POST", CHAT, chat(response_format={"type": "yaml"}), AUTH, 400,
     "response_format.type"),
    ("response-format-pattern", "POST", CHAT,
     chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string",
                                                                                        "pattern": "^a"}}}),
     AUTH, 400, "response_format"),
    ("response-format-schema-missing", "POST", CHAT, chat(response_format={"type": "json_schema", "json_schema": {}}),
     AUTH, 400, "response_format.json_schema.schema"),
    ("grammar-gbnf", "POST", CHAT, chat(grammar="root ::= \"a\""), AUTH, 400, "grammar"),
    ("model-number", "POST", CHAT, chat(model=3), AUTH, 400, "model"),
    ("spec-unknown", "POST", CHAT, chat(microspec={"spec": "banana"}), AUTH, 400, "microspec.spec"),
    ("spec-unavailable", "POST", CHAT, chat(microspec={"spec": "self"}), AUTH, 400, "microspec.spec"),
    ("spec-extension-key", "POST", CHAT, chat(microspec={"tree_depth": 9}), AUTH, 400, "microspec.tree_depth"),
    ("spec-extension-type", "POST", CHAT, chat(microspec="self"), AUTH, 400, "microspec"),
    ("body-too-large", "POST", CHAT, json.dumps(chat(messages=[{"role": "user", "content": "x" * (MAX_BODY + 10)}])).encode(),
     AUTH, 413, None),
    ("unknown-route", "POST", "/v1/embeddings", chat(), AUTH, 404, None),
    ("unknown-get", "GET", "/admin", None, AUTH, 404, None),
    ("unknown-model", "GET", "/v1/models/gpt-4", None, AUTH, 404, "model"),
    ("get-on-post-route", "GET", CHAT, None, AUTH, 405, None),
    ("delete-models", "DELETE", "/v1/models", None, AUTH, 405, None),
    ("put-health", "PUT", "/health", b"{}", AUTH, 405, None),
    ("key-missing", "POST", CHAT, chat(), {"Content-Type": "application/json"}, 401, None),
    ("key-wrong", "POST", COMP, comp(), {"Authorization": "Bearer sk-nope"}, 401, None),
    ("key-basic-scheme", "POST", COMP, comp(), {"Authorization": "Basic " + KEY}, 401, None),
    ("key-empty-bearer", "GET", "/v1/models", None, {"Authorization": "Bearer "}, 401, None),
    ("metrics-without-key", "GET", "/metrics", None, {}, 401, None),
]

# Wire-level cases: (id, raw bytes, expected status)
RAW_CASES = [
    ("chunked-body-too-large",
     b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
     b"\r\nTransfer-Encoding: chunked\r\n\r\n" + b"".join(b"4000\r\n" + b"a" * 0x4000 + b"\r\n" for _ in range(6)) +
     b"0\r\n\r\n", 413),
    ("content-length-lies-huge", raw_post(COMP, b'{"prompt": "x"}').replace(b"Content-Length: 15",
                                                                            b"Content-Length: 99999999999"), 413),
    ("unknown-method", b"BREW /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    ("garbage-request-line", b"\x00\x01\x02 nonsense\r\n\r\n", 400),
    ("uri-too-long", b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
    ("invalid-utf8-raw", raw_post(CHAT, b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}'), 400),
]


def check_error_body(body, status):
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    want_type = {401: "authentication_error", 429: "rate_limit_error"}.get(status, "invalid_request_error")
    assert err["type"] == want_type, err


def still_serving(server):
    status, _, body = http(server, "GET", "/health")
    assert status == 200 and body["status"] == "ok"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_malformed(server, case):
    _, method, path, body, headers, want_status, want_param = case
    status, _, answer = http(server, method, path, body, headers)
    assert status == want_status, answer
    check_error_body(answer, status)
    if want_param is not None:
        assert answer["error"]["param"] == want_param, answer
    still_serving(server)


@pytest.mark.parametrize("case", RAW_CASES, ids=[c[0] for c in RAW_CASES])
def test_malformed_wire(server, case):
    _, payload, want_status = case
    status, body = raw_request(server, payload)
    assert status == want_status, body[:300]
    check_error_body(json.loads(body), status)
    still_serving(server)


def test_context_errors_give_the_numbers(server):
    status, _, body = http(server, "POST", COMP, comp(max_tokens=N_CTX), AUTH)
    msg = body["error"]["message"]
    assert status == 400 and str(N_CTX) in msg and "for the completion" in msg
    status, _, body = http(server, "POST", COMP, comp(prompt=LONG_TEXT), AUTH)
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert str(N_CTX) in body["error"]["message"]


def test_serves_after_the_abuse(server):
    status, _, body = http(server, "POST", COMP, comp(max_tokens=3, temperature=0), AUTH)
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    status, _, body = http(server, "GET", "/metrics", headers=AUTH)
    assert status == 200 and 'microspec_requests_total{endpoint="other",status="404"}' in body


def nested_body(levels):
    """A valid chat request whose JSON nests `levels` containers deep: the body object, then an
    unused field holding arrays nested levels - 1 deep around a number."""
    inner = "[" * (levels - 1) + "0" + "]" * (levels - 1)
    return ('{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "x": %s}'
            % inner).encode()


def test_json_nesting_limit_is_64_levels(server):
    """README: JSON nested deeper than 64 levels is 400. Valid JSON 64 levels deep is served, one
    level more is refused with the limit in the message."""
    status, _, body = http(server, "POST", CHAT, nested_body(64), AUTH)
    assert status == 200, body
    status, _, body = http(server, "POST", CHAT, nested_body(65), AUTH)
    assert status == 400, body
    check_error_body(body, status)
    assert "nested deeper than 64 levels" in body["error"]["message"]


def test_connection_in_step_after_413(server):
    """An oversized chunked body is read and dropped, so the next request on the same connection is
    answered as itself (not parsed out of the rest of the body)."""
    import socket
    big = RAW_CASES[0][1]
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        statuses = []
        for request in (big, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"):
            s.sendall(request)  # one after the other: cpp-httplib does not take pipelined requests
            data = b""
            while not data.endswith(b"}"):
                b = s.recv(65536)
                if not b:
                    break
                data += b
            statuses.append(int(data[9:12]))
    assert statuses == [413, 200]
