#!/usr/bin/env python3
"""Time to first token of a 10-turn chat with and without the prefix cache, microspec against
llama.cpp's llama-server, in one run.

Each engine serves the same GGUF with one slot and the same threads. A conversation of --turns user
messages (about 60 tokens each) runs twice per repeat on each engine: first with the prefix cache
(`cache_prompt: true`, both engines' default), then without (`cache_prompt: false`); each turn adds
the engine's own greedy reply (max_tokens --reply-tokens) to the conversation, so every turn's
prompt is the whole conversation so far. Time to first token is measured by the client, streamed,
to the first chunk with text. Reported per turn: medians over --repeats of TTFT with and without
the cache and their ratio, per engine; the last turn's ratio is the headline figure.

llama-server is built from the llama.cpp sources the setup fetched (benchmarks/build_llama_server.sh)
unless --llama-server names one; --no-peer runs microspec alone.

    benchmarks/bench_prompt_cache.py -m models/smollm2-135m-instruct-q4_1.gguf -t 2 -o results/prompt_cache
"""
import argparse
import pathlib
import statistics
import sys

from bench_serving import REPO, cpu_name, llama_server_command, one_request, run_engines, write_report

# Ten user turns of one conversation, about 60 tokens each.
USER_TURNS = [
    "I am planning a small vegetable garden behind my house. The plot gets about six hours of sun in "
    "the morning and is shaded in the afternoon by a large oak tree. What vegetables would grow well "
    "there, and how should I prepare the soil before planting in spring?",
    "The soil is heavy clay that stays wet for days after rain. Would raised beds help, and if so, how "
    "deep should they be and what mix of compost, topsoil and sand should I fill them with for the "
    "vegetables you suggested?",
    "I also want to grow herbs for cooking, mostly basil, parsley, thyme and rosemary. Can these share "
    "the raised beds with the vegetables, or do some of them prefer drier soil and more sun than the "
    "others? Please explain which ones to keep apart.",
    "Slugs ate most of my lettuce last year. What are some ways to protect the seedlings without using "
    "chemical pellets, given that I have a dog and two cats that like to wander through the garden in "
    "the evening?",
    "How often should I water the beds during a hot summer week, and is it better to water in the "
    "morning or in the evening? I would like to set up a simple drip system if it does not cost too "
    "much. What parts would I need?",
    "My neighbour suggested planting marigolds and nasturtiums between the vegetables to keep pests "
    "away. Does companion planting like this really work, and are there other flowers that would "
    "attract bees to pollinate the beans and squash?",
    "In late summer I usually have far more tomatoes and zucchini than we can eat. What are good ways "
    "to preserve them for the winter, such as drying, freezing or canning, and which method keeps the "
    "best flavour for sauces and soups?",
    "I would like to start a compost heap with kitchen scraps and garden waste. How large should it "
    "be, what should and should not go into it, and how long does it take before the compost is ready "
    "to spread on the beds?",
    "Next year I want to rotate the crops so the soil does not wear out. Could you suggest a simple "
    "three-year rotation plan for four raised beds with tomatoes, beans, carrots, lettuce, squash and "
    "onions, and explain the reasoning behind it?",
    "Finally, what should I do in autumn to put the garden to bed for the winter? Should I cover the "
    "beds, plant a cover crop, or leave the old plants in place for insects, and when should I start "
    "the seeds indoors again?",
]


def converse(port, turns, reply_tokens, cache_prompt):
    """One conversation: per turn, (TTFT seconds, reply text)."""
    messages, out = [], []
    for user in turns:
        messages.append({"role": "user", "content": user})
        _, ttft, _, _, text = one_request(port, messages, reply_tokens, True, {"cache_prompt": cache_prompt})
        out.append((ttft, text))
        messages.append({"role": "assistant", "content": text})
    return out


def bench_engine(server, args):
    one_request(server.port, "Say hello.", 8, True, {})  # warm-up: page the weights in
    on, off = [], []
    for rep in range(args.repeats):
        on.append(converse(server.port, USER_TURNS[:args.turns], args.reply_tokens, True))
        off.append(converse(server.port, USER_TURNS[:args.turns], args.reply_tokens, False))
        print(f"  {server.name}: repeat {rep + 1}: last turn {on[-1][-1][0] * 1000:.0f} ms with the cache, "
              f"{off[-1][-1][0] * 1000:.0f} ms without", file=sys.stderr)
    rows = []
    for t in range(args.turns):
        ttft_on = statistics.median(run[t][0] for run in on)
        ttft_off = statistics.median(run[t][0] for run in off)
        same = all(run[t][1] == on[0][t][1] for run in on + off)
        rows.append({"turn": t + 1, "ttft_cache_ms": ttft_on * 1000, "ttft_no_cache_ms": ttft_off * 1000,
                     "speedup": ttft_off / ttft_on, "same_reply": same})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--turns", type=int, default=len(USER_TURNS), choices=range(1, len(USER_TURNS) + 1))
    ap.add_argument("--reply-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-c", "--ctx", type=int, default=4096)
    ap.add_argument("--spec", default="none", help="microspec's --spec")
    ap.add_argument("--microspec", default=str(REPO / "build" / "microspec"))
    ap.add_argument("--llama-server", default="", help="llama-server binary (default: build it, cached)")
    ap.add_argument("--no-peer", action="store_true", help="microspec only")
    ap.add_argument("-o", "--out", default="", help="folder for results.json and results.md")
    args = ap.parse_args()
    out = pathlib.Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    logdir = out or pathlib.Path("/tmp")

    engines = [(f"microspec --spec {args.spec}",
                [args.microspec, "serve", "-m", args.model, "--parallel", "1", "-t", str(args.threads), "-c",
                 str(args.ctx), "--spec", args.spec])]
    if not args.no_peer:
        engines.append(("llama-server", llama_server_command(args, 1, args.ctx)))
    results = run_engines(engines, logdir, lambda server: bench_engine(server, args), log_suffix="-prompt-cache")

    lines = [f"CPU: {cpu_name()}; threads {args.threads}; {args.turns} turns of about 60 new tokens, replies of at "
             f"most {args.reply_tokens} tokens (greedy); medians of {args.repeats} conversations", "",
             "| engine | turn | TTFT with cache (ms) | TTFT without (ms) | speedup | replies identical |",
             "|---|---|---|---|---|---|"]
    for name, rows in results.items():
        for r in rows:
            lines.append(f"| {name} | {r['turn']} | {r['ttft_cache_ms']:.0f} | {r['ttft_no_cache_ms']:.0f} | "
                         f"{r['speedup']:.1f}x | {'yes' if r['same_reply'] else 'no'} |")
    write_report(out, lines, results)


if __name__ == "__main__":
    main()
