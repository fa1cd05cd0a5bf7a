"""`--spec head` (an EAGLE-3 draft head) keeps greedy output identical to plain greedy decoding on
both real models, with every draft vocabulary (full, freq, dynamic, hybrid), and `--spec head+ngram`
(n-gram matches first, the head otherwise) with the dynamic vocabulary and the head's chains cut
under a path probability of 0.2 (`--draft-p-min 0.2`).

The head is the committed one under models/heads/ when present (found by default beside the model),
else a random head written here in llama.cpp's eagle3 layout (scripts/draft_head_gguf.py) for the
model's hidden size and EAGLE-3's layers (2, L/2, L-3): the output must be lossless whatever the
head predicts. SpecBench prompts, one `generate --prompts-jsonl` process per configuration.
Also: a head made for the other model is refused naming both values, and a head written here
loads in llama.cpp itself (llama-cpp-python's loader checks the eagle3 metadata and every
tensor's name and shape).
"""
import json
import pathlib
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from repo_paths import BIN, MODELS, REPO  # noqa: E402
sys.path.insert(0, str(REPO / "scripts"))

import draft_head_gguf  # noqa: E402
import gguf_files  # noqa: E402
import spec_bench  # noqa: E402
from server_helpers import cli_generate  # noqa: E402

# About a minute for both models on a quiet 2-core machine: left out of scripts/test.sh --quick.
pytestmark = pytest.mark.slow

N_PROMPTS = 5
N_TOKENS = 64
VOCABS = ["full", "freq", "dynamic", "hybrid"]


def committed_head(model):
    path = MODELS[model].parent / "heads" / (MODELS[model].stem + ".eagle3.gguf")
    return path if path.exists() else None


def random_head_file(model, path):
    """A random head for the model in llama.cpp's layout, with the target's tokenizer metadata (the
    target read once per session, gguf_files.py)."""
    target = gguf_files.reader(MODELS[model])
    n_embd, n_layer, _ = draft_head_gguf.target_info(target)
    cfg = dict(n_embd=n_embd, n_head=4, n_head_kv=2, head_dim=n_embd // 4, n_ff=2 * n_embd, rms_eps=1e-6,
               rope_base=10000.0, target_layers=draft_head_gguf.default_layers(n_layer), target_hidden=n_embd,
               norm_before_fc=True)
    weights = draft_head_gguf.random_head(n_embd, 4, 2, n_embd // 4, 2 * n_embd, seed=3, norm_before_fc=True)
    draft_head_gguf.write_head(path, weights, cfg, "q8_0", tokenizer_from=target)
    return path


@pytest.fixture(scope="module")
def random_heads(tmp_path_factory):
    """random_heads(model) -> a random head file for the model, written on first use: the same file
    (its weights come from a fixed seed) serves every test below that needs one."""
    directory, written = tmp_path_factory.mktemp("random-heads"), {}

    def head(model):
        if model not in written:
            written[model] = random_head_file(model, directory / f"{model}.gguf")
        return written[model]
    return head


@pytest.fixture(scope="module")
def heads(random_heads):
    """model -> head file: the committed one, else a random head for the model."""
    out = {}
    for model, path in MODELS.items():
        if not path.exists():
            pytest.fail(f"{path} is missing: run scripts/fetch_models.sh")
        out[model] = committed_head(model) or random_heads(model)
    return out


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("head") / "prompts.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for text in spec_bench.first_turns(N_PROMPTS):
            f.write(json.dumps({"prompt": text}) + "\n")
    return path


def run(model, prompts, extra):
    cmd = [BIN, "generate", "-m", str(MODELS[model]), "--chat", "-n", str(N_TOKENS), "-t", "2",
           "--prompts-jsonl", str(prompts)] + extra
    p = subprocess.run(cmd, capture_output=True, timeout=900)
    return p, cmd


@pytest.mark.parametrize("model", ["smollm2", "gemma"])
@pytest.mark.parametrize("mode,vocab", [("head", v) for v in VOCABS] + [("head+ngram", "dynamic")])
def test_head_greedy_equals_plain(model, mode, vocab, heads, prompts_file):
    base = cli_generate(MODELS[model], spec_bench.first_turns(N_PROMPTS), N_TOKENS, chat=True, extra=["-t", "2"])
    extra = ["--spec", mode, "--draft-head", str(heads[model]), "--draft-vocab", vocab]
    if vocab in ("freq", "hybrid"):
        extra += ["--freq-file", str(MODELS[model].with_suffix(".freq.bin"))]
    if mode == "head+ngram":
        extra += ["--draft-p-min", "0.2"]  # the head's chains cut under a path probability of 0.2
    p, cmd = run(model, prompts_file, extra)
    assert p.returncode == 0, f"{' '.join(cmd)} failed:\n{p.stderr.decode(errors='replace')[-2000:]}"
    rows = [json.loads(line) for line in p.stdout.decode("utf-8").splitlines() if line.strip()]
    assert len(rows) == N_PROMPTS
    drafted = 0
    for i, (a, b) in enumerate(zip(base, rows)):
        assert a["prompt_ids"] == b["prompt_ids"]
        assert b["tokens"] == a["tokens"], f"{model} {mode} {vocab}: prompt {i} differs from plain decoding"
        assert b["text"] == a["text"] and b["finish_reason"] == a["finish_reason"]
        drafted += b["spec"]["drafted_tokens"]
        assert b["spec"]["accepted_draft_tokens"] <= b["spec"]["drafted_tokens"]
    assert drafted > 0, "the head never drafted"


def test_head_for_another_model_is_refused(prompts_file, random_heads):
    # A SmolLM2 head (hidden size 576, layers of a 30-layer model) on Gemma (640, 18 layers).
    head = random_heads("smollm2")
    p, cmd = run("gemma", prompts_file, ["--spec", "head", "--draft-head", str(head)])
    err = p.stderr.decode(errors="replace")
    assert p.returncode != 0
    assert "target_hidden_size" in err and "is 576, expected 640" in err, err


def test_head_file_loads_in_llama_cpp(random_heads):
    code = ("import llama_cpp, sys\n"
            "llama_cpp.llama_backend_init()\n"
            "m = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), llama_cpp.llama_model_default_params())\n"
            "print('LOADED' if m else 'FAILED')\n")
    for model in MODELS:
        head = random_heads(model)
        p = subprocess.run([sys.executable, "-c", code, str(head)], capture_output=True, text=True, timeout=300)
        assert "LOADED" in p.stdout, f"llama.cpp did not load the {model} head:\n{p.stderr[-3000:]}"
        assert "EAGLE3 extract_layers" in p.stderr
