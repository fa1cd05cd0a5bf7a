"""`microspec serve`: API key, the bounded queue (429), cancellation when a streaming client goes
away, and a clean shutdown on SIGTERM in the middle of a stream.

One slot and one queue place, so a long stream holds the slot, a second request waits and a third
is refused. Streams are read over raw sockets so the test controls exactly when the client leaves.
"""
import json
import socket
import threading
import time

import openai
import pytest

from server_helpers import SMOLLM2, ServerProcess, http, metrics, wait_for

KEY = "sk-test-0123456789"
AUTH = {"Authorization": "Bearer " + KEY}
# A prompt SmolLM2 continues for a long time (counting), so a stream is still running when the
# test acts on it.
COUNTING = {"model": "m", "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 3000, "temperature": 0, "stream": True}


class RawStream:
    """A streamed completion over a plain socket: read events one by one, or drop the connection."""

    def __init__(self, server, body):
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        data = json.dumps(body).encode()
        self.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " +
                          str(len(data)).encode() + b"\r\n\r\n" + data)
        self.buf = b""
        while b"\r\n\r\n" not in self.buf:
            self._recv()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        assert b"text/event-stream" in head

    def _recv(self):
        b = self.sock.recv(65536)
        if not b:
            raise EOFError
        self.buf += b

    def events(self, n):
        """Reads until n more events have arrived (chunk framing is left in the buffer and skipped)."""
        got = []
        while len(got) < n:
            while b"\n\n" not in self.buf:
                self._recv()
            event, _, self.buf = self.buf.partition(b"\n\n")
            line = event[event.index(b"data: ") + 6:]
            got.append(line.decode())
        return got

    def rest(self):
        """Everything until the server closes the stream (chunked terminator) or the socket."""
        try:
            while not self.buf.endswith(b"0\r\n\r\n"):
                self._recv()
        except EOFError:
            pass
        return self.buf

    def close(self):
        self.sock.close()


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(SMOLLM2, "--parallel", "1", "--queue", "1", "--api-key", KEY)
    yield s
    s.kill()


def test_api_key(server):
    with openai.OpenAI(base_url=server.url("/v1"), api_key="sk-wrong", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError) as e:
            wrong.models.list()
    assert e.value.body["code"] == "invalid_api_key"
    for bad in (KEY[:-1], KEY + "x", "", KEY.upper()):
        status, hdrs, body = http(server, "GET", "/v1/models", headers={"Authorization": "Bearer " + bad})
        assert status == 401 and body["error"]["type"] == "authentication_error"
    status, hdrs, body = http(server, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert status == 401 and hdrs.get("WWW-Authenticate") == "Bearer"
    assert http(server, "GET", "/metrics")[0] == 401
    assert http(server, "GET", "/health")[0] == 200  # open, for load balancers
    assert http(server, "GET", "/")[0] == 200  # the page itself; it sends the key it is given
    with openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0) as ok:
        r = ok.completions.create(model="m", prompt="Hello", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3


def test_queue_429_and_cancellation(server):
    before = metrics(server, AUTH)
    holder = RawStream(server, COUNTING)
    assert len(holder.events(2)) == 2  # generating: the slot is taken
    waiter_result = {}

    def waiter():
        waiter_result["status"], _, waiter_result["body"] = http(
            server, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0}, headers=AUTH)

    t = threading.Thread(target=waiter)
    t.start()
    assert wait_for(lambda: metrics(server, AUTH)["microspec_queue_depth"] == 1)
    m = metrics(server, AUTH)
    assert m["microspec_slots_busy"] == 1
    with openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0) as client:
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model="m", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "queue_full"
    # The first client leaves mid-stream: its generation stops and the waiting request gets the slot.
    holder.close()
    t.join(60)
    assert waiter_result["status"] == 200 and waiter_result["body"]["usage"]["completion_tokens"] == 4
    after = wait_for(lambda: (lambda m: m if m["microspec_slots_busy"] == 0 else None)(metrics(server, AUTH)))
    cancelled = 'microspec_generations_total{outcome="cancelled"}'
    assert after[cancelled] == before[cancelled] + 1
    assert after["microspec_queue_depth"] == 0
    # The cancelled stream stopped long before its 3000 tokens.
    generated = after["microspec_completion_tokens_total"] - before["microspec_completion_tokens_total"] - 4
    assert 2 <= generated < 1000, generated
    assert after['microspec_requests_total{endpoint="/v1/completions",status="429"}'] >= 1


def test_sigterm_during_stream(server):
    stream = RawStream(server, COUNTING)
    first = stream.events(3)
    assert all(json.loads(e)["choices"][0]["text"] is not None for e in first)
    t0 = time.time()
    server.proc.send_signal(15)
    tail = stream.rest().decode()
    stream.close()
    events = [line[6:] for line in tail.split("\n") if line.startswith("data: ")]
    # The stream ends properly: an error event saying why, then [DONE], then the chunked terminator.
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "server_shutting_down" and err["type"] == "server_error"
    assert tail.endswith("0\r\n\r\n")
    rc = server.terminate(timeout=30)
    assert rc == 0, server.stderr_text()
    print("shutdown took %.2f s" % (time.time() - t0))
    assert "SIGTERM" in server.stderr_text() and "serve: stopped" in server.stderr_text()
