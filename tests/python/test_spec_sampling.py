"""Speculative sampling on the real models, through the CLI.

The distribution itself is proven on a tiny model (SpecSampling.OutputDistributionEqualsPlainSampling
in the C++ suite: an exact chi-square test needs a small vocabulary). Here the real models check
the parts around it: `--spec self --temp T` runs with every drafter and filter combination, a seed
reproduces its output, different seeds differ, stop strings and token limits hold, and the
acceptance statistics are reported and sane.
"""
import json
import os
import pathlib
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("MICROSPEC_BIN", str(REPO / "build" / "microspec"))
MODELS = {
    "gemma": REPO / "models" / "gemma-3-270m-q4_k_m.gguf",
    "smollm2": REPO / "models" / "smollm2-135m-instruct-q4_1.gguf",
}
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def run(model, *args):
    cmd = [BIN, "generate", "-m", str(MODELS[model]), "--chat", "-p", PROMPT, "--json", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model", ["gemma", "smollm2"])
@pytest.mark.parametrize(
    "spec",
    [
        ["--spec", "self"],
        ["--spec", "self", "--tree-topk", "2", "--tree-depth", "2", "--tree-tokens", "5"],
    ],
    ids=["chain", "tree"],
)
def test_sampling_runs_and_is_reproducible(model, spec):
    args = ["-n", "48", "--temp", "0.8", "--top-k", "40", "--top-p", "0.95", *spec]
    a = run(model, *args, "--seed", "3")
    b = run(model, *args, "--seed", "3")
    c = run(model, *args, "--seed", "4")
    assert a["tokens"] == b["tokens"] and a["text"] == b["text"]
    assert a["tokens"] != c["tokens"]
    assert len(a["tokens"]) == 48 or a["finish_reason"] == "stop"
    s = a["spec"]
    assert s["steps"] > 0
    # Acceptance length: at least 1 (the bonus token) and at most the tree depth + 2.
    assert 1.0 <= s["mean_acceptance_length"] <= 6.0
    assert s["accepted_draft_tokens"] <= s["drafted_tokens"]


def test_sampling_accepts_drafts_on_a_strong_draft():
    # Drafting with all the target's layers and the full vocabulary gives q == p, so every draft
    # token is accepted: the
    # acceptance length is the chain's length + 1 on every step that drafted a full chain.
    n_layer = 18
    out = run("gemma", "-n", "40", "--temp", "1.0", "--top-k", "0", "--top-p", "1.0", "--seed", "11",
              "--spec", "self", "--draft-layers", str(n_layer), "--tree-topk", "1", "--tree-depth", "3",
              "--tree-tokens", "4", "--ignore-eos", "--draft-vocab", "full")
    s = out["spec"]
    assert s["accepted_draft_tokens"] == s["drafted_tokens"]
    assert s["mean_acceptance_length"] > 4.5


def test_sampling_respects_stop_strings():
    out = run("smollm2", "-n", "96", "--temp", "0.7", "--seed", "5", "--spec", "self", "--stop", ".")
    assert "." not in out["text"]
    assert out["finish_reason"] in ("stop", "length")
