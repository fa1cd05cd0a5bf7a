"""Hugging Face model folders: loaded directly and converted by `microspec convert --hf`.

The folders in tests/data/hf/ are tiny transformers checkpoints of the real classes built by
scripts/make_hf_fixtures.py (LlamaForCausalLM float32 sharded, Qwen2ForCausalLM bfloat16 with an
untied head and a padded vocabulary, Gemma3ForCausalLM float16 with a sliding window of 8,
Phi3ForCausalLM bfloat16 with fused QKV / gate-up, partial rotary and LongRoPE (the 24-token
sequences exceed its original context of 16, so the long factors and the attention factor sqrt(2)
are in play), Qwen3ForCausalLM bfloat16 with Q/K norms, Gemma2ForCausalLM float16 with attention
and final soft-capping that bite (0.5, 2.0) and a sliding window of 8 on alternate layers,
MistralForCausalLM float32 with a sliding window of 16), with their tokenizers trained offline and transformers' goldens (token ids of the
tokenizer corpus, float32 logits under teacher forcing). Checked here, without torch:
- microspec on the folder vs transformers' float32 logits: max |difference| <= 4e-3 at every
  position of two 24-token sequences (logits up to 3 in size; the KV cache is F16), top-1 equal
  wherever transformers' top-2 margin >= 0.01;
- token ids of every corpus text equal transformers' (special tokens added as it adds them), except,
  for Qwen's NFC-normalizing tokenizer, the texts that NFC changes (llama.cpp does not normalize
  either; the converter says so in a notice);
- `microspec convert` output (the checkpoint's own float types, and q8_0) loads in llama.cpp, and
  llama.cpp's logits agree with microspec's on the same file (cosine >= 0.9999 float, >= 0.999
  q8_0; top-1 equal where llama.cpp's margin >= 0.05), and the float file gives microspec exactly
  the folder's logits; llama.cpp's token ids on the converted file equal microspec's (corpus texts
  but one with a NUL byte);
- a multimodal Gemma 3 layout skips its vision tensors with one notice;
- speculative greedy (self-drafting) equals plain greedy on a folder;
- Mistral's window (16) past it: greedy continuations equal transformers' (folder and converted
  file; plain, speculative chains, trees and n-grams; the batching server);
- each kind of bad folder (missing shard, tensor shape against config.json, unknown model_type,
  tokenizer ids past the model's vocabulary, missing config key, config.json that is not JSON, a
  directory without config.json) is a one-line error naming the file and the mismatch.
"""
import json
import pathlib
import shutil
import struct
import subprocess
import sys
import unicodedata

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import peer as peer_lib  # noqa: E402
from repo_paths import BIN, REPO  # noqa: E402
from test_model_conformance import run_eval  # noqa: E402

HF = REPO / "tests" / "data" / "hf"
ARCHS = ["llama", "qwen2", "gemma3", "phi3", "qwen3", "gemma2", "mistral"]
# Measured 1.3e-3 (llama), 1.4e-3 (qwen2), 2.3e-3 (gemma3), 1.6e-3 (phi3), 3.2e-3 (qwen3), 1.5e-3 (gemma2),
# 2.0e-3 (mistral); logits up to 3 in
# size; the KV cache is F16.
MAX_ABS_DIFF = 4e-3
NEAR_TIE = 0.01


def golden(arch):
    return json.loads((HF / arch / "golden.json").read_text(encoding="utf-8"))


def all_positions(seqs):
    return [(ids, list(range(len(ids)))) for ids in seqs]


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(arch):
    g = golden(arch)
    want = np.load(HF / arch / "golden_logits.npy")
    ours = run_eval(HF / arch, all_positions(g["sequences"]))
    worst, ties = 0.0, 0
    for (top1, rows), ref in zip(ours, want):
        assert rows.shape == ref.shape
        worst = max(worst, float(np.abs(rows - ref).max()))
        srt = np.sort(ref, axis=1)
        decisive = srt[:, -1] - srt[:, -2] >= NEAR_TIE
        ties += int((~decisive).sum())
        assert (top1[decisive] == ref.argmax(1)[decisive]).all()
    print(f"{arch}: max |microspec - transformers| = {worst:.2e}, near-ties skipped {ties}")
    assert worst <= MAX_ABS_DIFF


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_ids_match_transformers(arch, tmp_path):
    texts = golden(arch)["texts"]
    if arch == "qwen2":  # NFC normalizer: not applied (see the module docstring)
        texts = [t for t in texts if unicodedata.normalize("NFC", t["text"]) == t["text"]]
        assert len(texts) >= len(golden(arch)["texts"]) - 2
    req = tmp_path / "req.jsonl"
    req.write_text("".join(json.dumps({"op": "encode", "text": t["text"]}) + "\n" for t in texts), encoding="utf-8")
    res = subprocess.run([BIN, "tokenize", "-m", str(HF / arch), "--batch-jsonl", str(req)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    got = [json.loads(line)["ids"] for line in res.stdout.splitlines() if line.strip()]
    bad = [(t["text"], t["ids"], ids) for t, ids in zip(texts, got) if ids != t["ids"]]
    assert len(got) == len(texts)
    assert not bad, bad[:3]


def convert(arch, out, type_=None):
    cmd = [BIN, "convert", "--hf", str(HF / arch), "-o", str(out)] + (["--type", type_] if type_ else [])
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return out


def cosines(a, b):
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def mistral_window(arch):
    """The folder's sliding window when it is Mistral's (which llama.cpp does not apply), else None."""
    config = json.loads((HF / arch / "config.json").read_text())
    return config.get("sliding_window") if config["model_type"] == "mistral" else None


@pytest.mark.parametrize("arch", ARCHS)
def test_convert_agrees_with_llama_cpp(arch, tmp_path):
    seqs = golden(arch)["sequences"]
    folder = run_eval(HF / arch, all_positions(seqs))
    # llama.cpp ignores Mistral's window (llama.attention.sliding_window, which microspec writes):
    # its logits are compared at the positions inside the window only.
    window = mistral_window(arch)
    for type_, min_cos in [(None, 0.9999), ("q8_0", 0.999)]:
        path = convert(arch, tmp_path / f"{arch}-{type_ or 'float'}.gguf", type_)
        ours = run_eval(path, all_positions(seqs))
        if type_ is None:  # the same tensors as the folder's translation: the same logits
            for (t_f, r_f), (t_o, r_o) in zip(folder, ours):
                assert np.array_equal(r_f, r_o)
        if window:
            from gguf import GGUFReader
            assert GGUFReader(path).fields["llama.attention.sliding_window"].contents() == window
            ours = [(top1[:window], rows[:window]) for top1, rows in ours]
        peer = peer_lib.Peer(path, n_ctx=64)
        theirs = [peer.teacher_forcing(ids, [], list(range(len(ids))))[2].astype(np.float32)[:window]
                  for ids in seqs]
        peer.close()
        cos = np.concatenate([cosines(r, t) for (_, r), t in zip(ours, theirs)])
        agree = []
        for (top1, _), t in zip(ours, theirs):
            srt = np.sort(t, axis=1)
            decisive = srt[:, -1] - srt[:, -2] >= 0.05
            agree.append(top1[decisive] == t.argmax(1)[decisive])
        print(f"{arch} {type_ or 'float'}: cosine to llama.cpp min {cos.min():.6f}")
        assert cos.min() >= min_cos
        assert np.concatenate(agree).all()
    # The tokenizer metadata as llama.cpp reads it: the same ids as microspec (and so transformers').
    # Left out: the text with a NUL byte, which llama.cpp's SentencePiece path does not merge into
    # the learned token "\x00\x01" (transformers and microspec do).
    texts = [t["text"] for t in golden(arch)["texts"] if "\x00" not in t["text"]]
    peer = peer_lib.Peer(path, n_ctx=64)
    theirs = [peer.tokenize(t) for t in texts]
    peer.close()
    req = tmp_path / "req.jsonl"
    req.write_text("".join(json.dumps({"op": "encode", "text": t, "special": False}) + "\n" for t in texts),
                   encoding="utf-8")
    res = subprocess.run([BIN, "tokenize", "-m", str(path), "--batch-jsonl", str(req)], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    ours = [json.loads(line)["ids"] for line in res.stdout.splitlines() if line.strip()]
    assert ours == theirs


def test_speculative_greedy_equals_plain_on_folder():
    prompts = ["The quick brown fox", "It was the best of times"]
    outputs = {}
    for name, extra in [("plain", []), ("self", ["--spec", "self", "--draft-layers", "1"]),
                        ("draft", ["--spec", "draft", "--draft-model", str(HF / "llama"), "--hf-type", "q8_0"])]:
        jsonl = "".join(json.dumps({"prompt": p}) + "\n" for p in prompts)
        res = subprocess.run([BIN, "generate", "-m", str(HF / "llama"), "--prompts-jsonl", "/dev/stdin", "-n", "24",
                              "--ignore-eos", *extra], input=jsonl, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        outputs[name] = [json.loads(line)["tokens"] for line in res.stdout.splitlines() if line.strip()]
    assert len(outputs["plain"]) == len(prompts)
    assert all(len(ids) >= 24 for ids in outputs["plain"])
    assert outputs["self"] == outputs["plain"]
    assert outputs["draft"] != [] and outputs["draft"] == run_quantized_plain(prompts)


def run_quantized_plain(prompts):
    """Plain greedy on the folder quantized to q8_0 on load (the draft run's target)."""
    jsonl = "".join(json.dumps({"prompt": p}) + "\n" for p in prompts)
    res = subprocess.run([BIN, "generate", "-m", str(HF / "llama"), "--prompts-jsonl", "/dev/stdin", "-n", "24",
                          "--ignore-eos", "--hf-type", "q8_0"], input=jsonl, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return [json.loads(line)["tokens"] for line in res.stdout.splitlines() if line.strip()]


def read_safetensors(path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header.items() if k != "__metadata__"}


def write_safetensors(path, tensors):
    header, blobs, at = {}, [], 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def test_multimodal_gemma3_checkpoint_skips_vision_tensors(tmp_path):
    """A Gemma3ForConditionalGeneration layout (text config nested, language-model tensors under
    model.language_model., a vision tower and projector) gives the text model's logits exactly,
    with one notice for the skipped tensors."""
    d = tmp_path / "gemma3-mm"
    shutil.copytree(HF / "gemma3", d)
    tensors = {n.replace("model.", "model.language_model.", 1): t
               for n, t in read_safetensors(d / "model.safetensors").items()}
    tensors["model.vision_tower.vision_model.embeddings.patch_embedding.weight"] = ("F32", [4, 4], bytes(64))
    tensors["model.multi_modal_projector.mm_input_projection_weight"] = ("F32", [4, 64], bytes(1024))
    write_safetensors(d / "model.safetensors", tensors)
    text = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
                                               "text_config": text, "vision_config": {"model_type": "siglip_vision_model"}}))
    seqs = golden("gemma3")["sequences"]
    res = subprocess.run([BIN, "eval", "-m", str(d), "--ids", " ".join(map(str, seqs[0]))], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("skipped 2 vision tensors") == 1
    mm, = run_eval(d, all_positions(seqs[:1]))
    text_only, = run_eval(HF / "gemma3", all_positions(seqs[:1]))
    assert np.array_equal(mm[1], text_only[1])


def broken_folder(tmp_path, arch="llama"):
    d = tmp_path / arch
    shutil.copytree(HF / arch, d)
    return d


def edit_json(path, change):
    data = json.loads(path.read_text(encoding="utf-8"))
    change(data)
    path.write_text(json.dumps(data), encoding="utf-8")


def run_bad(folder):
    res = subprocess.run([BIN, "eval", "-m", str(folder), "--ids", "1 2 3"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    return lines[0]


def test_missing_shard(tmp_path):
    d = broken_folder(tmp_path)
    (d / "model-00002-of-00002.safetensors").unlink()
    err = run_bad(d)
    assert "model.safetensors.index.json" in err and "model-00002-of-00002.safetensors" in err and "missing" in err


def test_shape_mismatch(tmp_path):
    d = broken_folder(tmp_path)
    edit_json(d / "config.json", lambda c: c.update(intermediate_size=96))
    err = run_bad(d)
    assert "model-00002-of-00002.safetensors" in err and "config.json" in err
    assert "has shape [64, 128]" in err and "implies [64, 96]" in err


def test_unknown_architecture(tmp_path):
    d = broken_folder(tmp_path)
    edit_json(d / "config.json", lambda c: c.update(model_type="mamba"))
    err = run_bad(d)
    assert "config.json" in err and "'mamba'" in err


def test_tokenizer_of_another_vocabulary(tmp_path):
    d = broken_folder(tmp_path)
    edit_json(d / "tokenizer.json",  # a tokenizer with ids past the model's 1400 rows
              lambda t: t["added_tokens"].append({"id": 1450, "content": "<extra>", "single_word": False,
                                                  "lstrip": False, "rstrip": False, "normalized": False,
                                                  "special": True}))
    err = run_bad(d)
    assert "tokenizer.json" in err and "token id 1450" in err and "vocab_size 1400" in err


def test_missing_config_key(tmp_path):
    d = broken_folder(tmp_path)
    edit_json(d / "config.json", lambda c: c.pop("num_hidden_layers"))
    err = run_bad(d)
    assert "config.json" in err and "num_hidden_layers" in err


def test_config_that_is_not_json(tmp_path):
    d = broken_folder(tmp_path)
    (d / "config.json").write_text('{"model_type": "llama",', encoding="utf-8")
    err = run_bad(d)
    assert "config.json" in err and "not valid JSON" in err


def test_directory_without_config(tmp_path):
    err = run_bad(tmp_path)
    assert str(tmp_path) in err and "config.json" in err


def test_longrope_factors_of_the_wrong_length(tmp_path):
    d = broken_folder(tmp_path, "phi3")
    edit_json(d / "config.json", lambda c: c["rope_parameters"].update(long_factor=[1.0, 2.0, 3.0]))
    err = run_bad(d)
    assert "config.json" in err and "long_factor has 3 entries, expected 4" in err


def test_longrope_on_another_architecture(tmp_path):
    d = broken_folder(tmp_path)
    edit_json(d / "config.json", lambda c: c.update(rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
        "long_factor": [1.0] * 8, "short_factor": [1.0] * 8}))
    err = run_bad(d)
    assert "config.json" in err and "'longrope' on architecture llama is not supported" in err


def generate_from_ids(model, prompts, n, extra=()):
    """`microspec generate` over prompts given as token ids: the generated ids of each."""
    jsonl = "".join(json.dumps({"prompt_ids": ids}) + "\n" for ids in prompts)
    res = subprocess.run([BIN, "generate", "-m", str(model), "--prompts-jsonl", "/dev/stdin", "-n", str(n),
                          "--ignore-eos", "-t", "2", *extra], input=jsonl, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    return [json.loads(line)["tokens"] for line in res.stdout.splitlines() if line.strip()]


# The Mistral folder's window (16) is shorter than prompt + continuation (8 + 24): microspec's greedy
# continuations equal transformers' own (golden.json "greedy": prompts whose every step has a top-2
# margin >= 0.02 there), plainly and through speculative decoding (self-drafting chains and trees,
# n-gram drafting), from the folder and from the GGUF `convert` writes of it (which keeps the window
# as llama.attention.sliding_window). Teacher-forced argmax past the window: test_logits_match_transformers.
MISTRAL_SPEC = {
    "plain": [],
    "self chain": ["--spec", "self", "--draft-layers", "1", "--tree-depth", "4", "--tree-topk", "1", "--tree-tokens", "4"],
    "self tree": ["--spec", "self", "--draft-layers", "1", "--tree-depth", "3", "--tree-topk", "2", "--tree-tokens", "8"],
    "ngram": ["--spec", "ngram"],
}


@pytest.mark.parametrize("source", ["folder", "converted"])
def test_mistral_window_greedy_matches_transformers(source, tmp_path):
    runs = golden("mistral")["greedy"]
    window = mistral_window("mistral")
    assert window and all(len(r["prompt"]) + len(r["continuation"]) > window + 8 for r in runs)
    model = HF / "mistral" if source == "folder" else convert("mistral", tmp_path / "mistral.gguf")
    want = [r["continuation"] for r in runs]
    for name, extra in MISTRAL_SPEC.items():
        got = generate_from_ids(model, [r["prompt"] for r in runs], len(want[0]), extra)
        assert got == want, f"{source} {name}: greedy continuations differ from transformers'"


def test_mistral_window_in_the_batching_server():
    """The five greedy runs sent at once to `microspec serve --parallel 5` (the batch scheduler
    steps them in shared forward calls), plainly and self-drafting: each completion's text is the
    CLI's text for transformers' continuation."""
    import concurrent.futures
    import urllib.request
    from server_helpers import ServerProcess
    runs = golden("mistral")["greedy"]
    n = len(runs[0]["continuation"])
    jsonl = "".join(json.dumps({"prompt_ids": r["prompt"]}) + "\n" for r in runs)
    res = subprocess.run([BIN, "generate", "-m", str(HF / "mistral"), "--prompts-jsonl", "/dev/stdin", "-n", str(n),
                          "-t", "2"], input=jsonl, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    cli = [json.loads(line) for line in res.stdout.splitlines() if line.strip()]
    assert [row["tokens"] for row in cli] == [r["continuation"] for r in runs]
    server = ServerProcess(HF / "mistral", "--parallel", str(len(runs)), "--spec", "self", "--draft-layers", "1")
    try:
        def complete(prompt, spec):
            body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "microspec": {"spec": spec}}
            req = urllib.request.Request(server.url("/v1/completions"), data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                return json.loads(r.read())["choices"][0]["text"]
        for spec in ["none", "self"]:
            with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
                got = list(pool.map(lambda r: complete(r["prompt"], spec), runs))
            assert got == [row["text"] for row in cli], spec
    finally:
        server.kill()


def test_llama_config_sliding_window_is_not_read(tmp_path):
    """transformers' Llama has no window: a `llama` config.json's sliding_window changes nothing."""
    d = broken_folder(tmp_path)
    edit_json(d / "config.json", lambda c: c.update(sliding_window=4))
    seqs = golden("llama")["sequences"][:1]
    [(_, edited)], [(_, plain)] = run_eval(d, all_positions(seqs)), run_eval(HF / "llama", all_positions(seqs))
    assert np.array_equal(edited, plain)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_sliding_window_is_refused(arch, tmp_path):
    d = broken_folder(tmp_path, arch)
    edit_json(d / "config.json", lambda c: c.update(use_sliding_window=True, sliding_window=16))
    err = run_bad(d)
    assert "config.json" in err and "use_sliding_window is true: Qwen's sliding window is not supported" in err
