#!/usr/bin/env python3
"""Structured output's cost: decode speed of JSON-Schema-constrained generation against the same
generation unconstrained, with speculation (each drafter given) and without, in one run.

Every configuration runs the same chat prompts (each asks for JSON) through `microspec generate
--prompts-jsonl --json` (greedy, one model load per configuration and repeat); the configurations
are interleaved within each repeat. Reported per configuration: the median over --repeats of the
decode speed over all prompts (generated tokens / decode seconds) and the mean acceptance length;
then, per drafter, constrained speed / unconstrained speed. The constrained and unconstrained texts
differ (that is the point of the schema), so the ratio compares tokens per second, not outputs.

    benchmarks/bench_structured.py -m models/gemma-3-270m-q4_k_m.gguf -t 2 --repeats 3
"""
import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_serving import cpu_name  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "summary": {"type": "string", "maxLength": 160},
    "year": {"type": ["integer", "null"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 4},
    "rating": {"enum": [1, 2, 3, 4, 5]}},
    "required": ["name", "summary", "year", "tags", "rating"]}
TOPICS = ["the Eiffel Tower", "the Python programming language", "the novel Moby-Dick", "the planet Mars",
          "the city of Kyoto", "the game of chess", "the Amazon river", "the violin", "the Apollo 11 mission",
          "the painter Frida Kahlo"]
PROMPTS = [f"Describe {t} as a JSON object with the fields name, summary, year, tags and rating (1-5)."
           for t in TOPICS]


def run(binary, model, threads, n_predict, spec, schema):
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False, encoding="utf-8") as f:
        for p in PROMPTS:
            f.write(json.dumps({"prompt": p}) + "\n")
        path = f.name
    cmd = [binary, "generate", "-m", model, "-t", str(threads), "--prompts-jsonl", path, "-n", str(n_predict),
           "--chat", "--spec", spec]
    if schema:
        cmd += ["--json-schema", json.dumps(SCHEMA)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=True)
    finally:
        pathlib.Path(path).unlink()
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    tokens = sum(len(r["tokens"]) - 1 for r in rows)  # the first token comes from the prefill
    seconds = sum(r["decode_seconds"] for r in rows)
    acceptance = [r["spec"]["mean_acceptance_length"] for r in rows if "spec" in r]
    valid = None
    if schema:
        valid = sum(1 for r in rows if r["finish_reason"] != "length" and json.loads(r["text"]) is not None)
    return tokens / seconds, (statistics.mean(acceptance) if acceptance else None), valid


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--specs", default="none,ngram,self", help="comma-separated --spec modes")
    ap.add_argument("--bin", default=str(REPO / "build" / "microspec"))
    a = ap.parse_args()
    specs = a.specs.split(",")
    configs = [(s, c) for s in specs for c in (False, True)]
    speeds = {c: [] for c in configs}
    accept = {c: [] for c in configs}
    for _ in range(a.repeats):
        for spec, constrained in configs:
            tps, acc, _ = run(a.bin, a.model, a.threads, a.n_predict, spec, constrained)
            speeds[(spec, constrained)].append(tps)
            accept[(spec, constrained)].append(acc)
    print(f"# {pathlib.Path(a.model).name}, {cpu_name()}, {a.threads} threads, {len(PROMPTS)} prompts, "
          f"{a.n_predict} tokens, greedy, medians of {a.repeats}")
    print("| --spec | unconstrained tok/s (acceptance) | constrained tok/s (acceptance) | constrained / unconstrained |")
    print("|---|---|---|---|")
    for spec in specs:
        u, c = statistics.median(speeds[(spec, False)]), statistics.median(speeds[(spec, True)])
        def acc(k):
            v = [x for x in accept[k] if x is not None]
            return f" ({statistics.median(v):.2f})" if v else ""
        print(f"| {spec} | {u:.1f}{acc((spec, False))} | {c:.1f}{acc((spec, True))} | {c / u:.2f}x |")


if __name__ == "__main__":
    main()
