"""Model conformance against llama.cpp (llama-cpp-python, built by scripts/install_llama_cpp.sh).

On both real models, with token ids as input (so the tokenizer is out of the picture):
- teacher forcing on 20 prompts of 620 tokens (past Gemma 3's 512-token sliding window): top-1
  equals llama.cpp's at >= 99.5% of the positions where llama.cpp's top-2 margin is >= 0.5 logits
  and at >= 93% of all positions, mean logit cosine >= 0.998 (rows every 37 positions);
- on two of them, against an independent float64 forward pass (reference_forward.py): our top-1
  agreement with it at most 1.5 points below llama.cpp's, our mean cosine at most 0.0003 below
  llama.cpp's and >= 0.999 (rows every 5 positions);
- tiny random qwen2 and llama models written by the `gguf` package: cosine to the float64 forward
  pass >= 0.999 at every position, mean at most 0.0003 below llama.cpp's on the same file, top-1
  = the float64 model's at >= 95% of positions;
- greedy continuations of 64 tokens on 20 prompts: at every first difference from llama.cpp's the
  two engines order the two tokens within 1.5 logits of each other (llama.cpp's margin for its
  token plus ours for ours), our pick there is our own argmax on that prefix (so the disagreement
  is at least llama.cpp's margin; a sampling mutant fails this), and >= 20% (4/20) of the
  continuations are identical throughout.

llama.cpp quantizes activations to 8 bits like we do but keeps its KV cache in F16 and computes
some ops in other orders, so small logit differences are expected; the thresholds allow for that.

llama.cpp's and the float64 reference's results on the real models do not depend on microspec:
they are committed goldens under tests/golden/ (written by scripts/make_goldens.py), keyed by the
model's sha256, the peer's version (or the reference's source), the gguf package's version, the
prompts and the code version; a golden whose key changed is computed afresh and named in the
run's summary (result_cache.py). Logits rows are stored as LM-head coordinates (lm_head_rows.py).
llama.cpp runs live on the real models too: greedy continuations of N_LIVE = 3 further prompts per
model with the same first-difference rule (test_live_llama_cpp_greedy_continuations), so a broken
peer install fails the suite. microspec's side runs in one `eval` / `generate` process per model
and test.
"""
import hashlib
import json
import pathlib
import subprocess
import tempfile

import numpy as np
import pytest

import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import lm_head_rows  # noqa: E402
import peer as peer_lib  # noqa: E402
import spec_bench  # noqa: E402
from result_cache import file_sha256, source_sha256  # noqa: E402

# Minutes per model: left out of scripts/test.sh --quick.
pytestmark = pytest.mark.slow

from repo_paths import BIN, MODELS  # noqa: E402
N_LONG, MIN_LONG_TOKENS, N_GREEDY, GREEDY_TOKENS = 20, 600, 20, 64
N_REFERENCE = 2  # long prompts also run through the float64 reference
N_LIVE = 3  # further prompts whose greedy continuations llama.cpp computes live in every run
HERE = pathlib.Path(__file__).parent


def gguf_version():
    from importlib.metadata import version
    return version("gguf")
COS_STRIDE, REFERENCE_STRIDE = 37, 5


def cos_positions(n):
    return list(range(0, n, COS_STRIDE)) + [n - 1]


def reference_positions(n):
    return list(range(0, n, REFERENCE_STRIDE))


def texts_key(texts):
    return hashlib.sha256(json.dumps(texts).encode()).hexdigest()


def run_eval(model, seqs):
    """microspec's teacher forcing over (ids, positions) pairs in one process: per sequence the
    argmax at every position and the logits rows at its positions."""
    with tempfile.TemporaryDirectory() as d:
        jsonl, out = pathlib.Path(d) / "seqs.jsonl", pathlib.Path(d) / "logits.bin"
        jsonl.write_text("".join(json.dumps({"ids": list(map(int, ids)), "positions": list(map(int, pos))}) + "\n"
                                 for ids, pos in seqs))
        n_ctx = max(len(ids) for ids, _ in seqs) + 8
        cmd = [BIN, "eval", "-m", str(model), "--ids-jsonl", str(jsonl), "-c", str(n_ctx), "-t", "2", "-o", str(out)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        assert res.returncode == 0, res.stderr
        infos = [json.loads(line) for line in res.stdout.splitlines() if line.strip()]
        assert len(infos) == len(seqs)
        V = infos[0]["n_vocab"]
        rows = np.fromfile(out, dtype=np.float32)
        assert rows.size == sum(len(p) for _, p in seqs) * V
        result, at = [], 0
        for info, (_, pos) in zip(infos, seqs):
            result.append((np.array(info["argmax"]), rows[at * V:(at + len(pos)) * V].reshape(len(pos), V)))
            at += len(pos)
    return result


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    path = MODELS[request.param]
    assert path.exists(), f"{path} is missing: run scripts/fetch_models.sh"
    return request.param, path


def long_prompt_ids(peer, texts):
    prompts, cur = [], []
    bos = peer.tokenize("")  # [bos] when the file asks for one
    for t in texts:
        cur += peer.tokenize(t)[len(bos):]
        if len(cur) >= MIN_LONG_TOKENS + 20:
            prompts.append(bos + cur[:MIN_LONG_TOKENS + 20])
            cur = []
        if len(prompts) == N_LONG:
            break
    return prompts


@pytest.fixture(scope="module")
def peer_long(model, result_cache):
    """The long prompts and llama.cpp's teacher forcing on them: argmax and top-2 margin at every
    position, logits rows at the cosine positions (and the reference positions of the
    first N_REFERENCE prompts)."""
    name, path = model
    texts = spec_bench.first_turns()
    key = {"model": file_sha256(path), "peer": peer_lib.version(), "code": peer_lib.CODE_VERSION,
           "rows": source_sha256(HERE / "lm_head_rows.py"), "gguf": gguf_version(),
           "texts": texts_key(texts), "n": N_LONG, "min": MIN_LONG_TOKENS, "cos": COS_STRIDE,
           "ref": [N_REFERENCE, REFERENCE_STRIDE]}

    def compute():
        peer = peer_lib.Peer(path)
        out = {}
        for i, ids in enumerate(long_prompt_ids(peer, texts)):
            n = len(ids)
            rows_at = sorted(set(cos_positions(n)) | (set(reference_positions(n)) if i < N_REFERENCE else set()))
            top1, margin, rows = peer.teacher_forcing(ids, list(range(n)), rows_at)
            coords, residual = lm_head_rows.coordinates(path, rows)
            out.update({f"ids{i}": np.array(ids, np.int32), f"top1{i}": top1, f"margin{i}": margin,
                        f"rows_at{i}": np.array(rows_at, np.int32), f"coords{i}": coords, f"residual{i}": residual})
        peer.close()
        return out

    z = result_cache.get(f"peer-teacher-{name}", key, compute, golden=True)
    n = sum(1 for k in z if k.startswith("ids"))
    return [{k: z[f"{k}{i}"] for k in ("ids", "top1", "margin", "rows_at", "coords", "residual")} | {"path": path}
            for i in range(n)]


def rows_of(prompts, positions):
    """llama.cpp's logits rows of each prompt at its positions (a list per prompt), from their
    LM-head coordinates (lm_head_rows.py): one product with the LM head for all of them, since a
    pass over Gemma's 671 MB matrix costs about as much for 18 rows as for 360."""
    coords = []
    for p, wanted in zip(prompts, positions):
        index = {int(q): k for k, q in enumerate(p["rows_at"])}
        assert p["residual"].max() <= lm_head_rows.MAX_RESIDUAL
        coords.append(p["coords"][[index[q] for q in wanted]])
    return split_rows(lm_head_rows.rows_from(prompts[0]["path"], np.concatenate(coords)), positions)


def split_rows(rows, positions):
    """rows of several prompts, one after the other -> a list of each prompt's len(positions[k]) rows."""
    return np.split(rows, np.cumsum([len(wanted) for wanted in positions])[:-1])


def cosines(a, b):
    return np.sum(a * b, 1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.fixture(scope="module")
def ours_long(model, peer_long):
    """microspec's teacher forcing on the long prompts, one `eval` process for both tests below:
    per prompt the argmax at every position and a function from positions to logits rows (the
    cosine positions, and the reference positions of the first N_REFERENCE prompts)."""
    _, path = model
    asked = [sorted(set(cos_positions(len(p["ids"]))) |
                    (set(reference_positions(len(p["ids"]))) if i < N_REFERENCE else set()))
             for i, p in enumerate(peer_long)]
    out = []
    for positions, (top1, rows) in zip(asked, run_eval(path, [(p["ids"], pos) for p, pos in zip(peer_long, asked)])):
        index = {q: k for k, q in enumerate(positions)}
        out.append((top1, lambda wanted, rows=rows, index=index: rows[[index[q] for q in wanted]]))
    return out


def test_teacher_forcing_matches_llama_cpp(model, peer_long, ours_long):
    """Both engines quantize activations to 8 bits, so neither reproduces the exact model: on these
    files llama.cpp's own argmax agrees with the float64 reference at only ~96% of positions (the
    270M/135M models have many near-ties). Raw top-1 agreement between the two engines therefore
    sits near 96% too; what we require is (1) agreement wherever llama.cpp is confident (its top-2
    margin >= 0.5 logits), (2) high overall agreement and cosine, and (3) that we are at least as
    close to the float64 reference as llama.cpp is."""
    name, path = model
    assert len(peer_long) == N_LONG and all(len(p["ids"]) >= MIN_LONG_TOKENS for p in peer_long)
    ours = [(top1, rows_at(cos_positions(len(p["ids"])))) for p, (top1, rows_at) in zip(peer_long, ours_long)]
    agree = total = agree_conf = total_conf = 0
    cos_all = []
    peer_rows = rows_of(peer_long, [cos_positions(len(p["ids"])) for p in peer_long])
    for p, (ours_top1, ours_rows), theirs in zip(peer_long, ours, peer_rows):
        confident = p["margin"] >= 0.5
        hit = ours_top1 == p["top1"]
        agree += int(hit.sum())
        total += len(hit)
        agree_conf += int(hit[confident].sum())
        total_conf += int(confident.sum())
        cos_all += list(cosines(ours_rows, theirs))
    top1, top1_conf, mean_cos = agree / total, agree_conf / total_conf, float(np.mean(cos_all))
    print(f"{name}: top-1 agreement with llama.cpp {top1:.4f} over {total} positions, {top1_conf:.4f} over the "
          f"{total_conf} confident ones; mean cosine {mean_cos:.5f}, min {min(cos_all):.5f}")
    assert top1_conf >= 0.995
    assert top1 >= 0.93
    assert mean_cos >= 0.998


@pytest.fixture(scope="module")
def reference_long(model, peer_long, result_cache):
    """The float64 reference on the first N_REFERENCE long prompts: argmax at every position and
    logits rows at the reference positions (stored as the LM head's inputs, float32: a row is
    hidden @ out.T, the reference's own last step)."""
    from reference_forward import ReferenceModel

    name, path = model
    prompts = [p["ids"] for p in peer_long[:N_REFERENCE]]
    key = {"model": file_sha256(path), "gguf": gguf_version(), "code": 2,
           "source": source_sha256(HERE / "reference_forward.py"),
           "ids": [list(map(int, ids)) for ids in prompts], "stride": REFERENCE_STRIDE}

    def compute():
        reference = ReferenceModel(path)
        out = {}
        for i, hidden in enumerate(reference.hidden_many(prompts, [None] * len(prompts))):
            out[f"top1{i}"] = np.concatenate([(h @ reference.out.T).argmax(1) for h in np.split(
                hidden, range(64, len(hidden), 64))]).astype(np.int32)
            out[f"hidden{i}"] = hidden[reference_positions(len(hidden))]
        return out

    z = result_cache.get(f"reference-{name}", key, compute, golden=True)
    hidden = [z[f"hidden{i}"] for i in range(len(prompts))]
    rows = split_rows(lm_head_rows.rows_from(path, np.concatenate(hidden)), hidden)  # one pass over the LM head
    return [(z[f"top1{i}"], r) for i, r in enumerate(rows)]


def test_as_close_to_float64_reference_as_llama_cpp(model, peer_long, reference_long, ours_long):
    name, path = model
    prompts = peer_long[:N_REFERENCE]
    ours = [(top1, rows_at(reference_positions(len(p["ids"])))) for p, (top1, rows_at) in zip(prompts, ours_long)]
    ours_hits = peer_hits = n = 0
    ours_cos, peer_cos = [], []
    peer_rows = rows_of(prompts, [reference_positions(len(p["ids"])) for p in prompts])
    for p, (truth_top1, truth_rows), (ours_top1, ours_rows), theirs in zip(prompts, reference_long, ours, peer_rows):
        ours_hits += int((ours_top1 == truth_top1).sum())
        peer_hits += int((p["top1"] == truth_top1).sum())
        n += len(truth_top1)
        ours_cos += list(cosines(ours_rows, truth_rows))
        peer_cos += list(cosines(theirs, truth_rows))
    o_top1, p_top1 = ours_hits / n, peer_hits / n
    o_cos, p_cos = float(np.mean(ours_cos)), float(np.mean(peer_cos))
    print(f"{name}: vs float64 reference over {n} positions: top-1 microspec {o_top1:.4f}, llama.cpp {p_top1:.4f}; "
          f"mean cosine microspec {o_cos:.6f}, llama.cpp {p_cos:.6f}")
    assert o_top1 >= p_top1 - 0.015
    assert o_cos >= p_cos - 0.0003
    assert o_cos >= 0.999


@pytest.fixture(scope="module")
def peer_greedy(model, result_cache):
    """llama.cpp's greedy continuations of the first N_GREEDY SpecBench prompts (raw text, the
    file's BOS rule), with its GREEDY_TOP best (id, logit) pairs per step."""
    name, path = model
    texts = spec_bench.first_turns()[:N_GREEDY]
    key = {"model": file_sha256(path), "peer": peer_lib.version(), "code": peer_lib.CODE_VERSION,
           "texts": texts_key(texts), "n": GREEDY_TOKENS}

    def compute():
        peer = peer_lib.Peer(path)
        out = {}
        for i, t in enumerate(texts):
            ids = peer.tokenize(t)
            out[f"ids{i}"] = np.array(ids, np.int32)
            out[f"tokens{i}"], out[f"top_ids{i}"], out[f"top_logits{i}"] = peer.greedy(ids, GREEDY_TOKENS)
        peer.close()
        return out

    z = result_cache.get(f"peer-greedy-{name}", key, compute, golden=True)
    return [{k: z[f"{k}{i}"] for k in ("ids", "tokens", "top_ids", "top_logits")} for i in range(len(texts))]


def run_generate_ids(path, prompts, n):
    """microspec's greedy continuations of token-id prompts, one process (--prompts-jsonl)."""
    with tempfile.TemporaryDirectory() as d:
        jsonl = pathlib.Path(d) / "prompts.jsonl"
        jsonl.write_text("".join(json.dumps({"prompt_ids": list(map(int, ids))}) + "\n" for ids in prompts))
        res = subprocess.run([BIN, "generate", "-m", str(path), "--prompts-jsonl", str(jsonl), "-n", str(n),
                              "--ignore-eos", "-t", "2"], capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.strip()]
    assert len(rows) == len(prompts)
    for r, ids in zip(rows, prompts):
        assert r["prompt_ids"] == list(map(int, ids))
    return [r["tokens"] for r in rows]


def first_differences(path, peer_greedy, ours_all):
    """(number of continuations identical to llama.cpp's, common prefix lengths, and per differing
    continuation the two engines' disagreement at the first difference). There llama.cpp picks a
    and we pick b; the disagreement is llama.cpp's margin l(a) - l(b) plus ours, l'(b) - l'(a) (our
    logits on llama.cpp's prefix, one `eval` process for all of them). Two engines whose logits
    differ by at most e everywhere disagree by at most 2e, whichever of them is nearer the truth."""
    same, prefix_lens, differing = 0, [], []
    for g, ours in zip(peer_greedy, ours_all):
        ref = [int(t) for t in g["tokens"]]
        assert len(ours) == GREEDY_TOKENS
        if ours == ref:
            same += 1
            prefix_lens.append(GREEDY_TOKENS)
            continue
        j = next(i for i in range(GREEDY_TOKENS) if ours[i] != ref[i])
        prefix_lens.append(j)
        top_ids, top_logits = list(g["top_ids"][j]), g["top_logits"][j]
        # A token outside llama.cpp's best GREEDY_TOP trails its choice by at least the spread of those.
        theirs = float(top_logits[0] - (top_logits[top_ids.index(ours[j])] if ours[j] in top_ids else top_logits[-1]))
        differing.append((list(map(int, g["ids"])) + ref[:j], ref[j], ours[j], theirs))
    rows = run_eval(path, [(ids, [len(ids) - 1]) for ids, _, _, _ in differing]) if differing else []
    for (ids, _, b, _), (top1, _) in zip(differing, rows):
        # Our greedy pick is our own argmax on that prefix (eval's row is generate's, bit for bit), so
        # the disagreement is never less than llama.cpp's margin: a pick that is not the argmax (a
        # sampling or bookkeeping bug in generate) fails here even where the logits agree.
        assert int(top1[-1]) == b, f"generate picked {b} after {len(ids)} tokens, eval's argmax there is {top1[-1]}"
    gaps = [theirs + float(r[0][b] - r[0][a]) for (_, a, b, theirs), (_, r) in zip(differing, rows)]
    return same, prefix_lens, gaps


# The bound on the disagreement at a first difference. Our own two kernel tables (AVX2 and
# AVX-512, which differ only in float summation order) give logits rows up to 1.07 (SmolLM2) and
# 1.83 (Gemma) logits apart (5 positions of a 200-token SpecBench prompt, 2026-12-01): the 8-bit
# activations turn an ulp into a rounding step, so two faithful engines may disagree about a pair
# of tokens by up to about twice that. Measured at the first differences, same day, Zen 4, the
# builds before and after the row kernels' own e^x, each with both tables: at most 0.49, 0.63,
# 0.36, 0.49 (Gemma) and 0.45, 0.72, 0.32, 0.88 (SmolLM2). A continuation that leaves llama.cpp's
# where both engines are sure (a wrong token, a wrong position) disagrees by several logits.
MAX_DISAGREEMENT = 1.5


def test_greedy_continuations_match_llama_cpp(model, peer_greedy):
    """Greedy continuations of 64 tokens. Like the teacher-forcing test, two 8-bit-activation engines
    part ways at near-ties (llama.cpp itself matches the float64 model's argmax at only ~96% of
    positions), and after the first difference the texts go their own ways. So we require: wherever
    a continuation first differs, the two engines' logits order the two tokens within
    MAX_DISAGREEMENT of each other (llama.cpp's margin for its token plus ours for ours), and at
    least 20% of the continuations are identical throughout."""
    name, path = model
    ours_all = run_generate_ids(path, [g["ids"] for g in peer_greedy], GREEDY_TOKENS)
    same, prefix_lens, gaps = first_differences(path, peer_greedy, ours_all)
    print(f"{name}: {same}/{len(peer_greedy)} greedy continuations of {GREEDY_TOKENS} tokens identical; median common "
          f"prefix {int(np.median(prefix_lens))} tokens; the engines' disagreement at the first difference: "
          f"max {max(gaps, default=0):.3f} logits")
    assert all(g < MAX_DISAGREEMENT for g in gaps), gaps
    assert same >= 0.2 * len(peer_greedy)


def test_live_llama_cpp_greedy_continuations(model):
    """The committed goldens spare CI from running llama.cpp on the real models for minutes; this
    test runs it live in every run (no cache), so that a broken or missing peer fails the suite: its
    greedy continuations of N_LIVE further SpecBench prompts (after the golden's N_GREEDY), with the
    rule above: at every first difference from ours the engines disagree by < MAX_DISAGREEMENT."""
    name, path = model
    peer = peer_lib.Peer(path)
    live = []
    for text in spec_bench.first_turns(N_GREEDY + N_LIVE)[N_GREEDY:]:
        ids = peer.tokenize(text)
        tokens, top_ids, top_logits = peer.greedy(ids, GREEDY_TOKENS)
        live.append({"ids": ids, "tokens": tokens, "top_ids": top_ids, "top_logits": top_logits})
    peer.close()
    ours_all = run_generate_ids(path, [g["ids"] for g in live], GREEDY_TOKENS)
    same, _, gaps = first_differences(path, live, ours_all)
    print(f"{name}: live llama.cpp: {same}/{N_LIVE} continuations identical, disagreement at the first difference {gaps}")
    assert all(g < MAX_DISAGREEMENT for g in gaps), gaps


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tiny_qwen2_and_llama_against_float64_and_llama_cpp(arch, tmp_path):
    """qwen2 (q/k/v biases, NeoX rope) has no real model in the suite, and llama only SmolLM2: on a
    random model of each written by the `gguf` package (tiny_gguf.py), teacher forcing over two
    64-token sequences against the float64 reference and llama.cpp on the same file. Measured:
    minimum cosine to the float64 model 0.99989 (qwen2) / 0.99972 (llama) for both engines, top-1
    equal at 99.2% (qwen2) / 100% (llama) of the positions. Asserted: our minimum cosine >= 0.999, our mean cosine at most 0.0003 below
    llama.cpp's, top-1 equal to the float64 model's at >= 95% of positions. llama.cpp agreeing with
    the reference as closely also checks the reference's qwen2 / llama code itself."""
    from reference_forward import ReferenceModel
    from tiny_gguf import N_VOCAB, write_tiny_model

    path = write_tiny_model(arch, tmp_path / f"tiny-{arch}.gguf")
    rng = np.random.default_rng(5)
    seqs = [[1] + [int(t) for t in rng.integers(3, N_VOCAB, 63)] for _ in range(2)]
    truth = ReferenceModel(path).logits_many(seqs, [None] * len(seqs))
    ours = run_eval(path, [(ids, list(range(len(ids)))) for ids in seqs])
    peer = peer_lib.Peer(path, n_ctx=128)
    theirs = [peer.teacher_forcing(ids, [], list(range(len(ids))))[2].astype(np.float32) for ids in seqs]
    peer.close()
    ours_cos = np.concatenate([cosines(rows, t) for (_, rows), t in zip(ours, truth)])
    peer_cos = np.concatenate([cosines(rows, t) for rows, t in zip(theirs, truth)])
    top1 = np.mean(np.concatenate([top1 == t.argmax(1) for (top1, _), t in zip(ours, truth)]))
    print(f"tiny {arch}: cosine to float64 min/mean microspec {ours_cos.min():.6f}/{ours_cos.mean():.6f}, "
          f"llama.cpp {peer_cos.min():.6f}/{peer_cos.mean():.6f}; top-1 = float64 at {top1:.3f}")
    assert ours_cos.min() >= 0.999
    assert ours_cos.mean() >= peer_cos.mean() - 0.0003
    assert top1 >= 0.95
