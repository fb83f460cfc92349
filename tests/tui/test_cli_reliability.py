"""The `kdtree` command line under hostile conditions (issue 21): closed pipes, bad flags, damaged inputs.

Most cases call ``cli.main`` in-process (capsys); a few that need a real process (a closed pipe, signals) run
``python -m kdtree_tui``.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kdspec.kdtree_tui import cli
from kdspec.traces import open_trace

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}


def kdtree_to_closed_pipe(*args, timeout=60):
    """Run `kdtree ARGS` with stdout a pipe whose read end is already closed (as `| head` leaves it)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, "-m", "kdtree_tui", *args], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, env=ENV, cwd=ROOT, timeout=timeout)
    finally:
        os.close(write_end)


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory):
    out = tmp_path_factory.mktemp("reliability") / "tiny.h5"
    assert cli.main(["record", "--backend", "reference", "--max-new-tokens", "12", "--out", str(out)]) == 0
    return out


def test_a_closed_stdout_pipe_exits_quietly(small_trace):
    """`kdtree info --json T | head`, `kdtree config tiny | head`: no BrokenPipeError traceback, nothing on stderr."""
    for args in (["info", "--json", str(small_trace)], ["config", "tiny"], ["check", str(small_trace)], ["--help"]):
        result = kdtree_to_closed_pipe(*args)
        assert result.stderr == "", (args, result.stderr)
        # argparse itself ignores a failed write of --help (exit 0)
        assert result.returncode == (0 if args == ["--help"] else cli.BROKEN_PIPE_EXIT), (args, result.returncode)


# The child records through cli.main with each step's write slowed down and reported on stdout, so the test
# can signal it in the middle of the run.
SLOW_RECORD = """
import sys, time
from kdspec.kdtree_tui import cli
from kdspec.traces import open_trace
from kdspec.traces.writer import TraceWriter
write = TraceWriter.write_step
def slow_write(self, record):
    write(self, record)
    print(self.num_steps, flush=True)
    time.sleep(0.05)
TraceWriter.write_step = slow_write
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_and_sigterm_leave_an_interrupted_trace_with_every_step(tmp_path, signum, code):
    out = tmp_path / "killed.h5"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_RECORD, "record", "--backend", "reference", "--mode", "ar",
                             "--max-new-tokens", "200", "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    try:
        written = 0
        while written < 5:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            written = int(line)
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    written = max([written] + [int(x) for x in stdout.split() if x.isdigit()])
    assert proc.returncode == code, stderr
    assert stderr.strip() == "kdtree record: interrupted" and "Traceback" not in stderr
    with open_trace(out) as reader:
        assert reader.metadata["status"] == "interrupted"
        assert reader.num_steps == written and len(reader.metadata["end_time"]) == 32


# -- defect 4 -----------------------------------------------------------------------------------------------
def test_demo_does_not_overwrite_without_force(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_select_backend", lambda name: "reference")  # the simulator is slow here
    existing = tmp_path / "demo.h5"
    existing.write_bytes(b"keep me")
    assert cli.main(["demo", "--out", str(existing), "--no-tui", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert "exists" in err and "--force" in err and len(err.strip().splitlines()) == 1
    assert existing.read_bytes() == b"keep me"
    assert cli.main(["demo", "--out", str(existing), "--no-tui", "--max-new-tokens", "4", "--force"]) == 0
    with open_trace(existing) as reader:
        assert reader.is_complete


# -- defect 3 -----------------------------------------------------------------------------------------------
def test_a_second_record_to_the_same_path_is_refused_while_the_first_runs(tmp_path, capsys):
    out = tmp_path / "busy.h5"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_RECORD, "record", "--backend", "reference", "--mode", "ar",
                             "--max-new-tokens", "40", "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "1", proc.stderr.read()
        code = cli.main(["record", "--backend", "reference", "--out", str(out), "--force"])
        err = capsys.readouterr().err
        assert code == 2 and "another recording" in err and len(err.strip().splitlines()) == 1, err
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0
    with open_trace(out) as reader:   # the first run's trace, whole
        assert reader.is_complete and reader.metadata["mode"] == "ar" and len(reader.output_tokens) == 40
