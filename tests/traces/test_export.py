"""traces.export: JSON lines and CSV load with the standard library and equal the records written; the Perfetto
JSON is valid trace-event format (ph, ts, dur, pid, tid; ts monotone per track; stage slices inside their step)."""
from __future__ import annotations

import csv
import io
import json
import math

import numpy as np
import pytest
from test_traces import make_run, write_run

from kdspec.traces import open_trace
from kdspec.traces.export import FORMATS, export
from kdspec.traces.schema import STAGES

SCALARS = ("prefix_len", "root_token", "num_nodes", "tau", "bonus_token", "cache_len_before", "cache_len_verify",
           "cache_len_after", "cache_max_abs_diff") + tuple(f"time_{s}" for s in STAGES)
PATHS = ("accepted_nodes", "committed_tokens", "golden_tokens", "logit_max_abs_diff")


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    records, output, golden = make_run(4, 15, block_size=4, budget=6, draft_topk=3)
    records[3]["time_draft"] = float("nan")  # a stage not measured: no slice, an empty cell / null
    path = tmp_path_factory.mktemp("export") / "run.h5"
    write_run(path, records, output, golden, block_size=4, budget=6, draft_topk=3)
    return path, records


def run_export(path, fmt, nodes=False):
    out = io.StringIO()
    with open_trace(path) as reader:
        count = export(reader, fmt, out, nodes=nodes)
    return out.getvalue(), count


def same(got, want) -> bool:
    """A cell against a recorded value: equal ints; floats equal at the value's own precision; NaN as None."""
    if isinstance(want, (float, np.floating)) and math.isnan(want):
        return got is None
    if isinstance(want, np.float32):
        return np.float32(got) == want
    return got == want


def test_jsonl_steps_equal_the_records(trace):
    path, records = trace
    text, count = run_export(path, "jsonl")
    rows = [json.loads(line) for line in text.splitlines()]
    assert count == len(rows) == len(records)
    for i, (row, record) in enumerate(zip(rows, records)):
        assert row["step"] == i and row["num_nodes"] == len(record["tree_tokens"])
        assert row["tau"] == len(record["accepted_nodes"])
        for name in SCALARS:
            if name in record:
                assert same(row[name], record[name]), (i, name)
        for name in PATHS:
            assert len(row[name]) == row["tau"]
            assert all(same(g, w) for g, w in zip(row[name], np.asarray(record[name]))), (i, name)
    assert rows[3]["time_draft"] is None


def test_csv_steps_load_with_the_standard_library(trace):
    path, records = trace
    text, count = run_export(path, "csv")
    rows = list(csv.DictReader(io.StringIO(text)))
    assert count == len(rows) == len(records)
    for row, record in zip(rows, records):
        assert int(row["tau"]) == len(record["accepted_nodes"])
        assert [int(t) for t in row["committed_tokens"].split()] == record["committed_tokens"].tolist()
        assert float(row["time_verify"]) == record["time_verify"]
        assert np.float32(float(row["cache_max_abs_diff"])) == np.float32(record["cache_max_abs_diff"])
    assert rows[3]["time_draft"] == ""


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_node_rows_equal_the_tree_fields(trace, fmt):
    path, records = trace
    text, count = run_export(path, fmt, nodes=True)
    rows = ([json.loads(line) for line in text.splitlines()] if fmt == "jsonl"
            else list(csv.DictReader(io.StringIO(text))))
    assert count == len(rows) == sum(len(r["tree_tokens"]) for r in records)
    expected = []
    for i, r in enumerate(records):
        accepted = set(r["accepted_nodes"].tolist())
        for j in range(len(r["tree_tokens"])):
            depth, rank = int(r["tree_depths"][j]), int(r["tree_ranks"][j])
            expected.append((i, j, r["prefix_len"] + depth, int(r["tree_tokens"][j]), int(r["tree_parents"][j]),
                             depth, rank, r["tree_scores"][j], r["draft_logprobs"][depth - 1, rank] if depth else None,
                             int(r["target_choice"][j]), j in accepted))
    for row, (i, j, position, token, parent, depth, rank, score, lp, choice, accepted) in zip(rows, expected):
        assert [int(row[k]) for k in ("step", "node", "position", "token", "parent", "depth", "rank",
                                      "target_choice")] == [i, j, position, token, parent, depth, rank, choice]
        assert np.float32(float(row["score"])) == score
        assert (row["logprob"] in (None, "")) if lp is None else np.float32(float(row["logprob"])) == lp
        assert row["accepted"] in ((True, "1") if accepted else (False, "0"))


def test_perfetto_is_valid_trace_event_json(trace):
    path, records = trace
    text, count = run_export(path, "perfetto")
    data = json.loads(text)
    events = data["traceEvents"]
    assert count == len(events)
    slices = [e for e in events if e["ph"] == "X"]
    assert all(e["ph"] in ("X", "M") for e in events)
    for e in slices:
        assert {"ph", "ts", "dur", "pid", "tid", "name"} <= set(e)
        assert e["dur"] >= 0 and math.isfinite(e["ts"])
    last = {}
    for e in slices:  # timestamps never decrease along a track
        track = (e["pid"], e["tid"])
        assert e["ts"] >= last.get(track, -1.0)
        last[track] = e["ts"]
    steps = [e for e in slices if e["cat"] == "step"]
    assert len(steps) == len(records)
    for i, (step, record) in enumerate(zip(steps, records)):
        stages = [e for e in slices if e["cat"] == "stage" and e["args"]["step"] == i]
        want = [(s, record[f"time_{s}"] * 1e6) for s in STAGES if not math.isnan(record[f"time_{s}"])]
        assert [e["name"] for e in stages] == [s for s, _ in want]
        assert [e["dur"] for e in stages] == pytest.approx([d for _, d in want])
        assert step["dur"] == pytest.approx(sum(d for _, d in want))
        assert stages[0]["ts"] == step["ts"] and stages[-1]["ts"] + stages[-1]["dur"] <= step["ts"] + step["dur"] + 1e-6
        assert step["args"]["tau"] == len(record["accepted_nodes"])
    writes = [e for e in slices if e["tid"] == 2]
    assert len(writes) == len(records)  # a finished trace knows every step's write time
    for a, b in zip(writes, writes[1:]):  # the writer's slices do not overlap
        assert a["ts"] + a["dur"] <= b["ts"] + 1e-6


def test_unknown_format_is_refused(trace):
    with pytest.raises(ValueError, match="format"):
        run_export(trace[0], "parquet")
    assert FORMATS == ("jsonl", "csv", "perfetto")


def test_kdtree_export_command(trace, tmp_path, capsys):
    from kdspec.kdtree_tui.cli import main

    path, records = trace
    out = tmp_path / "nodes.csv"
    assert main(["export", str(path), "--format", "csv", "--nodes", "--out", str(out)]) == 0
    with open(out, newline="") as f:
        assert len(list(csv.DictReader(f))) == sum(len(r["tree_tokens"]) for r in records)
    capsys.readouterr()
    assert main(["export", str(path)]) == 0  # jsonl on stdout
    assert [json.loads(line)["tau"] for line in capsys.readouterr().out.splitlines()] == \
        [len(r["accepted_nodes"]) for r in records]
    assert main(["export", str(path), "--format", "perfetto", "--out", str(tmp_path / "p.json")]) == 0
    assert json.loads((tmp_path / "p.json").read_text())["traceEvents"]
    assert main(["export", str(path), "--format", "perfetto", "--nodes"]) == 2
    assert main(["export", str(path), "--out", str(tmp_path / "missing" / "x.jsonl")]) == 2
    assert "cannot write" in capsys.readouterr().err
