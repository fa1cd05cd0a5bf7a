"""SpecBench prompts for the tests: first turns, taken round-robin over the categories so that any
prefix of the list is spread over all 13 of them."""
import json
import pathlib

import pytest

SPEC_BENCH = pathlib.Path(__file__).resolve().parents[3] / "shared" / "data" / "spec_bench" / "question.jsonl"


def first_turns(n=None):
    if not SPEC_BENCH.exists():
        pytest.fail(f"{SPEC_BENCH} is missing")
    rows = [json.loads(line) for line in SPEC_BENCH.read_text(encoding="utf-8").splitlines() if line.strip()]
    by_cat = {}
    for r in rows:
        by_cat.setdefault(r["category"], []).append(r["turns"][0])
    n = len(rows) if n is None else n
    cats, texts, i = sorted(by_cat), [], 0
    while len(texts) < n:
        for c in cats:
            if i < len(by_cat[c]) and len(texts) < n:
                texts.append(by_cat[c][i])
        i += 1
    return texts
