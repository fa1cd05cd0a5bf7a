"""An independent high-precision forward pass for the GGUF architectures microspec runs (gemma2,
gemma3, llama, phi3, qwen2, qwen3), in numpy, following the file's metadata keys and tensor names
as llama.cpp writes them.

Weights are dequantized by the `gguf` package (not by microspec), every op runs in float64 except
the LM head (float32), and no activation is quantized. It is the yardstick that both microspec and
llama.cpp are measured against: each quantizes activations to 8 bits, so each drifts from it a
little, and the test checks we drift no more than llama.cpp does.
"""
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


class ReferenceModel:
    def __init__(self, path, n_ctx=4096):
        """n_ctx: the context size the engines run with (phi3's LongRoPE picks its factors by it)."""
        self.r = GGUFReader(str(path))
        self.t = {t.name: t for t in self.r.tensors}
        f = lambda k, d=None: self.r.fields[k].contents() if k in self.r.fields else d  # noqa: E731
        a = self.arch = f("general.architecture")
        self.gemma = a in ("gemma2", "gemma3")
        self.d = f(f"{a}.embedding_length")
        self.n_layer = f(f"{a}.block_count")
        self.n_head = f(f"{a}.attention.head_count")
        self.n_kv = f(f"{a}.attention.head_count_kv", self.n_head)
        self.hd = f(f"{a}.attention.key_length", self.d // self.n_head)
        self.n_rot = f(f"{a}.rope.dimension_count", self.hd)
        self.eps = f(f"{a}.attention.layer_norm_rms_epsilon")
        self.base = f(f"{a}.rope.freq_base", 10000.0)
        self.base_swa = f(f"{a}.rope.freq_base_swa", {"gemma3": 10000.0}.get(a, self.base))
        factor = f(f"{a}.rope.scaling.factor", 0.0)
        self.freq_scale = 1.0 / factor if factor and f(f"{a}.rope.scaling.type", "linear") == "linear" else 1.0
        self.freq_scale_swa = 1.0 if a == "gemma3" else self.freq_scale
        self.attn_factor = f(f"{a}.rope.scaling.attn_factor", 1.0)
        self.window = f(f"{a}.attention.sliding_window", {"gemma2": 4096}.get(a, 0)) if self.gemma else 0
        self.pattern = f(f"{a}.attention.sliding_window_pattern", {"gemma2": 2, "gemma3": 6}.get(a, 1))
        self.attn_cap = f(f"{a}.attn_logit_softcapping", 50.0 if a == "gemma2" else 0.0)
        self.final_cap = f(f"{a}.final_logit_softcapping", 30.0 if a == "gemma2" else 0.0)
        self.scale = 1.0 / np.sqrt(self.hd)
        if self.gemma and self.n_layer == {"gemma2": 46, "gemma3": 62}[a]:  # the 27B models
            self.scale = 1.0 / np.sqrt(self.d // self.n_head)
        self.neox = a != "llama"
        # Per-frequency divisors: Llama 3's rope_freqs, or phi3's LongRoPE factors by context size.
        self.freq_factors = self.w("rope_freqs.weight") if self.has("rope_freqs.weight") else None
        if self.has("rope_factors_long.weight"):
            orig = f(f"{a}.rope.scaling.original_context_length", f(f"{a}.context_length"))
            self.freq_factors = self.w("rope_factors_long.weight" if n_ctx > orig else "rope_factors_short.weight")
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

    def rope(self, x, pos, base, freq_scale):
        """Rotates the first n_rot dims of each head: theta_j = pos * base^(-2j/n_rot) / factor_j * scale."""
        n, half = self.n_rot, self.n_rot // 2
        inv = base ** (-np.arange(half) * 2.0 / n)
        if self.freq_factors is not None:
            inv = inv / self.freq_factors
        th = np.outer(pos, inv * freq_scale)
        c, s = (np.cos(th) * self.attn_factor)[:, None, :], (np.sin(th) * self.attn_factor)[:, None, :]
        y = x.copy()
        if self.neox:
            a, b = x[..., :half], x[..., half:n]
            y[..., :half], y[..., half:n] = a * c - b * s, a * s + b * c
        else:
            a, b = x[..., 0:n:2], x[..., 1:n:2]
            y[..., 0:n:2], y[..., 1:n:2] = a * c - b * s, a * s + b * c
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
        out = []
        for hn in self.hidden_many(sequences, positions):
            logits = hn @ self.out.T
            if self.final_cap:
                logits = (self.final_cap * np.tanh(logits.astype(np.float64) / self.final_cap)).astype(np.float32)
            out.append(logits)
        return out

    def hidden_many(self, sequences, positions):
        """The LM head's inputs (the final norm's output, float32) of several sequences at their
        positions: a logits row is hn @ out.T (soft-capped when the architecture caps)."""
        xs = [self.embd[ids].astype(np.float64) * (np.sqrt(self.d) if self.gemma else 1.0) for ids in sequences]
        for layer in range(self.n_layer):
            w = self.layer_weights(layer)
            xs = [self.block(x, layer, w) for x in xs]
        norm = self.w("output_norm.weight")
        return [self.rms(x if pos is None else x[pos], norm).astype(np.float32) for x, pos in zip(xs, positions)]

    def block(self, x, layer, w):
        n, H, KV, hd = len(x), self.n_head, self.n_kv, self.hd
        pos = np.arange(n)
        h = self.rms(x, w["attn_norm.weight"])
        if "attn_qkv.weight" in w:  # fused: rows q, then k, then v
            qkv = h @ w["attn_qkv.weight"].T
            q, k, v = qkv[:, :H * hd], qkv[:, H * hd:(H + KV) * hd], qkv[:, (H + KV) * hd:]
        else:
            q, k, v = (h @ w[f"attn_{m}.weight"].T for m in "qkv")
        if "attn_q.bias" in w:
            q, k, v = q + w["attn_q.bias"], k + w["attn_k.bias"], v + w["attn_v.bias"]
        q, k, v = q.reshape(n, H, hd), k.reshape(n, KV, hd), v.reshape(n, KV, hd)
        sliding = self.window > 0 and layer % self.pattern < self.pattern - 1
        if "attn_q_norm.weight" in w:
            q, k = self.rms(q, w["attn_q_norm.weight"]), self.rms(k, w["attn_k_norm.weight"])
        base, fs = (self.base_swa, self.freq_scale_swa) if sliding else (self.base, self.freq_scale)
        q, k = self.rope(q, pos, base, fs), self.rope(k, pos, base, fs)
        mask = np.tril(np.ones((n, n), dtype=bool))
        if sliding:
            mask &= (pos[:, None] - pos[None, :]) < self.window
        att = np.zeros((n, H, hd))
        for head in range(H):
            kh = head // (H // KV)
            s = q[:, head, :] @ k[:, kh, :].T * self.scale
            if self.attn_cap:
                s = self.attn_cap * np.tanh(s / self.attn_cap)
            s = np.where(mask, s, -np.inf)
            s = np.exp(s - s.max(1, keepdims=True))
            att[:, head, :] = (s / s.sum(1, keepdims=True)) @ v[:, kh, :]
        o = att.reshape(n, H * hd) @ w["attn_output.weight"].T
        x = x + (self.rms(o, w["post_attention_norm.weight"]) if "post_attention_norm.weight" in w else o)
        h = self.rms(x, w["ffn_norm.weight"])
        if "ffn_gate.weight" in w:
            g, u = h @ w["ffn_gate.weight"].T, h @ w["ffn_up.weight"].T
        else:  # fused gate/up (phi3): rows gate, then up
            gu = h @ w["ffn_up.weight"].T
            g, u = gu[:, :gu.shape[1] // 2], gu[:, gu.shape[1] // 2:]
        act = 0.5 * g * (1 + np.tanh(0.7978845608 * (g + 0.044715 * g**3))) if self.gemma else g / (1 + np.exp(-g))
        o = (act * u) @ w["ffn_down.weight"].T
        return x + (self.rms(o, w["post_ffw_norm.weight"]) if "post_ffw_norm.weight" in w else o)
