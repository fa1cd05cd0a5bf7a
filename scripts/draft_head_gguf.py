"""Reads and writes EAGLE-3 draft heads in llama.cpp's `eagle3` GGUF layout (numpy and the `gguf`
package only, no torch): used by scripts/train_draft_head.py and by the tests.

Layout (llama.cpp as vendored by llama-cpp-python 0.3.36: src/models/eagle3.cpp, src/llama-arch.cpp,
conversion/llama.py): metadata eagle3.{embedding_length, block_count=1, feed_forward_length,
attention.head_count, attention.head_count_kv, attention.key_length, attention.value_length,
attention.layer_norm_rms_epsilon, rope.freq_base, target_layers[3], target_hidden_size,
norm_before_residual}; tensors fc.weight, blk.0.{attn_norm, attn_norm_2, attn_q, attn_k, attn_v,
attn_output, ffn_norm, ffn_gate, ffn_up, ffn_down}.weight, output_norm.weight. Matrices are stored
as numpy arrays of shape [rows][cols] (ggml ne = [cols, rows]); q and k rows are in GGUF order
(llama.cpp's NORM RoPE: pairs (2j, 2j+1) within a head), so no permutation is needed.
"""
import numpy as np

MATRICES = ("fc.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight",
            "blk.0.attn_output.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight")
VECTORS = ("blk.0.attn_norm.weight", "blk.0.attn_norm_2.weight", "blk.0.ffn_norm.weight", "output_norm.weight")


def _reader(source):
    """A gguf.GGUFReader of `source`: a file path, or a reader already open (the tests keep one per
    file: parsing a large vocabulary's metadata takes the `gguf` package seconds)."""
    import gguf
    return source if isinstance(source, gguf.GGUFReader) else gguf.GGUFReader(str(source))


def target_info(model_path):
    """(n_embd, n_layer, n_vocab) of a target GGUF (a path or an open GGUFReader)."""
    r = _reader(model_path)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()

    def scalar(key):
        return int(r.fields[f"{arch}.{key}"].parts[-1][0])
    n_vocab = len(r.fields["tokenizer.ggml.tokens"].data)  # indices of its parts: one per token
    return scalar("embedding_length"), scalar("block_count"), n_vocab


def default_layers(n_layer):
    """EAGLE-3's choice: the inputs of layers 2, L/2 and L-3."""
    return [2, n_layer // 2, n_layer - 3]


def shapes(n_embd, n_head, n_head_kv, head_dim, n_ff, norm_before_fc=False, n_target_layers=3):
    """name -> numpy shape of every tensor of a head with these sizes (target hidden = n_embd)."""
    q, kv, h = n_head * head_dim, n_head_kv * head_dim, n_embd
    extra = {"enc.output_norm.weight": (n_target_layers * h,)} if norm_before_fc else {}
    return extra | {
        "fc.weight": (h, n_target_layers * h),
        "blk.0.attn_q.weight": (q, 2 * h), "blk.0.attn_k.weight": (kv, 2 * h), "blk.0.attn_v.weight": (kv, 2 * h),
        "blk.0.attn_output.weight": (h, q),
        "blk.0.ffn_gate.weight": (n_ff, h), "blk.0.ffn_up.weight": (n_ff, h), "blk.0.ffn_down.weight": (h, n_ff),
        "blk.0.attn_norm.weight": (h,), "blk.0.attn_norm_2.weight": (h,), "blk.0.ffn_norm.weight": (h,),
        "output_norm.weight": (h,),
    }


def random_head(n_embd, n_head, n_head_kv, head_dim, n_ff, seed, norm_before_fc=False):
    """Random weights (matrices ~ N(0, 1/cols), norms ~ 1 + N(0, 0.1^2))."""
    rng = np.random.default_rng(seed)
    w = {}
    for name, shape in shapes(n_embd, n_head, n_head_kv, head_dim, n_ff, norm_before_fc).items():
        if len(shape) == 2:
            w[name] = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
        else:
            w[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    return w


def write_head(path, weights, cfg, matrix_type="f16", tokenizer_from=None):
    """Writes weights (name -> float32 array) and cfg (n_embd, n_head, n_head_kv, head_dim, n_ff,
    rms_eps, rope_base, target_layers, target_hidden, optional norm_before_fc) as an eagle3 GGUF.
    matrix_type: f16, f32 or q8_0. tokenizer_from: the target GGUF whose tokenizer.* metadata is
    copied in, as llama.cpp's converter does (llama.cpp refuses a head without a vocabulary); a
    path or an open GGUFReader."""
    import gguf
    w = gguf.GGUFWriter(str(path), "eagle3")
    if tokenizer_from is not None:
        r = _reader(tokenizer_from)
        for name, field in r.fields.items():
            if name.startswith("tokenizer."):
                sub = field.types[1] if len(field.types) > 1 else None
                w.add_key_value(name, field.contents(), field.types[0], sub)
    a = "eagle3."
    w.add_uint32(a + "context_length", 8192)
    w.add_uint32(a + "embedding_length", cfg["n_embd"])
    w.add_uint32(a + "block_count", 1)
    w.add_uint32(a + "feed_forward_length", cfg["n_ff"])
    w.add_uint32(a + "attention.head_count", cfg["n_head"])
    w.add_uint32(a + "attention.head_count_kv", cfg["n_head_kv"])
    w.add_uint32(a + "attention.key_length", cfg["head_dim"])
    w.add_uint32(a + "attention.value_length", cfg["head_dim"])
    w.add_float32(a + "attention.layer_norm_rms_epsilon", cfg["rms_eps"])
    w.add_float32(a + "rope.freq_base", cfg["rope_base"])
    w.add_array(a + "target_layers", [int(x) for x in cfg["target_layers"]])
    w.add_uint32(a + "target_hidden_size", cfg["target_hidden"])
    w.add_bool(a + "norm_before_residual", False)
    w.add_bool(a + "norm_before_fc", bool(cfg.get("norm_before_fc", False)))
    names = MATRICES + VECTORS + (("enc.output_norm.weight",) if cfg.get("norm_before_fc") else ())
    for name in names:
        x = np.ascontiguousarray(weights[name], dtype=np.float32)
        if x.ndim == 1 or matrix_type == "f32":
            w.add_tensor(name, x)
        elif matrix_type == "f16":
            w.add_tensor(name, x.astype(np.float16))
        elif matrix_type == "q8_0":
            q = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            raise ValueError(f"matrix type {matrix_type}: expected f16, f32 or q8_0")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def read_head(path):
    """(weights as float32 arrays in numpy shape, cfg) of an eagle3 GGUF."""
    import gguf
    r = gguf.GGUFReader(str(path))
    f = r.fields

    def val(key):
        return f[key].parts[-1][0].item()
    cfg = {
        "n_embd": int(val("eagle3.embedding_length")), "n_head": int(val("eagle3.attention.head_count")),
        "n_head_kv": int(val("eagle3.attention.head_count_kv")), "head_dim": int(val("eagle3.attention.key_length")),
        "n_ff": int(val("eagle3.feed_forward_length")), "rms_eps": float(val("eagle3.attention.layer_norm_rms_epsilon")),
        "rope_base": float(val("eagle3.rope.freq_base")),
        "target_layers": [int(f["eagle3.target_layers"].parts[i][0]) for i in f["eagle3.target_layers"].data],
        "target_hidden": int(val("eagle3.target_hidden_size")),
        "norm_before_fc": bool(val("eagle3.norm_before_fc")) if "eagle3.norm_before_fc" in f else False,
    }
    weights = {}
    for t in r.tensors:
        x = gguf.quants.dequantize(t.data, t.tensor_type)
        weights[t.name] = np.asarray(x, dtype=np.float32).reshape(tuple(reversed([int(n) for n in t.shape])))
    return weights, cfg
