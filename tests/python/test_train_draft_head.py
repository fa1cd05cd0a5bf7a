"""The draft-head trainer's losses (scripts/draft_targets.py): the dynamic vocabulary it trains over,
checked against a direct reading of the candidate-stream rules; the window loss equal to the
full-vocabulary loss when the window holds the whole vocabulary; its gradient against finite
differences; and the unrolled training forward (scripts/train_draft_head.py) equal to the head
run chain by chain as at inference. Needs torch (scripts/requirements-train.txt), which CI does
not install: these run where the trainer runs."""
import math
import pathlib
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import draft_targets  # noqa: E402
import features_file  # noqa: E402


def sequence(ids, top_ids, top_logp, width=6):
    n = len(ids)
    return features_file.Sequence(np.asarray(ids, np.int32), np.zeros((n, width), np.uint16),
                                  np.asarray(top_ids, np.int32), np.asarray(top_logp, np.float32))


def random_sequence(rng, n, vocab, k):
    top_ids = np.stack([rng.choice(vocab, k, replace=False) for _ in range(n)])
    logp = np.sort(np.log(rng.dirichlet(np.ones(vocab))[:k]))[::-1]
    return sequence(rng.integers(0, vocab, n), top_ids, np.tile(logp, (n, 1)))


@pytest.mark.parametrize("w_max", [3072, 8, 6, 4])
def test_the_window_is_the_candidate_stream_read_directly(w_max):
    rng = np.random.default_rng(w_max)
    seq = random_sequence(rng, 40, 50, 5)
    uniq, mask = draft_targets.candidate_window(seq.ids, seq.top_ids, 3, w_max)
    back = -(-w_max // 4)  # whole positions of 1 + k_ver entries
    for c in range(len(seq.ids)):
        # Known tokens 0..c; the target's top-3 at 0..c-1; position t's entries: its token and t - 1's top-3.
        expect = set()
        for t in range(max(0, c - back + 1), c + 1):
            expect.add(int(seq.ids[t]))
            if t >= 1:
                expect.update(int(x) for x in seq.top_ids[t - 1, :3])
        assert set(uniq[mask[c]].tolist()) == expect, c


def test_the_window_loss_is_the_full_vocabulary_loss_when_the_window_holds_every_id():
    vocab, k = 12, 4
    rng = np.random.default_rng(1)
    seq = random_sequence(rng, 30, vocab, k)
    seq.ids[:vocab] = np.arange(vocab)  # every id enters the stream early
    rows = torch.randn(vocab, 8)
    t = draft_targets.make_targets(seq, "window", rows.numpy(), None, 3, 3072)
    assert t.lm.shape == (vocab, 8) and torch.equal(t.lm, rows)
    h = torch.randn(len(seq.ids) - 1, 8)
    first = vocab  # rows from here on see the whole vocabulary
    for j in range(3):
        n = len(seq.ids) - 1 - j
        mask = t.loss_mask(j, n)
        assert mask[first:].all() and not mask[:first].all()
        logits = h[:n] @ rows.T
        got = draft_targets.soft_cross_entropy(logits[first:], mask[first:], t.lab_col[j + first:j + n],
                                               t.lab_p[j + first:j + n])
        # The full-vocabulary soft cross-entropy, written out: labels at positions j + 1 + i.
        p = np.exp(seq.top_logp[1 + j + first:1 + j + n].astype(np.float64))
        p /= p.sum(-1, keepdims=True)
        logz = torch.logsumexp(logits[first:].double(), -1).numpy()
        lab = seq.top_ids[1 + j + first:1 + j + n]
        x = logits[first:].double().numpy()
        want = -np.mean([sum(p[i, q] * (x[i, lab[i, q]] - logz[i]) for q in range(k)) for i in range(len(lab))])
        assert math.isclose(float(got), want, rel_tol=1e-5), j


def test_the_window_loss_gradient_matches_finite_differences():
    torch.manual_seed(0)
    rows, cols, k = 5, 9, 3
    logits = torch.randn(rows, cols, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(rows, cols) < 0.6
    lab_col = torch.stack([torch.randperm(cols)[:k] for _ in range(rows)])
    mask[torch.arange(rows)[:, None].expand_as(lab_col), lab_col] = True  # the labels are in the set
    lab_col[0, 2] = -1  # a label outside the columns carries no probability
    lab_p = torch.rand(rows, k, dtype=torch.float64) * (lab_col >= 0)
    lab_p = lab_p / lab_p.sum(-1, keepdim=True)
    assert torch.autograd.gradcheck(lambda x: draft_targets.soft_cross_entropy(x, mask, lab_col, lab_p), (logits,))
    # Masked columns get no gradient: the softmax never saw them.
    draft_targets.soft_cross_entropy(logits, mask, lab_col, lab_p).backward()
    assert (logits.grad[~mask] == 0).all() and (logits.grad[mask] != 0).any()


def test_the_unrolled_training_forward_is_the_head_run_chain_by_chain():
    import train_draft_head
    from draft_head_torch import Eagle3Head
    torch.manual_seed(3)
    H, vocab, n, unroll = 16, 40, 9, 3
    cfg = dict(n_embd=H, n_head=4, n_head_kv=2, head_dim=4, n_ff=32, rms_eps=1e-6, rope_base=10000.0,
               target_layers=[0, 1, 2], target_hidden=H, norm_before_fc=True)
    head = Eagle3Head(cfg)
    emb = torch.randn(vocab, H)
    rng = np.random.default_rng(4)
    feats = rng.standard_normal((n, 3 * H)).astype(np.float32)
    bf16 = (feats.view(np.uint32) >> 16).astype(np.uint16)  # exact: the features are taken as bfloat16
    seq = random_sequence(rng, n, vocab, 4)._replace(features=bf16)
    targets = draft_targets.make_targets(seq, "window", torch.randn(vocab, H).numpy(), None, 3, 3072)
    with torch.no_grad():
        _, _, counts, outputs = train_draft_head.unrolled_losses(head, lambda t: emb[t], targets, seq, unroll, 0.0,
                                                                 None, False)
        assert counts == [n - 1 - j for j in range(unroll)]
        # The head as at inference: level 0 over the target's features for rows 0..n-2 (causal),
        # then for a chain from row i, level j's row sees rows 0..i of level 0 and its own chain.
        g0 = head.fuse(torch.from_numpy(seq.features_f32()))
        ids = torch.from_numpy(seq.ids.astype(np.int64))
        m = n - 1
        causal = torch.tril(torch.ones(m, m, dtype=torch.bool))
        h0, _, k0, v0 = head.rows(emb[ids[1:]], g0[:m], torch.arange(m), causal)
        assert torch.allclose(outputs[0], h0, atol=1e-5)
        for i in range(m - unroll + 1):
            past_k, past_v, g = k0[:i + 1], v0[:i + 1], h0[i:i + 1]
            for j in range(1, unroll):
                visible = torch.ones(1, len(past_k) + 1, dtype=torch.bool)
                h, _, past_k, past_v = head.rows(emb[ids[i + 1 + j:i + 2 + j]], g, torch.tensor([i + j]), visible,
                                                 past_k, past_v)
                assert torch.allclose(outputs[j][i], h[0], atol=1e-5), (i, j)
                g = h


def test_a_warm_start_takes_the_heads_weights_and_refuses_another_targets_head(tmp_path):
    import draft_head_gguf
    import train_draft_head
    cfg = dict(n_embd=16, n_head=4, n_head_kv=2, head_dim=4, n_ff=32, rms_eps=1e-6, rope_base=10000.0,
               target_layers=[2, 5, 9], target_hidden=16, norm_before_fc=True)
    weights = draft_head_gguf.random_head(16, 2, 1, 8, 24, seed=5, norm_before_fc=True)
    file_cfg = dict(cfg, n_head=2, n_head_kv=1, head_dim=8, n_ff=24, rope_base=5e5)
    path = tmp_path / "head.gguf"
    draft_head_gguf.write_head(path, weights, file_cfg, "f32")
    head = train_draft_head.initial_head(cfg, path)
    assert head.cfg["n_head"] == 2 and head.cfg["n_ff"] == 24 and head.cfg["rope_base"] == 5e5  # the file's own sizes
    got = head.weights()
    assert got.keys() == weights.keys() and all(np.array_equal(got[k], weights[k]) for k in weights)
    assert not np.array_equal(train_draft_head.initial_head(cfg, None).weights()["fc.weight"], weights["fc.weight"])
    with pytest.raises(ValueError, match=r"target_layers is \[2, 5, 9\], the target needs \[2, 6, 9\]"):
        train_draft_head.initial_head(dict(cfg, target_layers=[2, 6, 9]), path)
