#!/usr/bin/env python3
"""Structured output's cost: decode speed of JSON-Schema-constrained generation against the same
generation unconstrained, with speculation (each drafter given) and without, in one run.

Every configuration runs the same chat prompts (each asks for JSON) through `microspec generate
--prompts-jsonl --json` (greedy, one model load per configuration and repeat); the configurations
are interleaved within each repeat. Reported per configuration: the median over --repeats of the
decode speed over all prompts (generated tokens / decode seconds) and the mean acceptance length;
then, per drafter, constrained speed / unconstrained speed. The constrained and unconstrained texts
differ (that is the point of the schema), so the ratio compares tokens per second, not outputs.

--same-text isolates the grammar's cost: plain few-shot prompts (no chat) whose unconstrained
continuation is itself a valid object on a line of its own; every prompt runs constrained (ending
at the object) and unconstrained (stopping at the line's end), and only prompts whose two texts are
equal count. The ratio is then over the same text, drafts and all.

    benchmarks/bench_structured.py -m models/gemma-3-270m-q4_k_m.gguf -t 2 --repeats 3 [--same-text]
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


# --same-text: a few-shot list whose next line is an object of the same shape.
CITIES = ["Paris", "Tokyo", "Cairo", "Lima", "Oslo", "Delhi", "Rome", "Seoul", "Quito", "Dakar"]
LINE_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"},
                                                "population": {"type": "integer"}},
               "required": ["name", "country", "population"]}
FEW_SHOT = ('{"name": "Berlin", "country": "Germany", "population": 3700000}\n'
            '{"name": "Madrid", "country": "Spain", "population": 3300000}\n')
LINE_PROMPTS = [f"Cities as JSON, one object per line, {c} first.\n" + FEW_SHOT for c in CITIES]


def generate(binary, model, threads, n_predict, spec, prompts, extra):
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False, encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")
        path = f.name
    cmd = [binary, "generate", "-m", model, "-t", str(threads), "--prompts-jsonl", path, "-n", str(n_predict),
           "--spec", spec, *extra]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=True)
    finally:
        pathlib.Path(path).unlink()
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def same_text(binary, model, threads, spec):
    """Decode tok/s constrained and unconstrained over the prompts whose texts are equal: the
    unconstrained side stops at the line's end (--stop '\\n'), the constrained one at the object's."""
    constrained = generate(binary, model, threads, 96, spec, LINE_PROMPTS, ["--json-schema", json.dumps(LINE_SCHEMA)])
    free = generate(binary, model, threads, 96, spec, LINE_PROMPTS, ["--stop", "\n"])
    tokens = free_tokens = seconds = free_seconds = 0
    for c, f in zip(constrained, free):
        if c["finish_reason"] != "stop" or f["text"] != c["text"]:
            continue
        tokens += len(c["tokens"]) - 1  # the first token comes from the prefill
        free_tokens += len(f["tokens"]) - 1
        seconds += c["decode_seconds"]
        free_seconds += f["decode_seconds"]
    return tokens, (free_tokens / free_seconds if free_seconds else 0.0), (tokens / seconds if seconds else 0.0)


def run(binary, model, threads, n_predict, spec, schema):
    """The chat prompts, constrained or not: decode tok/s over all of them, mean acceptance length."""
    extra = ["--chat"] + (["--json-schema", json.dumps(SCHEMA)] if schema else [])
    rows = generate(binary, model, threads, n_predict, spec, PROMPTS, extra)
    tokens = sum(len(r["tokens"]) - 1 for r in rows)  # the first token comes from the prefill
    seconds = sum(r["decode_seconds"] for r in rows)
    acceptance = [r["spec"]["mean_acceptance_length"] for r in rows if "spec" in r]
    return tokens / seconds, (statistics.mean(acceptance) if acceptance else None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--specs", default="none,ngram,self", help="comma-separated --spec modes")
    ap.add_argument("--bin", default=str(REPO / "build" / "microspec"))
    ap.add_argument("--same-text", action="store_true", help="compare over identical tokens only (see above)")
    a = ap.parse_args()
    specs = a.specs.split(",")
    if a.same_text:
        rows = {s: [] for s in specs}
        for _ in range(a.repeats):
            for s in specs:
                rows[s].append(same_text(a.bin, a.model, a.threads, s))
        print(f"# {pathlib.Path(a.model).name}, {cpu_name()}, {a.threads} threads, {len(LINE_PROMPTS)} few-shot "
              f"prompts, identical text only, greedy, medians of {a.repeats}")
        print("| --spec | tokens compared | unconstrained tok/s | constrained tok/s | constrained / unconstrained |")
        print("|---|---|---|---|---|")
        for s in specs:
            n = statistics.median(r[0] for r in rows[s])
            u = statistics.median(r[1] for r in rows[s])
            c = statistics.median(r[2] for r in rows[s])
            print(f"| {s} | {n:.0f} | {u:.1f} | {c:.1f} | {c / u:.2f}x |" if u else f"| {s} | 0 | - | - | - |")
        return
    configs = [(s, c) for s in specs for c in (False, True)]
    speeds = {c: [] for c in configs}
    accept = {c: [] for c in configs}
    for _ in range(a.repeats):
        for spec, constrained in configs:
            tps, acc = run(a.bin, a.model, a.threads, a.n_predict, spec, constrained)
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
