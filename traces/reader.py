"""Lazy, read-only access to a trace: metadata, one step at a time, per-step columns, summaries.

``open_trace(path)`` opens the file in SWMR read mode, so a trace still being recorded (or left behind by
a killed writer) can be read; ``refresh()`` picks up steps written since. Every failure is a TraceError
whose one-line message names the file (and the dataset when one is damaged).
"""
from __future__ import annotations

import ctypes
import functools
import json
import os
import threading
from dataclasses import field, fields, make_dataclass
from typing import Any, Iterable, Optional

import h5py
import numpy as np

from kdspec.traces.schema import (COLUMNS, FORMAT_NAME, LOGITS_KEYS, MODES, SCHEMA_VERSION, STEP_FIELDS, TraceDims,
                                  TraceError)

_JSON_ATTRS = ("model_config", "decode_config", "versions")
_REQUIRED = object()
# The root attributes the reader relies on (docs/trace-format.md): name -> (type, default when absent, or
# _REQUIRED). Anything else in the file is passed through as found.
ATTRIBUTES: dict[str, tuple[type, Any]] = {
    "status": (str, _REQUIRED), "mode": (str, _REQUIRED), "backend": (str, _REQUIRED), "device": (str, _REQUIRED),
    "seed": (int, _REQUIRED), "start_time": (str, _REQUIRED), "end_time": (str, _REQUIRED),
    "model_config": (dict, _REQUIRED), "decode_config": (dict, _REQUIRED), "versions": (dict, _REQUIRED),
    "block_size": (int, _REQUIRED), "num_depths": (int, _REQUIRED), "budget": (int, _REQUIRED),
    "draft_topk": (int, _REQUIRED), "target_topk": (int, _REQUIRED), "save_logits": (bool, _REQUIRED),
    "vocab_size": (int, -1), "compression": (str, "None"), "time_trace_write_last": (float, float("nan")),
    "tokenizer": (str, "byte"), "drafter": (dict, {}), "time_golden": (float, float("nan")),
}
# Rows per HDF5 read in column()/field()/fields(). HDF5 converts a compound field selection through a
# buffer of whole rows (~2 KB each at budget 16), so reading 100k rows at once would peak at ~200 MB.
BLOCK_ROWS = 8192


def _step_record_fields() -> list[tuple]:
    """StepRecord's fields, from the schema: the step index, every step field in row order (the stored
    time_trace_write_prev un-shifted into this step's time_trace_write), then the optional logits and golden
    logits (schema.LOGITS_KEYS)."""
    found: list[tuple] = [("index", int)]
    for f in STEP_FIELDS:
        if f.name == "time_trace_write_prev":
            found.append(("time_trace_write", float))
        elif f.kind == "scalar":
            found.append((f.name, int if np.dtype(f.dtype).kind == "i" else float))
        else:
            found.append((f.name, np.ndarray))
    return found + [(name, Optional[np.ndarray], field(default=None)) for name in LOGITS_KEYS]


def _as_dict(self) -> dict[str, Any]:
    return {f.name: getattr(self, f.name) for f in fields(self)}


StepRecord = make_dataclass("StepRecord", _step_record_fields(), namespace={"as_dict": _as_dict})
StepRecord.__module__ = __name__
StepRecord.__doc__ = """One step, arrays trimmed to their true lengths (N+1 nodes, tau path entries).

    Fields: ``index``, the schema's (traces/schema.py STEP_FIELDS) in row order with ``time_trace_write``
    for the stored time_trace_write_prev, then ``logits`` and ``golden_logits``. Scalars are Python
    ints/floats; arrays as stored (int32 token ids / indices, float32 values). draft_* [L, K]; tree_*,
    target_choice, target_margin [N+1]; target_topk_* [N+1, T]; accepted_nodes, committed_tokens,
    golden_tokens, logit_max_abs_diff, compact_* [tau]; logits [tau, V] float32 or None when the trace has no
    logits; golden_logits [tau, V] float64 (NaN rows: the golden was not recorded there) or None when the
    trace has none (no logits, or recorded before golden_logits existed). time_trace_write: seconds spent
    writing this step (NaN while unknown: the last step of an unfinished trace).
    """


class TraceReader:
    """A read-only view of one trace file. Use ``open_trace``; close it (or use ``with``)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._file = None
        self.num_steps = 0
        self.metadata: dict[str, Any] = {}
        # Per-step scalar fields read so far, {stored name: int64/float64 [rows 0..k)}; rows below
        # num_steps never change (each step is written once), so they survive refresh().
        self._scalar_cache: dict[str, np.ndarray] = {}
        # Reads may come from several threads (the app's workers) while refresh() reopens the file.
        self._lock = threading.RLock()
        self._attach()

    def _attach(self) -> None:
        """(Re)open the file and read its metadata, dimensions and step count."""
        self._file = open_hdf5(self.path)
        try:
            metadata = self._read_metadata()
            self.metadata.clear()   # in place: callers may hold on to the dict across refresh()
            self.metadata.update(metadata)
            try:
                self.dims = TraceDims(self.metadata["num_depths"], self.metadata["draft_topk"],
                                      self.metadata["budget"], self.metadata["target_topk"])
            except TraceError as e:
                raise TraceError(f"{self.path}: {e}") from None
            if self.metadata["block_size"] != self.dims.num_depths + 1:
                raise TraceError(f"{self.path}: attributes block_size {self.metadata['block_size']} and num_depths "
                                 f"{self.dims.num_depths} disagree")
            self._steps = self._dataset("steps", ndim=1)
            self._check_step_fields()
            self._logits = self._dataset("logits", ndim=3) if self.metadata["save_logits"] else None
            if self._logits is not None and self._logits.shape[1] != self.dims.path_width:
                raise TraceError(f"{self.path}: dataset 'logits' has {self._logits.shape[1]} rows a step, "
                                 f"expected block_size {self.dims.path_width}")
            # Traces recorded before golden_logits existed have logits only.
            self._golden_logits = self._dataset("golden_logits", ndim=3) \
                if self._logits is not None and "golden_logits" in self._file else None
            golden = self._golden_logits
            if golden is not None and (golden.shape[1:] != self._logits.shape[1:] or golden.dtype.kind != "f"):
                raise TraceError(f"{self.path}: dataset 'golden_logits' is {golden.dtype}{list(golden.shape[1:])} a "
                                 f"step, expected floats {list(self._logits.shape[1:])} (as 'logits')")
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
            meta[key] = _attr_value(value)
        for key, (kind, default) in ATTRIBUTES.items():
            if key not in meta:
                if default is _REQUIRED:
                    raise TraceError(f"{self.path}: attribute {key!r} is missing")
                meta[key] = dict(default) if isinstance(default, dict) else default  # older traces
                continue
            meta[key] = self._typed(key, meta[key], kind)
        if meta["mode"] not in MODES:
            raise TraceError(f"{self.path}: attribute 'mode' must be one of {MODES}, got {meta['mode']!r:.40}")
        meta["prompt_tokens"] = self._integers(self._dataset("prompt_tokens", ndim=1), "prompt_tokens")
        return meta

    def _typed(self, key: str, value: Any, kind: type) -> Any:
        """An attribute's value as ``kind`` (JSON objects parsed); TraceError naming it when it is not one."""
        if kind is dict:
            try:
                value = json.loads(value) if isinstance(value, str) else None
            except (ValueError, RecursionError):
                value = None
            if not isinstance(value, dict):
                raise TraceError(f"{self.path}: attribute {key!r} is not a JSON object")
            return value
        if kind is bool and isinstance(value, (bool, np.bool_)):
            return bool(value)
        if kind is int and isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
            return int(value)
        if kind is float and isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
            return float(value)
        if kind is str and isinstance(value, str):
            return value
        raise TraceError(f"{self.path}: attribute {key!r} must be a {kind.__name__}, got {type(value).__name__}")

    def _check_step_fields(self) -> None:
        """The ``steps`` row has every field of the declared widths, of the schema's kind of number."""
        dtype = self._steps.dtype
        if dtype.names is None:
            raise TraceError(f"{self.path}: dataset 'steps' is not a table of step rows")
        missing = [f.name for f in self.dims.fields() if f.name not in dtype.names]
        if missing:
            raise TraceError(f"{self.path}: dataset 'steps' lacks fields {missing}")
        for f in self.dims.fields():
            stored = dtype[f.name]
            if stored.shape != self.dims.shape(f.kind) or stored.base.kind != np.dtype(f.dtype).kind:
                raise TraceError(f"{self.path}: field {f.name!r} of 'steps' is {stored.base}{list(stored.shape)}, "
                                 f"expected {np.dtype(f.dtype)}{list(self.dims.shape(f.kind))} (the trace's widths)")

    def _integers(self, dataset: h5py.Dataset, name: str) -> np.ndarray:
        values = self._read(dataset, ...)
        if values.dtype.kind not in "iu":
            raise TraceError(f"{self.path}: dataset {name!r} does not hold integers")
        return values.astype(np.int64)

    def _dataset(self, name: str, ndim: Optional[int] = None) -> h5py.Dataset:
        try:
            obj = self._file[name]
        except KeyError:
            raise TraceError(f"{self.path}: dataset {name!r} is missing") from None
        except (OSError, RuntimeError, ValueError) as e:
            raise TraceError(f"{self.path}: dataset {name!r} is damaged ({_first_line(e)})") from None
        if not isinstance(obj, h5py.Dataset):
            raise TraceError(f"{self.path}: {name!r} is not a dataset")
        if ndim is not None and obj.ndim != ndim:
            raise TraceError(f"{self.path}: dataset {name!r} has {obj.ndim} dimensions, expected {ndim}")
        return obj

    def _read(self, dataset: h5py.Dataset, selection, name=None):
        """Read ``dataset[selection]`` (of field(s) ``name``), turning HDF5 failures (truncation, bad chunks) into TraceError."""
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
        with self._lock:
            if self._file is None:
                raise TraceError(f"{self.path}: refresh after the trace was closed")
            if self._file.swmr_mode:
                self.close()
                self._attach()
            return self.num_steps

    def _count_steps(self) -> int:
        count = self._steps.shape[0]
        for extra in (self._logits, self._golden_logits):
            if extra is not None:
                count = min(count, extra.shape[0])
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
        with self._lock:
            self._check_open()
            i = self._check_index(index)
            rows = self._read(self._steps, slice(i, min(i + 2, self.num_steps)))
            logits = np.array(self._read(self._logits, i)) if self._logits is not None else None
            golden = np.array(self._read(self._golden_logits, i)) if self._golden_logits is not None else None
        row = rows[0]
        tau, num_nodes = int(row["tau"]), int(row["num_nodes"])
        if not (1 <= num_nodes <= self.dims.node_width and 1 <= tau <= min(self.dims.path_width, num_nodes)):
            raise TraceError(f"{self.path}: step {i}: num_nodes {num_nodes} / tau {tau} outside the trace's widths "
                             f"(1..{self.dims.node_width} nodes, 1..min({self.dims.path_width}, num_nodes) tau)")
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
        if logits is not None:
            values["logits"] = logits[:tau]
        if golden is not None:
            values["golden_logits"] = golden[:tau]
        return StepRecord(**values)

    def _check_index(self, index: int) -> int:
        i = int(index)
        if i < 0:
            i += self.num_steps
        if not 0 <= i < self.num_steps:
            raise IndexError(f"step {index} out of range (trace has {self.num_steps} steps)")
        return i

    def column(self, name: str, start: int = 0, stop: Optional[int] = None) -> np.ndarray:
        """A per-step scalar over steps [start, stop) (default all), shape [stop-start], int64 or float64.

        Read-only; cached, so asking again (or for more steps after refresh()) reads only new rows.
        """
        if name not in COLUMNS:
            raise KeyError(f"{name!r} is not a per-step scalar column; choose from {', '.join(COLUMNS)}")
        return self.fields([name], start, stop)[name]

    def field(self, name: str, start: int = 0, stop: Optional[int] = None) -> np.ndarray:
        """A stored per-step field over steps [start, stop), shape [stop-start, ...] as stored (padding -1 / NaN)."""
        self._check_open()
        if name not in self._steps.dtype.names:
            raise KeyError(f"{name!r} is not a stored per-step field")
        start, stop = self._check_range(start, stop)
        with self._lock:
            self._check_open()
            return self._read_rows([name], start, stop)[name]

    def fields(self, names: Iterable[str], start: int = 0, stop: Optional[int] = None) -> dict[str, np.ndarray]:
        """Several per-step fields over steps [start, stop) in one pass over the rows: {name: array}.

        A name in COLUMNS (per-step scalars, including the derived ``time_trace_write``) reads as
        ``column`` does (int64 / float64 [stop-start], cached); any other stored field as ``field`` does.
        """
        self._check_open()
        names = list(dict.fromkeys(names))
        stored = self._steps.dtype.names
        for name in names:
            if name not in COLUMNS and name not in stored:
                raise KeyError(f"{name!r} is not a per-step field of this trace")
        start, stop = self._check_range(start, stop)
        with self._lock:
            self._check_open()
            n = self.num_steps
            # name -> (stored field, rows [lo, hi)): time_trace_write of step i is stored in row i+1.
            wanted = {name: ("time_trace_write_prev", min(start + 1, n), min(stop + 1, n))
                      if name == "time_trace_write" else (name, start, stop) for name in names}
            to_read: dict[str, tuple[int, int]] = {}  # stored field -> rows to read from the file
            for field, lo, hi in wanted.values():
                if _is_scalar(field):
                    cache = self._scalar_cache.get(field)
                    if cache is not None and hi <= len(cache):
                        continue
                    if lo <= (len(cache) if cache is not None else 0):
                        # Extend the cache (from row 0, or after refresh() with only the new rows).
                        lo = len(cache) if cache is not None else 0
                if field in to_read:
                    lo, hi = min(lo, to_read[field][0]), max(hi, to_read[field][1])
                to_read[field] = (lo, hi)
            fetched: dict[str, tuple[int, np.ndarray]] = {}  # stored field -> (first row, values)
            if to_read:
                read_lo = min(r[0] for r in to_read.values())
                read_hi = max(r[1] for r in to_read.values())
                rows = self._read_rows(list(to_read), read_lo, read_hi)
                for field, (lo, hi) in to_read.items():
                    values = rows[field][lo - read_lo:hi - read_lo]
                    if _is_scalar(field):
                        values = values.astype(np.int64 if values.dtype.kind in "iu" else np.float64)
                        cache = self._scalar_cache.get(field)
                        if cache is not None and lo == len(cache):
                            values, lo = np.concatenate([cache, values]), 0
                        if lo == 0:
                            values.flags.writeable = False
                            self._scalar_cache[field] = values
                    fetched[field] = (lo, values)
            out = {}
            for name, (field, lo, hi) in wanted.items():
                cache = self._scalar_cache.get(field)
                base, values = (0, cache) if cache is not None and hi <= len(cache) else fetched[field]
                out[name] = values[lo - base:hi - base]
            if "time_trace_write" in out:
                # The last step's write time is an attribute set by finish() (NaN before).
                shifted = out["time_trace_write"]
                if stop == n and stop > start:
                    shifted = np.append(shifted, float(self.metadata.get("time_trace_write_last", np.nan)))
                    shifted.flags.writeable = False
                out["time_trace_write"] = shifted
        return {name: out[name] for name in names}

    def _read_rows(self, names: list[str], start: int, stop: int) -> dict[str, np.ndarray]:
        """Stored fields ``names`` over rows [start, stop), read BLOCK_ROWS rows at a time."""
        dtype = self._steps.dtype
        out = {name: np.empty((stop - start,) + dtype[name].shape, dtype[name].base) for name in names}
        for lo in range(start, stop, BLOCK_ROWS):
            hi = min(lo + BLOCK_ROWS, stop)
            rows = self._read(self._steps, slice(lo, hi), names)
            for name in names:
                out[name][lo - start:hi - start] = rows[name]
        return out

    def _check_range(self, start: int, stop: Optional[int]) -> tuple[int, int]:
        n = self.num_steps
        start, stop = int(start), n if stop is None else int(stop)
        if not 0 <= start <= stop <= n:
            raise IndexError(f"steps [{start}, {stop}) out of range (trace has {n} steps)")
        return start, stop

    @property
    def prompt_tokens(self) -> np.ndarray:
        return self.metadata["prompt_tokens"]

    def vocabulary(self) -> Optional[list[bytes]]:
        """The raw bytes of every token id (traces of BPE models), or None (byte-level: id = byte)."""
        self._check_open()
        if "vocab_offsets" not in self._file:
            return None
        offsets = self._integers(self._dataset("vocab_offsets", ndim=1), "vocab_offsets")
        data = self._read(self._dataset("vocab_bytes", ndim=1), slice(None))
        if data.dtype != np.uint8:
            raise TraceError(f"{self.path}: dataset 'vocab_bytes' does not hold bytes")
        data = data.tobytes()
        if offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0 or np.any(np.diff(offsets) < 0) \
                or offsets[-1] != len(data):
            raise TraceError(f"{self.path}: vocab_offsets do not index vocab_bytes")
        return [data[a:b] for a, b in zip(offsets[:-1], offsets[1:])]

    @property
    def output_tokens(self) -> np.ndarray:
        """The output recorded by finish() (empty while recording), int64."""
        self._check_open()
        return self._integers(self._dataset("output_tokens", ndim=1), "output_tokens")

    @property
    def golden_tokens(self) -> np.ndarray:
        """The golden tokens recorded by finish() (empty while recording or when none), int64."""
        self._check_open()
        return self._integers(self._dataset("golden_tokens", ndim=1), "golden_tokens")

    def summary(self):
        """TraceSummary of the steps read so far (traces.summary)."""
        from kdspec.traces.summary import summarize_trace
        self._check_open()
        return summarize_trace(self)

    # -- lifetime -------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._file is None:
            raise TraceError(f"{self.path}: the trace was closed")

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


def open_hdf5(path: str) -> h5py.File:
    """The trace file opened read-only as the reader opens it (plainly, else in SWMR mode with bounded metadata
    retries); TraceError (one line) when it cannot be."""
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
        return _open_swmr(path)
    except (OSError, RuntimeError, ValueError, KeyError) as e:
        raise TraceError(f"{path}: cannot open as HDF5, damaged or truncated? ({_first_line(e)})") from None


# Metadata read attempts in SWMR read mode. HDF5 retries a metadata block whose checksum fails (it may be
# half-written by the live writer) 100 times by default, sleeping longer each time: minutes on a damaged
# file. A live writer rewrites a block in microseconds, so a few attempts suffice.
SWMR_READ_ATTEMPTS = 4


def _open_swmr(path: str) -> h5py.File:
    """``h5py.File(path, "r", libver="latest", swmr=True, locking=False)`` with at most SWMR_READ_ATTEMPTS
    reads of a metadata block (h5py does not expose H5Pset_metadata_read_attempts: it is called directly)."""
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_LATEST, h5py.h5f.LIBVER_LATEST)
    fapl.set_file_locking(False, True)
    set_attempts = _read_attempts_setter()
    if set_attempts is not None:
        with h5py._objects.phil:  # h5py's lock around every HDF5 call (its HDF5 is not thread-safe)
            set_attempts(fapl.id, SWMR_READ_ATTEMPTS)
    fid = h5py.h5f.open(os.fsencode(path), h5py.h5f.ACC_RDONLY | h5py.h5f.ACC_SWMR_READ, fapl=fapl)
    return h5py.File(fid)


@functools.lru_cache(maxsize=1)
def _read_attempts_setter():
    """HDF5's H5Pset_metadata_read_attempts, from the library h5py is linked with (found through h5py's own
    extension module), or None where it cannot be found (HDF5's default retries then)."""
    try:
        function = ctypes.CDLL(h5py.h5p.__file__).H5Pset_metadata_read_attempts
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int64, ctypes.c_uint]   # hid_t is 64-bit since HDF5 1.10
    function.restype = ctypes.c_int
    return function


def _is_scalar(field: str) -> bool:
    """A stored per-step scalar (cached by fields())."""
    return field in COLUMNS or field == "time_trace_write_prev"


def _attr_value(value: Any) -> Any:
    """Attribute value as a plain Python value (fixed-width byte strings decoded)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value.item() if isinstance(value, np.generic) else value


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
