"""Dequantization against the `gguf` package (the reference Python reader of the format).

For every tensor type in the two real models (F32, Q8_0, Q5_0, Q4_K, Q6_K, Q4_1), several tensors of
that type, and for each the first rows, rows in the middle and the last rows: `microspec
dump-tensor` must write the same floats as gguf.quants.dequantize. Both sides compute exact
dequantizations (small integer times f16 scale, plus f16 min), so they agree to float rounding.
"""
import json
import pathlib
import subprocess
import tempfile

import numpy as np
import pytest

import gguf_files
from repo_paths import BIN, MODELS  # noqa: E402
# Types each real file is known to contain: the test fails if one goes missing (wrong file).
EXPECTED_TYPES = {
    "gemma": {"F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"},
    "smollm2": {"F32", "Q8_0", "Q4_1"},
}
TENSORS_PER_TYPE = 3


def gguf_module():
    try:
        import gguf as g
    except ImportError as e:  # a missing prerequisite is a failed setup, not a skipped test
        pytest.fail(f"the gguf package is not importable: run scripts/setup.sh ({e})")
    return g


def require(path):
    if not pathlib.Path(path).exists():
        pytest.fail(f"{path} is missing: build microspec (or set MICROSPEC_BIN) and run scripts/setup.sh")


def dump(model, name, begin, end, tmp):
    out = pathlib.Path(tmp) / "rows.bin"
    res = subprocess.run([BIN, "dump-tensor", "-m", str(model), "--tensor", name, "--rows", f"{begin}:{end}",
                          "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"dump-tensor {name} {begin}:{end} failed: {res.stderr}"
    info = json.loads(res.stdout)
    assert info["rows"] == [begin, end]
    return info, np.fromfile(out, dtype="<f4")


def pick(tensors):
    """First, middle and last tensor of a list (in file order), without repeats."""
    idx = sorted({0, len(tensors) // 2, len(tensors) - 1})
    return [tensors[i] for i in idx][:TENSORS_PER_TYPE]


@pytest.mark.parametrize("model", sorted(MODELS))
def test_dump_tensor_matches_gguf_package(model):
    g = gguf_module()
    require(BIN)
    path = MODELS[model]
    require(path)
    reader = gguf_files.reader(path)  # the session's GGUFReader of the file
    by_type = {}
    for t in reader.tensors:
        by_type.setdefault(t.tensor_type.name, []).append(t)
    assert EXPECTED_TYPES[model] <= set(by_type), f"{path.name} has types {sorted(by_type)}"
    checked = 0
    with tempfile.TemporaryDirectory() as tmp:
        for type_name, tensors in sorted(by_type.items()):
            for t in pick(tensors):
                cols = int(t.shape[0])
                rows = int(t.n_elements) // cols
                data = t.data.reshape(rows, -1)  # one row of the file per row of the tensor
                ranges = {(0, min(4, rows)), (rows // 2, min(rows // 2 + 3, rows)), (max(0, rows - 4), rows)}
                for begin, end in sorted(ranges):
                    info, ours = dump(path, t.name, begin, end, tmp)
                    assert info["type"] == type_name
                    assert info["cols"] == cols
                    want = g.quants.dequantize(data[begin:end], t.tensor_type).astype(np.float32).reshape(-1)
                    assert ours.shape == want.shape, f"{t.name} rows {begin}:{end}"
                    assert np.all(np.isfinite(ours)), f"{t.name}: non-finite values"
                    scale = float(np.max(np.abs(want))) or 1.0
                    err = np.abs(ours.astype(np.float64) - want.astype(np.float64))
                    tol = 1e-6 * np.abs(want.astype(np.float64)) + 1e-7 * scale
                    bad = np.nonzero(err > tol)[0]
                    assert bad.size == 0, (f"{type_name} {t.name} rows {begin}:{end}: {bad.size} values differ, "
                                           f"first at {bad[0]}: ours {ours[bad[0]]} gguf {want[bad[0]]}")
                    checked += 1
    assert checked >= 3 * len(by_type)


def test_dump_tensor_rejects_bad_requests():
    require(BIN)
    path = MODELS["gemma"]
    require(path)
    with tempfile.TemporaryDirectory() as tmp:
        out = str(pathlib.Path(tmp) / "x.bin")
        for extra, message in [(["--tensor", "no.such.tensor"], "no tensor named"),
                               (["--tensor", "blk.0.attn_q.weight", "--rows", "5:5000"], "not a non-empty range"),
                               (["--tensor", "blk.0.attn_q.weight", "--rows", "x:3"], "not a row number")]:
            res = subprocess.run([BIN, "dump-tensor", "-m", str(path), "-o", out] + extra, capture_output=True,
                                 text=True, timeout=60)
            assert res.returncode != 0 and message in res.stderr, (extra, res.stderr)
