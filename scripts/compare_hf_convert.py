#!/usr/bin/env python3
"""`microspec convert --hf` against llama.cpp's own convert_hf_to_gguf.py on the same folders.

Needs torch (llama.cpp's converter imports it): run with the torch venv, not part of CI:
    /work/torchenv/bin/python scripts/compare_hf_convert.py [build/microspec] [LLAMA_CPP_DIR]
For each fixture folder of tests/data/hf/ both converters write F32 GGUFs; printed: metadata keys
only one side has, values that differ, tensors that differ in name, type, shape or data.
The fixtures' tokenizers are trained here, so llama.cpp's pre-tokenizer detection (a hash of known
tokenizers' output) cannot know them: the converter is told the name microspec derived from the
tokenizer.json's regex (the same family's name) instead. Expected differences: general.name,
keys only one converter writes, Gemma's norm weights (+1 in F16 there, in F32 here), and the Gemma
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
PRE = {"llama": "llama-bpe", "qwen2": "qwen2", "gemma3": "gpt-2"}

RUN_LLAMA_CPP = """
import runpy, sys
sys.path.insert(0, {lcpp!r}); sys.path.insert(0, {lcpp!r} + "/gguf-py")
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}
sys.argv = [{lcpp!r} + "/convert_hf_to_gguf.py", {folder!r}, "--outfile", {out!r}, "--outtype", "f32"]
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


def main():
    with tempfile.TemporaryDirectory() as d:
        cases = [(arch, pre, REPO / "tests" / "data" / "hf" / arch) for arch, pre in PRE.items()]
        cases.append(("llama3-rope", "llama-bpe", llama3_rope_variant(d)))
        for arch, pre, folder in cases:
            theirs, ours = f"{d}/{arch}-llama-cpp.gguf", f"{d}/{arch}-microspec.gguf"
            code = RUN_LLAMA_CPP.format(lcpp=str(LCPP), pre=pre, folder=str(folder), out=theirs)
            subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
            subprocess.run([BIN, "convert", "--hf", str(folder), "-o", ours, "--type", "f32"], check=True,
                           capture_output=True)
            print(arch)
            compare(theirs, ours)


if __name__ == "__main__":
    main()
