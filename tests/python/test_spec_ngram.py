"""N-gram drafting is lossless on both real models: greedy output of `--spec ngram` (prompt lookup,
no weights) and `--spec self+ngram` (an n-gram match of at least --ngram-first tokens drafts, else
self-drafting with the dynamic vocabulary) and of `--spec auto` (the default: each step an n-gram
chain, the model drafter or a plain step) equals plain greedy decoding token for token.

`microspec generate --json --chat -n 128 --prompts-jsonl` over SpecBench first turns spread across
the categories (coding among them), one process per model and configuration. The plain baseline
comes from server_helpers.cli_generate, which runs it once per session. Every prompt's tokens, text
and finish reason must be identical, and the drafts must have been accepted at times (for ngram
that is the n-gram side; that both sides of self+ngram draft is shown on tiny models in
tests/test_spec_tiny.cpp, SpecTiny.NgramDraftingMatchesPlain).

MICROSPEC_NGRAM_PROMPTS (default 6: coding, extraction, humanities, math, math_reasoning, qa) sets
how many prompts each configuration runs. Six runs of 6 prompts x 128 tokens (two n-gram
configurations: the default cut and the whole continuation, and self+ngram, on both models).
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import spec_bench  # noqa: E402
from server_helpers import cli_generate, output_difference  # noqa: E402

# A real-model sweep, as test_spec_greedy.py: left out of scripts/test.sh --quick.
pytestmark = pytest.mark.slow

from repo_paths import BIN, MODELS  # noqa: E402
N_PROMPTS = int(os.environ.get("MICROSPEC_NGRAM_PROMPTS", "6"))
N_TOKENS = 128

CONFIGS = {
    # The defaults: chains cut where this generation's acceptance counts say they stop paying.
    "ngram": ["--spec", "ngram"],
    # The whole continuation of a longer chain: overlapping copies (a continuation that runs into
    # the suffix) get exercised.
    "ngram-whole": ["--spec", "ngram", "--ngram-min", "1", "--tree-tokens", "6", "--ngram-min-accept", "0"],
    "self+ngram-dynamic": ["--spec", "self+ngram", "--draft-vocab", "dynamic", "--ngram-first", "2",
                           "--ngram-min", "2"],
    # The default: each step an n-gram chain, the model drafter (the shipped head) or a plain step,
    # with costs of its own (cheap_step_costs).
    "auto": [],
}


def prompts():
    return spec_bench.first_turns(N_PROMPTS)


def cheap_step_costs(model, tmp_path):
    """A step-costs file for auto in which verified rows are cheap: a row adds a tenth of a one-row
    forward. Written by the engine first (so it carries this machine's key), then its seconds
    replaced, so that which options auto takes does not depend on how busy the machine was when it
    measured: with cheap rows the model drafter's probes run and its steps get verified too."""
    path = tmp_path / "step-costs.json"
    cmd = [BIN, "generate", "-m", str(MODELS[model]), "-p", "Hi", "-n", "1", "-t", "2", "--step-costs", str(path)]
    p = subprocess.run(cmd, capture_output=True, timeout=300)
    assert p.returncode == 0, p.stderr.decode(errors="replace")[-2000:]
    costs = json.loads(path.read_text())
    one, head_share = costs["forward"][0], costs["lm_head"][0] / costs["forward"][0]
    costs["forward"] = [one * (1 + 0.1 * (r - 1)) for r in costs["rows"]]
    costs["lm_head"] = [f * head_share for f in costs["forward"]]
    path.write_text(json.dumps(costs))
    return path


def run_batch(model, extra, tmp_path):
    path = tmp_path / "prompts.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for text in prompts():
            f.write(json.dumps({"prompt": text}) + "\n")
    cmd = [BIN, "generate", "-m", str(MODELS[model]), "--chat", "-n", str(N_TOKENS), "-t", "2",
           "--prompts-jsonl", str(path)] + extra
    p = subprocess.run(cmd, capture_output=True, timeout=900)
    assert p.returncode == 0, f"{' '.join(cmd)} failed:\n{p.stderr.decode(errors='replace')[-2000:]}"
    rows = [json.loads(line) for line in p.stdout.decode("utf-8").splitlines() if line.strip()]
    assert len(rows) == N_PROMPTS
    return rows


@pytest.mark.parametrize("model", ["smollm2", "gemma"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_ngram_greedy_equals_plain(model, config, tmp_path):
    if not pathlib.Path(BIN).exists():
        pytest.fail(f"microspec binary not found at {BIN} (build it or set MICROSPEC_BIN)")
    if not MODELS[model].exists():
        pytest.fail(f"{MODELS[model]} is missing: run scripts/fetch_models.sh")
    base = cli_generate(MODELS[model], prompts(), N_TOKENS, chat=True, extra=["-t", "2"])
    extra = CONFIGS[config] + (["--step-costs", str(cheap_step_costs(model, tmp_path))] if config == "auto" else [])
    rows = run_batch(model, extra, tmp_path)
    mismatches = []
    for i, (a, b) in enumerate(zip(base, rows)):
        assert a["prompt_ids"] == b["prompt_ids"]
        difference = output_difference(i, a, b)
        if difference:
            mismatches.append(difference)
        s = b["spec"]
        assert s["accepted_draft_tokens"] <= s["drafted_tokens"]
    assert not mismatches, f"{model} {config}: {len(mismatches)} of {len(rows)} prompts differ:\n" + "\n".join(
        mismatches)
    steps = sum(r["spec"]["steps"] for r in rows)
    drafted = sum(r["spec"]["drafted_tokens"] for r in rows)
    accepted = sum(r["spec"]["accepted_draft_tokens"] for r in rows)
    # The drafter really drafted and was right at times (chat replies repeat the prompt's words).
    assert drafted > 0 and accepted > 0, f"{model} {config}: drafted {drafted}, accepted {accepted}"
    assert (accepted + steps) / steps > 1.05
    if config == "auto":
        assert all(r["spec"]["mode"] == "auto" for r in rows)
        by = {k: sum(r["spec"]["steps_by_drafter"][k]["steps"] for r in rows) for k in ("plain", "n-gram", "model")}
        assert sum(by.values()) == steps and by["n-gram"] > 0 and by["model"] > 0, by
    if config.startswith("ngram"):
        # No LM head: the draft vocabulary is empty and the draft LM head costs nothing.
        assert all(r["spec"]["mean_active_vocab"] == 0 for r in rows)
