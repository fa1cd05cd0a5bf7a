"""Logits rows stored compactly: as their coordinates in the LM head's column space.

Every logits row an engine computes is its LM head matrix E [n_vocab, n_embd] times a hidden
vector a [n_embd] (llama.cpp and microspec quantize a to 8 bits first, the float64 reference does
not; E is the file's dequantized output matrix either way). So a row is known from its n_embd
coordinates c, with row = E c: 640 numbers instead of 262,144 on Gemma. The committed goldens
(tests/golden/) store llama.cpp's and the float64 reference's rows that way, as float32 (measured
on both models: llama.cpp's rows are E c to a relative residual of 4e-7, and a row rebuilt from
float32 coordinates has cosine 1 - 5e-13 to the original; float16 coordinates would cost 2e-7).

`coordinates` finds c by least squares (normal equations in float64) and refuses a row that is not
in E's column space (relative residual above MAX_RESIDUAL, e.g. a peer that adds a bias or a
soft-cap after the LM head), so a reconstruction E c is the row itself up to float rounding.
"""
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

MAX_RESIDUAL = 1e-4
_matrices = {}


def output_matrix(path):
    """The file's LM head [n_vocab, n_embd] as float32, dequantized by the `gguf` package (the
    tied token embedding when there is no output.weight); kept for the process's later calls."""
    key = str(path)
    if key not in _matrices:
        tensors = {t.name: t for t in GGUFReader(key).tensors}
        t = tensors.get("output.weight", tensors["token_embd.weight"])
        _matrices.clear()  # one model's matrix at a time: Gemma's is 671 MB
        _matrices[key] = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1, int(t.shape[0]))
    return _matrices[key]


def coordinates(path, rows):
    """rows [n, n_vocab] -> (c [n, n_embd] float32, relative residual [n] float32) with rows = E c."""
    E = output_matrix(path).astype(np.float64)
    gram = E.T @ E
    c, residual = np.zeros((len(rows), E.shape[1])), np.zeros(len(rows))
    for at in range(0, len(rows), 64):  # 64 rows at a time: Gemma's are 2 MB each in float64
        chunk = np.asarray(rows[at:at + 64], np.float64)
        c[at:at + 64] = np.linalg.solve(gram, E.T @ chunk.T).T
        residual[at:at + 64] = np.linalg.norm(chunk - c[at:at + 64] @ E.T, axis=1) / np.linalg.norm(chunk, axis=1)
    worst = float(residual.max(initial=0.0))
    if worst > MAX_RESIDUAL:
        raise ValueError(f"a logits row is not E times a hidden vector (relative residual {worst:.2e} > "
                         f"{MAX_RESIDUAL}): store the rows themselves")
    return c.astype(np.float32), residual.astype(np.float32)


def rows_from(path, c):
    """The logits rows E c [n, n_vocab] (float32) of coordinates c [n, n_embd]."""
    return np.asarray(c, np.float32) @ output_matrix(path).T
