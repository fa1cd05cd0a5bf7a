"""Small random llama / qwen2 models written as GGUF files by the `gguf` package (not by
microspec's writer), for numerics tests on the architectures without a real model in the suite
(qwen2: q/k/v biases) or with one model only (llama).

Shapes follow tests/tiny_model.h but with head_dim = n_embd / n_head, which llama.cpp requires of
qwen2, so that llama.cpp can run the same file. Weights are Q8_0 (gguf.quants.quantize), norms and
biases F32, from a fixed seed; the vocabulary is SentencePiece-style words "▁w3".."▁w319".
"""
import numpy as np
import gguf
from gguf.quants import quantize

N_VOCAB, N_EMBD, N_LAYER, N_HEAD, N_HEAD_KV, N_FF = 320, 64, 3, 4, 2, 96
HEAD_DIM = N_EMBD // N_HEAD


def write_tiny_model(arch, path, seed=1):
    """Writes a random `arch` (llama or qwen2) model to path."""
    assert arch in ("llama", "qwen2")
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(4096)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e4)
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"\u2581w{i}" for i in range(3, N_VOCAB)])
    w.add_token_types([2, 3, 3] + [1] * (N_VOCAB - 3))
    w.add_token_scores([0.0] * N_VOCAB)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def matrix(name, cols, rows, scale):  # [rows][cols] as ggml's {cols, rows}
        f = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        w.add_tensor(name, quantize(f, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    def vector(name, n, base, scale):  # [n]
        w.add_tensor(name, (base + rng.standard_normal(n) * scale).astype(np.float32))

    q_dim, kv_dim = N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM
    matrix("token_embd.weight", N_EMBD, N_VOCAB, 1.0)
    vector("output_norm.weight", N_EMBD, 1.0, 0.1)
    for layer in range(N_LAYER):
        p = f"blk.{layer}."
        vector(p + "attn_norm.weight", N_EMBD, 1.0, 0.1)
        matrix(p + "attn_q.weight", N_EMBD, q_dim, N_EMBD ** -0.5)
        matrix(p + "attn_k.weight", N_EMBD, kv_dim, N_EMBD ** -0.5)
        matrix(p + "attn_v.weight", N_EMBD, kv_dim, N_EMBD ** -0.5)
        matrix(p + "attn_output.weight", q_dim, N_EMBD, q_dim ** -0.5)
        vector(p + "ffn_norm.weight", N_EMBD, 1.0, 0.1)
        matrix(p + "ffn_gate.weight", N_EMBD, N_FF, N_EMBD ** -0.5)
        matrix(p + "ffn_up.weight", N_EMBD, N_FF, N_EMBD ** -0.5)
        matrix(p + "ffn_down.weight", N_FF, N_EMBD, N_FF ** -0.5)
        if arch == "qwen2":
            vector(p + "attn_q.bias", q_dim, 0.0, 0.5)
            vector(p + "attn_k.bias", kv_dim, 0.0, 0.5)
            vector(p + "attn_v.bias", kv_dim, 0.0, 0.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
