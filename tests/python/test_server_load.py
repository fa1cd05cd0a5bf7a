"""A bounded load test of `microspec serve` on loopback.

16 concurrent clients (the official `openai` client, one each) x 5 streamed chat requests with
small max_tokens against 2 slots with speculative decoding and a queue of 16, finishing by
itself. Requires zero failed requests, every greedy answer equal to `microspec generate --chat`
for its prompt, the server's resident memory (VmRSS) flat after the warm-up round, and the
server's own counters agreeing with what the clients saw. Prints p50/p95 latency and time to
first token (informational; noisy on a shared 2-core machine, never asserted).
"""
import statistics
import threading
import time

import openai
import pytest

from server_helpers import SMOLLM2, SPEC_ARGS, ServerProcess, cli_generate, metrics

CLIENTS = 16
ROUNDS = 5
MAX_TOKENS = 16
PROMPTS = [
    "Name a color.",
    "What is 2 + 2?",
    "Say hello in French.",
    "Give me one word that rhymes with cat.",
]
# Resident memory may grow this much from the end of the warm-up round to the end (KiB). Everything
# per slot is allocated at start; what is left is per-request JSON and strings, freed after each
# request, and the allocator's per-thread arenas, which the warm-up round (all 16 clients at once)
# has already touched.
RSS_SLACK_KIB = 8 * 1024


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(SMOLLM2, *SPEC_ARGS, "--parallel", "2", "--queue", "16")
    yield s
    assert s.terminate() == 0, s.stderr_text()


@pytest.mark.slow
def test_load(server):
    expected = [r["text"] for r in cli_generate(SMOLLM2, PROMPTS, MAX_TOKENS, chat=True)]
    before = metrics(server)
    results = []  # (client, round, prompt index, text, latency, time to first token)
    failures = []
    lock = threading.Lock()
    warm = threading.Barrier(CLIENTS + 1)  # everyone finished round 0
    go_on = threading.Barrier(CLIENTS + 1)  # RSS after warm-up is taken

    def client_main(c):
        client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120)
        try:
            for r in range(ROUNDS):
                p = (c + r) % len(PROMPTS)
                t0 = time.perf_counter()
                first = None
                text = ""
                try:
                    stream = client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": PROMPTS[p]}], max_tokens=MAX_TOKENS,
                        temperature=0, stream=True)
                    for chunk in stream:
                        if chunk.choices and chunk.choices[0].delta.content:
                            if first is None:
                                first = time.perf_counter() - t0
                            text += chunk.choices[0].delta.content
                    with lock:
                        results.append((c, r, p, text, time.perf_counter() - t0, first))
                except Exception as e:  # any failure counts; the test reports them all
                    with lock:
                        failures.append((c, r, repr(e)))
                if r == 0:
                    warm.wait()
                    go_on.wait()
        finally:
            client.close()

    threads = [threading.Thread(target=client_main, args=(c,)) for c in range(CLIENTS)]
    t_start = time.perf_counter()
    for t in threads:
        t.start()
    warm.wait()
    rss_warm = server.rss_kib()
    go_on.wait()
    peak = rss_warm
    while any(t.is_alive() for t in threads):
        peak = max(peak, server.rss_kib())
        time.sleep(0.05)
    for t in threads:
        t.join()
    wall = time.perf_counter() - t_start
    rss_end = server.rss_kib()

    assert not failures, failures
    assert len(results) == CLIENTS * ROUNDS
    wrong = [(c, r, PROMPTS[p], text) for c, r, p, text, _, _ in results if text != expected[p]]
    assert not wrong, wrong

    latencies = sorted(x[4] for x in results)
    ttft = sorted(x[5] for x in results if x[5] is not None)
    q = lambda xs, f: xs[min(len(xs) - 1, int(round(f * (len(xs) - 1))))]
    print("\nload: %d clients x %d streamed requests (max_tokens %d), 2 slots: %.1f s wall, %.1f req/s" %
          (CLIENTS, ROUNDS, MAX_TOKENS, wall, len(results) / wall))
    print("latency p50 %.3f s, p95 %.3f s; time to first token p50 %.3f s, p95 %.3f s; mean %.3f s" %
          (q(latencies, 0.5), q(latencies, 0.95), q(ttft, 0.5), q(ttft, 0.95), statistics.mean(latencies)))
    print("VmRSS: after warm-up %d KiB, peak %d KiB, end %d KiB" % (rss_warm, peak, rss_end))
    assert rss_end - rss_warm <= RSS_SLACK_KIB and peak - rss_warm <= RSS_SLACK_KIB

    after = metrics(server)
    key = 'microspec_requests_total{endpoint="/v1/chat/completions",status="200"}'
    assert after[key] - before.get(key, 0) == CLIENTS * ROUNDS
    assert after['microspec_generations_total{outcome="completed"}'] - \
        before['microspec_generations_total{outcome="completed"}'] == CLIENTS * ROUNDS
    assert after["microspec_slots_busy"] == 0 and after["microspec_queue_depth"] == 0
    assert after["microspec_acceptance_length_count"] - before["microspec_acceptance_length_count"] == CLIENTS * ROUNDS


# The leak check: LEAK_REQUESTS short requests after LEAK_WARMUP warm-up ones, two at a time (both
# slots), each with its own connection. A leak of LEAK_DETECT_KIB per request grows VmRSS by
# LEAK_REQUESTS * LEAK_DETECT_KIB = 10,000 KiB, more than twice the LEAK_SLACK_KIB allowed; what
# does vary (allocator arenas, page granularity) stays well under the slack after the warm-up.
LEAK_WARMUP, LEAK_REQUESTS, LEAK_DETECT_KIB, LEAK_SLACK_KIB = 200, 1000, 10, 4 * 1024


@pytest.mark.slow
def test_no_per_request_leak(server):
    import json
    import urllib.request

    body = json.dumps({"model": "m", "prompt": "Hello", "max_tokens": 1, "temperature": 0}).encode()

    def one():
        req = urllib.request.Request(server.url("/v1/completions"), data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
            json.loads(r.read())

    def run(n):
        errors = []

        def worker(count):
            try:
                for _ in range(count):
                    one()
            except Exception as e:  # reported below
                errors.append(repr(e))

        threads = [threading.Thread(target=worker, args=(n // 2,)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors

    run(LEAK_WARMUP)
    rss_warm = server.rss_kib()
    run(LEAK_REQUESTS)
    rss_end = server.rss_kib()
    print("VmRSS over %d requests after %d warm-up ones: %d -> %d KiB (%.2f KiB per request)" %
          (LEAK_REQUESTS, LEAK_WARMUP, rss_warm, rss_end, (rss_end - rss_warm) / LEAK_REQUESTS))
    assert rss_end - rss_warm <= LEAK_SLACK_KIB
