"""An independent high-precision forward pass for gemma3 / llama / qwen2 GGUF files, in numpy.

Weights are dequantized by the `gguf` package (not by microspec), every op runs in float64 except
the LM head (float32), and no activation is quantized. It is the yardstick that both microspec and
llama.cpp are measured against: each quantizes activations to 8 bits, so each drifts from it a
little, and the test checks we drift no more than llama.cpp does.
"""
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


class ReferenceModel:
    def __init__(self, path):
        self.r = GGUFReader(str(path))
        self.t = {t.name: t for t in self.r.tensors}
        f = lambda k, d=None: self.r.fields[k].contents() if k in self.r.fields else d  # noqa: E731
        a = self.arch = f("general.architecture")
        self.d = f(f"{a}.embedding_length")
        self.n_layer = f(f"{a}.block_count")
        self.n_head = f(f"{a}.attention.head_count")
        self.n_kv = f(f"{a}.attention.head_count_kv", self.n_head)
        self.hd = f(f"{a}.attention.key_length", self.d // self.n_head)
        self.eps = f(f"{a}.attention.layer_norm_rms_epsilon")
        self.base = f(f"{a}.rope.freq_base", 10000.0)
        self.window = f(f"{a}.attention.sliding_window", 0) if a == "gemma3" else 0
        self.embd = self.w("token_embd.weight", np.float32)
        self.out = self.w("output.weight", np.float32) if "output.weight" in self.t else self.embd

    def w(self, name, dtype=np.float64):
        t = self.t[name]
        a = dequantize(t.data, t.tensor_type).astype(dtype)
        return a.reshape(-1, int(t.shape[0])) if len(t.shape) > 1 else a.reshape(-1)

    def has(self, name):
        return name in self.t

    def rms(self, x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * w

    @staticmethod
    def rope(x, pos, base, neox):
        n = x.shape[-1]
        half = n // 2
        th = np.outer(pos, base ** (-np.arange(half) * 2.0 / n))
        c, s = np.cos(th)[:, None, :], np.sin(th)[:, None, :]
        y = x.copy()
        if neox:
            a, b = x[..., :half], x[..., half:]
            y[..., :half], y[..., half:] = a * c - b * s, a * s + b * c
        else:
            a, b = x[..., 0::2], x[..., 1::2]
            y[..., 0::2], y[..., 1::2] = a * c - b * s, a * s + b * c
        return y

    def layer_weights(self, layer):
        """One layer's weights, dequantized once for all the sequences that pass through it."""
        prefix = f"blk.{layer}."
        return {name[len(prefix):]: self.w(name) for name in self.t if name.startswith(prefix)}

    def logits(self, ids, positions=None):
        """Logits rows (float32) of one sequence at `positions` (every position when None)."""
        return self.logits_many([ids], [positions])[0]

    def logits_many(self, sequences, positions):
        """Logits rows of several sequences, each at its own positions (None = all). The layers run
        outermost, so each layer's weights are dequantized once however many sequences there are."""
        return [hn @ self.out.T for hn in self.hidden_many(sequences, positions)]

    def hidden_many(self, sequences, positions):
        """The LM head's inputs (the final norm's output, float32) of several sequences at their
        positions: a logits row is hn @ out.T."""
        xs = [self.embd[ids].astype(np.float64) * (np.sqrt(self.d) if self.arch == "gemma3" else 1.0)
              for ids in sequences]
        for layer in range(self.n_layer):
            w = self.layer_weights(layer)
            xs = [self.block(x, layer, w) for x in xs]
        norm = self.w("output_norm.weight")
        return [self.rms(x if pos is None else x[pos], norm).astype(np.float32) for x, pos in zip(xs, positions)]

    def block(self, x, layer, w):
        gemma = self.arch == "gemma3"
        n, H, KV, hd = len(x), self.n_head, self.n_kv, self.hd
        pos = np.arange(n)
        h = self.rms(x, w["attn_norm.weight"])
        q, k, v = (h @ w[f"attn_{m}.weight"].T for m in "qkv")
        if "attn_q.bias" in w:
            q, k, v = q + w["attn_q.bias"], k + w["attn_k.bias"], v + w["attn_v.bias"]
        q, k, v = q.reshape(n, H, hd), k.reshape(n, KV, hd), v.reshape(n, KV, hd)
        sliding = gemma and self.window > 0 and layer % 6 < 5
        if gemma:
            q, k = self.rms(q, w["attn_q_norm.weight"]), self.rms(k, w["attn_k_norm.weight"])
        base = 10000.0 if sliding else self.base
        neox = self.arch in ("gemma3", "qwen2")
        q, k = self.rope(q, pos, base, neox), self.rope(k, pos, base, neox)
        mask = np.tril(np.ones((n, n), dtype=bool))
        if sliding:
            mask &= (pos[:, None] - pos[None, :]) < self.window
        att = np.zeros((n, H, hd))
        for head in range(H):
            kh = head // (H // KV)
            s = np.where(mask, q[:, head, :] @ k[:, kh, :].T / np.sqrt(hd), -np.inf)
            s = np.exp(s - s.max(1, keepdims=True))
            att[:, head, :] = (s / s.sum(1, keepdims=True)) @ v[:, kh, :]
        o = att.reshape(n, H * hd) @ w["attn_output.weight"].T
        x = x + (self.rms(o, w["post_attention_norm.weight"]) if gemma else o)
        h = self.rms(x, w["ffn_norm.weight"])
        g, u = h @ w["ffn_gate.weight"].T, h @ w["ffn_up.weight"].T
        act = 0.5 * g * (1 + np.tanh(0.7978845608 * (g + 0.044715 * g**3))) if gemma else g / (1 + np.exp(-g))
        o = (act * u) @ w["ffn_down.weight"].T
        return x + (self.rms(o, w["post_ffw_norm.weight"]) if gemma else o)
