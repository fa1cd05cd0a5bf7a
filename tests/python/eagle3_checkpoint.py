"""A random EAGLE-3 draft head in the layout published EAGLE-3 checkpoints use on Hugging Face
(config.json + model.safetensors), written with numpy alone: for the `convert --eagle` tests and
scripts/compare_hf_convert.py (which compares the conversion with llama.cpp's converter)."""
import json

import numpy as np

# A head for SmolLM2: its attention shape, FFN 128, an own LM head over 2048 draft ids among the
# first 8192 target ids.
SMOLLM2_HEAD = dict(H=576, V=49152, D=2048, nh=9, nkv=3, hd=64, ff=128, id_range=8192)


def write_eagle3_checkpoint(folder, seed=5, shape=None, dtype="float16", target_layers=None):
    """A random EAGLE-3 head in the published layout (config.json + model.safetensors written with
    numpy, matrices in `dtype`): `shape` (default SMOLLM2_HEAD) gives the hidden size H, the target
    vocabulary V, the draft vocabulary D (its own LM head, d2t offsets and t2d), the attention shape
    (nh, nkv, hd), the FFN size ff and the target ids the draft ids are drawn from; the target
    layers are `target_layers` (config.json's eagle_aux_hidden_state_layer_ids), else the ones
    EAGLE-3 picks by default. Returns the draft ids."""
    rng = np.random.default_rng(seed)
    s = shape or SMOLLM2_HEAD
    H, V, D, nh, nkv, hd, ff = s["H"], s["V"], s["D"], s["nh"], s["nkv"], s["hd"], s["ff"]
    ids = np.sort(rng.choice(s["id_range"], D, replace=False))
    t = {
        "fc.weight": rng.standard_normal((H, 3 * H)) / np.sqrt(3 * H),
        "midlayer.hidden_norm.weight": 1 + 0.1 * rng.standard_normal(H),
        "midlayer.input_layernorm.weight": 1 + 0.1 * rng.standard_normal(H),
        "midlayer.self_attn.q_proj.weight": rng.standard_normal((nh * hd, 2 * H)) / np.sqrt(2 * H),
        "midlayer.self_attn.k_proj.weight": rng.standard_normal((nkv * hd, 2 * H)) / np.sqrt(2 * H),
        "midlayer.self_attn.v_proj.weight": rng.standard_normal((nkv * hd, 2 * H)) / np.sqrt(2 * H),
        "midlayer.self_attn.o_proj.weight": rng.standard_normal((H, nh * hd)) / np.sqrt(nh * hd),
        "midlayer.post_attention_layernorm.weight": 1 + 0.1 * rng.standard_normal(H),
        "midlayer.mlp.gate_proj.weight": rng.standard_normal((ff, H)) / np.sqrt(H),
        "midlayer.mlp.up_proj.weight": rng.standard_normal((ff, H)) / np.sqrt(H),
        "midlayer.mlp.down_proj.weight": rng.standard_normal((H, ff)) / np.sqrt(ff),
        "norm.weight": 1 + 0.1 * rng.standard_normal(H),
        "lm_head.weight": rng.standard_normal((D, H)) / np.sqrt(H),
    }
    arrays = {k: v.astype(dtype) for k, v in t.items()}
    arrays["d2t"] = (ids - np.arange(D)).astype(np.int64)
    t2d = np.zeros(V, dtype=np.bool_)
    t2d[ids] = True
    arrays["t2d"] = t2d
    names = {np.dtype(np.float16): "F16", np.dtype(np.float32): "F32", np.dtype(np.int64): "I64",
             np.dtype(np.bool_): "BOOL"}
    header, offset = {}, 0
    for k, a in arrays.items():
        header[k] = {"dtype": names[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    raw = json.dumps(header).encode()
    folder.mkdir()
    with open(folder / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for a in arrays.values():
            f.write(np.ascontiguousarray(a).tobytes())
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": H, "intermediate_size": ff,
           "num_attention_heads": nh, "num_key_value_heads": nkv, "num_hidden_layers": 1, "rms_norm_eps": 1e-5,
           "rope_theta": 100000.0, "max_position_embeddings": 2048, "vocab_size": V, "draft_vocab_size": D}
    if target_layers is not None:
        cfg["eagle_aux_hidden_state_layer_ids"] = list(target_layers)
    (folder / "config.json").write_text(json.dumps(cfg))
    return ids
