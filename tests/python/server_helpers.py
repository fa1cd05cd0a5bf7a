"""Shared helpers of the `microspec serve` tests: start the server binary on a free port, talk to
it over raw sockets or HTTP, run the CLI for expected outputs, read the process's memory."""
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

from repo_paths import BIN, MODELS, REPO  # noqa: E402
SMOLLM2 = MODELS["smollm2"]
GEMMA = MODELS["gemma"]
# Screenshots and other artifacts of the server tests (ignored by git).
ARTIFACTS = REPO / "tests" / "artifacts"

# Speculative settings the servers and the CLI comparisons share.
SPEC_ARGS = ["--spec", "self", "--draft-vocab", "dynamic"]


class ServerProcess:
    """`microspec serve` started with --port 0; the port is read from its "listening on" line."""

    def __init__(self, model, *args, startup_timeout=60):
        self.cmd = [BIN, "serve", "-m", str(model), "--port", "0", *map(str, args)]
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     errors="replace")
        self.log = []
        self.port = None
        ready = threading.Event()

        def pump():
            for line in self.proc.stderr:
                self.log.append(line)
                m = re.search(r"listening on http://[^:]+:(\d+)", line)
                if m and self.port is None:
                    self.port = int(m.group(1))
                    ready.set()
            ready.set()

        self.reader = threading.Thread(target=pump, daemon=True)
        self.reader.start()
        if not ready.wait(startup_timeout) or self.port is None:
            self.kill()
            raise RuntimeError("server did not start: " + " ".join(self.cmd) + "\n" + "".join(self.log))
        self.base = f"http://127.0.0.1:{self.port}"

    def url(self, path):
        return self.base + path

    def alive(self):
        return self.proc.poll() is None

    def rss_kib(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def terminate(self, timeout=30):
        """SIGTERM, then the exit status (kills and fails if it does not exit in time)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError("server did not exit within %d s of SIGTERM" % timeout)
        self.reader.join(5)
        return rc

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stderr_text(self):
        return "".join(self.log)


def http(server, method, path, body=None, headers=None, timeout=60):
    """One request with urllib: (status, headers, parsed JSON or text)."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    req = urllib.request.Request(server.url(path), data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, hdrs, raw = r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        status, hdrs, raw = e.code, dict(e.headers), e.read()
    text = raw.decode("utf-8", errors="replace")
    try:
        return status, hdrs, json.loads(text)
    except ValueError:
        return status, hdrs, text


def raw_request(server, payload: bytes, timeout=30):
    """Sends raw bytes on a fresh connection and returns (status, body bytes) of the first response
    (read by its Content-Length or chunked framing; the connection stays open meanwhile, as a real
    client's would)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as s:
        try:
            s.sendall(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may answer before reading everything
        data = b""

        def complete():
            head, sep, body = data.partition(b"\r\n\r\n")
            if not sep:
                return None
            h = head.decode("latin-1").lower()
            m = re.search(r"content-length: (\d+)", h)
            if m:
                n = int(m.group(1))
                return (head, body[:n]) if len(body) >= n else None
            if "transfer-encoding: chunked" in h:
                out, rest = b"", body
                while True:
                    size_line, sep2, rest2 = rest.partition(b"\r\n")
                    if not sep2:
                        return None
                    size = int(size_line, 16)
                    if size == 0:
                        return head, out
                    if len(rest2) < size + 2:
                        return None
                    out, rest = out + rest2[:size], rest2[size + 2:]
            return None

        while complete() is None:
            try:
                b = s.recv(65536)
            except ConnectionResetError:
                break
            if not b:
                break
            data += b
    got = complete()
    if got is None:
        raise AssertionError("no complete HTTP response: %r" % data[:200])
    head, body = got
    m = re.match(rb"HTTP/1\.[01] (\d{3})", head)
    assert m, head
    return int(m.group(1)), body


def metrics(server, headers=None):
    """GET /metrics parsed into {sample name with labels: value}."""
    status, _, text = http(server, "GET", "/metrics", headers=headers)
    assert status == 200, text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


_generated = {}  # one pytest session's `generate` results, shared by every module that asks


def output_difference(i, plain, spec):
    """None when the speculative row `spec` of prompt i (a --prompts-jsonl output line) has plain
    decoding's tokens, text and finish reason; else a line naming the first differing token."""
    if plain["tokens"] == spec["tokens"] and plain["text"] == spec["text"] and \
            plain["finish_reason"] == spec["finish_reason"]:
        return None
    a, b = plain["tokens"], spec["tokens"]
    first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"prompt {i}: first difference at token {first} ({a[first:first + 3]} vs {b[first:first + 3]})"


def cli_generate(model, prompts, n_predict, chat, extra=()):
    """`microspec generate --json` over prompts (batch mode): one dict per prompt. Deterministic
    runs (greedy, or a fixed seed) are run once per session: plain-decoding baselines that several
    modules compare against are computed once."""
    import copy
    import tempfile
    key = (str(model), tuple(prompts), n_predict, chat, tuple(map(str, extra)))
    if key not in _generated:
        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False, encoding="utf-8") as f:
            for p in prompts:
                f.write(json.dumps({"prompt": p}) + "\n")
            path = f.name
        try:
            cmd = [BIN, "generate", "-m", str(model), "--prompts-jsonl", path, "-n", str(n_predict), *map(str, extra)]
            if "--spec" not in map(str, extra):
                cmd += ["--spec", "none"]  # a baseline is plain decoding (--spec auto is the default)
            if chat:
                cmd.append("--chat")
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        finally:
            os.unlink(path)
        assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}"
        _generated[key] = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    return copy.deepcopy(_generated[key])


def sse_events(response):
    """The data fields of a streamed `requests` response's server-sent events, in order."""
    events = []
    for line in response.iter_lines(decode_unicode=True):
        if line and line.startswith("data: "):
            events.append(line[6:])
    return events


def wait_for(predicate, timeout=20.0, interval=0.05):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()
