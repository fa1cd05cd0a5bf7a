"""One `gguf.GGUFReader` per file for the whole pytest session.

The `gguf` package parses every metadata array element by element: opening Gemma 3's file (a
262,144-token vocabulary, with scores and token types) takes it 7-13 s, SmolLM2's 2-4 s, and
test_dequant_gguf.py and test_draft_head.py (its random heads: the target's sizes and tokenizer)
read the same two files. A reader maps the file read-only, so one serves them all; it is keyed by
the file's size and modification time too, so a file written again in the session is read again.
(lm_head_rows.py and reference_forward.py open their own: their source is part of the golden
entries' keys, result_cache.py, so editing them would make every committed golden stale.)
"""
import os

_readers = {}


def reader(path):
    """The session's GGUFReader of `path` (opened on first use). Callers must not write to it."""
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    if key not in _readers:
        from gguf import GGUFReader  # imported here: test_dequant_gguf.py reports a missing package itself
        _readers[key] = GGUFReader(str(path))
    return _readers[key]
