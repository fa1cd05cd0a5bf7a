"""Penalties with speculative decoding on the real models: greedy output with --repeat-penalty and
--frequency-penalty is identical token for token with and without speculation (n-gram drafting,
self-drafting as a chain and as a tree), and the penalties change the output at all (else the
comparison would prove nothing). SpecBench first turns, through `microspec generate --json`."""
import pytest

from server_helpers import GEMMA, SMOLLM2, cli_generate
from spec_bench import first_turns

PENALTIES = ["--repeat-penalty", "1.3", "--frequency-penalty", "0.5"]
N_PREDICT = 48
SPECS = {
    "ngram": ["--spec", "ngram"],
    "self-chain": ["--spec", "self", "--tree-topk", "1"],
    "self-tree": ["--spec", "self", "--tree-depth", "3", "--tree-topk", "2", "--tree-tokens", "8"],
}


@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("model", [SMOLLM2, GEMMA], ids=["smollm2", "gemma"])
def test_greedy_with_penalties_is_identical_with_speculation(model, spec):
    prompts = first_turns(6)  # 6: n-gram drafts get accepted on both models despite the penalties
    plain = cli_generate(model, prompts, N_PREDICT, chat=True, extra=["--spec", "none", *PENALTIES])
    unpenalised = cli_generate(model, prompts, N_PREDICT, chat=True, extra=["--spec", "none"])
    assert [r["tokens"] for r in plain] != [r["tokens"] for r in unpenalised], "the penalties changed nothing"
    got = cli_generate(model, prompts, N_PREDICT, chat=True, extra=[*SPECS[spec], *PENALTIES])
    for want, have in zip(plain, got):
        assert have["tokens"] == want["tokens"]
    # Speculation ran and drafts were accepted, so the equality covers verified tree rows.
    assert sum(r["spec"]["accepted_draft_tokens"] for r in got) > 0


def test_logit_bias_and_min_p_flags(tmp_path):
    """--logit-bias TOKEN+BIAS forces a token; a malformed value is an error naming the flag."""
    import subprocess
    from repo_paths import BIN
    base = cli_generate(SMOLLM2, ["The capital of France is"], 8, chat=False, extra=["--spec", "none"])[0]
    forced_id = base["tokens"][0] + 1
    forced = cli_generate(SMOLLM2, ["The capital of France is"], 8, chat=False,
                          extra=["--spec", "none", "--logit-bias", f"{forced_id}+100", "--min-p", "0.05"])[0]
    assert forced["tokens"] == [forced_id] * 8
    bad = subprocess.run([BIN, "generate", "-m", str(SMOLLM2), "-p", "x", "-n", "1", "--logit-bias", "12x3"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--logit-bias" in bad.stderr


@pytest.mark.parametrize("flag", [["--presence-penalty", "0.5"], ["--repeat-penalty", "1.1"], ["--min-p", "0.05"],
                                  ["--logit-bias", "5+1"]])
def test_device_cuda_refuses_penalties(flag):
    """The device applies no penalties: --device cuda refuses them (before it looks for a GPU)."""
    import subprocess
    from repo_paths import BIN
    out = subprocess.run([BIN, "generate", "-m", str(SMOLLM2), "-p", "x", "-n", "1", "--device", "cuda", *flag],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "not supported on the device" in out.stderr, out.stderr
