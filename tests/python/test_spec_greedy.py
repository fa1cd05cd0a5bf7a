"""Speculative greedy decoding equals plain greedy decoding, token for token, on both real models.

`microspec generate --json --chat -n 128` over SpecBench prompts spread across categories (one
process per configuration, --prompts-jsonl batch mode), with and without --spec:
- self-drafting with two draft-layer counts, as a chain (top-k 1), a small tree and the default
  tree (the default layer count too);
- a separate draft model: the same file (the only model with the same vocabulary), chain and tree;
- each with one of the draft vocabularies: full, freq (FR-Spec), dynamic (MicroSpec; once with a
  window small enough to evict mid-reply and the gather on the calling thread), hybrid.
Every prompt's tokens, text and finish reason must be identical to plain decoding, and the
speculative runs must report their statistics.

MICROSPEC_SPEC_PROMPTS (default 30) sets how many prompts each configuration runs.
"""
import json
import os
import pathlib
import subprocess

import pytest

import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import spec_bench  # noqa: E402

# Minutes per model (30 prompts x 5 configurations + plain): left out of scripts/test.sh --quick.
pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("MICROSPEC_BIN", str(REPO / "build" / "microspec"))
MODELS = {
    "gemma": REPO / "models" / "gemma-3-270m-q4_k_m.gguf",
    "smollm2": REPO / "models" / "smollm2-135m-instruct-q4_1.gguf",
}
N_PROMPTS = int(os.environ.get("MICROSPEC_SPEC_PROMPTS", "30"))
N_TOKENS = 128

# Draft-layer counts per model: one that drafts well (all but the last eighth or so) and one that
# is often wrong (so partial acceptance and rejection at the root are exercised).
LAYERS = {"gemma": (16, 12), "smollm2": (27, 15)}
CHAIN = ["--tree-topk", "1", "--tree-depth", "4", "--tree-tokens", "5"]
SMALL_TREE = ["--tree-topk", "2", "--tree-depth", "2", "--tree-tokens", "5"]


def configs(model):
    # Every drafter, every tree shape and every draft vocabulary, each on all the prompts; the
    # vocabularies are spread over the drafter / tree configurations to keep the suite's time.
    good, poor = LAYERS[model]
    path = str(MODELS[model])
    freq = ["--freq-file", freq_file(model)]
    return {
        "self-chain-dynamic": ["--spec", "self", "--draft-layers", str(good), "--draft-vocab", "dynamic"] + CHAIN,
        "self-tree-poor-draft-freq": ["--spec", "self", "--draft-layers", str(poor), "--draft-vocab", "freq"]
                                     + freq + SMALL_TREE,
        "self-default-full": ["--spec", "self", "--draft-vocab", "full"],
        # A window small enough to evict within a reply, and the gather on the calling thread.
        "draft-chain-dynamic-evicting": ["--spec", "draft", "--draft-model", path, "--draft-vocab", "dynamic",
                                         "--vocab-window", "256", "--no-async-gather"] + CHAIN,
        "draft-tree-hybrid": ["--spec", "draft", "--draft-model", path, "--draft-vocab", "hybrid"] + freq
                             + ["--hybrid-top", "512", "--tree-topk", "3", "--tree-depth", "3", "--tree-tokens", "10"],
    }


def freq_file(model):
    return str(MODELS[model].with_suffix(".freq.bin"))  # written by scripts/make_freq.sh


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec") / "prompts.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for text in spec_bench.first_turns(N_PROMPTS):
            f.write(json.dumps({"prompt": text}) + "\n")
    return path


def run_batch(model, prompts, extra):
    if not pathlib.Path(BIN).exists():
        pytest.fail(f"microspec binary not found at {BIN} (build it or set MICROSPEC_BIN)")
    if not MODELS[model].exists():
        pytest.fail(f"{MODELS[model]} is missing: run scripts/fetch_models.sh")
    cmd = [BIN, "generate", "-m", str(MODELS[model]), "--chat", "-n", str(N_TOKENS), "-t", "2",
           "--prompts-jsonl", str(prompts)] + extra
    p = subprocess.run(cmd, capture_output=True, timeout=1800)
    assert p.returncode == 0, f"{' '.join(cmd)} failed:\n{p.stderr.decode(errors='replace')[-2000:]}"
    rows = [json.loads(line) for line in p.stdout.decode("utf-8").splitlines() if line.strip()]
    assert len(rows) == N_PROMPTS
    return rows


def plain(model):
    """Plain greedy decoding of the prompts: server_helpers.cli_generate runs it once per session."""
    from server_helpers import cli_generate
    rows = cli_generate(MODELS[model], spec_bench.first_turns(N_PROMPTS), N_TOKENS, chat=True, extra=["-t", "2"])
    assert len(rows) == N_PROMPTS
    return rows


@pytest.mark.parametrize("model", ["smollm2", "gemma"])
@pytest.mark.parametrize("config", list(configs("smollm2")))
def test_spec_greedy_equals_plain(model, config, prompts_file):
    if not pathlib.Path(freq_file(model)).exists():
        pytest.fail(f"{freq_file(model)} is missing: run scripts/make_freq.sh")
    base = plain(model)
    rows = run_batch(model, prompts_file, configs(model)[config])
    mismatches = []
    for i, (a, b) in enumerate(zip(base, rows)):
        assert a["prompt_ids"] == b["prompt_ids"]
        if a["tokens"] != b["tokens"] or a["text"] != b["text"] or a["finish_reason"] != b["finish_reason"]:
            first = next((j for j, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y),
                         min(len(a["tokens"]), len(b["tokens"])))
            mismatches.append(f"prompt {i}: first difference at token {first} "
                              f"({a['tokens'][first:first + 3]} vs {b['tokens'][first:first + 3]})")
        s = b["spec"]
        assert s["steps"] >= 1 or len(b["tokens"]) <= 1
        assert s["accepted_draft_tokens"] <= s["drafted_tokens"]
        if s["steps"]:
            assert 1.0 <= s["mean_acceptance_length"] <= 1 + 10
        for k in ("draft_share", "verify_share", "lm_head_share"):
            assert 0.0 <= s[k] <= 1.0
    assert not mismatches, f"{model} {config}: {len(mismatches)} of {len(rows)} prompts differ:\n" + "\n".join(
        mismatches)
    # A draft that is the target itself (all its layers or its own file) must accept most tokens.
    if config.startswith("draft"):
        steps = sum(r["spec"]["steps"] for r in rows)
        accepted = sum(r["spec"]["accepted_draft_tokens"] for r in rows)
        assert (accepted + steps) / steps > 2.0
