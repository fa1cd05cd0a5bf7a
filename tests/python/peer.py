"""llama.cpp (llama-cpp-python) as the peer: teacher-forced logits at chosen positions and greedy
continuations, through the library's batch API so that logits are computed and copied only for
the positions a test compares (llama.cpp runs the LM head only for rows whose logits flag is set).
Results are cached on disk by result_cache.py; llama.cpp is loaded only when an entry is missing.
"""
import numpy as np
import pytest

# Bump when what these functions compute changes: it is part of every cache key.
CODE_VERSION = 2
# Greedy continuations keep llama.cpp's GREEDY_TOP best (id, logit) pairs per step: enough to know
# its margin over any token microspec could have chosen (a token outside them trails by more).
GREEDY_TOP = 32


def llama_cpp_module():
    try:
        import llama_cpp
    except ImportError as e:  # a missing peer is a failed setup, not a skipped test
        pytest.fail(f"llama_cpp (llama-cpp-python) is not importable: run scripts/setup.sh ({e})")
    return llama_cpp


def version():
    return llama_cpp_module().__version__


class Peer:
    def __init__(self, path, n_ctx=1024, n_batch=512):
        L = self.L = llama_cpp_module()
        self.llm = L.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_batch, n_threads=2, n_threads_batch=2,
                           logits_all=False, verbose=False)
        self.ctx = self.llm._ctx.ctx
        self.n_batch = n_batch
        self.n_vocab = self.llm.n_vocab()
        self.batch = L.llama_batch_init(n_batch, 0, 1)

    def close(self):
        self.L.llama_batch_free(self.batch)
        self.llm.close()

    def tokenize(self, text):
        add_bos = self.llm.metadata.get("tokenizer.ggml.add_bos_token", "false") == "true"
        ids = self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        return ([self.llm.token_bos()] if add_bos else []) + ids

    def _decode(self, ids, start, want):
        """Runs ids[start:...] at positions start.. and yields (position, logits row) for wanted ones."""
        b = self.batch
        for at in range(0, len(ids), self.n_batch):
            chunk = ids[at:at + self.n_batch]
            b.n_tokens = len(chunk)
            outputs = []
            for i, tok in enumerate(chunk):
                pos = start + at + i
                b.token[i], b.pos[i], b.n_seq_id[i] = int(tok), pos, 1
                b.seq_id[i][0] = 0
                b.logits[i] = pos in want
                if pos in want:
                    outputs.append((i, pos))
            rc = self.L.llama_decode(self.ctx, b)
            assert rc == 0, f"llama_decode failed ({rc})"
            for i, pos in outputs:
                ptr = self.L.llama_get_logits_ith(self.ctx, i)
                yield pos, np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def _clear(self):
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def teacher_forcing(self, ids, top1_positions, row_positions):
        """Argmax and top-2 margin at top1_positions, logits rows (float32) at row_positions."""
        self._clear()
        top1_at, rows_at = {p: k for k, p in enumerate(top1_positions)}, {p: k for k, p in enumerate(row_positions)}
        top1 = np.zeros(len(top1_positions), np.int32)
        margin = np.zeros(len(top1_positions), np.float32)
        rows = np.zeros((len(row_positions), self.n_vocab), np.float32)
        for pos, row in self._decode(ids, 0, set(top1_at) | set(rows_at)):
            if pos in top1_at:
                two = np.argpartition(row, -2)[-2:]
                hi, lo = (two[0], two[1]) if row[two[0]] >= row[two[1]] else (two[1], two[0])
                top1[top1_at[pos]], margin[top1_at[pos]] = np.argmax(row), row[hi] - row[lo]
            if pos in rows_at:
                rows[rows_at[pos]] = row
        return top1, margin, rows

    def greedy(self, ids, n):
        """llama.cpp's greedy continuation of n tokens, with its GREEDY_TOP best (id, logit) per step."""
        self._clear()
        out = np.zeros(n, np.int32)
        top_ids = np.zeros((n, GREEDY_TOP), np.int32)
        top_logits = np.zeros((n, GREEDY_TOP), np.float32)
        seq, start = list(ids), 0
        for step in range(n):
            (_, row), = list(self._decode(seq[start:], start, {len(seq) - 1}))
            best = np.argpartition(row, -GREEDY_TOP)[-GREEDY_TOP:]
            best = best[np.argsort(-row[best], kind="stable")]
            top_ids[step], top_logits[step] = best, row[best]
            out[step] = int(np.argmax(row))
            start = len(seq)
            seq.append(int(out[step]))
        return out, top_ids, top_logits
