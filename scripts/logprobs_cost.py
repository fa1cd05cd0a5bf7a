#!/usr/bin/env python3
"""What `logprobs` costs in decode speed: one `microspec serve` (plain decoding, one slot), the same
greedy chat requests with and without `logprobs: true, top_logprobs: K`, interleaved, compared by
the usage's decode_tokens_per_second (medians). Prints the figure; asserts nothing.

  python3 scripts/logprobs_cost.py [--bin build/microspec] [--model models/smollm2-135m-instruct-q4_1.gguf]
"""
import argparse
import json
import statistics
import subprocess
import sys
import threading
import urllib.request

PROMPTS = ["Write a story about a lighthouse keeper.", "Explain how a bicycle works.",
           "List ten facts about the ocean.", "Describe a day in a busy city."]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="build/microspec")
    ap.add_argument("--model", default="models/smollm2-135m-instruct-q4_1.gguf")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="")
    a = ap.parse_args()
    cmd = [a.bin, "serve", "-m", a.model, "--port", "0", "--parallel", "1"] + (["-t", a.threads] if a.threads else [])
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    port = None
    for line in proc.stderr:
        if "listening on http://" in line:
            port = int(line.split("listening on http://")[1].split()[0].rsplit(":", 1)[1])
            break
    if port is None:
        sys.exit("the server did not start")
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # keep the pipe drained

    def speed(prompt, logprobs):
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": a.tokens, "temperature": 0}
        if logprobs:
            body.update(logprobs=True, top_logprobs=a.top)
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())["usage"]["microspec"]["decode_tokens_per_second"]

    try:
        speed(PROMPTS[0], False)  # warm-up
        off, on = [], []
        for _ in range(a.rounds):
            for p in PROMPTS:
                off.append(speed(p, False))
                on.append(speed(p, True))
        m_off, m_on = statistics.median(off), statistics.median(on)
        print(f"decode tok/s, median of {len(off)}: without logprobs {m_off:.1f}, with top_logprobs {a.top} "
              f"{m_on:.1f}: cost {100 * (1 - m_on / m_off):.1f}%")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
