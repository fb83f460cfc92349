"""The views at 80x24 and 120x40: the deciding columns (the target's choice in the tree; engine, golden, margin
and verdict in the logits view) stay on screen, narrow panels drop the others (their values move under the row)
and no line needs the horizontal scroll; J / K scroll the view shown; the logits view shows the saved
distributions (--save-logits) against the golden's, with numbers computed here from the records.
"""
from __future__ import annotations

import re
import shutil

import h5py
import numpy as np
import pytest
from kdspec.kdtree_tui.app import TraceApp
from kdspec.kdtree_tui.palette import palette
from kdspec.kdtree_tui.session import BYTES
from kdspec.kdtree_tui.widgets import logits_panel, tree_panel
from kdspec.kdtree_tui.widgets.logits_panel import LogitsPanel, render_logits
from kdspec.kdtree_tui.widgets.run_panel import RunPanel
from kdspec.kdtree_tui.widgets.tree_panel import TreePanel
from kdspec.traces import open_trace
from test_tui_helpers import logits_trace, run_async, screen_text, settle, small_records, small_trace, text_of

COLOURS = palette(True)
SIZES = [(80, 24), (120, 40)]
DEEP = {"block_size": 16, "budget": 40, "draft_topk": 4}   # depth-15 trees: compact guides at 80 columns
DEEP_STEPS = 30
TOKEN = r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\""
PAIR = re.compile(rf"({TOKEN})\s+(\d\.\d{{3}})")
ROW = re.compile(rf"^(?P<guide>[|`+\- ]*)(?P<mark>[o.]) (?P<token>{TOKEN})\s+(?P<target>{TOKEN})")


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    directory = tmp_path_factory.mktemp("layout")
    return {"small": (small_trace(directory, steps=40), small_records(40)),
            "deep": (small_trace(directory, "deep.h5", steps=DEEP_STEPS, **DEEP), small_records(DEEP_STEPS, **DEEP))}


def preorder(r) -> list[int]:
    """Nodes depth-first, children by index (the tree panel's row order), by plain recursion."""
    parents = [int(p) for p in r["tree_parents"]]
    out = []

    def visit(node):
        out.append(node)
        for child in range(1, len(parents)):
            if parents[child] == node:
                visit(child)
    visit(0)
    return out


def check_tree(panel: TreePanel, r: dict, full: bool) -> None:
    width = panel.text_width()
    lines = panel.plain.split("\n")[:-1]
    assert max(len(line) for line in lines) <= width, "a line needs the horizontal scroll"
    head = next(i for i, line in enumerate(lines) if line.startswith("tree "))
    header = lines[head].split()
    assert "target" in header and header[0] == "tree" and header[-1] == "note"
    if full:
        assert tuple(header) == tree_panel.HEADERS
    depth = [int(d) for d in r["tree_depths"]]
    per_level = set()
    for node, line in zip(preorder(r), lines[head + 1:], strict=True):
        m = ROW.match(line)
        assert m, line
        assert m["token"] == repr(text_of([r["tree_tokens"][node]]))
        assert m["target"] == repr(text_of([r["target_choice"][node]]))
        if depth[node]:
            per_level.add(len(m["guide"]) / depth[node])
    # Two cells a level unless the deepest row, the target, r and lp (one-character tokens and ranks, lp like
    # -0.12) would not fit that way; then one.
    full = 2 * max(depth) + 2 + 3 + 1 + len("target") + 1 + 1 + 1 + 5
    assert per_level == ({1.0} if full > width else {2.0}) or max(depth) == 0, (per_level, full, width)


@pytest.mark.parametrize("size", SIZES, ids=["80x24", "120x40"])
@pytest.mark.parametrize("name", ["small", "deep"])
@run_async
async def test_tree_view_keeps_the_targets_choice_on_screen(traces, name, size):
    path, records = traces[name]
    app = TraceApp(path)
    async with app.run_test(size=size) as pilot:
        await settle(app, pilot)
        deepest = max(range(len(records)), key=lambda i: max(records[i]["tree_depths"]))
        for step in (0, 7, 9, deepest):
            app.go_to(step)
            await settle(app, pilot)
            panel = app.query_one(TreePanel)
            check_tree(panel, records[step], full=size == (120, 40) and name == "small")
            assert not panel.show_horizontal_scrollbar
            assert panel.plain.split("\n")[2].startswith("why tau ")


def verdict_word(r, j) -> str:
    """The short verdict of committed position j from the record: equal tokens ok; the synthetic flips are
    near-ties (the golden token the engine's runner-up, 1e-4 below)."""
    engine, golden = int(r["committed_tokens"][j]), int(r["golden_tokens"][j])
    if golden < 0:
        return "no golden"
    return "ok" if engine == golden else "near-tie"


@pytest.mark.parametrize("size", SIZES, ids=["80x24", "120x40"])
@run_async
async def test_logits_view_keeps_engine_golden_margin_and_verdict(traces, size):
    path, records = traces["small"]
    app = TraceApp(path)
    async with app.run_test(size=size) as pilot:
        await settle(app, pilot)
        await pilot.press("2")
        for step in (7, 9, 13):
            app.go_to(step)
            await settle(app, pilot)
            panel = app.query_one(LogitsPanel)
            width, lines = panel.text_width(), panel.plain.split("\n")
            assert max(len(line) for line in lines) <= width
            header = next(line for line in lines if line.endswith("verdict")).split()
            assert {"engine", "golden", "margin", "verdict"} <= set(header)
            if size == (120, 40):
                assert tuple(header) == logits_panel.HEADERS
            r = records[step]
            for j, node in enumerate(r["accepted_nodes"]):
                parts = [repr(text_of([r["committed_tokens"][j]])), repr(text_of([r["golden_tokens"][j]])),
                         f"{r['target_margin'][node]:.3f}", verdict_word(r, j)]
                pattern = re.compile(r"\s.*?".join(re.escape(p) for p in parts))
                at = next(i for i, line in enumerate(lines) if pattern.search(line))
                below = lines[at + 1]
                if "node" not in header:
                    assert f"node {node}" in below
                if "|dlogit|" not in header:
                    assert f"|dlogit| {r['logit_max_abs_diff'][j]:.2e}" in below


@run_async
async def test_scroll_keys_scroll_the_view_shown(traces):
    path, records = traces["deep"]
    app = TraceApp(path)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(app, pilot)
        assert "J/K scroll" in screen_text(app).rstrip("\n").split("\n")[-1], "the footer names the scroll keys"
        most_nodes = max(range(len(records)), key=lambda i: len(records[i]["tree_tokens"]))
        longest = max(range(len(records)), key=lambda i: len(records[i]["accepted_nodes"]))
        for tab, widget, step in (("1", TreePanel, most_nodes), ("2", LogitsPanel, longest), ("4", RunPanel, 0)):
            app.go_to(step)
            await pilot.press(tab)
            await settle(app, pilot)
            view = app.query_one(widget)
            assert view.max_scroll_y > 0, widget
            half = view.scrollable_content_region.height // 2
            await pilot.press("J")
            await settle(app, pilot)
            assert view.scroll_y == min(half, view.max_scroll_y), widget
            await pilot.press("J", "J", "J", "J", "J", "J", "J", "J")
            await settle(app, pilot)
            assert view.scroll_y == view.max_scroll_y
            await pilot.press("K")
            await settle(app, pilot)
            assert view.scroll_y == max(0, view.max_scroll_y - half)
            assert app.focused is app.query_one("#steps"), "J / K leave the focus on the step list"


# ------------------------------------------------------------------------------------------- --save-logits
def softmax(x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("saved")
    path, records = logits_trace(directory, steps=30)
    older = directory / "older.h5"
    shutil.copyfile(path, older)
    with h5py.File(older, "r+") as f:
        del f["golden_logits"]
    return path, str(older), records


@pytest.mark.parametrize("width", [100, 42])
def test_distributions_are_the_saved_logits(saved, width):
    path, _, records = saved
    with open_trace(path) as reader:
        for step in (0, 1, 2, 7):
            r = records[step]
            text = render_logits(reader.step(step), BYTES, COLOURS, 1e-4, width).plain
            assert max(len(line) for line in text.split("\n")) <= width
            lines = text.split("\n")
            for j in range(len(r["accepted_nodes"])):
                pos = r["prefix_len"] + 1 + j
                at = next(i for i, line in enumerate(lines) if line.startswith(f"pos {pos}"))
                p = softmax(r["logits"][j])
                if "golden_logits" in r:
                    q = softmax(r["golden_logits"][j])
                    tv = 0.5 * sum(abs(a - b) for a, b in zip(p, q))
                    worst = max(abs(float(a) - float(b)) for a, b in zip(r["logits"][j], r["golden_logits"][j]))
                    assert f"TV {tv:.3g}" in lines[at] and f"max|Δ| {worst:.2e}" in lines[at], lines[at]
                else:
                    assert "golden not recorded here" in lines[at]
                top_p = sorted(range(len(p)), key=lambda t: (-p[t], t))[:4]
                top_q = sorted(range(len(q)), key=lambda t: (-q[t], t))[:4] if "golden_logits" in r else []
                assert top_p[0] == r["committed_tokens"][j]
                for i in range(4):
                    pairs = PAIR.findall(lines[at + 2 + i])
                    want = [(repr(text_of([top_p[i]])), f"{p[top_p[i]]:.3f}")]
                    if top_q:
                        want.append((repr(text_of([top_q[i]])), f"{q[top_q[i]]:.3f}"))
                    assert pairs == want, lines[at + 2 + i]


def test_distributions_say_what_a_trace_lacks(saved, traces):
    _, older, _ = saved
    with open_trace(older) as reader:
        text = render_logits(reader.step(0), BYTES, COLOURS, 1e-4, 80).plain
        assert "golden distributions not stored" in text and "engine p" in text and "TV" not in text
    with open_trace(traces["small"][0]) as reader:
        text = render_logits(reader.step(0), BYTES, COLOURS, 1e-4, 80).plain
        assert "full distributions: not in this trace" in text and "engine p" not in text


@pytest.mark.parametrize("size", SIZES, ids=["80x24", "120x40"])
@run_async
async def test_saved_logits_in_the_app(saved, size):
    app = TraceApp(saved[0])
    async with app.run_test(size=size) as pilot:
        await settle(app, pilot)
        await pilot.press("2")
        await settle(app, pilot)
        panel = app.query_one(LogitsPanel)
        assert "engine p" in panel.plain and "golden p" in panel.plain
        assert max(len(line) for line in panel.plain.split("\n")) <= panel.text_width()
        assert not panel.show_horizontal_scrollbar


@run_async
async def test_a_resized_terminal_lays_the_views_out_again(traces):
    path, records = traces["deep"]
    app = TraceApp(path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        app.go_to(2)
        await settle(app, pilot)
        panel = app.query_one(TreePanel)
        wide = next(line for line in panel.plain.split("\n") if line.startswith("tree ")).split()
        assert tuple(wide) == tree_panel.HEADERS
        await pilot.resize_terminal(80, 24)
        await settle(app, pilot)
        check_tree(panel, records[2], full=False)
        narrow = next(line for line in panel.plain.split("\n") if line.startswith("tree ")).split()
        assert len(narrow) < len(wide) and "target" in narrow
