"""The debugger on damaged but openable traces (issue 21, defect 8): one line and exit status 2 when it cannot go
on, an in-app message for one bad step, never a full-screen traceback; the exit status is the app's return code."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from test_tui_helpers import run_async, settle, small_trace

from kdspec.kdtree_tui.app import TraceApp, run_app
from kdspec.kdtree_tui.widgets.tree_panel import TreePanel

ROOT = Path(__file__).resolve().parents[2]
SIZE = (100, 30)


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    return small_trace(tmp_path_factory.mktemp("tui-reliability"), steps=12)


def damaged(trace, directory, how):
    path = directory / f"{how.replace(' ', '_')}.h5"
    shutil.copy(trace, path)
    with h5py.File(path, "r+") as f:
        if how in ("negative tau", "huge tau"):
            rows = f["steps"][...]
            rows["tau"][5] = -3 if how == "negative tau" else 10 ** 9
            f["steps"][...] = rows
        elif how == "model_config a list":
            f.attrs["model_config"] = json.dumps([1, 2])
        elif how in ("2-D tree tokens", "wrong width"):
            rows = f["steps"][...]
            names = rows.dtype.names
            width = 2 if how == "2-D tree tokens" else None
            fields = [(n, rows.dtype[n].base, ((rows.dtype[n].shape[0], 2) if width else (rows.dtype[n].shape[0] + 1,))
                       if n == "tree_tokens" else rows.dtype[n].shape) for n in names]
            new = np.zeros(rows.shape, np.dtype(fields))
            for n in names:
                if n != "tree_tokens":
                    new[n] = rows[n]
            del f["steps"]
            f.create_dataset("steps", data=new, maxshape=(None,), chunks=(1,))
    return str(path)


def run_headless(path, compare=None, timeout=60):
    """`run_app` in a child process, headless: (exit status, stderr)."""
    code = (f"import sys; from kdspec.kdtree_tui.app import run_app; "
            f"sys.exit(run_app({path!r}, compare={compare!r}, headless=True))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                            env={**os.environ, "NUMBA_ENABLE_CUDASIM": "1"})
    return result.returncode, result.stderr


@pytest.mark.parametrize("how", ["negative tau", "huge tau", "model_config a list", "2-D tree tokens", "wrong width"])
def test_a_damaged_trace_stops_with_one_line_and_exit_2(trace, tmp_path, how):
    code, err = run_headless(damaged(trace, tmp_path, how))
    assert code == 2, err
    assert err.startswith("kdtree tui: error: ") and err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("how", ["negative tau", "model_config a list"])
def test_a_damaged_compare_trace_stops_with_one_line_and_exit_2(trace, tmp_path, how):
    code, err = run_headless(trace, compare=damaged(trace, tmp_path, how))
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err


def test_an_exception_in_the_app_is_one_line_and_exit_2(trace, monkeypatch):
    def broken(self, *args, **kwargs):
        raise ValueError("a field the panel cannot draw")
    monkeypatch.setattr(TreePanel, "show", broken)

    @run_async
    async def body():
        app = TraceApp(trace)
        async with app.run_test(size=SIZE):
            pass   # the first step's record is drawn on mount: the panel raises there, and the app stops
        assert app.return_code == 2 and "cannot draw" in app.fatal and "\n" not in app.fatal
    body()


def test_the_exit_status_is_the_apps_return_code(trace):
    @run_async
    async def body():
        app = TraceApp(trace)
        async with app.run_test(size=SIZE) as pilot:
            await settle(app, pilot)
            await pilot.press("q")
        assert app.return_code == 0 and app.fatal is None
    body()
