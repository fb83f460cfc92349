"""Held-out evaluation windows: every token of every held-out file predicted once, each file on its own.

A document's sequence is ``EOD t1 .. tn EOD`` (tokenizer.py); its n + 1 predictions (t1 .. tn and the closing
EOD, which stands for the end of the file as a compressor's end-of-stream does) are cut into non-overlapping
windows of at most ``context`` inputs, starting at the document's first token. A window's first prediction
sees only that window, so a token after a cut sees less context than it could (a sliding window would score
slightly better). Windows never cross files, as gzip / xz compress each file on its own.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .tokenizer import EOD_ID, document_bounds

IGNORE = -100  # target of a padding position (torch's cross_entropy ignore_index default)


@dataclass(frozen=True)
class EvalWindows:
    """inputs [w, context] int64 (padded with EOD), targets [w, context] int64 (padded with IGNORE), lengths [w];
    windows sorted by length, longest first, so a batch can be cut to its longest window."""

    inputs: np.ndarray
    targets: np.ndarray
    lengths: np.ndarray

    @property
    def predictions(self) -> int:
        return int(self.lengths.sum())

    def batches(self, batch_size: int):
        """(inputs [b, l], targets [b, l]) with l the batch's longest window."""
        for start in range(0, len(self.lengths), batch_size):
            stop = start + batch_size
            width = int(self.lengths[start])
            yield self.inputs[start:stop, :width], self.targets[start:stop, :width]


def eval_windows(stream: np.ndarray, context: int) -> EvalWindows:
    """Cut each document of a held-out stream into windows (module docstring); sum of lengths = len(stream) - 1."""
    if context < 1:
        raise ValueError(f"context must be positive, got {context}")
    pieces = []
    for a, b in document_bounds(stream):
        seq = stream[a:b].astype(np.int64)
        for i in range(0, len(seq) - 1, context):
            stop = min(i + context, len(seq) - 1)
            pieces.append((seq[i:stop], seq[i + 1:stop + 1]))
    order = sorted(range(len(pieces)), key=lambda j: (-len(pieces[j][0]), j))
    inputs = np.full((len(pieces), context), EOD_ID, dtype=np.int64)
    targets = np.full((len(pieces), context), IGNORE, dtype=np.int64)
    lengths = np.zeros(len(pieces), dtype=np.int64)
    for row, j in enumerate(order):
        x, y = pieces[j]
        inputs[row, :len(x)] = x
        targets[row, :len(y)] = y
        lengths[row] = len(x)
    return EvalWindows(inputs, targets, lengths)
