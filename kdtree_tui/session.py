"""The debugger's data model: one open trace, its per-step columns, anomalies, bookmarks. No Textual.

Everything the step list shows comes from columns read once (``reader.fields``, in one pass over the
rows, the first rows first), so moving through a 100k-step trace never touches the file; a step's full
record is read on demand (``reader.step``). A followed trace that grows reads only its new rows.
Dimension letters: S steps, L drafted depths (path width L+1), N+1 tree nodes.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional

import numpy as np

from kdspec.traces.thresholds import (  # noqa: F401 (the app's names)
    CACHE,
    DIVERGED,
    DLOGIT,
    FLAG_NAMES,
    LOW_TAU,
    Thresholds,
    flag_steps,
    thresholds_for,
)

# Columns the step list and run view need (scalars, one value per step).
LIST_COLUMNS = ("prefix_len", "tau", "num_nodes", "bonus_token", "cache_max_abs_diff")
PATH_COLUMNS = ("committed_tokens", "golden_tokens", "logit_max_abs_diff")
STAGE_COLUMNS = ("time_draft", "time_build", "time_verify", "time_accept", "time_compact", "time_trace_write")
# Rows read first (the first screen's step list), before the rest of the trace in READ_ROWS pieces
# (h5py's lock is held for a whole read: small pieces let the step worker in between).
FIRST_ROWS = 256
READ_ROWS = 8192


class Vocabulary:
    """How a trace's token ids read: byte-level (id = byte value; the presets) or, for BPE models, the token
    bytes the trace stores. A BPE token may hold part of a UTF-8 character: alone it shows escaped, inside a
    sequence its bytes join the neighbours' before decoding."""

    def __init__(self, pieces: Optional[list[bytes]] = None):
        self.pieces = pieces

    def token_text(self, token_id: int) -> str:
        token_id = int(token_id)
        if self.pieces is None:
            return chr(token_id) if 32 <= token_id < 127 else f"<{token_id}>"
        piece = self.pieces[token_id] if 0 <= token_id < len(self.pieces) else b""
        return piece.decode("utf-8", errors="backslashreplace") if piece else f"<{token_id}>"

    def tokens_text(self, ids: Iterable[int]) -> str:
        ids = [int(t) for t in ids if t >= 0]
        if self.pieces is None:
            return "".join(self.token_text(t) for t in ids)
        return b"".join(self.pieces[t] if t < len(self.pieces) else f"<{t}>".encode() for t in ids).decode(
            "utf-8", errors="replace")


BYTES = Vocabulary()
_ONE_LINE = {ord("\n"): "↵", ord("\t"): "→", ord("\r"): "\\r"}


def one_line(text: str) -> str:
    """text for a one-line cell: newlines as ↵, tabs as →, other control characters escaped."""
    text = text.translate(_ONE_LINE)
    return "".join(ch if ch.isprintable() or ch == " " else ch.encode("unicode_escape").decode() for ch in text)


def token_text(token_id: int, vocabulary: Vocabulary = BYTES) -> str:
    """One token for display: byte-level printable ASCII as is, other bytes as <id>; BPE tokens as their text."""
    return vocabulary.token_text(token_id)


def tokens_text(ids: Iterable[int], vocabulary: Vocabulary = BYTES) -> str:
    return vocabulary.tokens_text(ids)


def _open_trace(path):
    from kdspec.traces.reader import open_trace

    return open_trace(path)


class TraceSession:
    """A trace opened for viewing: metadata, columns, anomaly flags, bookmarks, step access.

    Args:
        path: the trace file (opened read-only through traces.reader).
        threshold_overrides: {"dlogit" / "cache" / "min_tau": value} replacing the defaults of the trace's
            precision (traces.thresholds): what counts as an anomaly.
        opener: path -> reader (traces.reader.open_trace; tests may wrap it).
    Raises traces' TraceError (one line) when the file cannot be opened as a trace.
    """

    def __init__(self, path: str | os.PathLike, threshold_overrides: Optional[Mapping[str, Any]] = None,
                 opener: Optional[Callable[[Any], Any]] = None):
        self.path = os.fspath(path)
        self.name = os.path.basename(self.path)
        self.reader = (opener or _open_trace)(self.path)
        self.metadata: dict = dict(self.reader.metadata)
        self.thresholds: Thresholds = thresholds_for(self.metadata, **dict(threshold_overrides or {}))
        self.mode = str(self.metadata.get("mode", "ddtree"))
        self.vocabulary = self._vocabulary()
        self.bookmarks: set[int] = set()
        # Until the columns are read (a worker does it after the first paint) the views show placeholders:
        # columns and flags hold the first ``rows`` steps; ``loaded`` once they hold all num_steps.
        self.loaded = False
        self.num_steps = int(self.reader.num_steps)
        self.rows = 0
        self.columns: dict[str, np.ndarray] = {}
        self.flags = np.zeros(0, np.uint8)

    def _vocabulary(self) -> Vocabulary:
        """The trace's stored token bytes (BPE models), else byte-level. A damaged vocabulary reads as bytes."""
        read = getattr(self.reader, "vocabulary", None)
        if self.metadata.get("tokenizer") != "bpe" or read is None:
            return BYTES
        from kdspec.traces.schema import TraceError
        try:
            return Vocabulary(read())
        except TraceError:  # a damaged table must not stop the viewer: ids then show as <id>
            return BYTES

    # -- columns --------------------------------------------------------------------------------------
    def read_columns(self, previous: Optional["Columns"] = None, stop: Optional[int] = None) -> "Columns":
        """Columns of steps [0, stop) (default: all the reader sees), reading only the rows past
        ``previous`` (an earlier result, kept as is). Safe in a worker thread; installs nothing."""
        reader = self.reader
        num_steps = int(reader.num_steps)
        stop = num_steps if stop is None else min(int(stop), num_steps)
        start = previous.rows if previous is not None and previous.rows <= stop else 0
        names = LIST_COLUMNS + PATH_COLUMNS
        # one pass over the rows; the stage timings ride along (the reader caches them for the run view)
        values = dict(reader.fields(names + STAGE_COLUMNS, start, stop))
        self._check_counts(values, start)
        new = {name: np.asarray(values[name]) for name in names}
        for name in PATH_COLUMNS:
            if new[name].ndim == 1:
                new[name] = new[name][:, None]
        flags = flag_steps(new, self.thresholds, self.mode)
        if start:
            new = {name: np.concatenate([previous.columns[name], new[name]]) for name in names}
            flags = (np.concatenate([previous.flags, flags]) if previous.thresholds == self.thresholds
                     else flag_steps(new, self.thresholds, self.mode))
        return Columns(num_steps, new, flags, self.thresholds)

    def _check_counts(self, values: dict, start: int) -> None:
        """Every size the views derive from a step (histograms, path widths) is bounded by the trace's declared
        widths: a tau or num_nodes outside them is damage (traces' TraceError), never an allocation."""
        dims = getattr(self.reader, "dims", None)
        if dims is None:
            return
        from kdspec.traces.schema import TraceError
        for name, high in (("num_nodes", dims.node_width), ("tau", dims.path_width)):
            column = np.asarray(values[name])
            bad = np.flatnonzero((column < 1) | (column > high))
            if bad.size:
                i = int(bad[0])
                raise TraceError(f"{self.path}: step {start + i}: {name} {int(column[i])} outside 1..{high} "
                                 f"(the trace's widths)")

    def install(self, loaded: "Columns") -> None:
        """Make freshly read columns current (on the UI thread)."""
        self.columns, self.flags, self.num_steps = loaded.columns, loaded.flags, loaded.num_steps
        self.rows = loaded.rows
        self.loaded = loaded.rows == loaded.num_steps
        if loaded.thresholds != self.thresholds:  # read before set_thresholds: flag again
            self.flags = flag_steps(self.columns, self.thresholds, self.mode) if self.rows else self.flags

    def set_thresholds(self, thresholds: Thresholds) -> None:
        """New anomaly thresholds: the flags of every step read so far are computed again (on the UI thread)."""
        self.thresholds = thresholds
        if self.rows:
            self.flags = flag_steps(self.columns, thresholds, self.mode)

    def read_stage_times(self) -> dict[str, np.ndarray]:
        """Per-step stage timings {column: float64 [S]} (read when the run view first needs them)."""
        return {name: np.asarray(self.reader.column(name), np.float64) for name in STAGE_COLUMNS}

    def refresh(self) -> bool:
        """Re-read the step count of a trace still being written; True when it changed (columns to read)."""
        return int(self.reader.refresh()) != self.num_steps

    def current_columns(self) -> Optional["Columns"]:
        """The installed columns (what read_columns may extend), or None before any."""
        return Columns(self.num_steps, self.columns, self.flags) if self.columns else None

    @property
    def is_complete(self) -> bool:
        return bool(self.reader.is_complete)

    def step(self, index: int):
        """The full StepRecord of step ``index`` (reads only that step)."""
        return self.reader.step(index)

    def close(self) -> None:
        close = getattr(self.reader, "close", None)
        if close is not None:
            close()

    # -- navigation -----------------------------------------------------------------------------------
    def has_row(self, index: int) -> bool:
        """Whether step ``index``'s columns have been read."""
        return 0 <= index < self.rows

    def committed_text(self, index: int) -> str:
        tau = int(self.columns["tau"][index])
        return tokens_text(self.columns["committed_tokens"][index, :tau], self.vocabulary)

    def committed_line(self, index: int) -> str:
        """committed_text on one line (for one-line cells): newline, tab and other control characters shown."""
        return one_line(self.committed_text(index))

    def next_flagged(self, index: int, direction: int, mask: int = 0xFF) -> Optional[int]:
        """The nearest step after (direction 1) or before (-1) ``index`` with any flag in ``mask``."""
        hits = np.flatnonzero(self.flags & mask)
        return _nearest(hits, index, direction)

    def toggle_bookmark(self, index: int) -> bool:
        """Toggle; returns whether the step is bookmarked now."""
        if index in self.bookmarks:
            self.bookmarks.discard(index)
            return False
        self.bookmarks.add(index)
        return True

    def next_bookmark(self, index: int, direction: int = 1) -> Optional[int]:
        """The next bookmark after ``index`` (wrapping around), or None without bookmarks."""
        if not self.bookmarks:
            return None
        marks = np.array(sorted(self.bookmarks))
        found = _nearest(marks, index, direction)
        if found is None:  # wrap
            found = int(marks[0] if direction > 0 else marks[-1])
        return found

    def search(self, query: str, limit: int = 20) -> list[int]:
        """Steps where a match of ``query`` in the output text starts (the step number itself first).

        The text is every step's committed tokens as displayed, concatenated (built once per column load),
        so a match may run on into the next step.
        """
        query = query.strip()
        found = []
        if query.isdigit() and int(query) < self.num_steps:
            found.append(int(query))
        if not query or not self.loaded:
            return found
        text, starts = self._text_index()
        at = text.find(query)
        while at >= 0 and len(found) < limit:
            step = int(np.searchsorted(starts, at, side="right")) - 1
            if step not in found:
                found.append(step)
            at = text.find(query, at + 1)
        return found

    def _text_index(self) -> tuple[str, np.ndarray]:
        """(all steps' committed text, start offset of each step in it), cached per column load."""
        if getattr(self, "_text_cache", (None,))[0] is not self.columns:
            pieces = [self.committed_text(i) for i in range(self.num_steps)]
            starts = np.cumsum([0] + [len(p) for p in pieces[:-1]]) if pieces else np.zeros(0, np.int64)
            self._text_cache = (self.columns, "".join(pieces), starts)
        return self._text_cache[1], self._text_cache[2]


@dataclass
class Columns:
    """What read_columns returns: of the trace's S steps, the first R (rows) as {name: [R] or [R, L+1]
    array} and anomaly flags uint8 [R]."""

    num_steps: int
    columns: dict
    flags: np.ndarray
    thresholds: Optional[Thresholds] = None  # what the flags were computed with

    @property
    def rows(self) -> int:
        return len(self.flags)


def _nearest(sorted_hits: np.ndarray, index: int, direction: int) -> Optional[int]:
    if direction > 0:
        at = int(np.searchsorted(sorted_hits, index, side="right"))
        return int(sorted_hits[at]) if at < len(sorted_hits) else None
    at = int(np.searchsorted(sorted_hits, index, side="left")) - 1
    return int(sorted_hits[at]) if at >= 0 else None


def format_seconds(seconds: float) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} us"
