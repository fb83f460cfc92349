"""traces.probe: a file on which HDF5 itself hangs (a byte-flipped trace the fuzz test found: libhdf5 loops in
reading its first attribute's value, holding the interpreter's lock) or crashes is one line, exit 2, within
seconds, from every command that reads a trace; healthy traces pass the probe untouched."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kdspec.kdtree_tui import cli
from kdspec.traces import TraceError, open_trace
from kdspec.traces import probe as probe_module
from kdspec.traces.probe import probe

from test_traces import make_run, write_run

HANGS = Path(__file__).parent / "data" / "hdf5-hangs-reading-an-attribute.h5"
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the probe forks")


def test_the_file_really_hangs_hdf5():
    """The reproducer itself: plain h5py on it does not return (a child process, killed after 3 s)."""
    code = "import h5py; f = h5py.File(sys.argv[1], 'r'); f.attrs['format']; print('returned')"
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", "import sys; " + code, str(HANGS)], capture_output=True, timeout=3)


def test_probe_turns_the_hang_into_one_line_within_its_limit():
    start = time.monotonic()
    with pytest.raises(TraceError, match="did not return within 1 s") as e:
        probe(HANGS, seconds=1.0)
    assert time.monotonic() - start < 3 and "\n" not in str(e.value)


def test_probe_turns_a_crash_into_one_line(tmp_path, monkeypatch):
    records, output, golden = make_run(1, 3, 4, 3, 3)
    path = tmp_path / "t.h5"
    write_run(path, records, output, golden, block_size=4, budget=3, draft_topk=3)
    monkeypatch.setattr(probe_module, "_read_headers", lambda p: os.kill(os.getpid(), signal.SIGSEGV))
    with pytest.raises(TraceError, match="crashed HDF5: signal 11"):
        probe(path)


def test_healthy_traces_pass(tmp_path):
    records, output, golden = make_run(2, 20, 8, 7, 7)
    path = tmp_path / "t.h5"
    write_run(path, records, output, golden, block_size=8, budget=7, draft_topk=7)
    probe(path)
    probe(tmp_path / "missing.h5")   # errors are for the real open to report
    with open_trace(path) as reader:
        assert reader.num_steps == 20


@pytest.mark.parametrize("argv", [["info"], ["info", "--json"], ["check"], ["export", "--format", "csv"],
                                  ["tui"]])
def test_every_command_reading_a_trace_is_one_line_on_it(capsys, monkeypatch, argv):
    monkeypatch.setattr(probe_module, "PROBE_SECONDS", 1.0)
    start = time.monotonic()
    code = cli.main(argv[:1] + [str(HANGS)] + argv[1:])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "did not return within 1 s" in err[0], err
    assert time.monotonic() - start < 5


def test_the_real_command_in_a_child_process():
    result = subprocess.run([sys.executable, "-m", "kdtree_tui", "check", str(HANGS)], capture_output=True,
                            text=True, timeout=30, cwd=ROOT, env={**os.environ, "NUMBA_ENABLE_CUDASIM": "1"})
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "did not return" in result.stderr
