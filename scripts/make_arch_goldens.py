#!/usr/bin/env python3
"""Writes the transformers goldens the architecture test (tests/python/test_architectures.py,
test_transformers_golden) compares microspec against: for each architecture a randomly initialised
`transformers` model of the real class with a small config of the real kind (a few layers, the
family's head/GQA structure, RoPE settings, norms and caps), converted to GGUF by llama.cpp's own
convert_hf_to_gguf.py, and transformers' float32 logits for one token sequence.

    /work/torchenv/bin/python scripts/make_arch_goldens.py [-o tests/data/arch_golden]
        [--llama-cpp /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp]

Needs torch, transformers and sentencepiece (scripts/requirements-train.txt; the venv, not CI). Weights are rounded to float16
before the logits are computed, so the F16 GGUF holds exactly the weights transformers ran; norms
stay float32. The tokenizer is a SentencePiece model trained here on tests/python/tokenizer_texts.json
(vocabulary VOCAB), written as tokenizer.model into each checkpoint so the converter can read it.
Per architecture the output folder gets <name>.gguf and <name>.npz (ids, logits [n][VOCAB]).
"""
import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch
import transformers

REPO = pathlib.Path(__file__).resolve().parent.parent
VOCAB, SEQ_LEN, SEED = 1024, 48, 11

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)

# name: (transformers class, config class, config overrides). Each is "of the real kind": the
# family's GQA, head_dim, RoPE and its specific parts, at a tiny size.
MODELS = {
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config",
              dict(num_hidden_layers=2, head_dim=32, rope_theta=1e6, tie_word_embeddings=True)),
    "llama3": ("LlamaForCausalLM", "LlamaConfig",
               dict(num_hidden_layers=2, head_dim=16, tie_word_embeddings=True,
                    rope_parameters=dict(rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0,
                                         high_freq_factor=4.0, original_max_position_embeddings=64))),
    "mistral": ("MistralForCausalLM", "MistralConfig",
                dict(num_hidden_layers=2, head_dim=16, rope_theta=1e6, sliding_window=4096,
                     tie_word_embeddings=False)),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config",
               dict(num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
                    attn_logit_softcapping=20.0, final_logit_softcapping=10.0, rope_theta=1e4,
                    hidden_activation="gelu_pytorch_tanh")),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig",
               dict(num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
                    rope_parameters=dict(full_attention=dict(rope_type="default", rope_theta=1e6),
                                         sliding_attention=dict(rope_type="default", rope_theta=1e4)),
                    hidden_activation="gelu_pytorch_tanh")),
    # Gemma 3 4B/12B/27B's text config: linear RoPE scaling (factor 8) on the global layers only.
    "gemma3_linear": ("Gemma3ForCausalLM", "Gemma3TextConfig",
                      dict(num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
                           rope_parameters=dict(
                               full_attention=dict(rope_type="linear", rope_theta=1e6, factor=8.0),
                               sliding_attention=dict(rope_type="default", rope_theta=1e4)),
                           hidden_activation="gelu_pytorch_tanh")),
    "phi3": ("Phi3ForCausalLM", "Phi3Config",
             dict(num_hidden_layers=2, max_position_embeddings=128, original_max_position_embeddings=32,
                  sliding_window=2047,
                  tie_word_embeddings=False,
                  rope_parameters=dict(rope_type="longrope", rope_theta=1e4, partial_rotary_factor=0.75,
                                       original_max_position_embeddings=32,
                                       short_factor=[1.0, 1.02, 1.05, 1.1, 1.2, 1.3],
                                       long_factor=[1.0, 1.5, 2.5, 4.0, 6.0, 8.0]))),
}


def train_tokenizer(out_dir):
    import sentencepiece as spm
    texts = json.loads((REPO / "tests/python/tokenizer_texts.json").read_text(encoding="utf-8"))
    if isinstance(texts, dict):
        texts = [t for v in texts.values() for t in (v if isinstance(v, list) else [v])]
    corpus = out_dir / "corpus.txt"
    corpus.write_text("\n".join(str(t) for t in texts), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(out_dir / "sp"), vocab_size=VOCAB,
                                   model_type="bpe", character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2,
                                   pad_id=-1, hard_vocab_limit=False, minloglevel=2,
                                   # llama.cpp's vocabulary loader looks these up in phi3 files
                                   user_defined_symbols=["<|endoftext|>", "<|end|>", "<|user|>", "<|assistant|>"])
    return out_dir / "sp.model"


def build(name, work, sp_model):
    cls_name, cfg_name, over = MODELS[name]
    cfg = getattr(transformers, cfg_name)(**{**COMMON, **over})
    if name.startswith("gemma"):
        cfg._attn_implementation = "eager"  # soft-capping and windows as written
    torch.manual_seed(SEED)
    model = getattr(transformers, cls_name)(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1:  # norms: their init (ones, or zeros for Gemma's 1 + w) plus noise
                p.add_(torch.randn_like(p) * 0.1)
            else:  # matrices: wide enough that logits have real margins
                p.normal_(0.0, 0.5 if "embed" in pname or "lm_head" in pname else 0.15)
            p.copy_(p.half().float())  # the F16 GGUF then holds exactly these weights
    folder = work / name
    model.save_pretrained(folder)
    shutil.copy(sp_model, folder / "tokenizer.model")
    return model, folder


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--out", default=str(REPO / "tests/data/arch_golden"))
    ap.add_argument("--llama-cpp", default="/tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp")
    ap.add_argument("--only", nargs="*", default=list(MODELS))
    a = ap.parse_args()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as t:
        work = pathlib.Path(t)
        sp_model = train_tokenizer(work)
        rng = np.random.default_rng(SEED)
        for name in a.only:
            model, folder = build(name, work, sp_model)
            gguf_path = out / f"{name}.gguf"
            cmd = [sys.executable, str(pathlib.Path(a.llama_cpp) / "convert_hf_to_gguf.py"), str(folder),
                   "--outfile", str(gguf_path), "--outtype", "f16"]
            subprocess.run(cmd, check=True, capture_output=True)
            ids = [1] + [int(x) for x in rng.integers(3, VOCAB, SEQ_LEN - 1)]
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0].float().numpy()
            np.savez_compressed(out / f"{name}.npz", ids=np.array(ids, np.int32), logits=logits.astype(np.float32),
                                transformers=np.array(transformers.__version__))
            print(f"{name}: {gguf_path.stat().st_size // 1024} KiB gguf, logits {logits.shape}, "
                  f"std {logits.std():.3f}")


if __name__ == "__main__":
    main()
