#!/usr/bin/env python3
"""Peer rows for `microspec bench --peers llama.cpp`: llama.cpp (through llama-cpp-python) on the
same GGUF file and the same chat-formatted prompts, as plain decoding and with its own
training-free speculation (prompt lookup, LlamaPromptLookupDecoding: n-gram drafts copied from
the context, verified by the target).

The bench command writes a job file (model, threads, token limit, sampling, and per question the
conversation rendered by microspec's chat format, with placeholders where the model's own earlier
answers go) and reads back one JSON record per method and question, with the fields of microspec's
records: tokens and text per turn, new tokens, wall time of the whole generation (prefill
included), time to the first token (reported as prefill).

The two engines run interleaved per prompt after one warm-up generation each. Exit status 0 on
success, 2 for a bad job file, 3 when llama-cpp-python is missing.

    benchmarks/peer_llama_cpp.py --job results/peer_job.json --out results/peer_records.jsonl
"""
import argparse
import json
import statistics
import sys
import time

METHODS = ("llama.cpp", "llama.cpp:prompt-lookup")


def fail(message, status=2):
    print(f"peer_llama_cpp.py: {message}", file=sys.stderr)
    sys.exit(status)


def generate(llm, ids, job, seed):
    """One generation; returns (tokens, seconds to the first token, total seconds, finish)."""
    import llama_cpp

    temp = float(job["temperature"])
    llm.set_seed(seed)
    llm.reset()  # no prefix reuse from the previous prompt: every generation pays its prefill
    tokens, first, finish = [], None, "length"
    start = time.perf_counter()
    stream = llm.generate(ids, temp=temp, top_k=int(job["top_k"]) if temp > 0 else 1,
                          top_p=float(job["top_p"]) if temp > 0 else 1.0, min_p=0.0, repeat_penalty=1.0,
                          reset=True)
    for tok in stream:
        if first is None:
            first = time.perf_counter()
        if not job["ignore_eos"] and llama_cpp.llama_vocab_is_eog(llm._model.vocab, tok):
            finish = "stop"
            break
        tokens.append(int(tok))
        if len(tokens) >= job["max_new_tokens"]:
            break
        if len(ids) + len(tokens) + 1 >= job["n_ctx"]:
            finish = "context_full"
            break
    stream.close()
    end = time.perf_counter()
    return tokens, (first or end) - start, end - start, finish


def run_question(llm, method, q, job, answer_trim):
    record = {"method": method, "index": q["index"], "question_id": q["question_id"], "category": q["category"],
              "turns": [], "new_tokens": 0, "wall_seconds": 0.0, "prefill_seconds": 0.0, "decode_seconds": 0.0,
              "decode_tokens": 0}
    answers = []
    for turn_text in q["turns"]:
        text = turn_text
        for i, answer in enumerate(answers):
            text = text.replace(job["placeholders"][i], answer.strip() if answer_trim else answer)
        ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        if len(ids) >= job["n_ctx"]:
            fail(f"question {q['question_id']}: the prompt has {len(ids)} tokens; the context holds {job['n_ctx']}")
        tokens, ttft, wall, finish = generate(llm, ids, job, int(job["seed"]) + int(q["index"]))
        answer = llm.detokenize(tokens).decode("utf-8", errors="replace")
        answers.append(answer)
        record["turns"].append({"tokens": tokens, "text": answer, "finish": finish, "prompt_tokens": len(ids)})
        record["new_tokens"] += len(tokens)
        record["wall_seconds"] += wall
        record["prefill_seconds"] += ttft
        record["decode_seconds"] += wall - ttft
        record["decode_tokens"] += max(0, len(tokens) - 1)
    record["tokens_per_second"] = record["new_tokens"] / record["wall_seconds"] if record["wall_seconds"] else 0.0
    return record


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", required=True, help="job file written by `microspec bench --peers llama.cpp`")
    ap.add_argument("--out", required=True, help="JSONL records to write")
    ap.add_argument("--lookup-tokens", type=int, default=10, help="prompt lookup: draft tokens per step")
    ap.add_argument("--lookup-ngram", type=int, default=2, help="prompt lookup: longest n-gram matched")
    args = ap.parse_args()
    try:
        with open(args.job, encoding="utf-8") as f:
            job = json.load(f)
        for key in ("model", "n_ctx", "n_batch", "threads", "max_new_tokens", "ignore_eos", "temperature", "top_k",
                    "top_p", "seed", "repeats", "trim_answers", "placeholders", "questions"):
            job[key]  # noqa: B018 (presence check)
    except (OSError, ValueError, KeyError) as e:
        fail(f"{args.job}: not a peer job ({e})")
    if not job["questions"]:
        fail(f"{args.job}: no questions")
    try:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        fail("llama-cpp-python is not installed (scripts/install_llama_cpp.sh)", 3)

    common = dict(model_path=job["model"], n_ctx=int(job["n_ctx"]), n_batch=int(job["n_batch"]),
                  n_threads=int(job["threads"]), n_threads_batch=int(job["threads"]), verbose=False)
    engines = {
        METHODS[0]: llama_cpp.Llama(**common),
        # logits_all=True although a draft model implies it: llama-cpp-python 0.3.36 sizes its logits
        # buffer from the argument (n_batch rows otherwise) and fails on prompts longer than n_batch.
        METHODS[1]: llama_cpp.Llama(**common, logits_all=True, draft_model=LlamaPromptLookupDecoding(
            max_ngram_size=args.lookup_ngram, num_pred_tokens=args.lookup_tokens)),
    }
    descriptions = {
        METHODS[0]: f"llama.cpp {llama_cpp.__version__} (llama-cpp-python), plain decoding",
        METHODS[1]: f"llama.cpp {llama_cpp.__version__} (llama-cpp-python), prompt lookup "
                    f"(n-gram <= {args.lookup_ngram}, {args.lookup_tokens} draft tokens)",
    }
    trim = bool(job["trim_answers"])
    warm = dict(job, max_new_tokens=min(16, int(job["max_new_tokens"])))
    first = dict(job["questions"][0], turns=job["questions"][0]["turns"][:1])
    for method, llm in engines.items():
        run_question(llm, method, first, warm, trim)

    n = len(job["questions"])
    start = time.perf_counter()
    with open(args.out, "w", encoding="utf-8") as out:
        for i, q in enumerate(job["questions"]):
            for method, llm in engines.items():
                runs = [run_question(llm, method, q, job, trim) for _ in range(int(job["repeats"]))]
                runs.sort(key=lambda r: r["wall_seconds"])
                kept = runs[(len(runs) - 1) // 2]
                kept["description"] = descriptions[method]
                out.write(json.dumps(kept) + "\n")
                out.flush()
                done = i + 1
                eta = (time.perf_counter() - start) / done * (n - done)
                print(f"[peer] prompt {done}/{n}  {method:<24} {kept['tokens_per_second']:7.1f} tok/s  "
                      f"ETA {int(eta) // 60}:{int(eta) % 60:02d}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
