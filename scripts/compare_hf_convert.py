#!/usr/bin/env python3
"""`microspec convert --hf` against llama.cpp's own convert_hf_to_gguf.py on the same folders.

Needs torch (llama.cpp's converter imports it): run with the torch venv, not part of CI:
    /work/torchenv/bin/python scripts/compare_hf_convert.py [build/microspec] [LLAMA_CPP_DIR]
For each fixture folder of tests/data/hf/ both converters write F32 GGUFs; printed: metadata keys
only one side has, values that differ, tensors that differ in name, type, shape or data.
The fixtures' tokenizers are trained here, so llama.cpp's pre-tokenizer detection (a hash of known
tokenizers' output) cannot know them: the converter is told the name microspec derived from the
tokenizer.json's regex (the same family's name) instead. Expected differences: general.name,
keys only one converter writes (microspec's llama.attention.sliding_window for Mistral, whose
window llama.cpp's converter drops), Gemma's norm weights (+1 in F16 there, in F32 here), and the Gemma
fixture's SentencePiece-style tokenizer, which llama.cpp's converter (without a tokenizer.model)
writes as a byte-level one.
"""
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
BIN = sys.argv[1] if len(sys.argv) > 1 else str(REPO / "build" / "microspec")
LCPP = pathlib.Path(sys.argv[2] if len(sys.argv) > 2 else "/tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp")
PRE = {"llama": "llama-bpe", "qwen2": "qwen2", "gemma3": "gpt-2", "phi3": "gpt-2", "qwen3": "qwen2"}

RUN_LLAMA_CPP = """
import runpy, sys
sys.path.insert(0, {lcpp!r}); sys.path.insert(0, {lcpp!r} + "/gguf-py")
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}
# Gemma 2 and Phi-3 read a tokenizer.model (SentencePiece) that these folders do not have: their
# byte-level tokenizer.json is converted as for the other byte-level models.
import conversion.gemma, conversion.phi
conversion.gemma.Gemma2Model.set_vocab = base.TextModel._set_vocab_gpt2
conversion.phi.Phi3MiniModel.set_vocab = base.TextModel._set_vocab_gpt2
sys.argv = [{lcpp!r} + "/convert_hf_to_gguf.py", {folder!r}, "--outfile", {out!r}, "--outtype", "f32"] + {extra!r}
runpy.run_path({lcpp!r} + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def load(path):
    sys.path.insert(0, str(LCPP / "gguf-py"))
    from gguf import GGUFReader
    r = GGUFReader(path)
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: (t.tensor_type.name, tuple(int(s) for s in t.shape), np.array(t.data)) for t in r.tensors}
    return kv, tensors


def compare(theirs, ours):
    a, ta = load(theirs)
    b, tb = load(ours)
    print("  keys only in llama.cpp's:", sorted(set(a) - set(b)))
    print("  keys only in microspec's:", sorted(set(b) - set(a)))
    for k in sorted(set(a) & set(b)):
        va, vb = a[k], b[k]
        same = abs(va - vb) <= 1e-6 * max(1.0, abs(va)) if isinstance(va, float) else va == vb
        if not same:
            print("  value differs:", k, str(va)[:60], "|", str(vb)[:60])
    print("  tensors only in one file:", sorted(set(ta) ^ set(tb)))
    for n in sorted(set(ta) & set(tb)):
        if ta[n][:2] != tb[n][:2]:
            print("  tensor differs:", n, ta[n][:2], tb[n][:2])
        elif not np.array_equal(ta[n][2], tb[n][2]):
            print(f"  tensor data differs: {n} max |diff| {np.abs(ta[n][2].astype(np.float64) - tb[n][2]).max():.2e}")
    print(f"  {len(set(ta) & set(tb))} tensors compared")


def llama3_rope_variant(d):
    """The Llama fixture with Llama 3.1's RoPE scaling (rope_freqs.weight) in its config."""
    folder = pathlib.Path(d) / "llama3-rope"
    shutil.copytree(REPO / "tests" / "data" / "hf" / "llama", folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def other_architectures(d):
    """Tiny float32 checkpoints of the architectures microspec maps but has no fixture of
    (Qwen3, Mistral, Gemma 2, Phi-3), with the Llama fixture's tokenizer: their keys, names and
    transforms against llama.cpp's converter, whatever microspec's loaders support."""
    import torch
    import transformers
    common = dict(vocab_size=1400, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    specs = {
        "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**common, head_dim=16)),
        "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig(**common, sliding_window=64)),
        "gemma2": (transformers.Gemma2ForCausalLM, transformers.Gemma2Config(**common, head_dim=16,
                                                                            query_pre_attn_scalar=16)),
        "phi3": (transformers.Phi3ForCausalLM, transformers.Phi3Config(**common, pad_token_id=0,
                                                                      partial_rotary_factor=0.5)),
    }
    folders = []
    for name, (cls, cfg) in specs.items():
        torch.manual_seed(0)
        folder = pathlib.Path(d) / name
        cls(cfg).save_pretrained(folder)
        for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]:
            shutil.copy(REPO / "tests" / "data" / "hf" / "llama" / f, folder / f)
        folders.append((name, "llama-bpe", folder))
    return folders


def eagle3_head(d):
    """A random EAGLE-3 head in the published layout for the Llama fixture (float32): converted by
    llama.cpp's converter with --target-model-dir and by `microspec convert --eagle --target`."""
    sys.path.insert(0, str(REPO / "tests" / "python"))
    from eagle3_checkpoint import write_eagle3_checkpoint
    folder = pathlib.Path(d) / "eagle3-llama"
    shape = dict(H=64, V=1400, D=256, nh=4, nkv=2, hd=16, ff=96, id_range=1400)
    # The fixture has 2 layers: EAGLE-3's default picks (2, L/2, L-3) do not exist there.
    write_eagle3_checkpoint(folder, seed=11, shape=shape, dtype="float32", target_layers=[0, 1, 1])
    return folder


def main():
    hf = REPO / "tests" / "data" / "hf"
    with tempfile.TemporaryDirectory() as d:
        # (name, llama.cpp pre-tokenizer, folder, llama.cpp's extra arguments, microspec's arguments)
        cases = [(arch, pre, hf / arch, [], ["--hf", hf / arch]) for arch, pre in PRE.items()]
        rope = llama3_rope_variant(d)
        cases.append(("llama3-rope", "llama-bpe", rope, [], ["--hf", rope]))
        cases += [(arch, pre, folder, [], ["--hf", folder]) for arch, pre, folder in other_architectures(d)]
        head = eagle3_head(d)
        cases.append(("eagle3-head", "llama-bpe", head, ["--target-model-dir", str(hf / "llama")],
                      ["--eagle", head, "--target", hf / "llama"]))
        for arch, pre, folder, extra, ours_args in cases:
            theirs, ours = f"{d}/{arch}-llama-cpp.gguf", f"{d}/{arch}-microspec.gguf"
            code = RUN_LLAMA_CPP.format(lcpp=str(LCPP), pre=pre, folder=str(folder), out=theirs, extra=extra)
            res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            if res.returncode != 0:
                print(arch, "llama.cpp's converter failed:", res.stderr.strip().splitlines()[-1])
                continue
            subprocess.run([BIN, "convert", *map(str, ours_args), "-o", ours, "--type", "f32"], check=True,
                           capture_output=True)
            print(arch)
            compare(theirs, ours)


if __name__ == "__main__":
    main()
