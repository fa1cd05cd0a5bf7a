#!/usr/bin/env python3
"""Decode and prefill speed of microspec against llama.cpp on the same GGUF files, in one run.

For each model and thread count: decode tok/s (prompt of 128 tokens, 128 generated, greedy,
end-of-generation ignored) and prefill tok/s (a 512-token prompt), median over --repeats runs,
and the ratio microspec / llama.cpp. Also microspec's share of decode time spent in the LM head.

llama.cpp runs in-process through llama-cpp-python (built from source by
scripts/install_llama_cpp.sh, AMX off); its decode loop is timed around llama_decode calls
(eval + argmax of the last logits row, the same work our decode loop does).
Usage: benchmarks/bench_vs_llama_cpp.py [--models gemma,smollm2] [--threads 1,2] [--repeats 3]
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
BIN = os.environ.get("MICROSPEC_BIN", str(REPO / "build" / "microspec"))
SPEC_BENCH = REPO.parent / "shared" / "data" / "spec_bench" / "question.jsonl"
MODELS = {
    "gemma": REPO / "models" / "gemma-3-270m-q4_k_m.gguf",
    "smollm2": REPO / "models" / "smollm2-135m-instruct-q4_1.gguf",
}


def prompt_ids(llm, n):
    text = " ".join(json.loads(l)["turns"][0] for l in SPEC_BENCH.read_text().splitlines() if l.strip())
    ids = llm.tokenize(text.encode(), add_bos=False, special=False)
    return ids[:n]


def ours(model, ids, n_gen, threads):
    cmd = [BIN, "generate", "-m", str(model), "--prompt-ids", " ".join(map(str, ids)), "-n", str(n_gen),
           "--ignore-eos", "--json", "-t", str(threads), "-c", "1024"]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def peer_run(llm, ids, n_gen):
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    t1 = time.perf_counter()
    tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    for _ in range(n_gen - 1):
        llm.eval([tok])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    t2 = time.perf_counter()
    return len(ids) / (t1 - t0), (n_gen - 1) / (t2 - t1) if n_gen > 1 else 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gemma,smollm2")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import llama_cpp

    print(f"machine: {os.cpu_count()} cores; microspec {BIN}; llama-cpp-python {llama_cpp.__version__}")
    print("| model | threads | decode tok/s microspec | decode tok/s llama.cpp | ratio | prefill tok/s microspec "
          "| prefill tok/s llama.cpp | ratio | LM-head share of decode (microspec) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        path = MODELS[name]
        for t in [int(x) for x in args.threads.split(",")]:
            llm = llama_cpp.Llama(model_path=str(path), n_ctx=1024, n_batch=512, n_threads=t, n_threads_batch=t,
                                  verbose=False)
            p128, p512 = prompt_ids(llm, 128), prompt_ids(llm, 512)
            ours(path, p128, 8, t)  # warm-up: page the file in
            peer_run(llm, p128, 8)
            o_dec, o_pre, o_share, l_dec, l_pre = [], [], [], [], []
            for _ in range(args.repeats):
                r = ours(path, p128, 128, t)
                o_dec.append(r["decode_tokens_per_second"])
                o_share.append(r["decode_lm_head_seconds"] / r["decode_seconds"])
                o_pre.append(ours(path, p512, 1, t)["prefill_tokens_per_second"])
                l_dec.append(peer_run(llm, p128, 128)[1])
                l_pre.append(peer_run(llm, p512, 1)[0])
            m = statistics.median
            print(f"| {name} | {t} | {m(o_dec):.1f} | {m(l_dec):.1f} | {m(o_dec) / m(l_dec):.2f}x | {m(o_pre):.0f} | "
                  f"{m(l_pre):.0f} | {m(o_pre) / m(l_pre):.2f}x | {100 * m(o_share):.0f}% |", flush=True)
            del llm


if __name__ == "__main__":
    sys.exit(main())
