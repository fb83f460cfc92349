"""Probing a trace file in a child process before reading it.

A damaged HDF5 file can make libhdf5 loop forever, or crash, inside one call (a byte-flipped trace hung in reading
its first attribute's value), and h5py holds the interpreter's lock meanwhile: no thread, signal handler or
timeout of this process can stop it. ``probe(path)`` reads what opening a trace reads, every attribute value and
every dataset's header with its first and last element, in a forked child, and turns a hang or a crash there into
a one-line TraceError within PROBE_SECONDS. Errors the child meets are left for the real open to report.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import time

from kdspec.traces.schema import TraceError

PROBE_SECONDS = 5.0
_POLL_SECONDS = 0.002


def probe(path: str | os.PathLike, seconds: float | None = None) -> None:
    """Raise TraceError when reading ``path``'s headers hangs past ``seconds`` (default PROBE_SECONDS) or crashes
    the reader. A no-op where there is no fork (the open itself then runs unguarded)."""
    if not hasattr(os, "fork"):
        return
    seconds = PROBE_SECONDS if seconds is None else seconds
    path = os.fspath(path)
    pid = os.fork()
    if pid == 0:  # the child: read, then leave at once (no atexit handlers, no flushing of inherited buffers)
        faulthandler.disable()  # a crash here is the parent's one line, not a dump on the shared stderr
        try:
            _read_headers(path)
        except BaseException:  # noqa: BLE001 - whatever it is, the parent's real open reports it in one line
            pass
        os._exit(0)
    deadline = time.monotonic() + seconds
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise TraceError(f"{path}: damaged trace (HDF5 did not return within {seconds:g} s reading its headers)")
        time.sleep(_POLL_SECONDS)
    if os.WIFSIGNALED(status):
        raise TraceError(f"{path}: damaged trace (reading its headers crashed HDF5: signal {os.WTERMSIG(status)})")


def _read_headers(path: str) -> None:
    import h5py

    from kdspec.traces.reader import open_hdf5

    with open_hdf5(path) as f:  # as the reader opens it (SWMR with bounded retries for a live or killed one)
        for name in f.attrs:
            f.attrs[name]
        for name in f:
            node = f[name]
            if isinstance(node, h5py.Dataset) and node.shape and node.shape[0]:
                node[0]
                node[node.shape[0] - 1]
