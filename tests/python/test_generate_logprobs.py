"""`microspec generate --json --logprobs K`: each generated token's log-probability and its K most
likely alternatives (sampling/logprobs.h), equal bit for bit between plain and speculative
decoding, and refused where it cannot be given."""
import json
import math
import subprocess

import pytest

from repo_paths import BIN, MODELS

SMOL = MODELS["smollm2"]
PROMPT = "Write a haiku about rain."


def generate(*args):
    p = subprocess.run([str(BIN), "generate", "-m", str(SMOL), "--chat", "-p", PROMPT, "-n", "24", *map(str, args)],
                       capture_output=True, text=True, timeout=300)
    return p


def logprobs_of(*args):
    p = generate("--json", "--logprobs", 3, *args)
    assert p.returncode == 0, p.stderr[-2000:]
    j = json.loads(p.stdout)
    assert len(j["logprobs"]) == len(j["tokens"]) > 0
    return j["tokens"], j["logprobs"]


def test_greedy_logprobs_are_the_rows_and_speculation_gives_the_same_floats():
    tokens, rows = logprobs_of("--spec", "none")
    for token, row in zip(tokens, rows):
        assert row["token"] == token and len(row["top"]) == 3
        assert row["top"][0] == [token, row["logprob"]] and row["logprob"] <= 0.0  # greedy: the best token
        values = [v for _, v in row["top"]]
        assert values == sorted(values, reverse=True) and sum(math.exp(v) for v in values) <= 1.0 + 1e-6
    for spec in ("ngram", "self"):
        assert logprobs_of("--spec", spec) == (tokens, rows), spec


def test_sampled_logprobs_are_those_of_the_distribution_drawn_from():
    tokens, rows = logprobs_of("--temp", 1.2, "--top-k", 2, "--top-p", 1, "-s", 5)
    for token, row in zip(tokens, rows):
        top = dict((t, v) for t, v in row["top"])
        assert 1 <= len(top) <= 2 and top[token] == row["logprob"]
        assert abs(sum(math.exp(v) for v in top.values()) - 1.0) < 1e-5


@pytest.mark.parametrize("args, message", [
    (["--logprobs", 2], "--logprobs needs --json"),
    (["--json", "--logprobs", 21], "not in range"),
])
def test_logprobs_refused_without_json_or_out_of_range(args, message):
    p = generate(*args)
    assert p.returncode != 0 and message in p.stderr, p.stderr
