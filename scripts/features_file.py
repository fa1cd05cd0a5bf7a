"""Reads the files `microspec features` writes (layout: src/cli/cmd_features.cpp's header) in place.

A file is memory-mapped and each sequence's arrays are views into it, so a training run streams
its feature shards from disk (the page cache) instead of holding them in RAM: the features stay
bfloat16 until a sequence is used (`Sequence.features_f32`). numpy only.
"""
import json
from typing import NamedTuple

import numpy as np


class Sequence(NamedTuple):
    ids: np.ndarray        # int32 [n]
    features: np.ndarray   # uint16 [n][layers * n_embd], bfloat16 bits
    top_ids: np.ndarray    # int32 [n][k], best first
    top_logp: np.ndarray   # float32 [n][k], log-softmax over the whole vocabulary

    def features_f32(self):
        """float32 [n][layers * n_embd]: bfloat16 is float32's upper half."""
        return (self.features.astype(np.uint32) << 16).view(np.float32)


def read(bin_path, idx_path, n_layers, n_embd, k):
    """The sequences of one file, in order, as views of the mapped file. idx_path: the JSON lines
    the command printed ({"n_tokens", "offset"} each). Raises ValueError when an entry does not fit
    the file or a sequence's features are not finite."""
    raw = np.memmap(bin_path, dtype=np.uint8, mode="r")
    seqs = []
    for line_no, line in enumerate(open(idx_path, encoding="utf-8").read().splitlines(), 1):
        entry = json.loads(line)
        n, at = entry["n_tokens"], entry["offset"]
        size = n * (4 + 2 * n_layers * n_embd + 8 * k)
        if n < 1 or at < 0 or at + size > len(raw):
            raise ValueError(f"{idx_path}:{line_no}: {n} tokens at byte {at} do not fit {bin_path} ({len(raw)} bytes)")

        def take(dtype, count):
            nonlocal at
            nbytes = count * np.dtype(dtype).itemsize
            x = raw[at:at + nbytes].view(dtype)
            at += nbytes
            return x
        seq = Sequence(take(np.int32, n), take(np.uint16, n * n_layers * n_embd).reshape(n, n_layers * n_embd),
                       take(np.int32, n * k).reshape(n, k), take(np.float32, n * k).reshape(n, k))
        # bfloat16 with every exponent bit set is infinite or NaN.
        if ((seq.features & 0x7F80) == 0x7F80).any():
            raise ValueError(f"{bin_path}: sequence {line_no} has non-finite features")
        seqs.append(seq)
    return seqs
