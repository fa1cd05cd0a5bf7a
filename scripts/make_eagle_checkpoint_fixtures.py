#!/usr/bin/env python3
"""Writes the published-layout EAGLE checkpoints of tests/test_eagle_checkpoint.cpp into
tests/data/eagle_checkpoint/, with goldens from a PyTorch forward written in Hugging Face's own
conventions (rotate-half RoPE on the checkpoint's unpermuted q/k rows, Llama 3 rope scaling as
transformers computes it), so the C++ side is checked through `convert --eagle` (the q/k
permutation, d2t offsets, names) and the runtime at once:

  eagle3/            config.json (LlamaForCausalLMEagle3 fields, draft_vocab_size 48, llama3
                     rope_scaling, eagle_aux_hidden_state_layer_ids [0, 1, 1]) + pytorch_model.bin
                     (torch.save of midlayer.*, fc, norm, lm_head [48, 64], d2t offsets, t2d) for the
                     tiny llama target tests/data/draft_head_golden/target.gguf (H 64, vocabulary 320)
  eagle3_golden.gguf features, tokens, the absolute d2t, and the own LM head's logits at tree levels
                     1-3 (as scripts/make_draft_head_golden.py lays out the levels)
  eagle2_smollm2/    config.json + pytorch_model.bin (F16) of an EAGLE-2 head (SafeAILab/EAGLE's
                     cnets1.py: fc 2H -> H with bias over [embedding ; hidden], a decoder layer without
                     input norm, no final norm) for models/smollm2-135m-instruct-q4_1.gguf (H 576);
                     small: 1 attention head of 64, FFN 64
  eagle2_golden.gguf features (the target's last stream, before its final norm), tokens, and the
                     head's output h at levels 1 and 2 (embeddings and final norm read from the GGUF)

    /work/torchenv/bin/python scripts/make_eagle_checkpoint_fixtures.py [--seed 11]
"""
import argparse
import collections
import json
import math
import pathlib

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "eagle_checkpoint"
T = 6  # committed rows before the root


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def inv_freq(cfg):
    """transformers' RoPE frequencies, with llama3 scaling when the config asks for it."""
    hd, base = cfg["head_dim"], cfg["rope_theta"]
    inv = 1.0 / (base ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    rs = cfg.get("rope_scaling")
    if rs and rs.get("rope_type") == "llama3":
        factor, low, high, old = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"], rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def rope_half(x, pos, cfg):
    """Hugging Face's rotate-half RoPE: x [T, heads, hd], pos [T]."""
    theta = pos.float()[:, None] * inv_freq(cfg)[None, :]
    emb = torch.cat((theta, theta), -1)[:, None, :]
    h = x.shape[-1] // 2
    rot = torch.cat((-x[..., h:], x[..., :h]), -1)
    return x * emb.cos() + rot * emb.sin()


class Layer:
    """The decoder layer both EAGLE versions share, on Hugging Face weights; keeps its KV rows."""

    def __init__(self, w, prefix, cfg):
        self.w, self.p, self.cfg = w, prefix, cfg
        self.k = torch.zeros(0, cfg["num_key_value_heads"], cfg["head_dim"])
        self.v = torch.zeros_like(self.k)

    def __call__(self, x, residual, pos, visible):
        """x: attention input [n, in]; residual [n, H]; visible [n, S + n] over kept rows then these."""
        c, w, p = self.cfg, self.w, self.p
        nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        q = rope_half((x @ w[p + "self_attn.q_proj.weight"].T).reshape(-1, nh, hd), pos, c)
        k = rope_half((x @ w[p + "self_attn.k_proj.weight"].T).reshape(-1, nkv, hd), pos, c)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).reshape(-1, nkv, hd)
        self.k, self.v = torch.cat((self.k, k)), torch.cat((self.v, v))
        kk, vv = self.k.repeat_interleave(nh // nkv, 1), self.v.repeat_interleave(nh // nkv, 1)
        s = torch.einsum("thd,shd->hts", q, kk) / math.sqrt(hd)
        s = s.masked_fill(~visible[None], float("-inf")).softmax(-1)
        a = torch.einsum("hts,shd->thd", s, vv).reshape(len(x), nh * hd)
        h = residual + a @ w[p + "self_attn.o_proj.weight"].T
        f = rms(h, w[p + "post_attention_layernorm.weight"], c["rms_norm_eps"])
        mlp = (torch.nn.functional.silu(f @ w[p + "mlp.gate_proj.weight"].T) * (f @ w[p + "mlp.up_proj.weight"].T))
        return h + mlp @ w[p + "mlp.down_proj.weight"].T


def levels_visibility():
    """Masks of the three levels: T + 1 causal rows, two siblings, then a child of the first."""
    vis1 = torch.tril(torch.ones(T + 1, T + 1, dtype=torch.bool))
    vis2 = torch.zeros(2, T + 3, dtype=torch.bool)
    vis2[:, :T + 1] = True
    vis2[0, T + 1] = vis2[1, T + 2] = True
    vis3 = torch.zeros(1, T + 4, dtype=torch.bool)
    vis3[0, :T + 2] = True
    vis3[0, T + 3] = True
    return vis1, vis2, vis3


def save_golden(path, tensors):
    import gguf
    w = gguf.GGUFWriter(str(path), "golden")
    for name, x in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(np.asarray(x), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def read_gguf_tensor(path, name):
    import gguf
    r = gguf.GGUFReader(str(path))
    t = next(t for t in r.tensors if t.name == name)
    x = gguf.quants.dequantize(t.data, t.tensor_type)
    return torch.tensor(np.asarray(x, dtype=np.float32).reshape(tuple(reversed([int(n) for n in t.shape]))))


def eagle3(rng):
    H, V, D = 64, 320, 48
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
           "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048,
           "vocab_size": V, "draft_vocab_size": D, "target_hidden_size": H, "tie_word_embeddings": False,
           "eagle_aux_hidden_state_layer_ids": [0, 1, 1], "torch_dtype": "float32",
           "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 32}}
    g = lambda *s: torch.tensor(rng.standard_normal(s), dtype=torch.float32)
    w = collections.OrderedDict()
    w["fc.weight"] = g(H, 3 * H) / math.sqrt(3 * H)
    w["midlayer.hidden_norm.weight"] = 1 + 0.1 * g(H)
    w["midlayer.input_layernorm.weight"] = 1 + 0.1 * g(H)
    w["midlayer.self_attn.q_proj.weight"] = g(64, 2 * H) / math.sqrt(2 * H)
    w["midlayer.self_attn.k_proj.weight"] = g(32, 2 * H) / math.sqrt(2 * H)
    w["midlayer.self_attn.v_proj.weight"] = g(32, 2 * H) / math.sqrt(2 * H)
    w["midlayer.self_attn.o_proj.weight"] = g(H, 64) / 8
    w["midlayer.post_attention_layernorm.weight"] = 1 + 0.1 * g(H)
    w["midlayer.mlp.gate_proj.weight"] = g(96, H) / 8
    w["midlayer.mlp.up_proj.weight"] = g(96, H) / 8
    w["midlayer.mlp.down_proj.weight"] = g(H, 96) / 10
    w["norm.weight"] = 1 + 0.1 * g(H)
    w["lm_head.weight"] = g(D, H) / 8
    target_ids = np.sort(rng.choice(V, D, replace=False))  # the published d2t holds offsets id - row
    w["d2t"] = torch.tensor(target_ids - np.arange(D), dtype=torch.int64)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.tensor(target_ids)] = True
    w["t2d"] = t2d
    d = OUT / "eagle3"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    torch.save(w, d / "pytorch_model.bin")

    emb = read_gguf_tensor(ROOT / "tests" / "data" / "draft_head_golden" / "target.gguf", "token_embd.weight")
    features = g(T + 1, 3 * H)
    tokens = torch.tensor(rng.integers(3, V, T + 1))
    level2, level3 = torch.tensor(rng.integers(3, V, 2)), torch.tensor(rng.integers(3, V, 1))
    layer = Layer(w, "midlayer.", cfg)
    eps = cfg["rms_norm_eps"]

    def run(tok, gin, pos, vis):
        x = torch.cat((rms(emb[tok], w["midlayer.input_layernorm.weight"], eps), rms(gin, w["midlayer.hidden_norm.weight"], eps)), -1)
        h = layer(x, gin, pos, vis)
        return h, rms(h, w["norm.weight"], eps) @ w["lm_head.weight"].T

    vis1, vis2, vis3 = levels_visibility()
    with torch.no_grad():
        h1, l1 = run(tokens, features @ w["fc.weight"].T, torch.arange(T + 1), vis1)
        h2, l2 = run(level2, h1[T].expand(2, H), torch.full((2,), T + 1), vis2)
        _, l3 = run(level3, h2[0:1], torch.full((1,), T + 2), vis3)
    save_golden(OUT / "eagle3_golden.gguf", {
        "features": features, "tokens": tokens.float(), "level2_tokens": level2.float(), "level3_tokens": level3.float(),
        "d2t": torch.tensor(target_ids, dtype=torch.float32), "level1_logits": l1[T:T + 1], "level2_logits": l2,
        "level3_logits": l3})


def eagle2(rng):
    target = ROOT / "models" / "smollm2-135m-instruct-q4_1.gguf"
    H, V, hd, ff = 576, 49152, 64, 64
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": ff,
           "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": hd, "num_hidden_layers": 1,
           "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 2048, "vocab_size": V,
           "bias": True, "torch_dtype": "float16"}
    g = lambda *s: torch.tensor(rng.standard_normal(s), dtype=torch.float32)
    w = collections.OrderedDict()
    w["fc.weight"] = g(H, 2 * H) / math.sqrt(2 * H)
    w["fc.bias"] = 0.1 * g(H)
    w["layers.0.self_attn.q_proj.weight"] = g(hd, H) / math.sqrt(H)
    w["layers.0.self_attn.k_proj.weight"] = g(hd, H) / math.sqrt(H)
    w["layers.0.self_attn.v_proj.weight"] = g(hd, H) / math.sqrt(H)
    w["layers.0.self_attn.o_proj.weight"] = g(H, hd) / 8
    w["layers.0.post_attention_layernorm.weight"] = 1 + 0.1 * g(H)
    w["layers.0.mlp.gate_proj.weight"] = g(ff, H) / math.sqrt(H)
    w["layers.0.mlp.up_proj.weight"] = g(ff, H) / math.sqrt(H)
    w["layers.0.mlp.down_proj.weight"] = g(H, ff) / 8
    w16 = collections.OrderedDict((k, v.half()) for k, v in w.items())
    w = collections.OrderedDict((k, v.float()) for k, v in w16.items())  # the reference uses the stored values
    d = OUT / "eagle2_smollm2"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    torch.save(w16, d / "pytorch_model.bin")

    emb = read_gguf_tensor(target, "token_embd.weight")
    out_norm = read_gguf_tensor(target, "output_norm.weight")
    features = 3 * g(T + 1, H)
    tokens = torch.tensor(rng.integers(3, V, T + 1))
    level2 = torch.tensor(rng.integers(3, V, 2))
    layer = Layer(w, "layers.0.", cfg)

    def run(tok, gin, pos, vis):
        x = torch.cat((emb[tok], gin), -1) @ w["fc.weight"].T + w["fc.bias"]
        return layer(x, x, pos, vis)

    vis1, vis2, _ = levels_visibility()
    with torch.no_grad():
        h1 = run(tokens, rms(features, out_norm, 1e-5), torch.arange(T + 1), vis1)  # SmolLM2's rms eps is 1e-5
        h2 = run(level2, h1[T].expand(2, H), torch.full((2,), T + 1), vis2)
    save_golden(OUT / "eagle2_golden.gguf", {
        "features": features, "tokens": tokens.float(), "level2_tokens": level2.float(),
        "level1_out": h1[T:T + 1], "level2_out": h2})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=11)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    eagle3(rng)
    eagle2(rng)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
