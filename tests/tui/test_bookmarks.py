"""Bookmarks persist in a side file (kdtree_tui/bookmarks.py), never in the trace: beside it, or under
$XDG_STATE_HOME/kdtree/ when its directory is not writable; written atomically at each toggle, loaded when the app
opens the trace; a damaged or foreign side file is a message in the app, never a stop. The trace's bytes and
modification time never change."""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
from kdspec.kdtree_tui import bookmarks
from kdspec.kdtree_tui.app import TraceApp
from kdspec.kdtree_tui.bookmarks import BookmarkFile
from kdspec.kdtree_tui.screens import HelpScreen
from kdspec.traces import open_trace
from test_tui_helpers import run_async, settle, small_trace


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return small_trace(tmp_path_factory.mktemp("marks-source"), steps=40)


@pytest.fixture
def trace(source, tmp_path, monkeypatch):
    """A fresh copy of the trace in its own directory; XDG_STATE_HOME points into the test's directory."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    (tmp_path / "traces").mkdir()
    path = tmp_path / "traces" / "run.h5"
    shutil.copyfile(source, path)
    os.utime(path, (1_000_000_000, 1_000_000_000))
    return path


def fingerprint(path) -> tuple:
    return hashlib.sha256(path.read_bytes()).hexdigest(), os.stat(path).st_mtime_ns


def start_time(path) -> str:
    with open_trace(path) as reader:
        return reader.metadata["start_time"]


async def toggle(app, pilot, *steps) -> None:
    for step in steps:
        app.go_to(step)
        await settle(app, pilot)
        await pilot.press("b")
        await settle(app, pilot)


@run_async
async def test_bookmarks_persist_beside_the_trace_and_the_trace_never_changes(trace):
    before = fingerprint(trace)
    side = trace.parent / "run.h5.bookmarks.json"
    app = TraceApp(str(trace))
    async with app.run_test(size=(100, 30)) as pilot:
        await settle(app, pilot)
        assert app.session.bookmarks == set() and not side.exists()
        await toggle(app, pilot, 5, 30, 12)
        assert json.loads(side.read_text()) == {"format": "kdtree-bookmarks", "version": 1, "trace": "run.h5",
                                                "recording": start_time(trace), "steps": [5, 12, 30]}
        await toggle(app, pilot, 12)  # off again
        assert json.loads(side.read_text())["steps"] == [5, 30]
    assert sorted(os.listdir(trace.parent)) == ["run.h5", "run.h5.bookmarks.json"], "no temporary file is left"
    app = TraceApp(str(trace))
    async with app.run_test(size=(100, 30)) as pilot:
        await settle(app, pilot)
        assert app.session.bookmarks == {5, 30} and app.message == ""
        app.go_to(30)
        await settle(app, pilot)
        assert "bookmarked" in app.status_text.plain
        await pilot.press("home", "B")
        await settle(app, pilot)
        assert app.cursor == 5
        await pilot.press("question_mark")
        await settle(app, pilot)
        assert isinstance(app.screen, HelpScreen) and app.screen.bookmark_path == str(side)
    assert fingerprint(trace) == before, "the trace was written"


DAMAGED = {
    "not json": b"{steps: [1, 2",
    "not utf-8": b"\xff\xfe\x00garbage",
    "another format": json.dumps({"format": "something-else", "steps": [1]}).encode(),
    "steps not numbers": json.dumps({"format": "kdtree-bookmarks", "version": 1, "steps": ["3", -1]}).encode(),
    "newer version": json.dumps({"format": "kdtree-bookmarks", "version": 99, "steps": [1]}).encode(),
    "deep nesting": b"[" * 100_000 + b"]" * 100_000,
}


@pytest.mark.parametrize("content", list(DAMAGED), ids=list(DAMAGED))
@run_async
async def test_a_damaged_side_file_is_a_message_and_is_kept_aside(trace, content):
    before = fingerprint(trace)
    side = trace.parent / "run.h5.bookmarks.json"
    side.write_bytes(DAMAGED[content])
    app = TraceApp(str(trace))
    async with app.run_test(size=(100, 30)) as pilot:
        await settle(app, pilot)
        assert "bookmarks not loaded" in app.status_text.plain and str(side) in app.status_text.plain
        assert app.session.bookmarks == set()
        await pilot.press("j", "j")
        await settle(app, pilot)
        assert app.cursor == 2 and app.return_code is None, "the app goes on"
        await pilot.press("b")
        await settle(app, pilot)
        assert app.session.bookmarks == {2}
    assert json.loads(side.read_text())["steps"] == [2]
    assert (trace.parent / "run.h5.bookmarks.json.unusable").read_bytes() == DAMAGED[content]
    assert fingerprint(trace) == before


@run_async
async def test_bookmarks_of_another_recording_at_the_path_are_not_loaded(trace):
    side = trace.parent / "run.h5.bookmarks.json"
    side.write_text(json.dumps({"format": "kdtree-bookmarks", "version": 1, "trace": "run.h5",
                                "recording": "2001-01-01T00:00:00+00:00", "steps": [3, 4]}))
    app = TraceApp(str(trace))
    async with app.run_test(size=(100, 30)) as pilot:
        await settle(app, pilot)
        assert app.session.bookmarks == set() and "another recording" in app.status_text.plain


@run_async
async def test_an_unwritable_directory_keeps_bookmarks_under_xdg_state_home(trace, tmp_path, monkeypatch):
    traces_dir = str(trace.parent)
    real = bookmarks._writable
    monkeypatch.setattr(bookmarks, "_writable", lambda d: False if d == traces_dir else real(d))
    before = fingerprint(trace)
    app = TraceApp(str(trace))
    async with app.run_test(size=(100, 30)) as pilot:
        await settle(app, pilot)
        await toggle(app, pilot, 7)
    stored = list((tmp_path / "state" / "kdtree" / "bookmarks").iterdir())
    assert len(stored) == 1 and stored[0].name.startswith("run.h5-") and stored[0].suffix == ".json"
    assert json.loads(stored[0].read_text())["steps"] == [7]
    assert os.listdir(traces_dir) == ["run.h5"]
    # another trace of the same name elsewhere gets a file of its own
    assert bookmarks.state_path(str(tmp_path / "elsewhere" / "run.h5")) != str(stored[0])
    app = TraceApp(str(trace))
    async with app.run_test(size=(100, 30)) as pilot:
        await settle(app, pilot)
        assert app.session.bookmarks == {7}
    assert fingerprint(trace) == before


def test_a_failed_write_beside_the_trace_falls_back_to_the_state_directory(trace, tmp_path, monkeypatch):
    real = bookmarks._write_atomic
    beside = str(trace) + ".bookmarks.json"

    def refuse_beside(path, document):
        if path == beside:
            raise PermissionError(13, "Permission denied", path)
        real(path, document)

    monkeypatch.setattr(bookmarks, "_write_atomic", refuse_beside)
    marks = BookmarkFile(str(trace), "t0")
    assert marks.path == beside
    saved, message = marks.save({4, 1})
    assert saved and "Permission denied" in message and marks.path.startswith(str(tmp_path / "state"))
    with open(marks.path) as f:
        assert json.load(f)["steps"] == [1, 4]
    assert not os.path.exists(beside)


@run_async
async def test_a_bookmark_that_cannot_be_saved_is_a_message(trace, monkeypatch):
    def refuse(path, document):
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr(bookmarks, "_write_atomic", refuse)
    app = TraceApp(str(trace))
    async with app.run_test(size=(100, 30)) as pilot:
        await settle(app, pilot)
        await toggle(app, pilot, 3)
        assert app.session.bookmarks == {3}, "the bookmark holds for this session"
        assert "bookmarks not saved" in app.status_text.plain and "No space left" in app.status_text.plain
        await pilot.press("j")
        await settle(app, pilot)
        assert app.cursor == 4
