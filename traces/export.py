"""`kdtree export`: a trace as rows for pandas / polars (JSON lines or CSV, one row per step or per node) and as a
Chrome / Perfetto trace-event JSON of the stage timings (ui.perfetto.dev and chrome://tracing open it).

Rows: per step, the step index, every per-step scalar (traces/schema.py) and the path fields cut to tau; per
node, the node's tree fields, its drafter log-prob and whether it was accepted. In CSV a list is its items
joined by spaces and NaN an empty cell; in JSON lines NaN is null. The file is read in blocks of steps.
"""
from __future__ import annotations

import csv
import json
import math
from typing import IO, Iterator

import numpy as np

from kdspec.traces.schema import COLUMNS, STAGES

FORMATS = ("jsonl", "csv", "perfetto")
BLOCK_STEPS = 4096
PATH_FIELDS = ("accepted_nodes", "committed_tokens", "golden_tokens", "logit_max_abs_diff")
NODE_FIELDS = ("prefix_len", "num_nodes", "accepted_nodes", "tau", "tree_tokens", "tree_parents", "tree_depths",
               "tree_ranks", "tree_scores", "target_choice", "target_margin")
NODE_COLUMNS = ("step", "node", "position", "token", "parent", "depth", "rank", "score", "logprob",
                "target_choice", "target_margin", "accepted")
STEP_COLUMNS = ("step",) + COLUMNS + PATH_FIELDS


def _value(x):
    """numpy scalars as Python numbers (a float32 as its shortest decimal, which reads back to the same float32);
    NaN as None."""
    if isinstance(x, (np.integer, np.bool_)):
        return x.item()
    if isinstance(x, np.float32):
        x = float(str(x))
    x = float(x) if isinstance(x, np.floating) else x
    return None if isinstance(x, float) and math.isnan(x) else x


def step_rows(reader, block: int = BLOCK_STEPS) -> Iterator[dict]:
    """One dict per step, keys STEP_COLUMNS; the path fields as lists of their first tau entries."""
    n = reader.num_steps
    for lo in range(0, n, block):
        v = reader.fields(COLUMNS + PATH_FIELDS, lo, min(lo + block, n))
        for i in range(len(v["tau"])):
            tau = int(v["tau"][i])
            row = {"step": lo + i, **{c: _value(v[c][i]) for c in COLUMNS}}
            row.update({f: [_value(x) for x in v[f][i][:tau]] for f in PATH_FIELDS})
            yield row


def node_rows(reader, block: int = BLOCK_STEPS) -> Iterator[dict]:
    """One dict per tree node of every step, keys NODE_COLUMNS (logprob: the drafter's at the node's depth and
    rank, None at the root; accepted: on the accepted path)."""
    n, has_draft = reader.num_steps, reader.dims.has_draft
    names = NODE_FIELDS + (("draft_logprobs",) if has_draft else ())
    for lo in range(0, n, block):
        v = reader.fields(names, lo, min(lo + block, n))
        for i in range(len(v["tau"])):
            nodes, prefix = int(v["num_nodes"][i]), int(v["prefix_len"][i])
            accepted = set(v["accepted_nodes"][i][:int(v["tau"][i])].tolist())
            for j in range(nodes):
                depth, rank = int(v["tree_depths"][i][j]), int(v["tree_ranks"][i][j])
                lp = v["draft_logprobs"][i][depth - 1, rank] if has_draft and depth > 0 else None
                yield {"step": lo + i, "node": j, "position": prefix + depth, "token": int(v["tree_tokens"][i][j]),
                       "parent": int(v["tree_parents"][i][j]), "depth": depth, "rank": rank,
                       "score": _value(v["tree_scores"][i][j]), "logprob": _value(lp),
                       "target_choice": int(v["target_choice"][i][j]),
                       "target_margin": _value(v["target_margin"][i][j]), "accepted": j in accepted}


def perfetto_events(reader, block: int = BLOCK_STEPS) -> Iterator[dict]:
    """Trace events: process 1 the run; thread 1 one "step N" slice per step with its stages back to back inside
    it (the trace holds durations, not start times, so steps are laid end to end); thread 2 the trace writer,
    each step's write placed after that step (the engine overlaps it with the next step's forward). ts and dur
    in microseconds; per thread, ts never decreases and slices never overlap except nested in their step."""
    model = (reader.metadata.get("model_config") or {}).get("name", "?")
    yield {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "ts": 0,
           "args": {"name": f"kdtree {model} {reader.metadata.get('mode', '?')} (budget {reader.dims.budget})"}}
    for tid, name in ((1, "engine step"), (2, "trace writer")):
        yield {"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "ts": 0, "args": {"name": name}}
    stages = tuple(f"time_{s}" for s in STAGES)
    now = writer = 0.0
    n = reader.num_steps
    for lo in range(0, n, block):
        v = reader.fields(("prefix_len", "tau", "num_nodes", "time_trace_write") + stages, lo, min(lo + block, n))
        for i in range(len(v["tau"])):
            durations = [(s[5:], float(v[s][i]) * 1e6) for s in stages if math.isfinite(v[s][i])]
            total = sum(d for _, d in durations)
            yield {"ph": "X", "name": f"step {lo + i}", "cat": "step", "pid": 1, "tid": 1, "ts": now, "dur": total,
                   "args": {"prefix_len": int(v["prefix_len"][i]), "tau": int(v["tau"][i]),
                            "num_nodes": int(v["num_nodes"][i])}}
            start = now
            for name, d in durations:
                yield {"ph": "X", "name": name, "cat": "stage", "pid": 1, "tid": 1, "ts": start, "dur": d,
                       "args": {"step": lo + i}}
                start += d
            now += total
            write = float(v["time_trace_write"][i])
            if math.isfinite(write):
                writer = max(writer, now)
                yield {"ph": "X", "name": "trace write", "cat": "write", "pid": 1, "tid": 2, "ts": writer,
                       "dur": write * 1e6, "args": {"step": lo + i}}
                writer += write * 1e6


def export(reader, fmt: str, out: IO[str], nodes: bool = False) -> int:
    """Write ``reader``'s trace to the text stream ``out`` as ``fmt`` (FORMATS); returns the rows / events written.
    ``nodes``: one row per tree node instead of per step (jsonl and csv)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt == "perfetto":
        count = 0
        out.write('{"displayTimeUnit": "ms", "traceEvents": [\n')
        for event in perfetto_events(reader):
            out.write((",\n" if count else "") + json.dumps(event))
            count += 1
        out.write("\n]}\n")
        return count
    rows = node_rows(reader) if nodes else step_rows(reader)
    columns = NODE_COLUMNS if nodes else STEP_COLUMNS
    count = 0
    if fmt == "jsonl":
        for row in rows:
            out.write(json.dumps(row) + "\n")
            count += 1
        return count
    writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _csv_cell(x) for k, x in row.items()})
        count += 1
    return count


def _csv_cell(x):
    if x is None:
        return ""
    if isinstance(x, bool):
        return int(x)
    if isinstance(x, list):
        return " ".join("" if e is None else str(e) for e in x)
    return x
