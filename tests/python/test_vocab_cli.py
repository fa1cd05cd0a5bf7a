"""`microspec vocab-freq` and `microspec coverage` produce the files they document.

- vocab-freq over a text file and a JSONL file: the binary file parses by the documented layout
  (magic, version, vocabulary size, n, ids ranked by count, counts), every id appears once, and the
  counts equal those of `microspec tokenize` over the same texts (text files whole, every string
  value of each JSON line, keys not); bad input gives a clear error and a non-zero exit.
- coverage on SmolLM2 (one SpecBench prompt per category, a few tokens each): the CSV has a row per
  vocabulary and category plus "all", static coverage grows with K, the active sizes match the
  definitions, and the PNG plot is written.
"""
import collections
import csv
import json
import pathlib
import struct
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import spec_bench  # noqa: E402

from repo_paths import BIN, REPO  # noqa: E402
SMOL = REPO / "models" / "smollm2-135m-instruct-q4_1.gguf"


def run(*args, ok=True):
    p = subprocess.run([BIN, *map(str, args)], capture_output=True, timeout=600)
    if ok:
        assert p.returncode == 0, f"{args} failed:\n{p.stderr.decode(errors='replace')[-2000:]}"
    return p


def tokenize(text):
    return json.loads(run("tokenize", "-m", SMOL, "-p", text, "--json", "--no-bos", "--no-special").stdout)


def read_freq(path):
    data = pathlib.Path(path).read_bytes()
    magic, version, n_vocab, n, reserved, total = struct.unpack_from("<8sIIIIQ", data, 0)
    assert magic == b"MSPFREQ\0" and version == 1 and reserved == 0
    assert len(data) == 32 + 12 * n
    ids = struct.unpack_from(f"<{n}i", data, 32)
    counts = struct.unpack_from(f"<{n}Q", data, 32 + 4 * n)
    return n_vocab, total, ids, counts


def test_vocab_freq_counts_match_the_tokenizer(tmp_path):
    text = "The quick brown fox jumps over the lazy dog.\nThe dog sleeps; the fox runs away.\n"
    jsonl = [{"id": 1, "text": "Hello there, general Kenobi!", "meta": {"note": "nested string"}},
             {"turns": ["first turn", "second turn"], "score": 3.5}]
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in jsonl) + "\n", encoding="utf-8")
    out = tmp_path / "freq.bin"
    run("vocab-freq", "-m", SMOL, "--corpus", tmp_path / "a.txt", tmp_path / "b.jsonl", "-o", out)
    n_vocab, total, ids, counts = read_freq(out)
    assert n_vocab == 49152 and len(ids) == n_vocab and sorted(ids) == list(range(n_vocab))
    assert list(counts) == sorted(counts, reverse=True)
    want = collections.Counter(tokenize(text))
    for s in ["Hello there, general Kenobi!", "nested string", "first turn", "second turn"]:
        want.update(tokenize(s))
    got = {i: c for i, c in zip(ids, counts) if c}
    assert got == dict(want)
    assert total == sum(want.values())
    # Ties are broken by id.
    for (i1, c1), (i2, c2) in zip(zip(ids, counts), list(zip(ids, counts))[1:]):
        if c1 == c2:
            assert i1 < i2

    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{not json\n', encoding="utf-8")
    p = run("vocab-freq", "-m", SMOL, "--corpus", tmp_path / "bad.jsonl", "-o", tmp_path / "x.bin", ok=False)
    assert p.returncode != 0 and b"bad.jsonl:2: not JSON" in p.stderr
    p = run("vocab-freq", "-m", SMOL, "--corpus", tmp_path / "missing.txt", "-o", tmp_path / "x.bin", ok=False)
    assert p.returncode != 0 and b"cannot open" in p.stderr
    # A file of another vocabulary or a damaged one is refused by generate.
    gemma_freq = REPO / "models" / "gemma-3-270m-q4_k_m.freq.bin"
    if not gemma_freq.exists():
        pytest.fail(f"{gemma_freq} is missing: run scripts/make_freq.sh")
    p = run("generate", "-m", SMOL, "-p", "hi", "-n", "2", "--spec", "self", "--draft-vocab", "freq",
            "--freq-file", gemma_freq, ok=False)
    assert p.returncode != 0 and b"another model" in p.stderr
    (tmp_path / "cut.bin").write_bytes(out.read_bytes()[:100])
    p = run("generate", "-m", SMOL, "-p", "hi", "-n", "2", "--spec", "self", "--draft-vocab", "hybrid",
            "--freq-file", tmp_path / "cut.bin", ok=False)
    assert p.returncode != 0 and b"truncated" in p.stderr


def test_coverage_writes_csv_and_plot(tmp_path):
    freq = tmp_path / "freq.bin"
    corpus = tmp_path / "c.txt"
    corpus.write_text("The cat sat on the mat. A function returns a value; print the result.\n" * 20,
                      encoding="utf-8")
    run("vocab-freq", "-q", "-m", SMOL, "--corpus", corpus, "-o", freq)
    out = tmp_path / "cov"
    p = run("coverage", "-m", SMOL, "--dataset", spec_bench.SPEC_BENCH, "--freq-file", freq, "-o", out,
            "--per-category", "1", "--max-new-tokens", "12", "--static-sizes", "64", "1024", "49152",
            "--windows", "32", "512", "-t", "2")
    assert b"coverage [" in p.stderr  # the progress bar
    rows = list(csv.DictReader(open(out / "coverage.csv", encoding="utf-8")))
    cats = {r["category"] for r in rows}
    assert "all" in cats and len(cats) == 13 + 1
    assert len(rows) == 5 * len(cats)
    allrows = {(r["kind"], int(r["param"])): r for r in rows if r["category"] == "all"}
    cov = {k: float(r["coverage"]) for k, r in allrows.items()}
    assert cov[("static", 64)] <= cov[("static", 1024)] <= cov[("static", 49152)] == 1.0
    assert 49152 <= float(allrows[("static", 49152)]["mean_active"]) <= 49152
    assert 64 <= float(allrows[("static", 64)]["mean_active"]) <= 64 + 4  # + end-of-generation ids
    for w in (32, 512):
        assert 0 < float(allrows[("dynamic", w)]["mean_active"]) <= w
    assert 0.3 < cov[("dynamic", 512)] <= 1.0  # the window holds the prompt and the target's top-3s
    steps = {int(r["steps"]) for r in allrows.values()}
    assert len(steps) == 1 and 13 <= steps.pop() <= 13 * 12
    png = out / "coverage.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
