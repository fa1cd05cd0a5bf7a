#!/usr/bin/env python3
"""Greedy outputs over SpecBench, as one md5 per (model, drafter) and one over all of them.

A restructuring that must not change what the engine computes runs this with the binary before and
after the change and compares the lines:

    python3 scripts/greedy_sweep.py OLD_BINARY > before.txt
    python3 scripts/greedy_sweep.py build/microspec > after.txt
    diff before.txt after.txt

Each run decodes the first N SpecBench first turns (spread round-robin over the 13 categories) with
--chat, greedily, plainly and with each drafter, and hashes the generated token ids. Speculative
greedy output equals plain greedy output, so every row of one model must also carry the same md5.
"""
import argparse
import hashlib
import json
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
SPEC_BENCH = REPO.parent / "shared" / "data" / "spec_bench" / "question.jsonl"
MODELS = ["models/gemma-3-270m-q4_k_m.gguf", "models/smollm2-135m-instruct-q4_1.gguf"]
# Flags that mean the same in every version of the CLI this script compares.
DRAFTERS = {
    "plain": ["--spec", "none"],
    "self": ["--spec", "self"],
    "ngram": ["--spec", "ngram"],
    "self+ngram": ["--spec", "self+ngram"],
    "head": ["--spec", "head"],
    "head+ngram": ["--spec", "head+ngram"],
    "draft (target file)": ["--spec", "draft", "--draft-model", "{model}"],
}


def first_turns(n):
    by_cat = {}
    for line in SPEC_BENCH.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            by_cat.setdefault(row["category"], []).append(row["turns"][0])
    texts, i = [], 0
    while len(texts) < n:
        for cat in sorted(by_cat):
            if i < len(by_cat[cat]) and len(texts) < n:
                texts.append(by_cat[cat][i])
        i += 1
    return texts


def head_for(model):
    return REPO / "models" / "heads" / (pathlib.Path(model).stem + ".eagle3.gguf")


def run_sweep(binary, model, flags, rows_path, n_tokens):
    flags = [f.replace("{model}", str(REPO / model)) for f in flags]
    if "head" in " ".join(flags):
        flags += ["--draft-head", str(head_for(model))]
    cmd = [binary, "generate", "-m", str(REPO / model), "--chat", "--prompts-jsonl", str(rows_path),
           "-n", str(n_tokens), "--json", "-t", "2"] + flags
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    tokens = [json.loads(line)["tokens"] for line in out.stdout.splitlines() if line.startswith("{")]
    return hashlib.md5(json.dumps(tokens).encode()).hexdigest(), len(tokens)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binary")
    ap.add_argument("--prompts", type=int, default=13)
    ap.add_argument("-n", "--tokens", type=int, default=64)
    args = ap.parse_args()
    total = hashlib.md5()
    with tempfile.TemporaryDirectory() as tmp:
        rows_path = pathlib.Path(tmp) / "rows.jsonl"
        rows_path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in first_turns(args.prompts)))
        for model in MODELS:
            for name, flags in DRAFTERS.items():
                digest, rows = run_sweep(args.binary, model, flags, rows_path, args.tokens)
                total.update(digest.encode())
                print(f"{pathlib.Path(model).stem:32s} {name:22s} {rows:3d} rows  {digest}", flush=True)
    print(f"all {total.hexdigest()}")


if __name__ == "__main__":
    main()
