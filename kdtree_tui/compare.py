"""Aligning two traces of the same prompt by committed position (no Textual).

Row r of an alignment is a position P where a step of A or of B starts (its prefix_len). Both traces
commit the same text when they agree, so the rows where both start a step show where their step
boundaries coincide; a row differs when the tokens the two traces commit from P up to the next row differ.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kdspec.kdtree_tui.session import TraceSession


@dataclass
class Alignment:
    """R rows: positions int64 [R]; a_step, b_step int64 [R] (-1: that trace has no step starting there);
    differs bool [R]; first_difference: position of the first differing token, or None."""

    positions: np.ndarray
    a_step: np.ndarray
    b_step: np.ndarray
    differs: np.ndarray
    first_difference: int | None

    @property
    def num_rows(self) -> int:
        return int(self.positions.shape[0])

    def row_of_a_step(self, step: int) -> int:
        hits = np.flatnonzero(self.a_step == step)
        return int(hits[0]) if hits.size else 0


def committed_stream(session: TraceSession) -> tuple[int, np.ndarray]:
    """(first position, int64 tokens): the tokens committed by all steps, at positions P0+1, P0+2, ..."""
    c = session.columns
    if session.num_steps == 0:
        return 0, np.zeros(0, np.int64)
    tau = c["tau"]
    valid = np.arange(c["committed_tokens"].shape[1])[None, :] < tau[:, None]
    return int(c["prefix_len"][0]) + 1, c["committed_tokens"][valid].astype(np.int64)


def align(a: TraceSession, b: TraceSession) -> Alignment:
    pa, pb = a.columns["prefix_len"].astype(np.int64), b.columns["prefix_len"].astype(np.int64)
    positions = np.union1d(pa, pb)
    a_step = np.full(positions.shape, -1, np.int64)
    b_step = np.full(positions.shape, -1, np.int64)
    a_step[np.searchsorted(positions, pa)] = np.arange(len(pa))
    b_step[np.searchsorted(positions, pb)] = np.arange(len(pb))
    # Token-by-token comparison of the committed streams at equal absolute positions.
    start_a, tokens_a = committed_stream(a)
    start_b, tokens_b = committed_stream(b)
    start = max(start_a, start_b)
    stop = min(start_a + len(tokens_a), start_b + len(tokens_b))
    wrong_positions = np.zeros(0, np.int64)
    if stop > start:
        seg_a = tokens_a[start - start_a:stop - start_a]
        seg_b = tokens_b[start - start_b:stop - start_b]
        wrong_positions = start + np.flatnonzero(seg_a != seg_b)
    # A row covers the tokens at positions (P_r, P_{r+1}]: it differs if any wrong position falls there.
    row_of_wrong = np.searchsorted(positions, wrong_positions, side="left") - 1
    differs = np.zeros(positions.shape, bool)
    differs[row_of_wrong[row_of_wrong >= 0]] = True
    first = int(wrong_positions[0]) if wrong_positions.size else None
    return Alignment(positions, a_step, b_step, differs, first)
