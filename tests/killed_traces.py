"""A trace whose writer was SIGKILLed mid-run (still flagged open for writing: readable in SWMR mode only),
shared by the reliability tests of traces/ and the TUI's fuzz test."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

TRACES_TESTS = Path(__file__).resolve().parent / "traces"

KILLED_WRITER = """
import os, sys, time
sys.path[:0] = [sys.argv[2], os.path.dirname(sys.argv[2])]
from test_traces import make_run
from test_reliability import new_writer
records, output, golden = make_run(int(sys.argv[3]), int(sys.argv[4]), 8, 7, 7)
writer = new_writer(sys.argv[1])
for record in records:
    writer.write_step(record)
print("ready", flush=True)
time.sleep(600)
"""


def write_killed_trace(path: Path, seed: int, steps: int) -> Path:
    """``steps`` steps of a synthetic run written to ``path`` by a child process, which is then SIGKILLed."""
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(path), str(TRACES_TESTS), str(seed),
                             str(steps)], stdout=subprocess.PIPE, text=True, cwd=TRACES_TESTS.parents[1])
    try:
        assert proc.stdout.readline().strip() == "ready"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return path
