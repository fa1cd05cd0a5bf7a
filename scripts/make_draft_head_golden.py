#!/usr/bin/env python3
"""Writes the golden files the C++ draft-head test (tests/test_draft_head.cpp, DraftHeadGolden)
compares against: a tiny llama target (its embeddings and LM head are what the head reads), a head
with random weights in llama.cpp's eagle3 layout, and golden.gguf holding random target features,
tokens and the logits scripts/draft_head_torch.py computes for

  level 1: T committed rows (positions 0..T-1) then the root row at position T (target features);
  level 2: two children of the root at position T + 1, each fed the root's own prenorm output;
  level 3: a child of the first of them at position T + 2, fed that child's output.

The head normalises the features before fc (norm_before_fc, as the trained heads do). Siblings do not see each other (the draft tree's attention mask). Everything is float32, so the
C++ side differs only by its half-float KV cache and summation order.

    /work/torchenv/bin/python scripts/make_draft_head_golden.py [-o tests/data/draft_head_golden] [--seed 7]
"""
import argparse
import pathlib
import sys

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import draft_head_gguf  # noqa: E402
from draft_head_torch import Eagle3Head  # noqa: E402

H, V, T = 64, 320, 6
CFG = dict(n_embd=H, n_head=4, n_head_kv=2, head_dim=16, n_ff=96, rms_eps=1e-6, rope_base=10000.0,
           target_layers=[0, 1, 1], target_hidden=H, norm_before_fc=True)


def write_target(path, rng):
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.context_length", 256)
    w.add_uint32("llama.embedding_length", H)
    w.add_uint32("llama.block_count", 1)
    w.add_uint32("llama.feed_forward_length", 96)
    w.add_uint32("llama.attention.head_count", 4)
    w.add_uint32("llama.attention.head_count_kv", 2)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    tensors = {
        "token_embd.weight": rng.standard_normal((V, H)), "output.weight": rng.standard_normal((V, H)) / np.sqrt(H),
        "output_norm.weight": 1 + 0.1 * rng.standard_normal(H), "blk.0.attn_norm.weight": np.ones(H),
        "blk.0.attn_q.weight": rng.standard_normal((H, H)) / 8, "blk.0.attn_k.weight": rng.standard_normal((32, H)) / 8,
        "blk.0.attn_v.weight": rng.standard_normal((32, H)) / 8, "blk.0.attn_output.weight": rng.standard_normal((H, H)) / 8,
        "blk.0.ffn_norm.weight": np.ones(H), "blk.0.ffn_gate.weight": rng.standard_normal((96, H)) / 8,
        "blk.0.ffn_up.weight": rng.standard_normal((96, H)) / 8, "blk.0.ffn_down.weight": rng.standard_normal((H, 96)) / 10,
    }
    for name, x in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(x, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {k: torch.tensor(v, dtype=torch.float32) for k, v in tensors.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-o", "--out", default=str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "data" / "draft_head_golden"))
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    target = write_target(out / "target.gguf", rng)
    weights = draft_head_gguf.random_head(H, 4, 2, 16, 96, seed=a.seed + 1, norm_before_fc=True)
    draft_head_gguf.write_head(out / "head.gguf", weights, CFG, "f32")
    head = Eagle3Head(CFG, weights)

    features = torch.tensor(rng.standard_normal((T + 1, 3 * H)), dtype=torch.float32)
    tokens = torch.tensor(rng.integers(3, V, T + 1))              # token at position i + 1 for row i
    level2 = torch.tensor(rng.integers(3, V, 2))
    level3 = torch.tensor(rng.integers(3, V, 1))
    emb = target["token_embd.weight"]

    def logits(normed):
        return normed @ target["output.weight"].T

    with torch.no_grad():
        # Committed rows and the root: causal over positions 0..T.
        pos = torch.arange(T + 1)
        vis = torch.tril(torch.ones(T + 1, T + 1, dtype=torch.bool))
        h1, n1, k, v = head.rows(emb[tokens], head.fuse(features), pos, vis)
        # Level 2: both children see rows 0..T and themselves only.
        vis2 = torch.zeros(2, T + 3, dtype=torch.bool)
        vis2[:, :T + 1] = True
        vis2[0, T + 1] = vis2[1, T + 2] = True
        h2, n2, k, v = head.rows(emb[level2], h1[T].expand(2, H), torch.full((2,), T + 1), vis2, k, v)
        # Level 3: a child of the first level-2 node.
        vis3 = torch.zeros(1, T + 4, dtype=torch.bool)
        vis3[0, :T + 2] = True
        vis3[0, T + 3] = True
        h3, n3, _, _ = head.rows(emb[level3], h2[0:1], torch.full((1,), T + 2), vis3, k, v)

    import gguf
    w = gguf.GGUFWriter(str(out / "golden.gguf"), "golden")
    g = {
        "features": features, "tokens": tokens.float(), "level2_tokens": level2.float(), "level3_tokens": level3.float(),
        "level1_logits": logits(n1[T:T + 1]), "level2_logits": logits(n2), "level3_logits": logits(n3),
        "level1_prenorm": h1[T:T + 1],
    }
    for name, x in g.items():
        w.add_tensor(name, np.ascontiguousarray(x.numpy(), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {out}/target.gguf, head.gguf, golden.gguf")


if __name__ == "__main__":
    main()
