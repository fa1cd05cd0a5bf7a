"""The architectures without a real model in the suite, each checked three ways on files of its
real structure (GGUF as llama.cpp names it):

- tiny random models written by the `gguf` package (tiny_gguf.py: qwen3, llama with Llama 3 RoPE
  scaling and no BOS, gemma2, phi3): teacher forcing against the float64 reference
  (reference_forward.py) and llama.cpp (llama-cpp-python) on the same file;
- the same files: speculative greedy decoding (self-draft with the full and with a dynamic draft
  vocabulary) equals plain greedy decoding token for token;
- transformers goldens (scripts/make_arch_goldens.py, tests/data/arch_golden): models of the real
  transformers classes (Qwen3, Llama with llama3 rope_scaling, Mistral, Gemma2, Gemma3 text-only
  with and without 4B+'s linear RoPE scaling,
  Phi3 with LongRoPE and partial rotary), converted by llama.cpp's own convert_hf_to_gguf.py, and
  transformers' float32 logits for one sequence: microspec's logits must match them.

Each check runs microspec once per file (eval / generate over several sequences in one process).
"""
import json
import pathlib
import subprocess
import sys
import tempfile

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import peer as peer_lib  # noqa: E402
from repo_paths import BIN, REPO  # noqa: E402
from test_model_conformance import cosines, run_eval  # noqa: E402

TINY = ["qwen3", "llama3", "gemma2", "phi3"]
GOLDEN = ["qwen3", "llama3", "mistral", "gemma2", "gemma3", "gemma3_linear", "phi3"]
GOLDEN_DIR = REPO / "tests/data/arch_golden"


@pytest.fixture(scope="module", params=TINY)
def tiny(request, tmp_path_factory):
    from tiny_gguf import write_tiny_model
    kind = request.param
    return kind, write_tiny_model(kind, tmp_path_factory.mktemp(kind) / f"tiny-{kind}.gguf")


def tiny_sequences(kind, n_seq=2, length=64):
    from tiny_gguf import n_vocab
    rng = np.random.default_rng(5)
    bos = [] if kind == "llama3" else [1]  # the llama3 file asks for no BOS
    return [bos + [int(t) for t in rng.integers(3, n_vocab(kind), length - len(bos))] for _ in range(n_seq)]


def test_tiny_against_float64_and_llama_cpp(tiny):
    """Teacher forcing over two 64-token sequences (past gemma2's 8-token window, past phi3's
    32-token original context). Asserted: our minimum cosine to the float64 model >= 0.999, our
    mean at most 0.0003 below llama.cpp's on the same file, top-1 equal to the float64 model's at
    >= 95% of positions. llama.cpp agreeing with the reference as closely also checks the
    reference's code for the architecture."""
    from reference_forward import ReferenceModel
    kind, path = tiny
    seqs = tiny_sequences(kind)
    truth = ReferenceModel(path).logits_many(seqs, [None] * len(seqs))
    ours = run_eval(path, [(ids, list(range(len(ids)))) for ids in seqs])
    peer = peer_lib.Peer(path, n_ctx=128)
    theirs = [peer.teacher_forcing(ids, [], list(range(len(ids))))[2].astype(np.float32) for ids in seqs]
    peer.close()
    ours_cos = np.concatenate([cosines(rows, t) for (_, rows), t in zip(ours, truth)])
    peer_cos = np.concatenate([cosines(rows, t) for rows, t in zip(theirs, truth)])
    top1 = np.mean(np.concatenate([top1 == t.argmax(1) for (top1, _), t in zip(ours, truth)]))
    print(f"tiny {kind}: cosine to float64 min/mean microspec {ours_cos.min():.6f}/{ours_cos.mean():.6f}, "
          f"llama.cpp {peer_cos.min():.6f}/{peer_cos.mean():.6f}; top-1 = float64 at {top1:.3f}")
    assert peer_cos.min() >= 0.999, "llama.cpp disagrees with the float64 reference: check reference_forward.py"
    assert ours_cos.min() >= 0.999
    assert ours_cos.mean() >= peer_cos.mean() - 0.0003
    assert top1 >= 0.95


def generate_ids(path, prompts, n, extra):
    with tempfile.TemporaryDirectory() as d:
        jsonl = pathlib.Path(d) / "prompts.jsonl"
        jsonl.write_text("".join(json.dumps({"prompt_ids": ids}) + "\n" for ids in prompts))
        cmd = [BIN, "generate", "-m", str(path), "--prompts-jsonl", str(jsonl), "-n", str(n), "--ignore-eos",
               "-t", "2"] + extra
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.strip()]
    assert len(rows) == len(prompts)
    return rows


_plain = {}


@pytest.mark.parametrize("drafter", ["self", "draft"])
@pytest.mark.parametrize("vocab", ["full", "dynamic"])
def test_tiny_speculative_greedy_equals_plain(tiny, drafter, vocab, tmp_path):
    """Speculative greedy decoding of 3 prompts x 40 tokens equals plain greedy decoding token for
    token, drafting with the target's layers but the last (self: drafts often accepted) or with
    another random model of the same architecture and vocabulary (draft: seed 2, drafts mostly
    rejected), through the full or
    a dynamic draft vocabulary (gemma2's final soft-capping runs in the draft vocabulary's LM-head
    paths too)."""
    from tiny_gguf import write_tiny_model
    kind, path = tiny
    prompts = [ids[:12] for ids in tiny_sequences(kind, n_seq=3)]
    if kind not in _plain:
        _plain[kind] = generate_ids(path, prompts, 40, [])
    plain = _plain[kind]
    from tiny_gguf import SPECS
    args = ["--spec", "self", "--draft-layers", str(SPECS[kind]["layers"] - 1)]
    if drafter == "draft":
        args = ["--spec", "draft", "--draft-model", str(write_tiny_model(kind, tmp_path / "draft.gguf", seed=2))]
    spec = generate_ids(path, prompts, 40, args + ["--draft-vocab", vocab])
    for a, b in zip(plain, spec):
        assert b["tokens"] == a["tokens"], f"{kind} {drafter} {vocab}: speculative output differs from plain"
    steps = sum(r["spec"]["steps"] for r in spec)
    accepted = sum(r["spec"]["accepted_draft_tokens"] for r in spec)
    distinct = len({t for r in plain for t in r["tokens"]})
    print(f"tiny {kind} {drafter} {vocab}: mean acceptance length {(accepted + steps) / max(steps, 1):.2f} over "
          f"{steps} steps; {distinct} distinct tokens in the plain output")
    assert steps > 0


def test_no_bos_file_tokenizes_as_llama_cpp(tmp_path):
    """A llama file with tokenizer.ggml.add_bos_token false (as Llama 3 base conversions and others
    have): prompt ids from text equal llama.cpp's, without a BOS."""
    from tiny_gguf import write_tiny_model
    path = write_tiny_model("llama3", tmp_path / "tiny-llama3.gguf")
    texts = ["w5 w17 w300", "w1900 w42", "w7w8 w3 w"]
    with tempfile.TemporaryDirectory() as d:
        jsonl = pathlib.Path(d) / "prompts.jsonl"
        jsonl.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
        res = subprocess.run([BIN, "generate", "-m", str(path), "--prompts-jsonl", str(jsonl), "-n", "1", "-t", "2"],
                             capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    ours = [json.loads(line)["prompt_ids"] for line in res.stdout.splitlines() if line.strip()]
    peer = peer_lib.Peer(path, n_ctx=64)
    theirs = [peer.tokenize(t) for t in texts]
    peer.close()
    assert ours == theirs
    assert all(ids[0] != 1 for ids in ours)


@pytest.mark.parametrize("kind,defect,message", [
    ("qwen3", "rope_scaling_yarn", "rope scaling 'yarn' is not supported"),
    ("phi3", "fused_qkv_rows", "tensor 'blk.0.attn_qkv.weight' has shape [64, 120], expected [64, 128]"),
    ("llama3", "rope_freqs_length", "tensor 'rope_freqs.weight' has shape [9], expected [8]"),
])
def test_bad_files_are_refused_at_load(kind, defect, message, tmp_path):
    """A file whose metadata or tensor shapes do not fit its architecture: a one-line error naming
    the file and what was expected against what was found, non-zero exit, no crash."""
    from tiny_gguf import write_tiny_model
    path = write_tiny_model(kind, tmp_path / f"{kind}-{defect}.gguf", defect=defect)
    res = subprocess.run([BIN, "generate", "-m", str(path), "--prompt-ids", "1 5 7", "-n", "1", "-t", "1"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode not in (0, -6, -11), res.stderr
    assert message in res.stderr and path.name in res.stderr, res.stderr


@pytest.mark.parametrize("name", GOLDEN)
def test_transformers_golden(name):
    """microspec on the GGUF that llama.cpp's converter wrote from a transformers model, against
    transformers' float32 logits over 48 positions. The weights are F16 in both (the script rounds
    them), so the difference is microspec's 8-bit activations and half-float KV cache only.
    Measured: cosine >= 0.999999 at every position, max |difference| <= 0.08% of the logits' spread
    (max - min), top-1 equal at every position (llama.cpp on the same files: <= 0.12%). Asserted:
    cosine >= 0.9999 at every position, max |difference| <= 0.5% of the spread at every position,
    top-1 equal wherever transformers' top-2 margin is >= 0.1 logits."""
    z = np.load(GOLDEN_DIR / f"{name}.npz")
    ids, truth = [int(t) for t in z["ids"]], z["logits"]
    [(top1, rows)] = run_eval(GOLDEN_DIR / f"{name}.gguf", [(ids, list(range(len(ids))))])
    cos = cosines(rows, truth)
    spread = truth.max(1) - truth.min(1)
    rel = np.abs(rows - truth).max(1) / spread
    srt = np.sort(truth, 1)
    clear = srt[:, -1] - srt[:, -2] >= 0.1
    agree = top1 == truth.argmax(1)
    print(f"{name}: cosine to transformers min {cos.min():.6f}; max |diff| / spread {rel.max():.4f}; "
          f"top-1 equal at {agree[clear].sum()}/{clear.sum()} clear positions ({agree.sum()}/{len(agree)} in all)")
    assert cos.min() >= 0.9999
    assert rel.max() <= 0.005
    assert agree[clear].all()
