"""Lazy, read-only access to a trace: metadata, one step at a time, per-step columns, summaries.

``open_trace(path)`` opens the file in SWMR read mode, so a trace still being recorded (or left behind by
a killed writer) can be read; ``refresh()`` picks up steps written since. Every failure is a TraceError
whose one-line message names the file (and the dataset when one is damaged).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any, Optional

import h5py
import numpy as np

from .schema import (COLUMNS, FORMAT_NAME, SCHEMA_VERSION, STEP_FIELDS, TraceDims, TraceError)

_JSON_ATTRS = ("model_config", "decode_config", "versions")


@dataclass
class StepRecord:
    """One step, arrays trimmed to their true lengths (N+1 nodes, tau path entries).

    Scalars are Python ints/floats; arrays as stored (int32 token ids / indices, float32 values).
    draft_* [L, K]; tree_*, target_choice, target_margin [N+1]; target_topk_* [N+1, T];
    accepted_nodes, committed_tokens, golden_tokens, logit_max_abs_diff, compact_* [tau];
    logits [tau, V] float32 or None when the trace has no logits. time_trace_write: seconds spent
    writing this step (NaN while unknown: the last step of an unfinished trace).
    """

    index: int
    prefix_len: int
    root_token: int
    num_nodes: int
    tau: int
    bonus_token: int
    cache_len_before: int
    cache_len_verify: int
    cache_len_after: int
    cache_max_abs_diff: float
    time_draft: float
    time_build: float
    time_verify: float
    time_accept: float
    time_compact: float
    time_trace_write: float
    draft_ids: np.ndarray
    draft_logprobs: np.ndarray
    tree_tokens: np.ndarray
    tree_parents: np.ndarray
    tree_depths: np.ndarray
    tree_ranks: np.ndarray
    tree_scores: np.ndarray
    target_choice: np.ndarray
    target_margin: np.ndarray
    target_topk_ids: np.ndarray
    target_topk_logits: np.ndarray
    accepted_nodes: np.ndarray
    committed_tokens: np.ndarray
    golden_tokens: np.ndarray
    logit_max_abs_diff: np.ndarray
    compact_src: np.ndarray
    compact_dst: np.ndarray
    logits: Optional[np.ndarray] = None

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class TraceReader:
    """A read-only view of one trace file. Use ``open_trace``; close it (or use ``with``)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._file = None
        self.num_steps = 0
        self.metadata: dict[str, Any] = {}
        self._attach()

    def _attach(self) -> None:
        """(Re)open the file and read its metadata, dimensions and step count."""
        self._file = _open_file(self.path)
        try:
            metadata = self._read_metadata()
            self.metadata.clear()   # in place: callers may hold on to the dict across refresh()
            self.metadata.update(metadata)
            self.dims = TraceDims(self.metadata["num_depths"], self.metadata["draft_topk"],
                                  self.metadata["budget"], self.metadata["target_topk"])
            self._steps = self._dataset("steps")
            missing = [f.name for f in self.dims.fields() if f.name not in (self._steps.dtype.names or ())]
            if missing:
                raise TraceError(f"{self.path}: dataset 'steps' lacks fields {missing}")
            self._logits = self._dataset("logits") if self.metadata["save_logits"] else None
            self.num_steps = self._count_steps()
        except TraceError:
            self.close()
            raise
        except (OSError, RuntimeError, KeyError, ValueError, TypeError) as e:
            self.close()
            raise TraceError(f"{self.path}: damaged trace ({_first_line(e)})") from None

    # -- opening --------------------------------------------------------------------------------------
    def _read_metadata(self) -> dict[str, Any]:
        attrs = self._file.attrs
        if attrs.get("format") != FORMAT_NAME:
            raise TraceError(f"{self.path}: an HDF5 file but not a kdtree trace (no format={FORMAT_NAME!r} attribute)")
        version = int(attrs.get("schema_version", -1))
        if version > SCHEMA_VERSION:
            raise TraceError(f"{self.path}: schema_version {version} is newer than this kdtree supports "
                             f"({SCHEMA_VERSION}); upgrade kdtree")
        if version < 1:
            raise TraceError(f"{self.path}: invalid schema_version {version}")
        meta: dict[str, Any] = {}
        for key, value in attrs.items():
            value = _attr_value(value)
            meta[key] = json.loads(value) if key in _JSON_ATTRS else value
        meta["prompt_tokens"] = self._dataset("prompt_tokens")[...].astype(np.int64)
        return meta

    def _dataset(self, name: str) -> h5py.Dataset:
        try:
            obj = self._file[name]
        except KeyError:
            raise TraceError(f"{self.path}: dataset {name!r} is missing") from None
        except (OSError, RuntimeError) as e:
            raise TraceError(f"{self.path}: dataset {name!r} is damaged ({_first_line(e)})") from None
        if not isinstance(obj, h5py.Dataset):
            raise TraceError(f"{self.path}: {name!r} is not a dataset")
        return obj

    def _read(self, dataset: h5py.Dataset, selection, name: Optional[str] = None):
        """Read ``dataset[selection]``, turning HDF5 failures (truncation, bad chunks) into TraceError."""
        try:
            return dataset.fields(name)[selection] if name else dataset[selection]
        except (OSError, RuntimeError, ValueError) as e:
            raise TraceError(f"{self.path}: dataset {dataset.name.lstrip('/')!r} is damaged or truncated "
                             f"({_first_line(e)})") from None

    # -- live following -------------------------------------------------------------------------------
    def refresh(self) -> int:
        """Re-read a trace still being recorded (more steps, finished status); return the step count.

        A live (SWMR) file is reopened: HDF5 offers h5py no way to refresh the root group's attributes
        (status, end time), and reopening costs about a millisecond. A closed file does not change.
        """
        if self._file is None:
            raise TraceError(f"{self.path}: refresh after the trace was closed")
        if self._file.swmr_mode:
            self.close()
            self._attach()
        return self.num_steps

    def _count_steps(self) -> int:
        count = self._steps.shape[0]
        if self._logits is not None:
            count = min(count, self._logits.shape[0])
        # A row whose extent reached the disk before its data did holds HDF5's fill value: tau 0.
        while count and int(self._read(self._steps, count - 1, "tau")) == 0:
            count -= 1
        return count

    @property
    def is_complete(self) -> bool:
        return self.metadata.get("status") == "complete"

    # -- random access --------------------------------------------------------------------------------
    def step(self, index: int) -> StepRecord:
        """Step ``index`` (0-based; negative counts from the end), reading only that row."""
        i = self._check_index(index)
        rows = self._read(self._steps, slice(i, min(i + 2, self.num_steps)))
        row = rows[0]
        tau, num_nodes = int(row["tau"]), int(row["num_nodes"])
        values: dict[str, Any] = {"index": i}
        trims = {"scalar": (), "node": (slice(0, num_nodes),), "path": (slice(0, tau),),
                 "topk": (slice(0, num_nodes),), "draft": ()}
        for field in STEP_FIELDS:
            if field.name == "time_trace_write_prev":
                continue
            if field.kind == "draft" and not self.dims.has_draft:
                values[field.name] = np.full(self.dims.shape("draft"), field.pad, dtype=field.dtype)
            elif field.kind == "scalar":
                values[field.name] = row[field.name].item()
            else:
                values[field.name] = np.array(row[field.name][trims[field.kind]])
        values["time_trace_write"] = float(rows[1]["time_trace_write_prev"]) if len(rows) > 1 else \
            float(self.metadata.get("time_trace_write_last", np.nan)) if i == self.num_steps - 1 else np.nan
        if self._logits is not None:
            values["logits"] = np.array(self._read(self._logits, i)[:tau])
        return StepRecord(**values)

    def _check_index(self, index: int) -> int:
        i = int(index)
        if i < 0:
            i += self.num_steps
        if not 0 <= i < self.num_steps:
            raise IndexError(f"step {index} out of range (trace has {self.num_steps} steps)")
        return i

    def column(self, name: str) -> np.ndarray:
        """A per-step scalar field over all steps, shape [num_steps] (int64 or float64)."""
        if name not in COLUMNS:
            raise KeyError(f"{name!r} is not a per-step scalar column; choose from {', '.join(COLUMNS)}")
        n = self.num_steps
        if name == "time_trace_write":
            # Row i+1 stores the write time of step i; the last step's is an attribute set by finish().
            shifted = self._read(self._steps, slice(1, n), "time_trace_write_prev") if n > 1 else np.zeros(0)
            return np.append(shifted, self.metadata.get("time_trace_write_last", np.nan)).astype(np.float64)[:n]
        values = self._read(self._steps, slice(0, n), name)
        return values.astype(np.int64 if values.dtype.kind == "i" else np.float64)

    def field(self, name: str) -> np.ndarray:
        """A padded per-step field over all steps, shape [num_steps, ...] as stored (padding -1 / NaN)."""
        if name not in self._steps.dtype.names:
            raise KeyError(f"{name!r} is not a stored per-step field")
        return self._read(self._steps, slice(0, self.num_steps), name)

    @property
    def prompt_tokens(self) -> np.ndarray:
        return self.metadata["prompt_tokens"]

    @property
    def output_tokens(self) -> np.ndarray:
        """The output recorded by finish() (empty while recording), int64."""
        return self._read(self._dataset("output_tokens"), slice(None)).astype(np.int64)

    @property
    def golden_tokens(self) -> np.ndarray:
        """The golden tokens recorded by finish() (empty while recording or when none), int64."""
        return self._read(self._dataset("golden_tokens"), slice(None)).astype(np.int64)

    def summary(self):
        """TraceSummary of the steps read so far (traces.summary)."""
        from .summary import summarize_trace
        return summarize_trace(self)

    # -- lifetime -------------------------------------------------------------------------------------
    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "TraceReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_trace(path: str | os.PathLike) -> TraceReader:
    """Open a trace read-only. TraceError (one line) for a missing, empty, non-HDF5, damaged or foreign file."""
    return TraceReader(path)


def _open_file(path: str) -> h5py.File:
    if not os.path.exists(path):
        raise TraceError(f"{path}: no such trace file")
    if os.path.isdir(path):
        raise TraceError(f"{path}: is a directory, not a trace file")
    if os.path.getsize(path) == 0:
        raise TraceError(f"{path}: empty file, not a trace")
    try:
        if not h5py.is_hdf5(path):
            raise TraceError(f"{path}: not an HDF5 file")
    except OSError as e:
        raise TraceError(f"{path}: cannot read ({_first_line(e)})") from None
    # A closed trace opens plainly, which also lets HDF5 catch truncation. A trace whose writer is still
    # running (or was killed) is flagged "open for writing" and opens only in SWMR read mode (SWMR skips
    # the truncation check, and retries unreadable metadata for a long time, so it is the fallback only).
    # No file lock either way: the viewer must never block (or be blocked by) the recorder.
    try:
        return h5py.File(path, "r", locking=False)
    except (OSError, RuntimeError, ValueError) as e:
        plain_error = e
    if not any(s in str(plain_error) for s in ("already open for write", "locking flag")):
        raise TraceError(f"{path}: cannot open as HDF5, damaged or truncated? ({_first_line(plain_error)})") from None
    try:
        return h5py.File(path, "r", libver="latest", swmr=True, locking=False)
    except (OSError, RuntimeError, ValueError) as e:
        raise TraceError(f"{path}: cannot open as HDF5, damaged or truncated? ({_first_line(e)})") from None


def _attr_value(value: Any) -> Any:
    """Attribute value as a plain Python value (fixed-width byte strings decoded)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value.item() if isinstance(value, np.generic) else value


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
