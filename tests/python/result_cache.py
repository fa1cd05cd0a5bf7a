"""Results of the peer (llama.cpp) and of the float64 reference, computed once and kept on disk.

Neither result depends on microspec, so a run reuses what an earlier run computed as long as the
inputs are the same. The key of an entry is everything its value depends on: the model file's
sha256, the peer's version (or the reference's source and the `gguf` package's version), the exact
token ids and positions asked for, and the version of the code below that computes it. Any change
gives a new key, so a stale entry is never read; `pytest --cache-clear` empties the directory.

Entries are numpy .npz files under pytest's cache directory (.pytest_cache/d/microspec-results),
written to a temporary name and renamed, so an interrupted run leaves no half-written entry.

Golden entries (the peer's and the reference's results on the real models) are also committed
under tests/golden/, named by the same key digest (and carrying the key as JSON), and written by
scripts/make_goldens.py: CI starts with an empty pytest cache and reads them instead of running
llama.cpp and the float64 forward pass for minutes. A golden whose inputs changed has another
name, so it is never read: the entry is computed and the run's summary names it.
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
    """get() answers from, in order: the committed goldens (golden entries only), pytest's cache
    directory, a fresh computation. A golden entry that had to be computed is named in
    `recomputed_goldens` (with the committed files of its kind, now stale), which conftest.py
    prints in the run's summary. With `write_goldens` "all" (or True; scripts/make_goldens.py) every golden entry
    is computed afresh and written to the golden directory, replacing its kind's older files; with
    "stale" (scripts/make_goldens.py --stale) only the entries whose committed file is missing or
    stale are (from pytest's cache when it has them), and current files are read as usual."""

    def __init__(self, directory, golden_dir=None, write_goldens=False):
        self.dir = pathlib.Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.golden_dir = pathlib.Path(golden_dir) if golden_dir else None
        self.write_goldens = write_goldens
        self.hits = self.misses = self.golden_hits = 0
        self.recomputed_goldens = []  # "kind (why)" per golden entry that was not read from its file
        self.written_goldens = []

    @staticmethod
    def _name(kind, key):
        digest = hashlib.sha256(json.dumps({"kind": kind, **key}, sort_keys=True).encode()).hexdigest()
        return f"{kind}-{digest[:24]}.npz"

    @staticmethod
    def _load(path):
        with np.load(path) as z:
            return {k: z[k] for k in z.files}

    @staticmethod
    def _save(path, value, compressed):
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            (np.savez_compressed if compressed else np.savez)(f, **value)
        os.replace(tmp, path)

    def get(self, kind, key, compute, golden=False):
        """The arrays `compute()` returns (a dict name -> array), from disk when `key` (a JSON-able
        dict) was computed before. A golden entry is first looked up in the golden directory."""
        name = self._name(kind, key)
        rewrite = golden and self.write_goldens in (True, "all")
        if golden and not rewrite:
            path = self.golden_dir / name
            if path.exists():
                value = self._load(path)
                if str(value.pop("key", "")) == json.dumps(key, sort_keys=True):
                    self.golden_hits += 1
                    return value
            if not self.write_goldens:
                stale = sorted(p.name for p in self.golden_dir.glob(f"{kind}-*.npz"))
                self.recomputed_goldens.append(
                    f"{kind} (key changed; stale: {', '.join(stale)})" if stale else f"{kind} (no committed file)")
        path = self.dir / name
        if path.exists() and not rewrite:
            self.hits += 1
            value = self._load(path)
        else:
            self.misses += 1
            value = compute()
            self._save(path, value, compressed=False)
        if golden and self.write_goldens:
            for old in self.golden_dir.glob(f"{kind}-*.npz"):
                old.unlink()
            self._save(self.golden_dir / name, {"key": np.array(json.dumps(key, sort_keys=True)), **value},
                       compressed=True)
            self.written_goldens.append(name)
        value.pop("key", None)
        return value
