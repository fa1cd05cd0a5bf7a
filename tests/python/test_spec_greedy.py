"""Speculative greedy decoding equals plain greedy decoding, token for token, on both real models,
for every drafter with every draft vocabulary, and every tree shape with every drafter and every
vocabulary.

The property that makes greedy speculation lossless (each verification row's logits equal plain
single-token decoding's, bit for bit) is proven directly by the C++ test VerifyBitExact on both
models. This sweep checks everything around it end to end, through `microspec generate --json
--chat`: drafting, acceptance, KV commit and eviction, the draft vocabularies, the token sink.

Factors (per model):
- drafter: self-drafting with a good layer count (all but the last eighth or so) and a poor one
  (often wrong, so rejection at the root and partial acceptance are exercised); a separate draft
  model that is the target file itself (accepts almost everything); and a genuinely different
  draft model, the target requantized to Q4_0 by llama.cpp (draft_models.py);
- draft vocabulary: full, freq (FR-Spec), dynamic (MicroSpec), hybrid;
- tree shape: a chain (top-k 1, depth 4), a small tree (top-k 2, depth 2, nodes under a path
  probability of 0.2 cut: --draft-p-min), a wide tree (top-k 3, depth 3, 10 nodes, cut under 0.05)
  and the default tree.
All 16 drafter x vocabulary pairs run, each with the tree shape (d + v) mod 4, a Latin square: every
tree shape meets every drafter and every vocabulary exactly once. The dynamic-vocabulary runs of
the two separate-model drafters use a window small enough to evict within a reply (128 entries)
and gather on the calling thread (--no-async-gather).

Each configuration runs in one process (--prompts-jsonl) over PROMPTS_PER_CONFIG SpecBench prompts
(N_TOKENS tokens each), the configurations taking successive, overlapping slices of a pool of
POOL prompts spread over all 13 categories; plain decoding of the pool runs once per session
(server_helpers.cli_generate). Every prompt's tokens, text and finish reason must equal plain
decoding's, and the statistics must be sane: a draft model that is the target file must reach a
mean acceptance length > 2.0 over its prompts (measured 2.18-4.90), the requantized one > 1.4
(measured 1.63-4.48; the lowest with the dynamic vocabulary's evicting window on SmolLM2).
"""
import json
import pathlib
import subprocess

import pytest

import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import spec_bench  # noqa: E402

# A real-model sweep (about a minute per model): left out of scripts/test.sh --quick.
pytestmark = pytest.mark.slow

from repo_paths import BIN, MODELS  # noqa: E402
from server_helpers import output_difference  # noqa: E402
POOL, PROMPTS_PER_CONFIG, N_TOKENS = 16, 3, 48

# Draft-layer counts per model: one that drafts well and one that is often wrong.
LAYERS = {"gemma": (16, 12), "smollm2": (27, 15)}
DRAFTERS = ["self-good", "self-poor", "draft-same-file", "draft-requantized"]
VOCABS = ["full", "freq", "dynamic", "hybrid"]
TREES = {
    "chain": ["--tree-topk", "1", "--tree-depth", "4", "--tree-tokens", "5"],
    "small-tree": ["--tree-topk", "2", "--tree-depth", "2", "--tree-tokens", "5", "--draft-p-min", "0.2"],
    "wide-tree": ["--tree-topk", "3", "--tree-depth", "3", "--tree-tokens", "10", "--draft-p-min", "0.05"],
    "default-tree": [],
}
# Smallest mean acceptance length per separate draft model (accepted draft tokens + 1 per step).
MIN_ACCEPTANCE_LENGTH = {"draft-same-file": 2.0, "draft-requantized": 1.4}


def config_names():
    """(drafter, vocabulary, tree) of every configuration: all drafter x vocabulary pairs, the tree
    shape a Latin square over them."""
    trees = list(TREES)
    return [(d, v, trees[(i + j) % len(trees)]) for i, d in enumerate(DRAFTERS) for j, v in enumerate(VOCABS)]


def config_args(model, drafter, vocab, tree, requantized):
    good, poor = LAYERS[model]
    args = {
        "self-good": ["--spec", "self", "--draft-layers", str(good)],
        "self-poor": ["--spec", "self", "--draft-layers", str(poor)],
        "draft-same-file": ["--spec", "draft", "--draft-model", str(MODELS[model])],
        "draft-requantized": ["--spec", "draft", "--draft-model", str(requantized)],
    }[drafter] + ["--draft-vocab", vocab]
    if vocab in ("freq", "hybrid"):
        args += ["--freq-file", freq_file(model)]
    if vocab == "hybrid":
        args += ["--hybrid-top", "512"]
    if vocab == "dynamic" and drafter.startswith("draft"):
        # A window small enough to evict within a reply, and the gather on the calling thread.
        args += ["--vocab-window", "128", "--no-async-gather"]
    return args + TREES[tree]


def freq_file(model):
    return str(MODELS[model].with_suffix(".freq.bin"))  # written by scripts/make_freq.sh


def prompt_slice(index):
    """Indices into the pool of configuration `index`'s prompts: successive slices, wrapping."""
    return [(index * PROMPTS_PER_CONFIG + k) % POOL for k in range(PROMPTS_PER_CONFIG)]


def run_batch(model, prompts, extra, tmp_path):
    if not pathlib.Path(BIN).exists():
        pytest.fail(f"microspec binary not found at {BIN} (build it or set MICROSPEC_BIN)")
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts), encoding="utf-8")
    cmd = [BIN, "generate", "-m", str(MODELS[model]), "--chat", "-n", str(N_TOKENS), "-t", "2",
           "--prompts-jsonl", str(path)] + extra
    p = subprocess.run(cmd, capture_output=True, timeout=1800)
    assert p.returncode == 0, f"{' '.join(cmd)} failed:\n{p.stderr.decode(errors='replace')[-2000:]}"
    rows = [json.loads(line) for line in p.stdout.decode("utf-8").splitlines() if line.strip()]
    assert len(rows) == len(prompts)
    return rows


def plain(model):
    """Plain greedy decoding of the pool: server_helpers.cli_generate runs it once per session. It
    multiplies the file's weights as stored (--no-repack) while every speculative run uses the
    default repacked layout, so the sweep also shows the two layouts give the same tokens."""
    from server_helpers import cli_generate
    rows = cli_generate(MODELS[model], spec_bench.first_turns(POOL), N_TOKENS, chat=True,
                        extra=["-t", "2", "--no-repack"])
    assert len(rows) == POOL
    return rows


def test_the_configurations_cover_every_pair():
    names = config_names()
    assert len(set(names)) == len(DRAFTERS) * len(VOCABS)
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert len({(n[a], n[b]) for n in names}) == len({n[a] for n in names}) * len({n[b] for n in names})
    # Every pool prompt is used by some configuration.
    assert {i for k in range(len(names)) for i in prompt_slice(k)} == set(range(POOL))


@pytest.mark.parametrize("model", ["smollm2", "gemma"])
@pytest.mark.parametrize("index,name", list(enumerate(config_names())), ids=lambda x: "-".join(x)
                         if isinstance(x, tuple) else str(x))
def test_spec_greedy_equals_plain(model, index, name, draft_model, tmp_path):
    drafter, vocab, tree = name
    if not MODELS[model].exists():
        pytest.fail(f"{MODELS[model]} is missing: run scripts/fetch_models.sh")
    if not pathlib.Path(freq_file(model)).exists():
        pytest.fail(f"{freq_file(model)} is missing: run scripts/make_freq.sh")
    requantized = draft_model(MODELS[model]) if drafter == "draft-requantized" else None
    pool, texts = plain(model), spec_bench.first_turns(POOL)
    chosen = prompt_slice(index)
    base = [pool[i] for i in chosen]
    rows = run_batch(model, [texts[i] for i in chosen], config_args(model, drafter, vocab, tree, requantized),
                     tmp_path)
    mismatches = []
    for i, a, b in zip(chosen, base, rows):
        assert a["prompt_ids"] == b["prompt_ids"]
        difference = output_difference(i, a, b)
        if difference:
            mismatches.append(difference)
        s = b["spec"]
        assert s["steps"] >= 1 or len(b["tokens"]) <= 1
        assert s["accepted_draft_tokens"] <= s["drafted_tokens"]
        if s["steps"]:
            # At least the bonus token, at most the deepest path (depth + 1 levels) + the bonus.
            assert 1.0 <= s["mean_acceptance_length"] <= 1 + 10
        for k in ("draft_share", "verify_share", "lm_head_share"):
            assert 0.0 <= s[k] <= 1.0
    assert not mismatches, f"{model} {name}: {len(mismatches)} of {len(rows)} prompts differ:\n" + "\n".join(
        mismatches)
    steps = sum(r["spec"]["steps"] for r in rows)
    accepted = sum(r["spec"]["accepted_draft_tokens"] for r in rows)
    print(f"{model} {name}: mean acceptance length {(accepted + steps) / steps:.2f} over {steps} steps")
    if drafter in MIN_ACCEPTANCE_LENGTH:
        assert (accepted + steps) / steps > MIN_ACCEPTANCE_LENGTH[drafter]
