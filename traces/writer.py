"""TraceWriter: records a run's metadata and one ``steps`` row per speculative step into an HDF5 file.

The whole schema is created before the first step, then the file switches to SWMR mode
(libver='latest', swmr_mode=True): a reader can follow the recording live, and after every step the file
is flushed, so a crash or SIGKILL loses at most the step in flight. Each step is one row of the
compound dataset ``steps`` in its own chunk, so a flushed step's bytes are never rewritten.

Nothing at the output path changes until the recording has a step: every argument is checked first, the
file is written as ``.NAME.recording-PID.h5`` beside it and renamed into place once the first step is
flushed (or at ``finish`` of a run without steps). A recording that fails before that removes its
temporary file, and a trace that was there stays.
"""
from __future__ import annotations

import datetime
import glob
import json
import math
import os
import platform
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import h5py
import numpy as np

from kdspec.traces.lock import OutputLock
from kdspec.traces.schema import (
    DERIVED_FIELDS,
    FIELDS_BY_NAME,
    FORMAT_NAME,
    LOGITS_KEYS,
    MODES,
    SCHEMA_VERSION,
    STAGES,
    TraceDims,
    TraceError,
)

COMPRESSIONS = ("gzip", "lzf", None)
# Free space the writer insists on: HDF5 fails in odd ways on a full disk (a RuntimeError, or a segfault with
# a few KB left), so the writer stops with a TraceError first. Before creating a file (the schema is small):
MIN_FREE_BYTES = 256 * 1024
# ... and before each write, beyond the bytes it writes (metadata, the chunk index, the status at close):
WRITE_RESERVE_BYTES = 128 * 1024
HDF5_ERRORS = (OSError, ValueError, RuntimeError)
GZIP_LEVEL = 1   # small chunks: level 1 is within a few % of level 4's size at a fraction of the time


def default_versions() -> dict[str, str]:
    """Versions of what the trace format itself depends on; the engine adds its own (numba, ...)."""
    return {"python": platform.python_version(), "numpy": np.__version__, "h5py": h5py.__version__,
            "hdf5": h5py.version.hdf5_version}


def _now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds")


@dataclass(frozen=True)
class RunMetadata:
    """What a trace records about its run (the root attributes of docs/trace-format.md).

    decode_config: the run's settings, a JSON-serialisable dict (the engine's resolved
        DecodeConfig.as_dict()); the writer takes mode, block_size (L+1), budget (B), topk (K) and seed from it.
        AR runs are one node per step: block_size 1, budget 0.
    model_config: the model's configuration (HF field names, plus ``name``); ``vocab_size`` V read from it.
    backend, device: e.g. "cuda", "NVIDIA H200". prompt_tokens: int [P0], the prompt ids.
    versions: package versions, merged over ``default_versions()``.
    tokenizer: "byte" (token id = byte) or "bpe"; vocabulary: the raw bytes of every token id 0..V-1 (a BPE
        model's), stored so that a viewer shows text with neither the tokenizer nor the model directory.
    drafter: what drafted, JSON-serialisable: ``name`` (e.g. "oracle", "noisy:0.7", "dflash:DIR") and, for a
        trained drafter, its ``config`` and the ``digest`` of its weights ({} for AR runs).
    golden_seconds: wall seconds the float64 golden took before the first step (NaN: no golden, or not timed).
    """

    decode_config: Mapping[str, Any]
    model_config: Mapping[str, Any]
    backend: str
    device: str
    prompt_tokens: Sequence[int]
    versions: Mapping[str, str] = field(default_factory=dict)
    tokenizer: str = "byte"
    vocabulary: Optional[Sequence[bytes]] = None
    drafter: Mapping[str, Any] = field(default_factory=dict)
    golden_seconds: float = math.nan


def _run_shape(path: str, decode_config: Mapping[str, Any]) -> tuple[str, int, TraceDims]:
    """(mode, seed, dims) from a decode_config; TraceError (one line) when a key is missing or wrong."""
    missing = [k for k in ("mode", "block_size", "budget", "topk", "seed") if k not in decode_config]
    if missing:
        raise TraceError(f"{path}: decode_config lacks {missing}")
    mode, block_size, budget = decode_config["mode"], decode_config["block_size"], decode_config["budget"]
    if mode not in MODES:
        raise TraceError(f"{path}: mode must be one of {MODES}, got {mode!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise TraceError(f"{path}: block_size must be an integer >= 1, got {block_size!r}")
    if mode == "ar" and (block_size != 1 or budget != 0):
        raise TraceError(f"{path}: an AR trace has block_size 1 and budget 0, got {block_size} and {budget}")
    try:
        dims = TraceDims(int(block_size) - 1, decode_config["topk"], budget)
    except TraceError as e:
        raise TraceError(f"{path}: {e}") from None
    return mode, decode_config["seed"], dims


def check_output(path: str, force: bool) -> None:
    """TraceError unless a trace can be written at ``path``: its directory exists, and nothing is there (or,
    with ``force``, a regular file, which the new trace replaces once it has a step)."""
    if os.path.lexists(path) and not force:
        raise TraceError(f"{path}: file exists (pass force=True to overwrite it)")
    if os.path.lexists(path) and not os.path.isfile(path):
        raise TraceError(f"{path}: not a regular file (a trace is written as a file and renamed into place)")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise TraceError(f"{path}: no such directory {directory}")


class TraceWriter:
    """Write a trace to ``path``; use as a context manager, call ``write_step`` per step, then ``finish``.

    Args:
        path: the .h5 file to create. An existing file is a TraceError unless ``force``.
        run: the run's metadata (RunMetadata); the decode_config gives the trace's widths.
        save_logits: also store float32 logits [steps, L+1, V] of the committed positions (small V only);
            every record must then carry ``logits`` [tau, V], and model_config its vocab_size. A record may
            also carry ``golden_logits`` [tau, V] (the golden's logits at the same positions, NaN where the
            golden does not reach), stored as float64 in ``golden_logits``; a step without it takes no space.
        compression: "gzip" (default), "lzf" or None.
        lock: the output's OutputLock when the caller took it already (the writer then owns it); by default
            the writer takes it. Either way it is held until close(): a second writer of ``path`` is refused.
    """

    def __init__(self, path: str | os.PathLike, run: RunMetadata, *, save_logits: bool = False,
                 compression: Optional[str] = "gzip", force: bool = False, lock: Optional[OutputLock] = None):
        self.path = os.fspath(path)
        self._file = None
        self._lock = lock
        try:
            mode, seed, self.dims = _run_shape(self.path, run.decode_config)
            vocab_size = run.model_config.get("vocab_size")
            if compression not in COMPRESSIONS:
                raise TraceError(f"{self.path}: compression must be one of {COMPRESSIONS}, got {compression!r}")
            if save_logits and (not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1):
                raise TraceError(f"{self.path}: save_logits needs model_config's vocab_size (a positive integer), "
                                 f"got {vocab_size!r}")
            self.save_logits = bool(save_logits)
            self.vocab_size = int(vocab_size) if isinstance(vocab_size, (int, np.integer)) else -1
            self._compression = compression
            prepared = self._prepare(mode, seed, run)   # every check before the output is touched
            self._check_target(force)
            if self._lock is None:
                self._lock = OutputLock(self.path)
            self._check_target(force)  # again, now that no other recorder can make it
        except BaseException:
            self._release_lock()
            raise
        self._force = force
        directory, name = os.path.split(os.path.abspath(self.path))
        self._temp_path = os.path.join(directory, f".{name}.recording-{os.getpid()}.h5")
        self._in_place = False
        self.num_steps = 0
        self._row = self.dims.blank_row()
        self._blank = self._row.copy()
        self._fields = self.dims.fields()
        self._expected_keys = {f.name for f in self._fields} - set(DERIVED_FIELDS)
        # Not every run measures every stage (AR has no draft/build) or has a golden cache: NaN then.
        self._optional_keys = {"cache_max_abs_diff"} | {f"time_{s}" for s in STAGES}
        if not self.dims.has_draft:
            self._optional_keys |= {"draft_ids", "draft_logprobs"}
        self._last_write_time = math.nan
        try:
            self._remove_stale_temporaries()
            self._check_free_space(MIN_FREE_BYTES + prepared["size"], "create the trace")
            self._create_file(prepared)
        except BaseException:
            self._remove_temporary()
            self._release_lock()
            raise

    def _check_target(self, force: bool) -> None:
        check_output(self.path, force)

    def _prepare(self, mode: str, seed: int, run: RunMetadata) -> dict:
        """The file's contents that do not depend on the steps, checked: attributes, prompt, vocabulary."""
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2 ** 64:
            raise TraceError(f"{self.path}: seed must be an integer in 0..2^64-1, got {seed!r}")
        try:
            model_json = json.dumps(dict(run.model_config), sort_keys=True)
            decode_json = json.dumps(dict(run.decode_config), sort_keys=True)
            versions_json = json.dumps({**default_versions(), **dict(run.versions or {})}, sort_keys=True)
            drafter_json = json.dumps(dict(run.drafter or {}), sort_keys=True)
            golden_seconds = float(run.golden_seconds)
        except (TypeError, ValueError, RecursionError) as e:
            raise TraceError(f"{self.path}: metadata is not JSON-serialisable ({_first_line(e)})") from None
        d = self.dims
        # Every attribute exists before SWMR mode (no attribute may be created after it); finish() only
        # modifies values.
        attrs = {"format": FORMAT_NAME, "schema_version": SCHEMA_VERSION, "status": _fixed("recording"),
                 "mode": mode, "backend": str(run.backend), "device": str(run.device), "seed": int(seed),
                 "start_time": _now_iso(), "end_time": _fixed(""), "model_config": model_json,
                 "decode_config": decode_json, "versions": versions_json,
                 "block_size": d.num_depths + 1, "num_depths": d.num_depths, "budget": d.budget,
                 "draft_topk": d.draft_topk, "target_topk": d.target_topk, "vocab_size": self.vocab_size,
                 "save_logits": self.save_logits, "compression": str(self._compression),
                 "time_trace_write_last": math.nan, "tokenizer": str(run.tokenizer), "drafter": drafter_json,
                 "time_golden": golden_seconds}
        prompt = _int32_tokens(self.path, "prompt_tokens", run.prompt_tokens)
        vocabulary = None
        if run.vocabulary is not None:
            try:
                pieces = [bytes(piece) for piece in run.vocabulary]
            except (TypeError, ValueError) as e:
                raise TraceError(f"{self.path}: vocabulary must be a sequence of bytes ({_first_line(e)})") from None
            offsets = np.zeros(len(pieces) + 1, dtype="<i8")
            offsets[1:] = np.cumsum([len(piece) for piece in pieces])
            vocabulary = (offsets, np.frombuffer(b"".join(pieces), dtype=np.uint8))
        size = prompt.nbytes + (0 if vocabulary is None else vocabulary[0].nbytes + vocabulary[1].nbytes) + \
            sum(len(str(v)) for v in attrs.values())
        return {"attrs": attrs, "prompt": prompt, "vocabulary": vocabulary, "size": size}

    def _check_free_space(self, needed: int, what: str) -> None:
        """TraceError unless the output's file system has ``needed`` bytes free (statvfs; unknown: no check)."""
        try:
            stat = os.statvfs(os.path.dirname(self._temp_path))
        except (OSError, AttributeError):
            return
        free = stat.f_bavail * stat.f_frsize
        if free < needed:
            raise TraceError(f"{self.path}: only {free // 1024} KB free on its file system, {-(-needed // 1024)} KB "
                             f"needed to {what}")

    def _create_file(self, prepared: dict) -> None:
        try:
            # we hold the lock: a temporary file of this name is a dead recording's of the same pid
            self._file = h5py.File(self._temp_path, "w", libver="latest")
        except (OSError, ValueError, RuntimeError) as e:
            raise TraceError(f"{self.path}: cannot create trace file ({_first_line(e)})") from None
        try:
            self._create_schema(prepared)
            self._file.swmr_mode = True
            self._file.flush()
        except (OSError, ValueError, TypeError, RuntimeError) as e:
            self._file.close()
            self._file = None
            raise TraceError(f"{self.path}: cannot create the trace schema ({_first_line(e)})") from None

    def _place(self) -> None:
        """Rename the temporary file into place (its first step is flushed; the old trace goes now)."""
        if self._in_place:
            return
        try:
            self._check_target(self._force)
            fd = os.open(self._temp_path, os.O_RDONLY)
            try:
                os.fsync(fd)  # the steps reach the disk before the rename drops the old trace
            finally:
                os.close(fd)
            os.replace(self._temp_path, self.path)
        except OSError as e:
            raise TraceError(f"{self.path}: cannot put the trace in place ({e.strerror or _first_line(e)})") from None
        self._in_place = True
        self._lock.set_state("recording")

    def _remove_temporary(self) -> None:
        if not self._in_place:
            try:
                os.unlink(self._temp_path)
            except OSError:
                pass

    def _remove_stale_temporaries(self) -> None:
        """Temporary files of this output left by killed recorders (they hold no step: a step renames them)."""
        directory = os.path.dirname(self._temp_path)
        stem = f".{os.path.basename(self.path)}.recording-"
        for stale in glob.glob(os.path.join(glob.escape(directory), glob.escape(stem) + "*.h5")):
            try:
                os.unlink(stale)
            except OSError:
                pass

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _create_schema(self, prepared: dict) -> None:
        f, d, compression = self._file, self.dims, self._compression
        for key, value in prepared["attrs"].items():
            f.attrs[key] = value
        f.create_dataset("prompt_tokens", data=prepared["prompt"], dtype="<i4")
        if prepared["vocabulary"] is not None:
            self._write_vocabulary(*prepared["vocabulary"])
        # One row per chunk: a flush writes only the new step's chunk, never an earlier one again.
        self._steps = f.create_dataset("steps", shape=(0,), maxshape=(None,), dtype=d.row_dtype(),
                                       chunks=(1,), compression=compression,
                                       compression_opts=GZIP_LEVEL if compression == "gzip" else None)
        self._logits = self._golden_logits = None
        if self.save_logits:
            # golden_logits: a step whose record has none writes no chunk (it reads as the fill value, NaN)
            self._logits, self._golden_logits = (
                f.create_dataset(name, shape=(0, d.path_width, self.vocab_size),
                                 maxshape=(None, d.path_width, self.vocab_size), dtype=dtype,
                                 chunks=(1, d.path_width, self.vocab_size), compression=compression,
                                 compression_opts=GZIP_LEVEL if compression == "gzip" else None, fillvalue=np.nan)
                for name, dtype in (("logits", "<f4"), ("golden_logits", "<f8")))
        for name in ("output_tokens", "golden_tokens"):
            f.create_dataset(name, shape=(0,), maxshape=(None,), dtype="<i4", chunks=(1024,))

    def _write_vocabulary(self, offsets: np.ndarray, data: np.ndarray) -> None:
        """Token id i's bytes are vocab_bytes[vocab_offsets[i]:vocab_offsets[i + 1]] (flat: no vlen types)."""
        compression = self._compression
        self._file.create_dataset("vocab_offsets", data=offsets, compression=compression)
        # HDF5 cannot compress an empty dataset (a vocabulary of empty tokens only)
        self._file.create_dataset("vocab_bytes", data=data, dtype="u1", compression=compression if len(data) else None)

    # -- per step -----------------------------------------------------------------------------------
    def write_step(self, record: Mapping[str, Any]) -> None:
        """Append one step record (the fields of docs/trace-format.md) and flush it to disk.

        Variable-length fields are padded: node fields to B+1, path fields to L+1. ``num_nodes`` and
        ``tau`` are taken from the lengths of tree_tokens and accepted_nodes (if the record also has
        them they must agree). Raises TraceError on a missing/unknown field or a bad length.
        """
        start = time.perf_counter()
        if self._file is None:
            raise TraceError(f"{self.path}: write_step after the trace was closed")
        row = self._row
        row[...] = self._blank
        self._fill_row(row, record)
        index = self.num_steps
        row["time_trace_write_prev"] = self._last_write_time
        step_bytes = row.nbytes + (0 if self._logits is None else self._logits_value.nbytes) + \
            (0 if self._golden_value is None else self._golden_value.nbytes)
        self._check_free_space(WRITE_RESERVE_BYTES + step_bytes, f"write step {index}")
        try:
            self._append_chunk(self._steps, index, row)
            if self._logits is not None:
                self._append_padded(self._logits, index, self._logits_value, "<f4")
                if self._golden_value is None:  # no chunk: the step reads as NaN (not measured)
                    self._golden_logits.id.set_extent((index + 1, self.dims.path_width, self.vocab_size))
                else:
                    self._append_padded(self._golden_logits, index, self._golden_value, "<f8")
            self._file.flush()
        except HDF5_ERRORS as e:
            raise TraceError(f"{self.path}: writing step {index} failed ({_first_line(e)})") from None
        self._place()
        self.num_steps = index + 1
        self._last_write_time = time.perf_counter() - start

    def _append_padded(self, dataset: h5py.Dataset, index: int, value: np.ndarray, dtype: str) -> None:
        """Store ``value`` [tau, V] as step ``index`` of a [S, L+1, V] dataset, NaN past tau."""
        padded = np.full((self.dims.path_width, self.vocab_size), np.nan, dtype=dtype)
        padded[:len(value)] = value
        self._append_chunk(dataset, index, padded)

    def _append_chunk(self, dataset: h5py.Dataset, index: int, value: np.ndarray) -> None:
        """Grow ``dataset`` to index+1 steps and store ``value`` (one step, the dataset's exact dtype) as
        chunk ``index``. gzip and uncompressed chunks are written directly (zlib here, no HDF5 type
        conversion or filter pipeline): ~20-60 us a step instead of ~200 us through H5Dwrite."""
        # The row shape comes from the value, not dataset.shape: h5py asks HDF5 for the dataspace on every
        # .shape, which costs ~0.7 ms a step on a file in SWMR write mode (most of a step's write time).
        row_shape = np.shape(value) if dataset.dtype.names is None else ()
        dataset.id.set_extent((index + 1,) + row_shape)
        if self._compression == "lzf":   # no Python lzf compressor: HDF5's pipeline does it (~150 us)
            file_space = dataset.id.get_space()
            file_space.select_hyperslab((index,) + (0,) * len(row_shape), (1,) + row_shape)
            memory = np.ascontiguousarray(value).reshape((1,) + row_shape)
            dataset.id.write(h5py.h5s.create_simple(memory.shape), file_space, memory, dataset.id.get_type())
            return
        data = np.ascontiguousarray(value).tobytes()
        if self._compression == "gzip":  # HDF5's deflate filter stores zlib streams
            data = zlib.compress(data, GZIP_LEVEL)
        dataset.id.write_direct_chunk((index,) + (0,) * len(row_shape), data, 0)

    def _fill_row(self, row: np.ndarray, record: Mapping[str, Any]) -> None:
        keys = set(record)
        missing = self._expected_keys - self._optional_keys - keys
        if missing:
            raise TraceError(f"{self.path}: step {self.num_steps} record lacks {sorted(missing)}")
        unknown = keys - self._expected_keys - {"num_nodes", "tau"} - set(LOGITS_KEYS)
        if unknown:
            raise TraceError(f"{self.path}: step {self.num_steps} record has unknown fields {sorted(unknown)}")
        num_nodes = np.shape(record["tree_tokens"])[0] if np.ndim(record["tree_tokens"]) == 1 else -1
        tau = np.shape(record["accepted_nodes"])[0] if np.ndim(record["accepted_nodes"]) == 1 else -1
        d = self.dims
        if not 1 <= num_nodes <= d.node_width:
            raise TraceError(f"{self.path}: step {self.num_steps}: tree_tokens must be [N+1] with "
                             f"1 <= N+1 <= {d.node_width} (budget + 1), got shape {np.shape(record['tree_tokens'])}")
        if not 1 <= tau <= min(d.path_width, num_nodes):
            raise TraceError(f"{self.path}: step {self.num_steps}: accepted_nodes must be [tau] with 1 <= tau <= "
                             f"min(block_size, N+1) = {min(d.path_width, num_nodes)}, got shape {np.shape(record['accepted_nodes'])}")
        for name, length in (("num_nodes", num_nodes), ("tau", tau)):
            if name in record and int(record[name]) != length:
                raise TraceError(f"{self.path}: step {self.num_steps}: {name}={record[name]} disagrees with "
                                 f"the array lengths ({length})")
        row["num_nodes"] = num_nodes
        row["tau"] = tau
        lengths = {"node": (num_nodes,), "path": (tau,), "topk": (num_nodes, d.target_topk),
                   "draft": (d.num_depths, d.draft_topk), "scalar": ()}
        for name in keys & self._expected_keys:
            field = FIELDS_BY_NAME[name]
            value = np.asarray(record[name])
            want = lengths[field.kind]
            if field.kind == "draft" and not d.has_draft:
                if value.size:
                    raise TraceError(f"{self.path}: step {self.num_steps}: {name} must be empty in a trace "
                                     f"with L*K == 0, got shape {value.shape}")
                continue
            if value.shape != want:
                raise TraceError(f"{self.path}: step {self.num_steps}: {name} must have shape {list(want)}, "
                                 f"got {list(value.shape)}")
            problem = _unstorable(value, field.dtype)
            if problem:
                raise TraceError(f"{self.path}: step {self.num_steps}: {name} {problem}")
            if field.kind == "scalar":
                row[name] = value
            else:
                row[name][0][tuple(slice(0, n) for n in want)] = value
        self._tau = tau
        self._golden_value = None
        if self.save_logits:
            logits = np.asarray(record.get("logits"), dtype=np.float32) if "logits" in record else None
            if logits is None or logits.shape != (tau, self.vocab_size):
                got = None if logits is None else list(logits.shape)
                raise TraceError(f"{self.path}: step {self.num_steps}: save_logits needs logits [tau, V] = "
                                 f"{[tau, self.vocab_size]}, got {got}")
            self._logits_value = logits
            if record.get("golden_logits") is not None:
                golden = np.asarray(record["golden_logits"])
                if golden.shape != (tau, self.vocab_size):
                    raise TraceError(f"{self.path}: step {self.num_steps}: golden_logits must have shape [tau, V] = "
                                     f"{[tau, self.vocab_size]}, got {list(golden.shape)}")
                problem = _unstorable(golden, "<f8")
                if problem:
                    raise TraceError(f"{self.path}: step {self.num_steps}: golden_logits {problem}")
                self._golden_value = golden.astype(np.float64)

    # -- end of run ---------------------------------------------------------------------------------
    def finish(self, output_tokens: Sequence[int], golden_tokens: Optional[Sequence[int]] = None) -> None:
        """Record completion: output and golden tokens, end time, status "complete"; then close the file.

        The status says "complete" only once the tokens have been flushed: a finish that fails (a full disk)
        raises TraceError and leaves the trace "recording" (close it with a status, e.g. "failed")."""
        if self._file is None:
            raise TraceError(f"{self.path}: finish after the trace was closed")
        tokens = {name: _int32_tokens(self.path, name, values) for name, values in
                  (("output_tokens", output_tokens), ("golden_tokens", golden_tokens)) if values is not None}
        self._check_free_space(WRITE_RESERVE_BYTES + sum(v.nbytes for v in tokens.values()), "finish the trace")
        try:
            for name, values in tokens.items():
                dataset = self._file[name]
                dataset.resize(values.shape)
                dataset[...] = values
            self._file.attrs.modify("time_trace_write_last", self._last_write_time)
            self._file.flush()
        except HDF5_ERRORS as e:
            raise TraceError(f"{self.path}: finishing the trace failed ({_first_line(e)})") from None
        try:
            self._file.attrs.modify("end_time", _fixed(_now_iso()))
            self._file.attrs.modify("status", _fixed("complete"))
            self._file.flush()
        except HDF5_ERRORS as e:
            self._mark("failed")  # what close() writes out must not say "complete"
            raise TraceError(f"{self.path}: finishing the trace failed ({_first_line(e)})") from None
        self._place()  # a run without steps
        self.close()

    def _mark(self, status: str) -> None:
        """Set status and end_time in the file, as far as HDF5 still can (a failing disk: best effort)."""
        try:
            self._file.attrs.modify("status", _fixed(status))
            self._file.attrs.modify("end_time", _fixed(_now_iso()))
        except HDF5_ERRORS:
            pass

    def close(self, status: Optional[str] = None) -> None:
        """Close without finishing; the status stays "recording" unless given (e.g. "interrupted"). A
        recording without a step in place is dropped: its temporary file goes, what was at the path stays.
        TraceError when HDF5 cannot close the file (the writer is closed all the same)."""
        if self._file is None:
            return
        try:
            if status is not None and self._in_place:
                self._mark(status)
            self._file.close()
        except HDF5_ERRORS as e:
            raise TraceError(f"{self.path}: closing the trace failed ({_first_line(e)})") from None
        finally:
            self._file = None
            self._remove_temporary()
            self._release_lock()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close("interrupted" if exc_type is not None else None)
        except TraceError:
            if exc_type is None:
                raise   # else the exception in flight says more than the failed close


def _fixed(text: str) -> np.ndarray:
    """A fixed-width (32-byte) string for the attributes finish() changes in SWMR mode: a variable-length
    string lives in the global heap, which a live SWMR reader may hold stale ("bad heap pointer")."""
    if len(text.encode()) > 32:
        raise TraceError(f"attribute value {text!r} is longer than 32 bytes")
    # a 0-d S32 array, not its scalar: h5py stores a numpy bytes scalar at its own length (S9 for "recording")
    return np.array(text.encode(), dtype="S32")


def _unstorable(value: np.ndarray, dtype: str) -> str:
    """Why ``value`` cannot be stored as ``dtype`` without changing it ("" when it can): integer fields take
    integers within the dtype's range (numpy would wrap them silently), float fields numbers."""
    kind = np.dtype(dtype).kind
    if kind == "i":
        if value.dtype.kind not in "iu":
            return f"must hold integers, got {value.dtype}"
        limits = np.iinfo(dtype)
        if value.size and (int(value.min()) < limits.min or int(value.max()) > limits.max):
            return f"holds values outside {np.dtype(dtype).name} ({int(value.min())}..{int(value.max())})"
    elif value.dtype.kind not in "fiu":
        return f"must hold numbers, got {value.dtype}"
    return ""


def _int32_tokens(path: str, name: str, tokens: Sequence[int]) -> np.ndarray:
    """Token ids as int32 [n]; TraceError when they are not integers of int32 range."""
    try:
        values = np.asarray(tokens).reshape(-1)
    except (TypeError, ValueError, OverflowError) as e:
        raise TraceError(f"{path}: {name} must be token ids ({_first_line(e)})") from None
    if values.size == 0:
        return np.zeros(0, np.int32)
    problem = _unstorable(values, "<i4")
    if problem:
        raise TraceError(f"{path}: {name} {problem}")
    return values.astype(np.int32)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
