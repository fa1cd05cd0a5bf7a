"""The target model's forward in PyTorch, from its GGUF file: what `microspec features` computes for
training a draft head (the residual streams entering chosen layers, and the target's top-k
next-token log-probabilities at every position), for a machine where that is faster than the
engine: a GPU (scripts/train_draft_head.py --features torch --device cuda).

Architectures: llama (SmolLM2) and gemma3 (the shipped targets), with the file's metadata keys
and tensor names as llama.cpp writes them. The weights are dequantized by the `gguf` package and
kept in `dtype` on `device`. Activations are not quantized, where microspec rounds them to 8 bits
before each product, so the two differ by that rounding: tests/python/test_target_torch.py bounds
the difference against `microspec features` on both shipped models.

A batch is [B][T] token ids, every row a sequence from position 0; a row shorter than T is padded
at its end, and causal attention keeps the padding out of every real position's values.
"""
import math

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

ARCHITECTURES = ("llama", "gemma3")


class TargetModel:
    def __init__(self, path, device="cpu", dtype=torch.float32):
        self.device, self.dtype = torch.device(device), dtype
        r = GGUFReader(str(path))
        tensors = {t.name: t for t in r.tensors}
        field = lambda k, d=None: r.fields[k].contents() if k in r.fields else d  # noqa: E731
        a = self.arch = field("general.architecture")
        if a not in ARCHITECTURES:
            raise ValueError(f"{path}: architecture {a!r}; this forward runs {', '.join(ARCHITECTURES)}")
        self.gemma = a == "gemma3"
        self.d = field(f"{a}.embedding_length")
        self.n_layer = field(f"{a}.block_count")
        self.n_head = field(f"{a}.attention.head_count")
        self.n_kv = field(f"{a}.attention.head_count_kv", self.n_head)
        self.hd = field(f"{a}.attention.key_length", self.d // self.n_head)
        self.eps = field(f"{a}.attention.layer_norm_rms_epsilon")
        self.base = field(f"{a}.rope.freq_base", 10000.0)
        self.base_swa = field(f"{a}.rope.freq_base_swa", 10000.0)
        self.window = field(f"{a}.attention.sliding_window", 0) if self.gemma else 0
        self.pattern = field(f"{a}.attention.sliding_window_pattern", 6) if self.gemma else 1
        factor = field(f"{a}.rope.scaling.factor", 0.0)
        linear = factor and field(f"{a}.rope.scaling.type", "linear") == "linear"
        self.freq_scale = 1.0 / factor if linear else 1.0  # gemma3: the global layers only

        def weight(name):
            t = tensors[name]
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            w = w.reshape(-1, int(t.shape[0])) if len(t.shape) > 1 else w.reshape(-1)
            return torch.from_numpy(w.copy()).to(self.device, self.dtype)

        self.embd = weight("token_embd.weight")  # [n_vocab][d]
        self.out = weight("output.weight") if "output.weight" in tensors else self.embd
        self.output_norm = weight("output_norm.weight")
        self.layers = [{name[len(f"blk.{i}."):]: weight(name) for name in tensors if name.startswith(f"blk.{i}.")}
                       for i in range(self.n_layer)]
        self.n_vocab = self.embd.shape[0]
        # Llama 3's per-frequency divisors, when the file has them.
        self.freq_factors = weight("rope_freqs.weight").double() if "rope_freqs.weight" in tensors else None

    def rms(self, x, w):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps).to(x.dtype) * w

    def rope(self, x, base, freq_scale):
        """x [B][T][heads][hd] at positions 0..T-1, theta_j = pos * base^(-2j/hd) / factor_j * scale:
        NEOX pairs (j, j + hd/2) for gemma3, adjacent pairs (2j, 2j + 1) for llama."""
        T, half = x.shape[1], self.hd // 2
        inv = base ** (-torch.arange(half, dtype=torch.float64, device=x.device) * 2.0 / self.hd) * freq_scale
        if self.freq_factors is not None:
            inv = inv / self.freq_factors
        theta = torch.arange(T, dtype=torch.float64, device=x.device)[:, None] * inv  # [T][half]
        c = torch.cos(theta).to(x.dtype)[None, :, None, :]
        s = torch.sin(theta).to(x.dtype)[None, :, None, :]
        if self.gemma:
            a, b = x[..., :half], x[..., half:]
            return torch.cat((a * c - b * s, a * s + b * c), -1)
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * c - b * s, a * s + b * c), -1).flatten(-2)

    def block(self, x, i):
        w, (B, T, _) = self.layers[i], x.shape
        h = self.rms(x, w["attn_norm.weight"])
        q = (h @ w["attn_q.weight"].T).view(B, T, self.n_head, self.hd)
        k = (h @ w["attn_k.weight"].T).view(B, T, self.n_kv, self.hd)
        v = (h @ w["attn_v.weight"].T).view(B, T, self.n_kv, self.hd)
        if "attn_q_norm.weight" in w:
            q, k = self.rms(q, w["attn_q_norm.weight"]), self.rms(k, w["attn_k_norm.weight"])
        sliding = self.window > 0 and i % self.pattern < self.pattern - 1
        base, scale = (self.base_swa, 1.0) if sliding else (self.base, self.freq_scale)
        q, k = self.rope(q, base, scale), self.rope(k, base, scale)
        pos = torch.arange(T, device=x.device)
        visible = pos[:, None] >= pos[None, :]
        if sliding:
            visible &= (pos[:, None] - pos[None, :]) < self.window
        group = self.n_head // self.n_kv
        att = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.repeat_interleave(group, 2).transpose(1, 2), v.repeat_interleave(group, 2).transpose(1, 2),
            attn_mask=visible, scale=1.0 / math.sqrt(self.hd))
        o = att.transpose(1, 2).reshape(B, T, self.n_head * self.hd) @ w["attn_output.weight"].T
        x = x + (self.rms(o, w["post_attention_norm.weight"]) if self.gemma else o)
        h = self.rms(x, w["ffn_norm.weight"])
        g, u = h @ w["ffn_gate.weight"].T, h @ w["ffn_up.weight"].T
        act = torch.nn.functional.gelu(g, approximate="tanh") if self.gemma else torch.nn.functional.silu(g)
        o = (act * u) @ w["ffn_down.weight"].T
        return x + (self.rms(o, w["post_ffw_norm.weight"]) if self.gemma else o)

    @torch.no_grad()
    def features(self, ids, layers, top_k):
        """ids: int64 [B][T]. Returns (features float32 [B][T][len(layers)][d]: the residual stream
        entering each named layer, n_layer meaning the one leaving the last; top_ids int64 [B][T][k]
        and top_logp float32 [B][T][k]: the target's best next tokens, log-softmax over the whole
        vocabulary, best first). layers: non-decreasing, each in [0, n_layer]."""
        if any(not 0 <= l <= self.n_layer for l in layers) or list(layers) != sorted(layers):
            raise ValueError(f"feature layers {list(layers)}: each in [0, {self.n_layer}], non-decreasing")
        ids = ids.to(self.device)
        x = self.embd[ids] * (math.sqrt(self.d) if self.gemma else 1.0)
        taken = []
        for i in range(self.n_layer + 1):
            taken += [x.float()] * layers.count(i)
            if i < self.n_layer:
                x = self.block(x, i)
        logits = (self.rms(x, self.output_norm) @ self.out.T).float()
        top_logp, top_ids = torch.log_softmax(logits, -1).topk(top_k, -1)
        return torch.stack(taken, 2), top_ids, top_logp
