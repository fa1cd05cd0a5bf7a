"""What a draft head is trained and judged over at each position of a sequence: the columns its
logits are computed for (the target's LM-head rows of some token ids), which of them a softmax may
use at each unrolled level, and the target's labels among them. Used by scripts/train_draft_head.py.

Two losses:
- "vocab": a fixed training vocabulary (the ids most often among the labels), the same columns at
  every position (EAGLE-3's reduced draft vocabulary).
- "window": the candidates MicroSpec's dynamic vocabulary would hold when the row is drafted, plus
  the target's top-k at the predicted position. The candidate stream follows the runtime's rules
  (src/vocab/candidate_stream.h) with the target's top-k_ver at every verified position: the
  tokens, and at each position the target's k_ver best next tokens; the active set is the unique
  ids of the stream's last w_max entries (candidate_window). Level j of an unrolled chain keeps
  its first level's set (the draft's own tokens join the stream only after the step). The draft tree's tokens,
  which the runtime appends too, are not modelled.

Every level is judged by the top-1 agreement over the dynamic vocabulary alone (the window, without
the labels): at inference a token outside it cannot be drafted.
"""
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Targets:
    lm: torch.Tensor         # float32 [C][H] LM-head rows of the columns
    lab_col: torch.Tensor    # int64 [m][k] column of each label id at positions 1..m (-1: not a column)
    lab_p: torch.Tensor      # float32 [m][k] the target's probabilities over the label columns, summing to 1
    window: torch.Tensor     # bool [m][C] row i (known tokens up to position i + 1): the dynamic vocabulary
    with_labels: bool        # the loss's softmax also takes each predicted position's label columns

    def loss_mask(self, j, rows):
        """bool [rows][C]: the columns the loss's softmax takes at level j (None: all of them)."""
        if not self.with_labels:
            return None
        mask = self.window[:rows].clone()
        cols = self.lab_col[j:j + rows]
        valid = cols >= 0
        mask[torch.arange(rows)[:, None].expand_as(cols)[valid], cols[valid]] = True
        return mask


def candidate_window(ids, top_ids, k_ver, w_max):
    """The dynamic vocabulary at each position of a teacher-forced sequence. Returns (U, mask): U
    the sorted unique ids of the stream, mask bool [n][U] whether U[u] is in the active set when the
    known tokens end at position c: the stream then holds tokens 0..c and the target's k_ver best
    next tokens at positions 0..c-1 (verification scored those rows; c's row is scored next)."""
    n = len(ids)
    per_pos = 1 + k_ver
    uniq, inverse = np.unique(np.concatenate([ids, top_ids[:, :k_ver].reshape(-1)]), return_inverse=True)
    tok_at, top_at = inverse[:n], inverse[n:].reshape(n, k_ver)
    count = np.zeros((n + 1, len(uniq)), dtype=np.int32)  # [c + 1][u]: occurrences up to c's entries
    np.add.at(count[1:], (np.arange(n), tok_at), 1)
    np.add.at(count[2:], (np.repeat(np.arange(n - 1), k_ver), top_at[:-1].reshape(-1)), 1)
    count = np.cumsum(count, axis=0)
    # The window is the stream's last w_max entries, counted in whole positions (1 + k_ver entries
    # each, rounded up: a superset by fewer than 1 + k_ver entries when w_max is not a multiple).
    back = -(-w_max // per_pos)
    before = np.zeros_like(count)
    if back <= n:
        before[back:] = count[:-back]
    return uniq, (count - before)[1:] > 0


@dataclass
class TrainingVocabulary:
    """The fixed columns of --loss vocab, built once for the run."""
    ids: np.ndarray      # int64 [C] the id of each column
    cols: np.ndarray     # int64 [V] the column of each id (-1 outside)
    lm: torch.Tensor     # float32 [C][H] their LM-head rows


def training_vocabulary(ids, all_rows):
    """The TrainingVocabulary of `ids` (column order) over all_rows, float32 [V][H]."""
    ids = np.asarray(ids, dtype=np.int64)
    cols = np.full(len(all_rows), -1, dtype=np.int64)
    cols[ids] = np.arange(len(ids))
    return TrainingVocabulary(ids, cols, torch.from_numpy(np.ascontiguousarray(all_rows[ids])))


def make_targets(seq, loss, all_rows, vocab, k_ver=3, w_max=3072):
    """The Targets of one sequence (features_file.Sequence). all_rows: float32 [V][H] every LM-head
    row; vocab: the TrainingVocabulary of "vocab" (unused by "window")."""
    ids = np.asarray(seq.ids, dtype=np.int64)
    top_ids = np.asarray(seq.top_ids, dtype=np.int64)
    lab_ids = top_ids[1:]
    lab_p = np.exp(np.asarray(seq.top_logp[1:], dtype=np.float64))
    uniq, window = candidate_window(ids, top_ids, k_ver, w_max)
    if loss == "vocab":
        columns, lm = vocab.ids, vocab.lm

        def column_of(x):
            return vocab.cols[x]
    elif loss == "window":
        columns = np.union1d(uniq, lab_ids.reshape(-1))  # sorted
        lm = torch.from_numpy(all_rows[columns])

        def column_of(x):
            at = np.minimum(np.searchsorted(columns, x), len(columns) - 1)
            return np.where(columns[at] == x, at, -1)
    else:
        raise ValueError(f"unknown loss {loss!r}")
    lab_col = column_of(lab_ids)
    # The window as columns; row i predicts position i + 1's label, its known tokens end at i + 1.
    win_cols = np.zeros((len(ids) - 1, len(columns)), dtype=bool)
    uniq_col = column_of(uniq)
    win_cols[:, uniq_col[uniq_col >= 0]] = window[1:, uniq_col >= 0]
    lab_p = np.where(lab_col >= 0, lab_p, 0.0)
    lab_p /= np.maximum(lab_p.sum(-1, keepdims=True), 1e-12)
    return Targets(lm=lm, lab_col=torch.from_numpy(lab_col), lab_p=torch.from_numpy(lab_p.astype(np.float32)),
                   window=torch.from_numpy(win_cols), with_labels=loss == "window")


def soft_cross_entropy(logits, mask, lab_col, lab_p):
    """Mean over rows of -sum_k p_k log softmax(logits)[lab_col_k], the softmax over the columns
    `mask` allows (all when None). logits [rows][C]; lab_col [rows][k] (-1: no such column, p 0)."""
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    logp = torch.log_softmax(logits, -1).gather(1, lab_col.clamp_min(0))
    return -torch.where(lab_p > 0, lab_p * logp, torch.zeros_like(logp)).sum(-1).mean()


def window_agreement(logits, targets, j, rows):
    """How many of level j's rows pick the target's best token over the dynamic vocabulary alone."""
    best = logits.masked_fill(~targets.window[:rows], float("-inf")).argmax(-1)
    top1 = targets.lab_col[j:j + rows, 0]  # the labels are best first
    return float(((best == top1) & (top1 >= 0)).sum())
