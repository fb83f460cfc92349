"""The `kdtree` command line under hostile conditions (issue 21): closed pipes, bad flags, damaged inputs.

Most cases call ``cli.main`` in-process (capsys); a few that need a real process (a closed pipe, signals) run
``python -m kdtree_tui``.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kdspec.kdtree_tui import cli

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
