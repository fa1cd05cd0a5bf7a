#!/usr/bin/env python3
"""Load benchmark of `microspec serve` against llama.cpp's llama-server, in one run.

N concurrent clients (default 1, 2, 4, 8, 16) each send streamed chat completions of SpecBench
questions (first turns, read from --dataset) to one server; both engines serve the same GGUF
file with the same threads, context per sequence and max_tokens, greedy. Every engine is started
once, all at the same time, with room for the largest client count (microspec `--parallel N`,
llama-server `-np N`, continuous batching in both), and warmed up; then every client count runs
--repeats rounds, the engines taking turns round by round on the same prompts, so that drift in
the machine's speed falls on all of them alike.

Reported per engine and client count: aggregate completion tokens per second (all clients' tokens
/ wall time of the round; median over repeats), time to first token p50/p95 and inter-token
latency p50/p95 (per request: (time of last token - time of first token) / (tokens - 1); pooled
over repeats), and the microspec / llama-server ratios of aggregate tok/s (higher is better for
microspec), of TTFT p95 and of inter-token latency p50 (lower is better). --spec takes several
modes (none,self), and --microspec several builds (old,new): each pair is one microspec server in
the same run. Without streaming
(--no-stream) TTFT is the whole request's latency and inter-token latency is not measured.

llama-server is built from the llama.cpp sources the setup fetched (benchmarks/build_llama_server.sh,
AMX off, into a cache directory) when --llama-server is not given. Standard library only (HTTP
with http.client), plus matplotlib for the optional plots.

    benchmarks/bench_serving.py -m models/gemma-3-270m-q4_k_m.gguf --clients 1,4,8 -t 2 -o results/serving
"""
import argparse
import http.client
import json
import os
import pathlib
import platform
import re
import socket
import statistics
import subprocess
import sys
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_name():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        m = re.search(r"Model name:\s*(.+)", out)
        if m:
            return m.group(1).strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_prompts(path, limit):
    prompts = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            turns = row.get("turns") or [row.get("prompt", "")]
            if turns[0]:
                prompts.append(turns[0])
            if len(prompts) >= limit:
                break
    if not prompts:
        raise SystemExit(f"no prompts in {path}")
    return prompts


class Server:
    """A server process on a free port, ready when GET /health answers 200."""

    def __init__(self, name, cmd, port, log_path):
        self.name, self.port = name, port
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{name} exited with {self.proc.returncode}; see {log_path}")
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise SystemExit(f"{name} did not become ready; see {log_path}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def one_request(port, prompt, max_tokens, stream, extra):
    """One chat completion of a prompt (a user message's text, or a list of messages); returns
    (completion tokens, ttft seconds, total seconds, itl seconds or None, the answer's text)."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    if not stream:
        j = json.loads(r.read())
        total = time.perf_counter() - t0
        conn.close()
        return j["usage"]["completion_tokens"], total, total, None, j["choices"][0]["message"]["content"]
    first = last = None
    chunks = 0
    text = ""
    tokens = None
    for raw in r:
        line = raw.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            break
        j = json.loads(data)
        if j.get("usage"):
            tokens = j["usage"]["completion_tokens"]
        if j.get("choices") and j["choices"][0].get("delta", {}).get("content"):
            text += j["choices"][0]["delta"]["content"]
            now = time.perf_counter()
            first = first if first is not None else now
            last = now
            chunks += 1
    total = time.perf_counter() - t0
    conn.close()
    if tokens is None:
        tokens = chunks  # no usage chunk: one token per content chunk
    ttft = (first - t0) if first is not None else total
    itl = (last - first) / (tokens - 1) if first is not None and tokens > 1 else None
    return tokens, ttft, total, itl, text


def run_round(port, prompts, clients, requests, max_tokens, stream, extra, offset):
    records, errors = [], []
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)

    def client(c):
        start.wait()
        for r in range(requests):
            prompt = prompts[(offset + c * requests + r) % len(prompts)]
            try:
                rec = one_request(port, prompt, max_tokens, stream, extra)
                with lock:
                    records.append(rec)
            except Exception as e:  # reported after the round
                with lock:
                    errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"{len(errors)} failed requests, first: {errors[0]}")
    return wall, records


def quantile(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def bench_interleaved(engines, logdir, prompts, args):
    """Starts every (name, command) server at once, each on its own port, warms each up, then runs
    each client count's rounds engine after engine (round 1 of every engine, round 2 of every
    engine, ...) on the same prompts, so drift in the machine's speed falls on every engine alike.
    Returns {name: rows}."""
    servers = []
    try:
        for name, cmd in engines:
            port = free_port()
            cmd = cmd + ["--port", str(port)]
            print(f"{name}: {' '.join(cmd)}", file=sys.stderr)
            servers.append(Server(name, cmd, port, logdir / f"{name.replace(' ', '_').replace('/', '_')}.log"))
        # Warm-up: one request per slot at the largest client count (page in weights, grow buffers).
        for server in servers:
            run_round(server.port, prompts, max(args.clients), 1, 8, args.stream, {}, 0)
        results = {server.name: [] for server in servers}
        for n in args.clients:
            runs = {server.name: ([], [], []) for server in servers}  # rates, ttft, itl
            for rep in range(args.repeats):
                for server in servers:
                    wall, records = run_round(server.port, prompts, n, args.requests, args.max_tokens, args.stream, {},
                                              offset=rep * n * args.requests)
                    rates, ttft, itl = runs[server.name]
                    rates.append(sum(r[0] for r in records) / wall)
                    ttft += [r[1] for r in records]
                    itl += [r[3] for r in records if r[3] is not None]
                    print(f"  {server.name}: {n} clients, repeat {rep + 1}: {rates[-1]:.1f} tok/s", file=sys.stderr)
            for name, (rates, ttft, itl) in runs.items():
                results[name].append({"clients": n, "tok_s": statistics.median(rates), "tok_s_runs": rates,
                                      "ttft_p50": quantile(ttft, 0.5), "ttft_p95": quantile(ttft, 0.95),
                                      "itl_p50": quantile(itl, 0.5), "itl_p95": quantile(itl, 0.95)})
        return results
    finally:
        for server in servers:
            server.stop()


def llama_server_command(args, parallel, ctx):
    """llama-server serving args.model with `parallel` slots and `ctx` tokens of context in all."""
    return [llama_server_binary(args), "-m", args.model, "-np", str(parallel), "-t", str(args.threads), "-c",
            str(ctx), "--host", "127.0.0.1", "--no-webui"]


def run_engines(engines, logdir, bench, log_suffix=""):
    """Starts each (name, command) server in turn on a free port, runs bench(server) on it and stops
    it; returns {name: what bench returned}."""
    results = {}
    for name, cmd in engines:
        port = free_port()
        cmd = cmd + ["--port", str(port)]
        print(f"{name}: {' '.join(cmd)}", file=sys.stderr)
        server = Server(name, cmd, port, logdir / f"{name}{log_suffix}.log")
        try:
            results[name] = bench(server)
        finally:
            server.stop()
    return results


def paired_ratios(results):
    """Report lines: each engine's tok/s over the first engine's, round by round (the rounds ran
    back to back on the same prompts, so each pair saw about the same machine): the median of those
    ratios and their range, per client count. Steadier than a ratio of medians when the machine's
    speed drifts between rounds."""
    names = list(results)
    if len(names) < 2:
        return []
    base = {r["clients"]: r["tok_s_runs"] for r in results[names[0]]}
    lines = ["", f"paired tok/s ratio to {names[0]}, round by round: median (lowest - highest)", "",
             "| engine | clients | rounds | median | range |", "|---|---|---|---|---|"]
    for name in names[1:]:
        for r in results[name]:
            pairs = [a / b for a, b in zip(r["tok_s_runs"], base.get(r["clients"], [])) if b > 0]
            if pairs:
                lines.append(f"| {name} | {r['clients']} | {len(pairs)} | {statistics.median(pairs):.3f} | "
                             f"{min(pairs):.3f} - {max(pairs):.3f} |")
    return lines


def write_report(out, lines, results):
    """Prints the report's lines; with a folder `out`, writes them to results.md and the results,
    command and CPU to results.json."""
    table = "\n".join(lines)
    print(table)
    if out:
        (out / "results.md").write_text(table + "\n")
        (out / "results.json").write_text(json.dumps({"command": sys.argv, "cpu": cpu_name(), "results": results},
                                                     indent=1))


def llama_server_binary(args):
    if args.llama_server:
        return args.llama_server
    out = subprocess.run([str(REPO / "benchmarks" / "build_llama_server.sh")], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit("building llama-server failed:\n" + out.stderr[-3000:])
    return out.stdout.strip().splitlines()[-1]


def plot(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plots", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, rows in results.items():
        xs = [r["clients"] for r in rows]
        axes[0].plot(xs, [r["tok_s"] for r in rows], marker="o", label=name)
        axes[1].plot(xs, [r["ttft_p95"] * 1000 for r in rows], marker="o", label=name)
        axes[2].plot(xs, [r["itl_p95"] * 1000 for r in rows], marker="o", label=name)
    for ax, title in zip(axes, ["aggregate tok/s", "TTFT p95 (ms)", "inter-token latency p95 (ms)"]):
        ax.set_title(title)
        ax.set_xlabel("concurrent clients")
        ax.set_xscale("log", base=2)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--dataset", default=str(REPO.parent / "shared" / "data" / "spec_bench" / "question.jsonl"),
                    help="SpecBench question.jsonl (read in place)")
    ap.add_argument("--clients", default="1,2,4,8,16", help="comma-separated client counts")
    ap.add_argument("--requests", type=int, default=2, help="requests per client per round")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="rounds per client count (median tok/s)")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count())
    ap.add_argument("-c", "--ctx", type=int, default=2048, help="context per sequence")
    ap.add_argument("--no-stream", dest="stream", action="store_false")
    ap.add_argument("--spec", default="none",
                    help="microspec's --spec, comma-separated for several microspec servers (none,self)")
    ap.add_argument("--spec-max-batch", type=int, default=None,
                    help="microspec's --spec-max-batch (default: the server's)")
    ap.add_argument("--microspec", default=str(REPO / "build" / "microspec"),
                    help="microspec binary; comma-separated for several builds side by side (each with every --spec)")
    ap.add_argument("--llama-server", default="", help="llama-server binary (default: build it, cached)")
    ap.add_argument("--no-peer", action="store_true", help="microspec only")
    ap.add_argument("-o", "--out", default="", help="folder for results.json, results.md, serving.png")
    args = ap.parse_args()
    args.clients = [int(x) for x in args.clients.split(",")]
    prompts = load_prompts(args.dataset, 80)
    np_ = max(args.clients)
    out = pathlib.Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    logdir = out or pathlib.Path("/tmp")

    engines = []
    binaries = args.microspec.split(",")
    for binary in binaries:
        for spec in args.spec.split(","):
            cmd = [binary, "serve", "-m", args.model, "--parallel", str(np_), "--queue", str(np_),
                   "-t", str(args.threads), "-c", str(args.ctx), "--spec", spec]
            if args.spec_max_batch is not None:
                cmd += ["--spec-max-batch", str(args.spec_max_batch)]
            engines.append((f"microspec --spec {spec}" + (f" ({binary})" if len(binaries) > 1 else ""), cmd))
    if not args.no_peer:
        engines.append(("llama-server", llama_server_command(args, np_, args.ctx * np_)))
    results = bench_interleaved(engines, logdir, prompts, args)

    lines = [f"CPU: {cpu_name()}; threads {args.threads}; max_tokens {args.max_tokens}; "
             f"{args.requests} requests per client per round; {args.repeats} rounds; "
             f"{'streaming' if args.stream else 'not streaming'}", "",
             "ratios: engine / llama-server at the same client count (tok/s: higher is better; TTFT p95 and "
             "ITL p50: lower is better)" if "llama-server" in results else "no llama-server in this run: no ratios",
             "",
             "| engine | clients | aggregate tok/s | tok/s ratio | TTFT p50 / p95 (ms) | TTFT p95 ratio "
             "| ITL p50 / p95 (ms) | ITL p50 ratio |",
             "|---|---|---|---|---|---|---|---|"]
    peer = {r["clients"]: r for r in results.get("llama-server", [])}

    def ratio(r, key):
        p = peer.get(r["clients"])
        return f"{r[key] / p[key]:.2f}x" if p and p[key] and p[key] == p[key] else "-"

    for name, rows in results.items():
        for r in rows:
            lines.append(f"| {name} | {r['clients']} | {r['tok_s']:.1f} | {ratio(r, 'tok_s')} | "
                         f"{r['ttft_p50'] * 1000:.0f} / {r['ttft_p95'] * 1000:.0f} | {ratio(r, 'ttft_p95')} | "
                         f"{r['itl_p50'] * 1000:.1f} / {r['itl_p95'] * 1000:.1f} | {ratio(r, 'itl_p50')} |")
    lines += paired_ratios(results)
    write_report(out, lines, results)
    if out:
        plot(results, out / "serving.png")


if __name__ == "__main__":
    main()
