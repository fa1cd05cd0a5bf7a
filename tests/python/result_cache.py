"""Results of the peer (llama.cpp) and of the float64 reference, computed once and kept on disk.

Neither result depends on microspec, so a run reuses what an earlier run computed as long as the
inputs are the same. The key of an entry is everything its value depends on: the model file's
sha256, the peer's version (or the reference's source and the `gguf` package's version), the exact
token ids and positions asked for, and the version of the code below that computes it. Any change
gives a new key, so a stale entry is never read; `pytest --cache-clear` empties the directory.

Entries are numpy .npz files under pytest's cache directory (.pytest_cache/d/microspec-results),
written to a temporary name and renamed, so an interrupted run leaves no half-written entry.
"""
import hashlib
import json
import os
import pathlib
import tempfile

import numpy as np

_sha_memo = {}


def file_sha256(path):
    path = pathlib.Path(path).resolve()
    st = path.stat()
    memo_key = (str(path), st.st_size, st.st_mtime_ns)
    if memo_key not in _sha_memo:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        _sha_memo[memo_key] = h.hexdigest()
    return _sha_memo[memo_key]


def source_sha256(path):
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


class ResultCache:
    def __init__(self, directory):
        self.dir = pathlib.Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.hits = self.misses = 0

    def get(self, kind, key, compute):
        """The arrays `compute()` returns (a dict name -> array), from disk when `key` (a JSON-able
        dict) was computed before."""
        digest = hashlib.sha256(json.dumps({"kind": kind, **key}, sort_keys=True).encode()).hexdigest()
        path = self.dir / f"{kind}-{digest[:24]}.npz"
        if path.exists():
            with np.load(path) as z:
                self.hits += 1
                return {k: z[k] for k in z.files}
        self.misses += 1
        value = compute()
        fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **value)
        os.replace(tmp, path)
        return value
