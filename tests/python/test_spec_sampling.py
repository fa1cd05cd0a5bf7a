"""Speculative sampling on the real models, through the CLI.

The distribution itself is proven with power on small models in the C++ suite
(SpecSampling.OutputDistributionEqualsPlainSampling against the exact distribution, and
SpecSamplingPower, where four broken verifiers must fail). Here the real models check:
- that speculative and plain sampling give the same distribution of the first N_OUT tokens on
  SmolLM2 (test_output_distribution_equals_plain_sampling, bound derived there), with a
  self-drafted tree and with the requantized draft model as a chain;
- the parts around it: `--spec self --temp T` runs with every drafter and filter combination, a
  seed reproduces its output, different seeds differ, stop strings and token limits hold, and the
  acceptance statistics are reported and sane.
"""
import collections
import json
import math
import pathlib
import subprocess

import pytest

from repo_paths import BIN, MODELS  # noqa: E402
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
        ["--spec", "auto"],
    ],
    ids=["chain", "tree", "auto"],
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




def test_prompts_jsonl_row_seeds(tmp_path):
    """A --prompts-jsonl row's "seed" replaces --seed: the same seed gives the same tokens as a
    single run with --seed, and a seed that is not a non-negative integer is refused by line."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": PROMPT, "seed": s}) + "\n" for s in (7, 7, 8)))
    args = ["-n", "12", "--temp", "1.0", "--spec", "self", "--chat"]
    cmd = [BIN, "generate", "-m", str(MODELS["smollm2"]), "--prompts-jsonl", str(rows), "--seed", "3", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    a, b, c = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    assert [a["seed"], b["seed"], c["seed"]] == [7, 7, 8]
    assert a["tokens"] == b["tokens"] != c["tokens"]
    single = run("smollm2", *args[:-1], "--seed", "7")
    assert single["tokens"] == a["tokens"]
    rows.write_text(json.dumps({"prompt": PROMPT}) + "\n" + json.dumps({"prompt": PROMPT, "seed": -1}) + "\n")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and ':2: "seed" must be a non-negative integer' in out.stderr

# The distribution test: N_SAMPLES seeds per prompt and run, the first N_OUT tokens of each (the
# first from the prefill's logits, the second from the first verification: an accepted draft
# token or a draw from the residual), top-k TOP_K so that at most TOP_K ** N_OUT = 4 outcomes
# exist, top-p on (it cuts the second candidate where the first has >= 90% of the mass).
N_SAMPLES, N_OUT, TOP_K, TOP_P, ALPHA = 500, 2, 2, 0.9, 1e-4
# Per drafter: the prompt and the speculative settings, with the full draft vocabulary (a dynamic
# one on a 5-token prompt holds a dozen tokens and rejects nearly everything). A self-draft from
# 22 of the 30 layers in a tree of width 2 is often wrong (rejections, a second sibling accepted
# after the first is rejected; with 15 layers its top-2 never meets the target's on this prompt); the requantized model (draft_models.py) drafts a chain from a genuinely
# different distribution.
DIST_RUNS = {
    "self-tree": ("My favourite colour is",
                  ["--spec", "self", "--draft-layers", "22", "--draft-vocab", "full", "--tree-topk", "2",
                   "--tree-depth", "2", "--tree-tokens", "5"]),
    "requantized-chain": ("The weather today is",
                          ["--spec", "draft", "--draft-vocab", "full", "--tree-topk", "1", "--tree-depth", "3",
                           "--tree-tokens", "4"]),
}


def tv_bound(n, outcomes, alpha):
    """A threshold that the empirical total variation between two independent samples of n draws
    each from the SAME distribution over at most `outcomes` outcomes exceeds with probability
    below alpha. The empirical TV is the largest difference p1(A) - p2(A) over the sets A of
    outcomes; for one set that difference is a sum of 2n independent terms, each within a range of
    1/n, so Hoeffding gives P(>= t) <= exp(-n t^2); over all 2^outcomes sets,
    P(TV >= t) <= 2^outcomes exp(-n t^2), which is alpha at t = sqrt((ln(1/alpha) + outcomes ln 2) / n)."""
    return math.sqrt((math.log(1 / alpha) + outcomes * math.log(2)) / n)


def start_sampling(prompt, extra, first_seed, directory):
    """Starts one process that samples N_OUT tokens from `prompt` with seeds first_seed, first_seed
    + 1, ... (one --prompts-jsonl row per seed); -t 1, so that the runs share the cores."""
    rows = pathlib.Path(directory) / f"rows-{first_seed}.jsonl"
    rows.write_text("".join(json.dumps({"prompt": prompt, "seed": first_seed + s}) + "\n"
                            for s in range(N_SAMPLES)))
    cmd = [BIN, "generate", "-m", str(MODELS["smollm2"]), "--prompts-jsonl", str(rows), "-t", "1",
           "-n", str(N_OUT), "--ignore-eos", "--temp", "1.0", "--top-k", str(TOP_K), "--top-p", str(TOP_P), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), first_seed


def finish_sampling(started):
    proc, first_seed = started
    out, err = proc.communicate(timeout=1200)
    assert proc.returncode == 0, err[-2000:]
    results = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert [r["seed"] for r in results] == list(range(first_seed, first_seed + N_SAMPLES))
    assert all(len(r["tokens"]) == N_OUT for r in results)
    return collections.Counter(tuple(r["tokens"]) for r in results), results


@pytest.fixture(scope="module")
def distribution_samples(draft_model, tmp_path_factory):
    """Per drafter: (plain counts, speculative counts, speculative rows). All runs at once."""
    d = tmp_path_factory.mktemp("sampling")
    requantized = str(draft_model(MODELS["smollm2"]))
    started = {}
    for k, (name, (prompt, spec)) in enumerate(DIST_RUNS.items()):
        if "draft" in spec:
            spec = spec + ["--draft-model", requantized]
        # Seeds of the speculative runs differ from plain sampling's: with the same seed both would
        # draw the same first token, and the two samples would not be independent.
        started[name] = (start_sampling(prompt, [], 10_000 * k, d),
                         start_sampling(prompt, spec, 1_000_000 + 10_000 * k, d))
    out = {}
    for name, (plain_run, spec_run) in started.items():
        plain_counts, _ = finish_sampling(plain_run)
        spec_counts, spec_rows = finish_sampling(spec_run)
        out[name] = (plain_counts, spec_counts, spec_rows)
    return out


@pytest.mark.slow  # about a minute of sampling: left out of scripts/test.sh --quick
@pytest.mark.parametrize("drafter", list(DIST_RUNS))
def test_output_distribution_equals_plain_sampling(drafter, distribution_samples):
    """Speculative sampling's distribution of the first N_OUT = 2 tokens equals plain sampling's on
    SmolLM2: the empirical total variation between N_SAMPLES = 500 speculative and 500 plain draws
    stays below tv_bound(500, 4, 1e-4) = 0.155 (false-failure probability < 1e-4 per drafter), with
    top-k 2 and top-p 0.9 active. A shift of the true distribution by more than about twice that
    fails: this is a real-model check of the whole sampling path through the CLI; the power
    against subtle verifier bugs is in the C++ suite (SpecSamplingPower)."""
    plain_counts, spec_counts, rows = distribution_samples[drafter]
    # Each row's second token came from one verification: an accepted draft token or a residual draw.
    accepted = sum(1 for r in rows if r["spec"]["accepted_draft_tokens"] > 0)
    outcomes = set(plain_counts) | set(spec_counts)
    bound = tv_bound(N_SAMPLES, TOP_K ** N_OUT, ALPHA)
    tv = 0.5 * sum(abs(plain_counts[k] - spec_counts[k]) for k in outcomes) / N_SAMPLES
    print(f"{drafter}: {len(outcomes)} outcomes, TV {tv:.4f} (bound {bound:.4f}), a draft token accepted in "
          f"{accepted}/{len(rows)} runs")
    assert len(outcomes) <= TOP_K ** N_OUT
    # Drafts are both accepted and rejected, often enough that both branches shape the sample.
    assert 0.1 * len(rows) < accepted < 0.9 * len(rows)
    assert tv < bound
