"""A writer killed with SIGKILL loses at most the step in flight; a reader follows a live recording."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kdspec.traces import check, open_trace

from test_traces import make_run

TESTS = Path(__file__).resolve().parent
STEPS, SEED = 200, 11

# The child writes STEPS steps of make_run(SEED, ...) and prints the number flushed after each one.
WRITER = f"""
import sys, time
sys.path.insert(0, {str(TESTS)!r})
from test_traces import make_run, write_run
from test_traces import decode_config
from kdspec.traces import RunMetadata, TraceWriter
path, delay = sys.argv[1], float(sys.argv[2])
records, output, golden = make_run({SEED}, {STEPS}, 8, 7, 7)
writer = TraceWriter(path, RunMetadata(decode_config(8, 7, 7), {{"name": "tiny"}}, "reference", "cpu", [1, 2, 3, 4, 5]))
print(0, flush=True)
for record in records:
    writer.write_step(record)
    print(writer.num_steps, flush=True)
    time.sleep(delay)
writer.finish(output, golden)
print("done", flush=True)
"""


def start_writer(path, delay):
    return subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(delay)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=TESTS.parents[1])


def wait_for_count(proc, at_least, timeout=60.0):
    """Read the child's progress lines until it reports >= at_least flushed steps; return that count."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"writer exited early: {proc.stderr.read()}")
        if line.strip() != "done" and int(line) >= at_least:
            return int(line)
    raise AssertionError("writer too slow")


def test_sigkill_loses_at_most_the_step_in_flight(tmp_path):
    path = tmp_path / "killed.h5"
    proc = start_writer(path, delay=0.0)     # no sleep: the kill lands in the middle of a write most times
    try:
        flushed = wait_for_count(proc, 25)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    records, _, _ = make_run(SEED, STEPS, 8, 7, 7)
    with open_trace(path) as r:
        assert r.num_steps >= flushed and r.num_steps < STEPS
        assert not r.is_complete and r.metadata["status"] == "recording"
        for i in range(r.num_steps):
            step = r.step(i)
            np.testing.assert_array_equal(step.tree_tokens, records[i]["tree_tokens"])
            np.testing.assert_array_equal(step.committed_tokens, records[i]["committed_tokens"])
        assert r.summary().num_steps == r.num_steps
        assert check(r)[0] == 1     # unfinished


def test_reader_follows_a_live_recording(tmp_path):
    path = tmp_path / "live.h5"
    proc = start_writer(path, delay=0.01)
    try:
        wait_for_count(proc, 3)
        with open_trace(path) as r:
            first = r.num_steps
            assert first >= 3 and not r.is_complete
            seen = wait_for_count(proc, first + 5)
            assert r.refresh() >= seen > first
            assert r.num_steps >= seen
            r.step(r.num_steps - 1)
            assert np.isnan(r.column("time_trace_write")[-1])
            proc.stdout.read()       # until the writer finished
            assert proc.wait(timeout=60) == 0
            assert r.refresh() == STEPS
            assert r.is_complete
            assert check(r)[0] == 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
