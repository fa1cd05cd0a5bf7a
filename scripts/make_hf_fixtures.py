#!/usr/bin/env python3
"""Builds the tiny Hugging Face checkpoints of tests/data/hf/ and their transformers goldens.

Run with the torch venv (not part of CI):  /work/torchenv/bin/python scripts/make_hf_fixtures.py

For each architecture a model of the real transformers class (LlamaForCausalLM, Qwen2ForCausalLM,
Gemma3ForCausalLM) with a small config of the real kind (GQA, the real RoPE and norm settings),
random weights from a fixed seed, and a byte-level BPE tokenizer trained offline with `tokenizers`
on the tokenizer conformance corpus (tests/python/tokenizer_texts.json), each with that family's
pre-tokenizer, special tokens and chat template. Saved with save_pretrained:
  llama   float32, sharded (model.safetensors.index.json + 2 shards), tied embeddings, BOS added
  qwen2   bfloat16, q/k/v biases, untied LM head, vocab_size padded past the tokenizer, no BOS,
          an NFC normalizer (as Qwen's own tokenizer.json has)
  gemma3  float16, sandwich norms, Q/K norms, sliding window 8 (in play at 24 tokens), tied,
          a SentencePiece-style tokenizer (spaces as U+2581, byte fallback), as Gemma's
  phi3    bfloat16, fused QKV and gate/up, partial rotary (half of each head), LongRoPE with an
          original context of 16 and max_position_embeddings 256 (so the 24-token sequences run
          on the long factors, and the attention factor is sqrt(2)), untied; a Llama-2-style
          SentencePiece tokenizer (a U+2581 prepended to the text), no BOS
  qwen3   bfloat16, Q/K norms, no QKV bias, explicit head_dim, tied, Qwen's byte-level BPE
  gemma2  float16, attention and final logit soft-capping at values that bite (0.5 and 2.0),
          sliding window 8 on alternate layers, sandwich norms, tied, Gemma's tokenizer kind
  mistral float32, Mistral 7B v0.1's kind with a sliding window of 16 (on every layer; the
          24-token sequences and the 8 + 24-token greedy runs go past it), a Llama-2-style
          SentencePiece tokenizer with BOS
Goldens per folder (golden.json): transformers' token ids for every corpus text (special tokens
added as the tokenizer does), and transformers' float32 logits under teacher forcing for two token
sequences (golden_logits.npy, [2, T, vocab]); models saved in BF16/F16 are evaluated in float32 on
the weights as saved (rounded), so the goldens are exactly what the saved files compute. For the
families in GREEDY also "greedy": transformers' greedy continuations (model.generate, checked
against argmax of full forwards) of prompts drawn until GREEDY_RUNS of them keep a top-2 margin
>= GREEDY_MARGIN at every step, so the F16 KV cache's rounding cannot flip a token.
"""
import json
import pathlib
import shutil

import numpy as np
import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

REPO = pathlib.Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "data" / "hf"
TEXTS = [t["text"] for t in json.loads((REPO / "tests/python/tokenizer_texts.json").read_text())["texts"] if "text" in t]
SEQ_LEN, N_SEQ = 24, 2
GREEDY, GREEDY_RUNS, GREEDY_PROMPT, GREEDY_NEW, GREEDY_MARGIN = {"mistral"}, 5, 8, 24, 0.02

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3_CHAT = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
               "{{ m['content'] }}<|eot_id|>{% endfor %}"
               "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
GEMMA_CHAT = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
              "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")

# Per family: pre-tokenizer, special tokens (bos, eos, others), whether BOS is added, chat template.
FAMILIES = {
    "llama": dict(split=LLAMA3_SPLIT, ignore_merges=True, bos="<|begin_of_text|>", eos="<|end_of_text|>",
                  extra=["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], add_bos=True, chat=LLAMA3_CHAT),
    "qwen2": dict(split=QWEN2_SPLIT, ignore_merges=False, nfc=True, bos=None, eos="<|im_end|>",
                  extra=["<|endoftext|>", "<|im_start|>"], add_bos=False, chat=CHATML),
    "gemma3": dict(sentencepiece=True, split=None, ignore_merges=False, bos="<bos>", eos="<eos>",
                   extra=["<pad>", "<start_of_turn>", "<end_of_turn>"], add_bos=True, chat=GEMMA_CHAT),
}
PHI3_CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
FAMILIES["phi3"] = dict(sentencepiece=True, prepend=True, split=None, ignore_merges=False, bos="<s>",
                        eos="<|endoftext|>", extra=["</s>", "<|user|>", "<|assistant|>", "<|end|>"], add_bos=False,
                        chat=PHI3_CHAT)
FAMILIES["qwen3"] = dict(FAMILIES["qwen2"], nfc=False)
FAMILIES["gemma2"] = dict(FAMILIES["gemma3"])
MISTRAL_CHAT = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
                "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
FAMILIES["mistral"] = dict(sentencepiece=True, prepend=True, split=None, ignore_merges=False, bos="<s>", eos="</s>",
                           extra=["[INST]", "[/INST]"], add_bos=True, chat=MISTRAL_CHAT)
VOCAB_TARGET = 1400


def train_sentencepiece_style(f):
    """Gemma's kind of tokenizer.json: BPE over text whose spaces are U+2581, byte fallback to
    <0xXX> tokens, and merges listed as Hugging Face's converter lists them for a SentencePiece
    model: every split of every token into two tokens, ordered by the token's rank."""
    specials = [f["bos"], f["eos"]] + f["extra"]
    base = Tokenizer(models.BPE())
    base.normalizer = normalizers.Replace(" ", "\u2581")
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=True)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_TARGET - 256 - len(specials) - 1, show_progress=False)
    # Without "<|": no chat marker of another family (<|im_end|>) becomes a learned token here, which
    # llama.cpp (and microspec) would take for an end-of-generation control token by its text.
    # Likewise Gemma's turn markers for a family whose specials they are not (llama.cpp ends
    # generation on "<end_of_turn>" by its text).
    foreign = [m for m in ("<start_of_turn>", "<end_of_turn>") if m not in specials]
    texts = []
    for t in TEXTS:
        for m in foreign:
            t = t.replace(m, "")
        texts.append(t.replace("<|", ""))
    base.train_from_iterator(texts * 3, trainer)
    trained = json.loads(base.to_str())["model"]["vocab"]
    vocab = {"<unk>": 0}
    for t in specials:
        vocab[t] = len(vocab)
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for t, _ in sorted(trained.items(), key=lambda kv: kv[1]):
        vocab.setdefault(t, len(vocab))
    merges = sorted(((a, t[len(a):]) for t in vocab for i in range(1, len(t))
                     for a in [t[:i]] if a in vocab and t[i:] in vocab and vocab[t] > 256 + len(specials)),
                    key=lambda m: (vocab[m[0] + m[1]], vocab[m[0]], vocab[m[1]]))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    if f.get("prepend"):  # Llama 2's (and Phi-3's): one U+2581 before the text
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(specials + ["<unk>"])
    return tok


def train_tokenizer(family):
    f = FAMILIES[family]
    if f.get("sentencepiece"):
        return wrap(f, train_sentencepiece_style(f))
    tok = Tokenizer(models.BPE(ignore_merges=f["ignore_merges"]))
    if f.get("nfc"):
        tok.normalizer = normalizers.NFC()
    if f["split"]:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(f["split"]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = [t for t in [f["bos"], f["eos"]] + f["extra"] if t]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_TARGET, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 3, trainer)
    if f["add_bos"]:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{f['bos']} $A", pair=f"{f['bos']} $A {f['bos']} $B",
            special_tokens=[(f["bos"], tok.token_to_id(f["bos"]))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return wrap(f, tok)


def wrap(f, tok):
    if f["add_bos"] and tok.post_processor is None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{f['bos']} $A", pair=f"{f['bos']} $A {f['bos']} $B",
            special_tokens=[(f["bos"], tok.token_to_id(f["bos"]))])
    kwargs = dict(tokenizer_object=tok, eos_token=f["eos"])
    if f["bos"]:
        kwargs["bos_token"] = f["bos"]
    fast = transformers.PreTrainedTokenizerFast(**kwargs)
    fast.chat_template = f["chat"]
    return fast


def make_model(family, vocab):
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if family == "llama":
        cfg = transformers.LlamaConfig(**common, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
        return transformers.LlamaForCausalLM(cfg), torch.float32
    if family == "qwen2":
        cfg = transformers.Qwen2Config(**common, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        return transformers.Qwen2ForCausalLM(cfg), torch.bfloat16
    if family == "phi3":
        # Half of each 16-dimension head rotated: 4 rotated pairs, so 4 LongRoPE factors each.
        rng = np.random.default_rng(7)
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                "original_max_position_embeddings": 16,
                "long_factor": [float(x) for x in 1.0 + 3.0 * rng.random(4)],
                "short_factor": [float(x) for x in 1.0 + 0.5 * rng.random(4)]}
        cfg = transformers.Phi3Config(**common, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                      original_max_position_embeddings=16, rope_parameters=rope,
                                      pad_token_id=None, bos_token_id=None, eos_token_id=None)
        return transformers.Phi3ForCausalLM(cfg), torch.bfloat16
    if family == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=24, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        return transformers.Qwen3ForCausalLM(cfg), torch.bfloat16
    if family == "gemma2":
        cfg = transformers.Gemma2Config(**common, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                        attn_logit_softcapping=0.5, final_logit_softcapping=2.0,
                                        rms_norm_eps=1e-6, tie_word_embeddings=True)
        return transformers.Gemma2ForCausalLM(cfg), torch.float16
    if family == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=16, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        return transformers.MistralForCausalLM(cfg), torch.float32
    cfg = transformers.Gemma3TextConfig(**common, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                        rms_norm_eps=1e-6, tie_word_embeddings=True)
    cfg.num_hidden_layers = 2
    return transformers.Gemma3ForCausalLM(cfg), torch.float16


def randomize(model, seed):
    """Weights of a trained model's scale: N(0, 0.02) matrices, norm weights near their identity
    (gemma's stored weight is added to 1), biases small."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                base = 0.0 if "Gemma" in type(model).__name__ else 1.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))


def greedy_runs(model, rng, n_tok):
    """Prompts (BOS, then random ids) and transformers' greedy continuations, kept only when every
    step's top-2 margin is >= GREEDY_MARGIN and no step picks EOS; each continuation is the argmax
    of a full forward over the whole sequence at every step, and equals model.generate's (which
    runs on transformers' sliding-window cache)."""
    runs = []
    while len(runs) < GREEDY_RUNS:
        prompt = [1] + [int(t) for t in rng.integers(3, n_tok, GREEDY_PROMPT - 1)]
        ids, margins = list(prompt), []
        with torch.no_grad():
            for _ in range(GREEDY_NEW):
                last = model(torch.tensor([ids])).logits[0, -1].float()  # [vocab]
                top2 = torch.topk(last, 2).values
                margins.append(float(top2[0] - top2[1]))
                ids.append(int(last.argmax()))
        if min(margins) < GREEDY_MARGIN or model.config.eos_token_id in ids[len(prompt):]:
            continue
        with torch.no_grad():
            generated = model.generate(torch.tensor([prompt]), max_new_tokens=GREEDY_NEW, do_sample=False)[0]
        assert generated.tolist() == ids, "generate() and full forwards disagree"
        runs.append({"prompt": prompt, "continuation": ids[len(prompt):], "min_margin": min(margins)})
    return runs


def build(family, seed):
    out = OUT / family
    shutil.rmtree(out, ignore_errors=True)
    tok = train_tokenizer(family)
    n_tok = len(tok)
    vocab = n_tok + 64 if family == "qwen2" else n_tok  # Qwen pads its embedding past the tokenizer
    torch.manual_seed(seed)
    model, dtype = make_model(family, vocab)
    randomize(model, seed)
    model = model.to(dtype).to(torch.float32).eval()  # the weights as saved, evaluated in float32
    to_save = model.to(dtype) if dtype != torch.float32 else model
    shard = {"max_shard_size": "300KB"} if family == "llama" else {}
    to_save.save_pretrained(out, **shard)
    tok.save_pretrained(out)
    model = model.to(torch.float32)

    rng = np.random.default_rng(seed)
    seqs = [[int(t) for t in rng.integers(0, n_tok, SEQ_LEN)] for _ in range(N_SEQ)]
    with torch.no_grad():
        logits = np.stack([model(torch.tensor([s])).logits[0].float().numpy() for s in seqs]).astype(np.float32)
    reloaded = transformers.AutoTokenizer.from_pretrained(out)
    golden = {
        "transformers": transformers.__version__,
        "n_tokenizer": n_tok,
        "sequences": seqs,
        "texts": [{"text": t, "ids": reloaded(t)["input_ids"]} for t in TEXTS],
    }
    if family in GREEDY:
        golden["greedy"] = greedy_runs(model, rng, n_tok)
    (out / "golden.json").write_text(json.dumps(golden, ensure_ascii=False))
    np.save(out / "golden_logits.npy", logits)
    files = sorted(p.name for p in out.iterdir())
    print(family, "vocab", vocab, "tokenizer", n_tok, "files", files,
          "bytes", sum(p.stat().st_size for p in out.iterdir()))


if __name__ == "__main__":
    import sys
    torch.set_num_threads(1)
    chosen = sys.argv[1:] or list(FAMILIES)  # families to (re)build; all by default
    for i, family in enumerate(FAMILIES):
        if family in chosen:
            build(family, 1000 + i)
