"""`microspec features`, the training data of a draft head (src/cli/cmd_features.cpp), read back
with the trainer's own reader (scripts/features_file.py): its labels are the target's top-k
log-probabilities, the same floats `generate --logprobs` reports for the same positions, though
features runs every position in one prefill and its LM head over many positions per call; its
bad input is refused with the line named."""
import json
import subprocess
import sys

import numpy as np
import pytest

from repo_paths import BIN, MODELS, REPO

sys.path.insert(0, str(REPO / "scripts"))
import features_file  # noqa: E402

SMOL = MODELS["smollm2"]
LAYERS = [2, 15, 27]  # EAGLE-3's layers of a 30-layer target
N_EMBD, TOP_K = 576, 16


def features(tmp_path, lines, *extra):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.bin"
    inp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return subprocess.run([BIN, "features", "-m", str(SMOL), "--input", str(inp), "-o", str(out), "--layers",
                           ",".join(map(str, LAYERS)), "--top-k", str(TOP_K), "-t", "2", *extra],
                          capture_output=True, text=True, timeout=600)


def test_labels_are_the_logprobs_generate_reports_at_every_generated_position(tmp_path):
    # Plain greedy decoding of 40 tokens (each a one-token forward, the LM head over one row) ...
    g = subprocess.run([BIN, "generate", "-m", str(SMOL), "--chat", "-p", "Name three rivers of Europe.", "-n", "40",
                        "--spec", "none", "--json", "--logprobs", str(TOP_K)],
                       capture_output=True, text=True, timeout=300)
    assert g.returncode == 0, g.stderr[-2000:]
    gen = json.loads(g.stdout)
    prompt, tokens = gen["prompt_ids"], gen["tokens"]
    # ... then the whole sequence through features, beside its first 7 tokens and a conversation
    # whose user turn is the prompt's.
    ids = prompt + tokens
    conversation = {"messages": [{"role": "user", "content": "Name three rivers of Europe."},
                                 {"role": "assistant", "content": "The Danube, the Rhine and the Loire."}]}
    p = features(tmp_path, [json.dumps({"ids": ids}), json.dumps({"ids": ids[:7]}), json.dumps(conversation)])
    assert p.returncode == 0, p.stderr[-2000:]
    index = [json.loads(line) for line in p.stdout.splitlines()]
    assert [e["n_tokens"] for e in index][:2] == [len(ids), 7]
    idx_path = tmp_path / "out.idx.jsonl"
    idx_path.write_text(p.stdout)
    seqs = features_file.read(tmp_path / "out.bin", idx_path, len(LAYERS), N_EMBD, TOP_K)
    assert len(seqs) == 3 and seqs[0].ids.tolist() == ids and seqs[1].ids.tolist() == ids[:7]
    # The conversation is rendered by the chat template: the generation prompt is where its reply starts.
    assert seqs[2].ids[:len(prompt)].tolist() == prompt and len(seqs[2].ids) > len(prompt) + 5
    # The label of position p is the distribution of token p + 1: the generated token i came from
    # position len(prompt) - 1 + i, with the same ids and bitwise the same float log-probabilities.
    seq = seqs[0]
    for i, row in enumerate(gen["logprobs"]):
        at = len(prompt) - 1 + i
        assert seq.top_ids[at].tolist() == [t for t, _ in row["top"]], i
        assert seq.top_logp[at].tolist() == [np.float32(v) for _, v in row["top"]], i
        assert seq.top_ids[at][0] == tokens[i]
    # A sequence's labels do not depend on what else the file holds or on its own length.
    assert np.array_equal(seqs[1].top_ids, seq.top_ids[:7]) and np.array_equal(seqs[1].top_logp, seq.top_logp[:7])
    assert np.array_equal(seqs[1].features, seq.features[:7])
    f = seq.features_f32().reshape(len(ids), len(LAYERS), N_EMBD)
    assert np.isfinite(f).all() and (np.abs(f).max(axis=-1) > 0).all()
    # Each layer's stream differs from the others' (three layers, not one written three times).
    assert not np.array_equal(f[:, 0], f[:, 1]) and not np.array_equal(f[:, 1], f[:, 2])


@pytest.mark.parametrize("line, message", [
    ('{"ids": [1, 2, 49152]}', "token id 49152 is not in [0, 49152)"),
    ('{"ids": [1, -3]}', "token id -3 is not in [0, 49152)"),
    ('{"ids": [1, 2.5]}', "token id 2.5 is not in"),
    ('{"ids": "1 2 3"}', '"ids" must be an array'),
    ('{"ids": []}', "empty sequence"),
    ('{"messages": [{"role": "user"}]}', 'each message needs string "role" and "content"'),
    ('[1, 2', 'expected {"messages": [...]} or {"ids": [...]}'),
])
def test_bad_input_is_refused_with_its_line(tmp_path, line, message):
    p = features(tmp_path, ['{"ids": [1, 2, 3]}', line])
    assert p.returncode != 0 and "in.jsonl:2: " in p.stderr and message in p.stderr, p.stderr[-2000:]


@pytest.mark.parametrize("top_k", ["0", "1025"])
def test_a_top_k_outside_its_range_is_refused(tmp_path, top_k):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"ids": [1, 2, 3]}\n')
    p = subprocess.run([BIN, "features", "-m", str(SMOL), "--input", str(inp), "-o", str(tmp_path / "o.bin"),
                        "--layers", "2", "--top-k", top_k], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "--top-k must be in [1, 1024]" in p.stderr, p.stderr[-2000:]


def test_a_reader_refuses_an_index_that_does_not_fit_the_file(tmp_path):
    p = features(tmp_path, ['{"ids": [1, 2, 3, 4]}'])
    assert p.returncode == 0, p.stderr[-2000:]
    idx_path = tmp_path / "bad.idx.jsonl"
    idx_path.write_text(json.dumps({"n_tokens": 5, "offset": 0}) + "\n")
    with pytest.raises(ValueError, match="do not fit"):
        features_file.read(tmp_path / "out.bin", idx_path, len(LAYERS), N_EMBD, TOP_K)
