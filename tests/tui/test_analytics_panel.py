"""The analytics view's drawing: charts hold their values (read back from the characters), the sections show the
numbers computed here by plain loops over the synthetic records, every line fits an 80x24 terminal's panel, and the
panel computes in a worker and heads the view with the current step's "why"."""
from __future__ import annotations

import math

import numpy as np
import pytest
from test_tui_helpers import run_async, settle, small_records, small_trace
from textual.app import App

from kdspec.kdtree_tui.palette import palette
from kdspec.kdtree_tui.session import TraceSession
from kdspec.kdtree_tui.widgets.analytics_panel import AnalyticsPanel, render_analytics, render_why
from kdspec.kdtree_tui.widgets.charts import EIGHTHS, bucket_means, column_chart, hbar
from kdspec.traces import open_trace
from kdspec.traces.analytics import WhyTau, analyze

COLOURS = palette(True)
NARROW = 42   # the panel's text width at 80x24 (80 - the 34-column step list, border, padding, scroll bar)
STEPS = 90


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = small_trace(tmp_path_factory.mktemp("an"), steps=STEPS)
    with open_trace(path) as reader:
        analytics = analyze(reader)
    return path, small_records(STEPS), analytics


def chart_rows(text: str, height: int) -> list[str]:
    """The ``height`` bar rows of a column chart, the gutter and axis character cut off."""
    rows = text.split("\n")[:height]
    return [row[row.index(next(c for c in row if c in "┤│")) + 1:] for row in rows]


def eighths(rows: list[str], col: int) -> int:
    return sum(EIGHTHS.index(row[col]) if col < len(row) and row[col] in EIGHTHS else 0 for row in rows)


def test_column_chart_holds_each_value_in_eighths():
    values, height = [0.0, 0.3, 0.55, 1.0, 0.07], 5
    text = column_chart(values, 1.0, height, {0: "1.0", 2: ".5"}, ["a", "b", "c", "d", "e"], COLOURS, "", 2, 1,
                        marks=[0.9, None, 0.2, 1.0, float("nan")]).plain
    rows = chart_rows(text, height)
    for i, v in enumerate(values):
        assert eighths(rows, 3 * i) == round(8 * height * v) == eighths(rows, 3 * i + 1)
    lines = text.split("\n")
    assert lines[0].startswith("1.0┤") and lines[2].startswith(" .5┤") and lines[1].startswith("   │")
    assert lines[height].startswith("   └" + "─" * 15)
    assert lines[height + 1].split() == ["a", "b", "c", "d", "e"]
    assert rows[0][2] == "·" and rows[0][11] == "·" and rows[4][8] == "·"  # 0.9 and 1.0 at the top, 0.2 low
    assert sum(row.count("·") for row in rows) == 3


def test_hbar_and_bucket_means():
    assert hbar(1.0, 1.0, 10) == "█" * 10 and hbar(0.0, 1.0, 10) == "" and hbar(float("nan"), 1, 5) == ""
    assert hbar(0.5, 1.0, 3) == "█▌"
    values = list(range(10))
    assert bucket_means(values, 20) == values
    assert bucket_means(values, 3) == pytest.approx([1.0, 4.0, 7.5])


def rank_percentages(records, depths=7, topk=4):
    """Per depth d the rank of the target's token (committed token d-1) among steps whose tau >= d, by loops."""
    out = []
    for d in range(1, depths + 1):
        counts = [0] * (topk + 1)
        for r in records:
            if len(r["accepted_nodes"]) >= d:
                row = r["draft_ids"][d - 1].tolist()
                token = int(r["committed_tokens"][d - 1])
                counts[row.index(token) if token in row else topk] += 1
        n = sum(counts)
        out.append(([f"{c / n:.0%}" for c in counts] if n else ["-"] * (topk + 1)) + [str(n)])
    return out


def test_sections_show_the_numbers_of_the_records(trace):
    _, records, analytics = trace
    text = render_analytics(analytics, COLOURS, 84).plain
    lines = text.split("\n")
    # rank histogram rows
    at = lines.index(next(line for line in lines if line.startswith("target token's rank")))
    assert lines[at + 1].split() == ["d", "r0", "r1", "r2", "r3", "none", "n"]
    for d, expected in enumerate(rank_percentages(records), 1):
        assert lines[at + 1 + d].split() == [str(d)] + expected
    # acceptance chart: depth d's column holds 8 x height x (share of steps with tau >= d+1) eighths
    at = lines.index(next(line for line in lines if line.startswith("acceptance:")))
    rows = chart_rows("\n".join(lines[at + 1:]), 6)
    taus = [len(r["accepted_nodes"]) for r in records]
    for d in range(1, 8):
        share = sum(t >= d + 1 for t in taus) / len(taus)
        assert eighths(rows, 3 * (d - 1)) == round(8 * 6 * share), d
    # budget curve: each row's tau is the recorded walk cut to nodes 0..B'; the best row has the highest tok/s
    at = lines.index(next(line for line in lines if line.startswith("budget curve")))
    for b in range(17):
        cut = [1 + next((k for k, a in enumerate(r["accepted_nodes"][1:]) if a > b), len(r["accepted_nodes"]) - 1)
               for r in records]
        cells = lines[at + 2 + b].split()
        assert int(cells[0]) == b and float(cells[1]) == pytest.approx(np.mean(cut), abs=0.005)
    best = [line for line in lines[at + 2:at + 19] if line.endswith(" best")]
    assert len(best) == 1 and int(best[0].split()[0]) == analytics.curve.best_budget
    assert f"ECE {analytics.calibration.ece:.3f}" in text


@pytest.mark.parametrize("width", [NARROW, 84])
def test_every_line_fits_the_panel(trace, width):
    text = render_analytics(trace[2], COLOURS, width).plain
    too_wide = [line for line in text.split("\n") if len(line) > width]
    assert not too_wide, too_wide


def test_chain_line_names_unknown_steps_only_when_there_are_some():
    # the shipped pycoder-mini sample: every step's tree holds the drafter's top-1 chain
    from importlib.resources import files
    with open_trace(str(files("kdspec.kdtree_tui") / "data" / "pycoder-mini-sample.h5")) as reader:
        a = analyze(reader)
    assert a.curve.chain_known_steps == a.num_steps
    text = " ".join(render_analytics(a, COLOURS, 120).plain.split())
    assert f"on {a.num_steps}/{a.num_steps} steps" in text and "the rest" not in text


def test_render_why():
    base = dict(step=3, tau=2, budget=16, token=ord("x"), best_first=True, in_tree=False)
    drafted = render_why(WhyTau(**base, depth=2, rank=2, logprob=math.log(0.25), budget_needed=23,
                                reason=""), chr, COLOURS, NARROW).plain
    assert max(len(line) for line in drafted.split("\n")) <= NARROW
    assert "depth 2: target chose 'x'" in drafted and "drafter rank 2" in drafted
    assert "p 0.25" in drafted and "budget 23 holds it" in drafted
    absent = render_why(WhyTau(**base, depth=2, rank=None, logprob=None, budget_needed=None, reason=""), chr,
                        COLOURS).plain
    assert "not in the drafter's top-K" in absent
    full = render_why(WhyTau(**{**base, "tau": 8}, depth=None, rank=None, logprob=None, budget_needed=None,
                             reason="every drafted depth accepted (block full)"), chr, COLOURS).plain
    assert "block full" in full


class PanelApp(App):
    def __init__(self, path):
        super().__init__()
        self.session = TraceSession(path)

    def compose(self):
        yield AnalyticsPanel(self.session, id="an")


@run_async
async def test_panel_computes_in_a_worker_and_follows_the_step(trace):
    path, records, analytics = trace
    app = PanelApp(path)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(app, pilot)
        panel = app.query_one(AnalyticsPanel)
        assert panel.analytics is not None and panel.analytics.num_steps == STEPS
        assert "acceptance:" in panel.plain and "budget curve" in panel.plain
        panel.show_step(app.session.step(5))
        await settle(app, pilot)
        assert panel.plain.startswith(f"step 5: tau {len(records[5]['accepted_nodes'])}")
        app.session.close()


# ------------------------------------------------------------------------------------------- in the app (key 6)
def make_run_before(step, *keys):
    async def run_before(pilot):
        app = pilot.app
        await settle(app, pilot)
        app.go_to(step)
        await settle(app, pilot)
        await pilot.press(*keys)
        await settle(app, pilot)
    return run_before


@run_async
async def test_key_6_opens_the_analytics_view_and_it_follows_the_cursor(trace):
    from kdspec.kdtree_tui.app import TraceApp

    path, records, analytics = trace
    app = TraceApp(path)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(app, pilot)
        await pilot.press("6")
        await settle(app, pilot)
        panel = app.query_one(AnalyticsPanel)
        assert app.query_one("#tabs").active == "analytics"
        assert panel.analytics.curve.mean_tau == analytics.curve.mean_tau
        assert panel.plain.startswith(f"step 0: tau {len(records[0]['accepted_nodes'])}")
        await pilot.press("j", "j")
        await settle(app, pilot)
        assert panel.plain.startswith(f"step 2: tau {len(records[2]['accepted_nodes'])}")
        assert "budget curve" in panel.plain
        assert not panel.show_horizontal_scrollbar  # every line fits the panel at 80x24


@pytest.mark.parametrize("size", [(120, 40), (80, 24)], ids=["120x40", "80x24"])
def test_snapshot_analytics_view(snap_compare, trace, size):
    from test_tui_helpers import stable_opener

    from kdspec.kdtree_tui.app import TraceApp

    app = TraceApp(trace[0], opener=stable_opener)
    assert snap_compare(app, terminal_size=size, run_before=make_run_before(4, "6"))


def test_logits_view_verdict_compares_the_golden_tokens_logit(trace):
    """Step 7 of the synthetic trace is a genuine near-tie flip (the golden token is the engine's runner-up,
    1e-4 below); the same flip with the golden token moved out of the engine's top-k is a mismatch, however
    large |dlogit| is."""
    import dataclasses

    from kdspec.kdtree_tui.session import BYTES
    from kdspec.kdtree_tui.widgets.logits_panel import render_logits

    with open_trace(trace[0]) as reader:
        record = reader.step(7)
    assert int(record.committed_tokens[0]) != int(record.golden_tokens[0])
    assert int(record.target_topk_ids[0, 1]) == int(record.golden_tokens[0])
    assert "near-tie flip" in render_logits(record, BYTES, COLOURS, 1e-4).plain
    ids = np.array(record.target_topk_ids)
    ids[0, 1] = 1  # the golden token now outside the top-k
    outside = dataclasses.replace(record, target_topk_ids=ids)
    text = render_logits(outside, BYTES, COLOURS, 1e-4).plain
    assert "near-tie" not in text and "MISMATCH (golden not in top-k)" in text
