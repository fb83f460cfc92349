"""Bookmarks of a trace in a side file, never in the trace (no Textual).

Where: ``TRACE.bookmarks.json`` beside the trace when its directory is writable (or that file is there already);
otherwise ``$XDG_STATE_HOME/kdtree/bookmarks/NAME-HASH.json`` (``~/.local/state`` when XDG_STATE_HOME is unset;
HASH from the trace's absolute path, so two traces of one name do not share a file). A save that cannot write
beside the trace falls back to the state directory. Written atomically (a temporary file in the same directory,
fsync, os.replace) at every toggle. The file names the recording (the trace's start_time): bookmarks of an
earlier recording at the same path are not loaded. A file that cannot be used is reported (one line, for the app
to show), never raised, and is kept as FILE.unusable when the next bookmark replaces it.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile

FORMAT = "kdtree-bookmarks"
VERSION = 1
SUFFIX = ".bookmarks.json"
MAX_BYTES = 16 << 20  # a bookmarks file is a list of step numbers: anything bigger is not one


def beside_path(trace_path: str) -> str:
    return os.path.abspath(trace_path) + SUFFIX


def state_path(trace_path: str) -> str:
    """The file under $XDG_STATE_HOME/kdtree/bookmarks/ for a trace whose directory is not writable."""
    trace_path = os.path.abspath(trace_path)
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    digest = hashlib.sha256(trace_path.encode("utf-8", "surrogateescape")).hexdigest()[:12]
    return os.path.join(base, "kdtree", "bookmarks", f"{os.path.basename(trace_path)}-{digest}.json")


def _writable(directory: str) -> bool:
    return os.access(directory, os.W_OK | os.X_OK)


class BookmarkFile:
    """The side file of one trace. ``path``: where the bookmarks are read from and written to."""

    def __init__(self, trace_path: str, recording: str = ""):
        self.trace_path = os.path.abspath(trace_path)
        self.recording = str(recording)   # the trace's start_time: which recording the bookmarks are of
        beside, state = beside_path(trace_path), state_path(trace_path)
        if os.path.lexists(beside) or (not os.path.lexists(state) and _writable(os.path.dirname(beside))):
            self.path = beside
        else:
            self.path = state
        self._unusable = False   # the file there could not be used: keep it aside before replacing it

    def load(self) -> tuple[set[int], str]:
        """(bookmarked steps, "" or a one-line message why the file was not used)."""
        if not os.path.lexists(self.path):
            return set(), ""
        try:
            if os.path.getsize(self.path) > MAX_BYTES:
                raise ValueError(f"larger than {MAX_BYTES >> 20} MB")
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
            steps = self._steps(data)
        except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:
            self._unusable = True
            return set(), f"bookmarks not loaded: {self.path}: {_one_line(e)} (kept aside when you next set one)"
        if data.get("recording", "") != self.recording:
            self._unusable = True
            return set(), (f"bookmarks not loaded: {self.path} is of another recording of this path (started "
                           f"{data.get('recording') or 'unknown'}; kept aside when you next set one)")
        return steps, ""

    @staticmethod
    def _steps(data) -> set[int]:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} file")
        if data.get("version") != VERSION:
            raise ValueError(f"version {data.get('version')!r}, this kdtree reads {VERSION}")
        steps = data.get("steps")
        if not isinstance(steps, list) or not all(type(s) is int and s >= 0 for s in steps):
            raise ValueError("'steps' is not a list of step numbers")
        return set(steps)

    def save(self, steps) -> tuple[bool, str]:
        """Write ``steps``: (saved, "" or a one-line message: what failed, or where the file went instead)."""
        document = {"format": FORMAT, "version": VERSION, "trace": os.path.basename(self.trace_path),
                    "recording": self.recording, "steps": sorted(int(s) for s in steps)}
        note = ""
        if self._unusable and os.path.lexists(self.path):
            try:
                os.replace(self.path, self.path + ".unusable")
                note = f"; the file that was there is now {self.path}.unusable"
            except OSError as e:
                return False, f"bookmarks not saved: cannot move {self.path} aside ({_one_line(e)})"
        self._unusable = False
        try:
            _write_atomic(self.path, document)
            return True, f"bookmarks saved{note}" if note else ""
        except OSError as e:
            first_error = e
        fallback = state_path(self.trace_path)
        if self.path != fallback:
            try:
                _write_atomic(fallback, document)
                self.path = fallback
                return True, f"bookmarks saved to {fallback} (cannot write beside the trace: {_one_line(first_error)})"
            except OSError:
                pass
        return False, f"bookmarks not saved: {self.path}: {_one_line(first_error)}"


def _write_atomic(path: str, document: dict) -> None:
    """``document`` as JSON at ``path``: a temporary file in the same directory, fsync, then os.replace."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(document, f)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise


def _one_line(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
