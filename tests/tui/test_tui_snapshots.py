"""SVG snapshots of the main screens at 100x30, and of the tree, logits (a --save-logits trace) and help views at
120x40 and 80x24 (pytest-textual-snapshot; update with --snapshot-update).

The traces are synthetic and seeded; the only measured numbers in a trace (its own write times) are
zeroed by StableReader, so the screens are byte-for-byte reproducible.
"""
from __future__ import annotations

import pytest
from test_tui_helpers import logits_trace, settle, small_trace, stable_opener

from kdspec.kdtree_tui.app import TraceApp

SIZE = (100, 30)
SIZES = pytest.mark.parametrize("size", [(120, 40), (80, 24)], ids=["120x40", "80x24"])


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    directory = tmp_path_factory.mktemp("snap")
    return (small_trace(directory, "budget16.h5", steps=80),
            small_trace(directory, "budget4.h5", steps=80, budget=4, seed=3))


@pytest.fixture(scope="module")
def more_traces(tmp_path_factory):
    directory = tmp_path_factory.mktemp("snap-more")
    return {"deep": small_trace(directory, "deep.h5", steps=30, block_size=16, budget=40),
            "logits": logits_trace(directory, steps=12)[0]}


def make_run_before(*keys, step=None, bookmark_path=None):
    async def run_before(pilot):
        app = pilot.app
        if bookmark_path is not None:  # the help names it: a fixed one, not the test's temporary directory
            app.bookmark_file.path = bookmark_path
        await settle(app, pilot)
        if step is not None:
            app.go_to(step)
            await settle(app, pilot)
        if keys:
            await pilot.press(*keys)
            await settle(app, pilot)
    return run_before


def test_snapshot_tree_view(snap_compare, traces):
    app = TraceApp(traces[0], opener=stable_opener)
    assert snap_compare(app, terminal_size=SIZE, run_before=make_run_before(step=7))


def test_snapshot_logits_view(snap_compare, traces):
    app = TraceApp(traces[0], opener=stable_opener)
    assert snap_compare(app, terminal_size=SIZE, run_before=make_run_before("2", step=7))


def test_snapshot_run_view(snap_compare, traces):
    app = TraceApp(traces[0], opener=stable_opener)
    assert snap_compare(app, terminal_size=SIZE, run_before=make_run_before("4", step=20))


def test_snapshot_compare_view(snap_compare, traces):
    app = TraceApp(traces[0], compare=traces[1], opener=stable_opener)
    assert snap_compare(app, terminal_size=SIZE, run_before=make_run_before("5", step=10))


def test_snapshot_light_theme_cache_view(snap_compare, traces):
    app = TraceApp(traces[0], opener=stable_opener)
    assert snap_compare(app, terminal_size=SIZE, run_before=make_run_before("3", "d", step=21))


@SIZES
def test_snapshot_tree_view_sizes(snap_compare, traces, size):
    app = TraceApp(traces[0], opener=stable_opener)
    assert snap_compare(app, terminal_size=size, run_before=make_run_before(step=7))


@SIZES
def test_snapshot_deep_tree_view(snap_compare, more_traces, size):
    app = TraceApp(more_traces["deep"], opener=stable_opener)
    assert snap_compare(app, terminal_size=size, run_before=make_run_before(step=2))


@SIZES
def test_snapshot_logits_view_sizes(snap_compare, traces, size):
    app = TraceApp(traces[0], opener=stable_opener)
    assert snap_compare(app, terminal_size=size, run_before=make_run_before("2", step=7))


@SIZES
def test_snapshot_saved_logits_view(snap_compare, more_traces, size):
    app = TraceApp(more_traces["logits"], opener=stable_opener)
    assert snap_compare(app, terminal_size=size, run_before=make_run_before("2", step=1))


@SIZES
def test_snapshot_help(snap_compare, traces, size):
    app = TraceApp(traces[0], opener=stable_opener)
    assert snap_compare(app, terminal_size=size,
                        run_before=make_run_before("question_mark", bookmark_path="/traces/budget16.h5.bookmarks.json"))
