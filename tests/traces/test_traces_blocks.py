"""TraceReader's bulk reads: column() / field() / fields(names, start, stop) read in blocks, cache the
per-step scalars and, after the step count grows, read only the new rows. Expected values come from the
records written (make_run) and from step(i), which reads one whole row by another path."""
from __future__ import annotations

import math

import numpy as np
import pytest

import kdspec.traces.reader as reader_module
from kdspec.traces import open_trace
from kdspec.traces.schema import COLUMNS, STAGES

from test_traces import make_run, write_run

NUM_STEPS = 61
ARRAY_FIELDS = ("committed_tokens", "golden_tokens", "logit_max_abs_diff", "tree_tokens", "target_topk_logits",
                "draft_ids", "accepted_nodes")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("blocks") / "run.h5"
    records, output, golden = make_run(3, NUM_STEPS, block_size=5, budget=9, draft_topk=3)
    write_run(path, records, output, golden, block_size=5, budget=9, draft_topk=3)
    return str(path), records


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Blocks of 7 rows, so every range below crosses block boundaries (61 = 8 * 7 + 5)."""
    monkeypatch.setattr(reader_module, "BLOCK_ROWS", 7)


def expected_column(records, name: str) -> np.ndarray:
    """A per-step scalar column straight from the records (time_trace_write is not in them)."""
    return np.array([r[name] for r in records], dtype=np.float64)


def padded(records, name: str, width: int, pad) -> np.ndarray:
    """A path field [S, width] from the records, padded as the format documents."""
    out = np.full((len(records), width), pad, dtype=np.float64)
    for i, r in enumerate(records):
        values = np.asarray(r[name], np.float64)
        out[i, :len(values)] = values
    return out


def test_fields_equal_step_rows_at_random_steps(run):
    path, records = run
    with open_trace(path) as r:
        names = list(COLUMNS) + list(ARRAY_FIELDS)
        values = r.fields(names)
        assert list(values) == names
        for name in COLUMNS:
            assert values[name].shape == (NUM_STEPS,)
            assert values[name].dtype in (np.int64, np.float64), name
        for i in np.random.default_rng(0).integers(0, NUM_STEPS, 15).tolist() + [0, NUM_STEPS - 1]:
            step = r.step(i)
            for name in COLUMNS:
                want = getattr(step, name)
                got = values[name][i]
                assert (math.isnan(want) and math.isnan(got)) or got == want, (name, i)
            for name in ARRAY_FIELDS:
                row = values[name][i]
                mine = np.asarray(getattr(step, name))
                # step() trims node fields to N+1 and path fields to tau; the rest is padding.
                np.testing.assert_array_equal(row[:len(mine)], mine, err_msg=f"{name} step {i}")
                rest = row[len(mine):]
                assert (np.isnan(rest).all() if rest.dtype.kind == "f" else (rest == -1).all()), (name, i)


def test_columns_and_fields_equal_the_records(run):
    path, records = run
    with open_trace(path) as r:
        for name in ("prefix_len", "root_token", "bonus_token", "cache_max_abs_diff",
                     *(f"time_{s}" for s in STAGES)):
            np.testing.assert_allclose(r.column(name), expected_column(records, name), rtol=1e-7, err_msg=name)
        np.testing.assert_array_equal(r.column("tau"), [len(x["accepted_nodes"]) for x in records])
        np.testing.assert_array_equal(r.column("num_nodes"), [len(x["tree_tokens"]) for x in records])
        np.testing.assert_array_equal(r.field("committed_tokens"), padded(records, "committed_tokens", 5, -1))
        np.testing.assert_array_equal(r.field("logit_max_abs_diff"),
                                      padded(records, "logit_max_abs_diff", 5, np.nan).astype(np.float32))
        assert r.field("tau").dtype == np.int32  # field() keeps the stored dtype, column() widens
        # time_trace_write of step i is stored in row i+1; the last one is the attribute finish() set.
        shifted = r.field("time_trace_write_prev")
        times = r.column("time_trace_write")
        np.testing.assert_array_equal(times[:-1], shifted[1:])
        assert times[-1] == r.metadata["time_trace_write_last"] and np.isfinite(times).all()


@pytest.mark.parametrize("start,stop", [(0, 0), (0, 1), (0, 7), (3, 10), (6, 8), (13, 61), (60, 61), (61, 61),
                                        (5, None)])
def test_partial_ranges_equal_slices_of_the_records(run, start, stop):
    path, records = run
    end = NUM_STEPS if stop is None else stop
    names = ["tau", "prefix_len", "time_trace_write", "committed_tokens", "tree_parents"]
    with open_trace(path) as r:
        full_times = r.fields(["time_trace_write"])["time_trace_write"]
    with open_trace(path) as r:  # a fresh reader: nothing cached
        values = r.fields(names, start, stop)
        np.testing.assert_array_equal(values["tau"], [len(x["accepted_nodes"]) for x in records[start:end]])
        np.testing.assert_array_equal(values["prefix_len"], [x["prefix_len"] for x in records[start:end]])
        np.testing.assert_array_equal(values["committed_tokens"], padded(records, "committed_tokens", 5, -1)[start:end])
        np.testing.assert_array_equal(values["tree_parents"], padded(records, "tree_parents", 10, -1)[start:end])
        np.testing.assert_array_equal(values["time_trace_write"], full_times[start:end])
        for name in names:
            assert len(values[name]) == end - start
        # The same ranges again, now partly or fully from the cache.
        r.column("tau")
        np.testing.assert_array_equal(r.column("tau", start, stop), values["tau"])
        np.testing.assert_array_equal(r.column("time_trace_write", start, stop), values["time_trace_write"])


def test_bad_names_and_ranges_are_one_line_errors(run):
    path, _ = run
    with open_trace(path) as r:
        with pytest.raises(KeyError, match="not a per-step field"):
            r.fields(["tau", "no_such_field"])
        with pytest.raises(KeyError, match="not a per-step scalar column"):
            r.column("tree_tokens")
        for start, stop in ((-1, 3), (5, 4), (0, NUM_STEPS + 1)):
            with pytest.raises(IndexError, match=r"out of range \(trace has 61 steps\)"):
                r.fields(["tau"], start, stop)


def test_reads_stay_within_blocks_and_cached_columns_are_not_read_again(run, monkeypatch):
    path, records = run
    selections = []
    with open_trace(path) as r:
        read = r._read

        def counting_read(dataset, selection, name=None):
            selections.append((selection, name))
            return read(dataset, selection, name)

        monkeypatch.setattr(r, "_read", counting_read)
        r.fields(["tau", "committed_tokens", "time_verify"])
        rows = [s.stop - s.start for s, _ in selections]
        assert sum(rows) == NUM_STEPS and max(rows) <= 7, rows  # one pass, blocks of at most BLOCK_ROWS
        selections.clear()
        tau = r.column("tau")
        assert selections == [] and not tau.flags.writeable  # cached, read-only
        r.fields(["tau", "time_verify", "time_trace_write"])
        # Only time_trace_write_prev is new: one more pass, reading only that field.
        assert {tuple(name) for _, name in selections} == {("time_trace_write_prev",)}


def test_more_steps_read_only_the_new_rows(run, monkeypatch):
    """As after refresh() on a growing trace: the step count rises, cached columns extend by the new rows."""
    path, records = run
    with open_trace(path) as r:
        r.num_steps = 20
        first = r.fields(["tau", "prefix_len", "committed_tokens"])
        assert len(first["tau"]) == 20
        ranges = []
        read_rows = r._read_rows

        def recording(names, start, stop):
            ranges.append((tuple(names), start, stop))
            return read_rows(names, start, stop)

        monkeypatch.setattr(r, "_read_rows", recording)
        r.num_steps = NUM_STEPS
        tau, prefix = r.column("tau"), r.column("prefix_len")
        assert ranges == [(("tau",), 20, NUM_STEPS), (("prefix_len",), 20, NUM_STEPS)]
        np.testing.assert_array_equal(tau, [len(x["accepted_nodes"]) for x in records])
        np.testing.assert_array_equal(prefix, [x["prefix_len"] for x in records])
        ranges.clear()
        tail = r.fields(["tau", "committed_tokens"], 20)   # path fields are not cached: only [20, 61)
        assert ranges == [(("committed_tokens",), 20, NUM_STEPS)]
        np.testing.assert_array_equal(tail["committed_tokens"], padded(records, "committed_tokens", 5, -1)[20:])


def test_summary_reads_one_pass(run, monkeypatch):
    path, records = run
    with open_trace(path) as r:
        calls = []
        read_rows = r._read_rows
        monkeypatch.setattr(r, "_read_rows", lambda names, a, b: calls.append(b - a) or read_rows(names, a, b))
        summary = r.summary()
        assert calls == [NUM_STEPS]
        assert summary.mean_tau == pytest.approx(np.mean([len(x["accepted_nodes"]) for x in records]))
