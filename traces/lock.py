"""One recording per output path: an exclusive lock file beside the trace, held for the whole recording.

``OutputLock(path)`` takes ``PATH.lock`` (fcntl.flock, never blocking: a second recorder of the same path gets
a one-line TraceError at once) and writes "PID STATE" into it: "starting" until the first step is in
place at PATH, then "recording". ``recording_state(path)`` tells a follower what a live recorder of PATH is
doing (None when none is); readers never take the lock, so a viewer never blocks a recorder. The file is
removed when the lock is released; one left behind by a killed recorder names a dead process and is
ignored (and taken over by the next recorder).
"""
from __future__ import annotations

import fcntl
import os
from typing import Optional

from kdspec.traces.schema import TraceError

LOCK_SUFFIX = ".lock"
STATES = ("starting", "recording")


def lock_path(path: str | os.PathLike) -> str:
    """The lock file of trace ``path``: PATH.lock, in the same directory."""
    return os.fspath(path) + LOCK_SUFFIX


class OutputLock:
    """The exclusive right to record ``path`` (acquired by the constructor; ``release()`` gives it back)."""

    def __init__(self, path: str | os.PathLike):
        self.target = os.fspath(path)
        self.path = lock_path(path)
        self._fd: Optional[int] = None
        while self._fd is None:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as e:
                raise TraceError(f"{self.target}: cannot create the lock file {self.path} "
                                 f"({e.strerror or type(e).__name__})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if isinstance(e, BlockingIOError):
                    raise TraceError(f"{self.target}: another recording is writing this trace "
                                     f"({_describe(self.path)}holds {self.path})") from None
                raise TraceError(f"{self.target}: cannot lock {self.path} ({e.strerror or type(e).__name__})") from None
            # The previous holder removes the file as it lets go: a lock on a file no longer at the path
            # guards nothing, so open it again.
            if _same_file(fd, self.path):
                self._fd = fd
            else:
                os.close(fd)
        self.set_state("starting")

    def set_state(self, state: str) -> None:
        """Record what the recorder is doing ("starting" | "recording") for followers."""
        if self._fd is None:
            return
        data = f"{os.getpid()} {state}\n".encode()
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, data, 0)
        except OSError:  # a full disk: followers then see no state and simply open the trace
            pass

    def release(self) -> None:
        """Remove the lock file and let go (idempotent)."""
        if self._fd is None:
            return
        try:
            if _same_file(self._fd, self.path):
                os.unlink(self.path)
        except OSError:
            pass
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "OutputLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def recording_state(path: str | os.PathLike) -> Optional[str]:
    """What a live recorder of trace ``path`` is doing: "starting" (no step in place yet), "recording", or
    None (no recorder alive). Reads the lock file only; never locks."""
    try:
        with open(lock_path(path), "rb") as f:
            words = f.read(64).decode("ascii", "replace").split()
    except OSError:
        return None
    if len(words) != 2 or not words[0].isdigit() or words[1] not in STATES:
        return None
    return words[1] if _alive(int(words[0])) else None


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, but is another user's
        return True
    except (OverflowError, ValueError):  # not a process id at all
        return False
    return pid > 0


def _describe(path: str) -> str:
    """'process PID ' of a lock file's holder, when it says."""
    try:
        with open(path, "rb") as f:
            words = f.read(64).split()
        return f"process {int(words[0])} " if words else ""
    except (OSError, ValueError):
        return ""
