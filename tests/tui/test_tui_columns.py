"""The app's column loading in pieces (first rows first, then the rest; a growing trace: only new rows) and
`kdtree bench tui` (kdtree_tui/bench.py) on a tiny trace. Expected values come from the synthetic
records (plain loops), never from the code under test."""
from __future__ import annotations

import numpy as np
import pytest
from test_tui_helpers import brute_flags, small_records, small_trace

from kdspec.engine.bench.synthetic import write_synthetic_trace
from kdspec.kdtree_tui import bench
from kdspec.kdtree_tui.session import TraceSession

FLAG_BITS = {"golden divergence": 1, "|dlogit| over threshold": 2, "tau below threshold": 4, "cache mismatch": 8}


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    return small_trace(tmp_path_factory.mktemp("columns"))


@pytest.fixture(scope="module")
def records():
    return small_records()


def check_columns(columns, records) -> None:
    rows = columns.rows
    np.testing.assert_array_equal(columns.columns["tau"], [len(r["accepted_nodes"]) for r in records[:rows]])
    np.testing.assert_array_equal(columns.columns["prefix_len"], [r["prefix_len"] for r in records[:rows]])
    for i, r in enumerate(records[:rows]):
        tau = len(r["accepted_nodes"])
        np.testing.assert_array_equal(columns.columns["committed_tokens"][i, :tau], r["committed_tokens"])
        assert (columns.columns["committed_tokens"][i, tau:] == -1).all()
    want = [sum(FLAG_BITS[n] for n in names) for names in brute_flags(records[:rows])]
    np.testing.assert_array_equal(columns.flags, want)


@pytest.mark.parametrize("stops", [(1,), (17, 64), (50, 51, 119), ()])
def test_columns_read_in_pieces_equal_the_records(trace, records, stops):
    session = TraceSession(trace)
    try:
        columns = None
        for stop in stops:
            columns = session.read_columns(columns, stop)
            assert columns.rows == stop and columns.num_steps == len(records)
            check_columns(columns, records)
        columns = session.read_columns(columns)
        assert columns.rows == len(records)
        check_columns(columns, records)
        session.install(columns)
        assert session.loaded and session.has_row(len(records) - 1) and not session.has_row(len(records))
    finally:
        session.close()


def test_partly_installed_session_shows_only_read_rows(trace, records):
    session = TraceSession(trace)
    try:
        session.install(session.read_columns(None, 30))
        assert not session.loaded and session.rows == 30 and session.num_steps == len(records)
        assert session.has_row(29) and not session.has_row(30)
        # Anomalies among the rows read so far only.
        flagged = [i for i, names in enumerate(brute_flags(records)) if names]
        assert session.next_flagged(0, 1) == next(i for i in flagged if i > 0)
        assert session.next_flagged(29, 1) is None
    finally:
        session.close()


def test_percentile_is_a_measured_value():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert bench._percentile(values, 50) == 3.0 and bench._percentile(values, 95) == 5.0
    assert bench._percentile(values, 20) == 1.0 and bench._percentile(values, 100) == 5.0


def test_rows_compare_against_the_targets():
    result = {"launch_to_first_paint_s": 0.7, "open_to_first_paint_s": 0.2, "imports_s": 0.4,
              "open_to_first_screen_s": 0.3, "open_to_columns_s": 2.0, "key_ms": [10.0] * 94 + [80.0] * 6,
              "max_rss_mb": 310.0}
    rows = {r["metric"]: r for r in bench.result_rows(result, 1000)}
    assert all(r["suite"] == "tui" for r in rows.values())
    assert rows["first paint (launch to first frame)"]["ok"] is True
    assert rows["key press to new step drawn, median"]["value"] == 10.0
    assert rows["key press to new step drawn, p95"]["value"] == 80.0
    assert rows["key press to new step drawn, p95"]["ok"] is False
    assert rows["peak resident memory"]["ok"] is False


def test_bench_child_runs_on_a_tiny_trace(tmp_path):
    path = bench.synthetic_trace(60, write_synthetic_trace, directory=str(tmp_path))
    assert bench.synthetic_trace(60, write_synthetic_trace, directory=str(tmp_path)) == path  # reused
    result = bench.measure_in_subprocess(path, keys=("j", "pagedown", "k", "n"))
    assert result["num_steps"] == 60 and len(result["key_ms"]) == 4
    assert all(0 < ms < 10_000 for ms in result["key_ms"])
    assert 0 < result["open_to_first_paint_s"] <= result["open_to_first_screen_s"]
    assert result["launch_to_first_paint_s"] > result["open_to_first_paint_s"]
    assert 20 < result["max_rss_mb"] < 10_000
    # j, PgDn (+10), k, then the next anomaly after step 10 (anomalies from the records, brute force).
    flagged = [i for i, names in enumerate(brute_flags(small_records(60))) if names]
    assert result["end_step"] == next(i for i in flagged if i > 10)
