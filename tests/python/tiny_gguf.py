"""Small random models written as GGUF files by the `gguf` package (not by microspec's writer), for
numerics tests on the architectures without a real model in the suite: qwen2 (q/k/v biases),
llama, and with the real structure of each newer family (arch names, keys and tensor names as
llama.cpp's converter writes them):
- qwen3: per-head q/k RMS norms, head_dim (key_length) != n_embd / n_head, GQA, NEOX RoPE;
- llama3: Llama 3.x RoPE scaling as llama.cpp stores it (rope_freqs.weight, computed by the llama3
  rule from rope_scaling), no BOS token added (tokenizer.ggml.add_bos_token false);
- gemma2: attention and final logit soft-capping (small caps so tanh bends), sliding window on even
  layers (8 tokens, so 64-token sequences cross it), post-attention/post-FFN norms, GELU, LM head
  tied to the embeddings (as llama.cpp always does for gemma2);
- phi3: fused attn_qkv and gate/up (ffn_up, 2 * n_ff rows), partial rotary (12 of 16 dims), GQA,
  LongRoPE long/short factors with an original context of 32 (so every run here uses the long ones,
  llama.cpp's rule by context size) and rope.scaling.attn_factor.

qwen2/llama follow tests/support/tiny_model.h with head_dim = n_embd / n_head (llama.cpp requires it of
qwen2). Weights are Q8_0 (gguf.quants.quantize), norms, biases and rope factors F32, from a fixed
seed; the vocabulary is SentencePiece-style words "▁w3".."▁w<n>". The newer kinds have an untied
LM head (gemma2: smaller embeddings and larger post-norm weights instead), so that greedy decoding does not just repeat a
token and speculative decoding sees rejections.
"""
import math

import numpy as np
import gguf
from gguf.quants import quantize

N_VOCAB, N_EMBD, N_LAYER, N_HEAD, N_HEAD_KV, N_FF = 320, 64, 3, 4, 2, 96
HEAD_DIM = N_EMBD // N_HEAD

# Per architecture: file arch name, vocabulary, layers, head_dim, rotated dims, rope base.
SPECS = {
    "qwen2": dict(arch="qwen2", vocab=N_VOCAB, layers=N_LAYER, head_dim=HEAD_DIM, n_rot=HEAD_DIM, base=1e4),
    "llama": dict(arch="llama", vocab=N_VOCAB, layers=N_LAYER, head_dim=HEAD_DIM, n_rot=HEAD_DIM, base=1e4),
    "qwen3": dict(arch="qwen3", vocab=2000, layers=3, head_dim=32, n_rot=32, base=1e6),
    "llama3": dict(arch="llama", vocab=2000, layers=3, head_dim=16, n_rot=16, base=5e5),
    "gemma2": dict(arch="gemma2", vocab=2000, layers=4, head_dim=32, n_rot=32, base=1e4),
    "phi3": dict(arch="phi3", vocab=2000, layers=3, head_dim=16, n_rot=12, base=1e4),
}
GEMMA2_WINDOW, GEMMA2_ATTN_CAP, GEMMA2_FINAL_CAP = 8, 3.0, 20.0
PHI3_ORIG_CTX, PHI3_ATTN_FACTOR = 32, 1.19


def llama3_rope_factors(head_dim, base, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, old_context=64):
    """Llama 3's rope_scaling as per-frequency divisors (the rule llama.cpp's converter applies)."""
    out = []
    for j in range(head_dim // 2):
        wavelen = 2 * math.pi * base ** (2 * j / head_dim)
        if wavelen < old_context / high_freq_factor:
            out.append(1.0)
        elif wavelen > old_context / low_freq_factor:
            out.append(factor)
        else:
            smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


# The llama3 file's vocabulary ends with these pieces, from which llama.cpp's SentencePiece merges
# build the words "▁w<i>" of a text (it has no byte tokens to fall back on).
TEXT_PIECES = ["\u2581", "w", "\u2581w"] + [str(i) for i in range(10)]


def token_list(kind):
    V = SPECS[kind]["vocab"]
    extra = TEXT_PIECES if kind == "llama3" else []
    return ["<unk>", "<s>", "</s>"] + [f"\u2581w{i}" for i in range(3, V - len(extra))] + extra


def n_vocab(kind):
    return SPECS[kind]["vocab"]


# Defects write_tiny_model can put into a file, for the load-time checks.
DEFECTS = ("rope_scaling_yarn", "fused_qkv_rows", "rope_freqs_length")


def write_tiny_model(kind, path, seed=1, defect=None):
    """Writes a random model of `kind` (a key of SPECS) to path, with one of DEFECTS if named."""
    assert defect is None or defect in DEFECTS
    s = SPECS[kind]
    arch, V, n_layer, hd = s["arch"], s["vocab"], s["layers"], s["head_dim"]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(4096)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(s["base"])
    if hd != N_EMBD // N_HEAD:
        w.add_key_length(hd)
        w.add_value_length(hd)
    if s["n_rot"] != hd:
        w.add_rope_dimension_count(s["n_rot"])
    if defect == "rope_scaling_yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
    if kind == "gemma2":
        w.add_sliding_window(GEMMA2_WINDOW)
        w.add_attn_logit_softcapping(GEMMA2_ATTN_CAP)
        w.add_final_logit_softcapping(GEMMA2_FINAL_CAP)
    if kind == "phi3":
        w.add_rope_scaling_orig_ctx_len(PHI3_ORIG_CTX)
        w.add_rope_scaling_attn_factors(PHI3_ATTN_FACTOR)
    w.add_tokenizer_model("llama")
    w.add_token_list(token_list(kind))
    w.add_token_types([2, 3, 3] + [1] * (V - 3))
    w.add_token_scores([0.0] * V)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if kind == "llama3":
        w.add_add_bos_token(False)

    def matrix(name, cols, rows, scale):  # [rows][cols] as ggml's {cols, rows}
        f = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        w.add_tensor(name, quantize(f, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    def vector(name, n, base, scale):  # [n]
        w.add_tensor(name, (base + rng.standard_normal(n) * scale).astype(np.float32))

    q_dim, kv_dim = N_HEAD * hd, N_HEAD_KV * hd
    # gemma2: smaller embeddings (also its LM head) so the final soft-cap bends the logits but does not
    # flatten them, and the blocks are not drowned by the sqrt(n_embd)-scaled embeddings.
    matrix("token_embd.weight", N_EMBD, V, 0.3 if kind == "gemma2" else 1.0)
    vector("output_norm.weight", N_EMBD, 1.0, 0.1)
    if kind in ("qwen3", "llama3", "phi3"):  # an untied LM head: tied random models mostly repeat their input
        matrix("output.weight", N_EMBD, V, 1.0)
    if kind == "llama3":
        factors = llama3_rope_factors(hd, s["base"])
        w.add_tensor("rope_freqs.weight", np.append(factors, np.float32(1.0)).astype(np.float32) if defect == "rope_freqs_length" else factors)
    if kind == "phi3":  # [n_rot/2] each, LongRoPE's divisors
        w.add_tensor("rope_factors_long.weight", (1.0 + rng.uniform(0, 6, s["n_rot"] // 2)).astype(np.float32))
        w.add_tensor("rope_factors_short.weight", (1.0 + rng.uniform(0, 0.2, s["n_rot"] // 2)).astype(np.float32))
    for layer in range(n_layer):
        p = f"blk.{layer}."
        vector(p + "attn_norm.weight", N_EMBD, 1.0, 0.1)
        if kind == "phi3":
            rows = q_dim + 2 * kv_dim - (8 if defect == "fused_qkv_rows" else 0)
            matrix(p + "attn_qkv.weight", N_EMBD, rows, N_EMBD ** -0.5)
        else:
            matrix(p + "attn_q.weight", N_EMBD, q_dim, N_EMBD ** -0.5)
            matrix(p + "attn_k.weight", N_EMBD, kv_dim, N_EMBD ** -0.5)
            matrix(p + "attn_v.weight", N_EMBD, kv_dim, N_EMBD ** -0.5)
        matrix(p + "attn_output.weight", q_dim, N_EMBD, q_dim ** -0.5)
        vector(p + "ffn_norm.weight", N_EMBD, 1.0, 0.1)
        if kind == "phi3":
            matrix(p + "ffn_up.weight", N_EMBD, 2 * N_FF, N_EMBD ** -0.5)
        else:
            matrix(p + "ffn_gate.weight", N_EMBD, N_FF, N_EMBD ** -0.5)
            matrix(p + "ffn_up.weight", N_EMBD, N_FF, N_EMBD ** -0.5)
        matrix(p + "ffn_down.weight", N_FF, N_EMBD, N_FF ** -0.5)
        if kind == "qwen2":
            vector(p + "attn_q.bias", q_dim, 0.0, 0.5)
            vector(p + "attn_k.bias", kv_dim, 0.0, 0.5)
            vector(p + "attn_v.bias", kv_dim, 0.0, 0.5)
        if kind == "qwen3":
            vector(p + "attn_q_norm.weight", hd, 1.0, 0.1)
            vector(p + "attn_k_norm.weight", hd, 1.0, 0.1)
        if kind == "gemma2":
            vector(p + "post_attention_norm.weight", N_EMBD, 8.0, 0.2)
            vector(p + "post_ffw_norm.weight", N_EMBD, 8.0, 0.2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
