"""scripts/target_torch.py, the target's forward in PyTorch that trains a draft head on a GPU,
against `microspec features` on both shipped models: the same token ids in, and per position
the residual streams entering the head's layers and the target's top-k log-probabilities out.

microspec rounds activations to 8 bits before each quantized product and the PyTorch forward does
not, so the two agree up to that rounding: each feature layer within 3% (relative L2 over the
sequence), the best next token the same at 95% of positions or more, and its log-probability
within 0.1 on average and 0.5 at most where it is (the engine's rounding moves a few uncertain
positions by 0.25). Mutants fail it by far: RoPE on adjacent pairs for Gemma moves its features
by 8-20% and leaves the best token the same at 42% of positions; the global RoPE base on its
sliding layers, by 3-9% and at 82%.

Needs torch (the training requirements, scripts/requirements-train.txt), which CI does not
install: skipped there, as tests/python/test_train_draft_head.py is.
"""
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(pathlib.Path(__file__).parent))
import features_file  # noqa: E402
import target_torch  # noqa: E402
from repo_paths import BIN, MODELS  # noqa: E402

CONVERSATIONS = [
    [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."},
     {"role": "assistant", "content": "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
                                      "    return a"}],
    [{"role": "user", "content": "What is the capital of France, and why is it famous?"},
     {"role": "assistant", "content": "The capital of France is Paris. It is famous for the Eiffel Tower, the "
                                      "Louvre and its cafes."}],
]
TOP_K = 8


@pytest.mark.parametrize("model, layers", [("smollm2", [2, 15, 27]), ("gemma", [2, 9, 15])])
def test_torch_features_match_the_engine(model, layers, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "f.bin"
    inp.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    p = subprocess.run([BIN, "features", "-m", str(MODELS[model]), "--input", str(inp), "-o", str(out), "--layers",
                        ",".join(map(str, layers)), "--top-k", str(TOP_K), "-t", "2"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    (tmp_path / "f.idx.jsonl").write_text(p.stdout)
    target = target_torch.TargetModel(MODELS[model])
    seqs = features_file.read(out, tmp_path / "f.idx.jsonl", len(layers), target.d, TOP_K)
    for seq in seqs:
        feats, top_ids, top_logp = target.features(torch.from_numpy(seq.ids.astype(np.int64))[None], layers, TOP_K)
        ours = seq.features_f32().reshape(len(seq.ids), len(layers), target.d)
        theirs = feats[0].numpy()
        for j, layer in enumerate(layers):
            rel = np.linalg.norm(theirs[:, j] - ours[:, j]) / np.linalg.norm(ours[:, j])
            assert rel < 0.03, f"{model} layer {layer}: relative difference {rel:.4f}"
        same = top_ids[0, :, 0].numpy() == seq.top_ids[:, 0]
        assert same.mean() >= 0.95, f"{model}: best next token the same at {same.mean():.3f} of positions"
        diff = np.abs(top_logp[0, :, 0].numpy() - seq.top_logp[:, 0])[same]
        print(f"{model}: features within {rel:.4f}; best token the same at {same.mean():.3f}; its log-probability "
              f"within {diff.mean():.4f} on average, {diff.max():.3f} at most")
        assert diff.mean() < 0.1 and diff.max() < 0.5, (diff.mean(), diff.max())


def test_refuses_other_architectures_and_bad_layers(tmp_path):
    target = target_torch.TargetModel(MODELS["smollm2"])
    with pytest.raises(ValueError, match="feature layers"):
        target.features(torch.zeros(1, 3, dtype=torch.int64), [3, 2], 4)
    with pytest.raises(ValueError, match="feature layers"):
        target.features(torch.zeros(1, 3, dtype=torch.int64), [target.n_layer + 1], 4)
    import gguf
    w = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'phi3'"):
        target_torch.TargetModel(tmp_path / "phi.gguf")
