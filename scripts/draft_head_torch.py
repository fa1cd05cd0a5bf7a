"""PyTorch forward of an EAGLE-3 draft head, the same computation as microspec's C++ head
(src/draft_head/eagle3_head.cpp) and llama.cpp's eagle3 graph (llama-cpp-python 0.3.36's vendored
llama.cpp, src/models/eagle3.cpp). Used by scripts/train_draft_head.py (training) and
scripts/make_draft_head_golden.py (the golden file the C++ test compares against).

One row: g = fc(features) (level 1; fc(rms_norm(features)) with norm_before_fc) or the previous level's prenorm output (deeper levels);
x = [attn_norm(embed(token)) ; attn_norm_2(g)]; r = Wo attn(rope(Wq x), rope(Wk x), Wv x) + g;
h = r + Wdown(silu(Wgate ffn_norm(r)) * Wup ffn_norm(r)); logits = LM head(output_norm(h)).
RoPE is llama.cpp's NORM style (pairs 2j, 2j+1 within a head), attention scale 1/sqrt(head_dim).
"""
import math

import torch
import torch.nn as nn

import draft_head_gguf


class Eagle3Head(nn.Module):
    def __init__(self, cfg, weights=None):
        super().__init__()
        self.cfg = dict(cfg)
        shapes = draft_head_gguf.shapes(cfg["n_embd"], cfg["n_head"], cfg["n_head_kv"], cfg["head_dim"], cfg["n_ff"],
                                        cfg.get("norm_before_fc", False))
        self.params = nn.ParameterDict()
        self.names = {}  # parameter key -> GGUF tensor name
        for name, shape in shapes.items():
            key = name.replace(".", "_")
            self.names[key] = name
            if weights is not None:
                t = torch.tensor(weights[name], dtype=torch.float32)
            elif len(shape) == 2:
                t = torch.randn(shape) / math.sqrt(shape[1])
            else:
                t = torch.ones(shape)
            self.params[key] = nn.Parameter(t)

    def w(self, name):
        return self.params[name.replace(".", "_")]

    def weights(self):
        """name -> float32 numpy array, as draft_head_gguf.write_head takes them."""
        return {self.names[k]: v.detach().cpu().float().numpy() for k, v in self.params.items()}

    def rms(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg["rms_eps"]) * w

    def rope(self, x, pos):
        # x [..., T, n_heads, head_dim]; pos [T] (or broadcastable to x's T).
        hd = self.cfg["head_dim"]
        j = torch.arange(hd // 2, dtype=torch.float32)
        inv = self.cfg["rope_base"] ** (-2.0 * j / hd)
        theta = pos.to(torch.float32)[..., :, None] * inv  # [..., T, hd/2]
        c, s = torch.cos(theta)[..., None, :], torch.sin(theta)[..., None, :]
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)

    def fuse(self, features):
        if self.cfg.get("norm_before_fc"):
            features = self.rms(features, self.w("enc.output_norm.weight"))
        return features @ self.w("fc.weight").T

    def qkv(self, emb, g, pos):
        """emb, g: [..., T, H] -> q [..., T, nh, hd], k, v [..., T, nkv, hd] (q, k rotated)."""
        c = self.cfg
        x = torch.cat((self.rms(emb, self.w("blk.0.attn_norm.weight")), self.rms(g, self.w("blk.0.attn_norm_2.weight"))), -1)
        shp = x.shape[:-1]
        q = (x @ self.w("blk.0.attn_q.weight").T).reshape(*shp, c["n_head"], c["head_dim"])
        k = (x @ self.w("blk.0.attn_k.weight").T).reshape(*shp, c["n_head_kv"], c["head_dim"])
        v = (x @ self.w("blk.0.attn_v.weight").T).reshape(*shp, c["n_head_kv"], c["head_dim"])
        return self.rope(q, pos), self.rope(k, pos), v

    def attend(self, q, k, v, visible):
        """q [..., T, nh, hd]; k, v [..., S, nkv, hd]; visible [T, S] bool -> [..., T, nh*hd]."""
        c = self.cfg
        group = c["n_head"] // c["n_head_kv"]
        k = k.repeat_interleave(group, dim=-2)
        v = v.repeat_interleave(group, dim=-2)
        scores = torch.einsum("...thd,...shd->...hts", q, k) / math.sqrt(c["head_dim"])
        scores = scores.masked_fill(~visible, float("-inf"))
        out = torch.einsum("...hts,...shd->...thd", torch.softmax(scores, -1), v)
        return out.flatten(-2)

    def finish(self, attn, g):
        """Attention output and hidden input -> (prenorm h, normed output)."""
        r = attn @ self.w("blk.0.attn_output.weight").T + g
        rn = self.rms(r, self.w("blk.0.ffn_norm.weight"))
        ff = (nn.functional.silu(rn @ self.w("blk.0.ffn_gate.weight").T) * (rn @ self.w("blk.0.ffn_up.weight").T))
        h = r + ff @ self.w("blk.0.ffn_down.weight").T
        return h, self.rms(h, self.w("output_norm.weight"))

    def rows(self, emb, g, pos, visible, past_k=None, past_v=None):
        """Rows that see the past rows and each other as `visible` [T, past + T] says. Returns
        (prenorm [T, H], normed [T, H], keys [past + T, nkv, hd], values)."""
        q, k, v = self.qkv(emb, g, pos)
        if past_k is not None:
            k, v = torch.cat((past_k, k), 0), torch.cat((past_v, v), 0)
        h, n = self.finish(self.attend(q, k, v, visible), g)
        return h, n, k, v
