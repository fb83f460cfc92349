"""Pilot tests of the trace debugger: every key, the palette, compare, follow, bad files.

Traces are written by traces' writer from synthetic records; what the screen must show is derived from
those records directly (plain loops), never from the app's own code.
"""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from test_tui_helpers import brute_flags, run_async, settle, small_records, small_trace, text_of

from kdspec.kdtree_tui.app import FOLLOW_INTERVAL, TraceApp, run_app
from kdspec.kdtree_tui.screens import GoToStepScreen, HelpScreen
from kdspec.kdtree_tui.widgets.step_list import StepList

SIZE = (100, 30)


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tui")


@pytest.fixture(scope="module")
def trace(trace_dir):
    return small_trace(trace_dir)


@pytest.fixture(scope="module")
def records():
    return small_records()


def sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


TOKEN = r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\""
TREE_ROW = re.compile(rf"^(?P<guide>[|`+\- ]*)(?P<mark>[o.]) (?P<token>{TOKEN})\s+(?P<target>{TOKEN})\s+(?P<rest>.*)$")


def check_tree_rows(plain: str, r: dict) -> None:
    """The tree panel's text against the record: header lines, then a row per node in depth-first order with the
    node's token, the target's choice, node, d, r, lp and score, indented two cells a depth."""
    lines = plain.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("tree "))
    assert lines[head].split() == ["tree", "target", "node", "d", "r", "lp", "score", "note"]
    above = " ".join(lines[:head])
    assert "accepted " + " > ".join(str(int(a)) for a in r["accepted_nodes"]) in above
    assert f"bonus {text_of([r['bonus_token']])!r}" in above
    rows = lines[head + 1:]
    assert len(rows) == len(r["tree_tokens"])
    accepted, seen = set(r["accepted_nodes"].tolist()), []
    for line in rows:
        m = TREE_ROW.match(line)
        assert m, line
        cells = m["rest"].split()
        node = int(cells[0])
        assert r["tree_parents"][node] in seen or node == 0, "a node's parent comes before it"
        seen.append(node)
        depth, rank = int(r["tree_depths"][node]), int(r["tree_ranks"][node])
        assert len(m["guide"]) == 2 * depth
        assert m["token"] == repr(text_of([r["tree_tokens"][node]]))
        assert m["target"] == repr(text_of([r["target_choice"][node]]))
        assert (m["mark"] == "o") == (node in accepted)
        assert cells[1:3] == [str(depth), str(rank)]
        if node:
            lp = r["draft_logprobs"][depth - 1, rank]
            assert cells[3:5] == [f"{lp:+.2f}", f"{r['tree_scores'][node]:+.2f}"]
        assert ("bonus" in cells) == (node == int(r["accepted_nodes"][-1]))
    assert sorted(seen) == list(range(len(r["tree_tokens"])))


@run_async
async def test_navigation_keys_and_panels(trace, records):
    before = sha(trace)
    app = TraceApp(trace)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert app.cursor == 0 and app.session.num_steps == len(records)
        for keys, want in ((["j", "j", "down"], 3), (["k"], 2), (["end"], len(records) - 1), (["home"], 0),
                           (["pagedown"], 10), (["up"], 9)):
            await pilot.press(*keys)
            await settle(app, pilot)
            assert app.cursor == want, keys
            assert app.query_one(StepList).cursor == want
            assert f"step {want}/{len(records) - 1}" in app.status_text.plain
            assert app.record.index == want
        r = records[9]
        # Tree: the lines above the table name the accepted path and the bonus; then one row per node, every
        # column as recorded (the panel is wide enough at 100x30 for all of them).
        check_tree_rows(app.query_one("#tree-panel").plain, r)
        # Logits: one row per committed position with engine, golden, |dlogit| and margin.
        logits = app.query_one("#logits-panel").plain
        for j, (c, g) in enumerate(zip(r["committed_tokens"], r["golden_tokens"])):
            node = r["accepted_nodes"][j]
            row = next(l for l in logits.splitlines() if l.split()[:2] == [str(r["prefix_len"] + 1 + j), str(node)])
            assert repr(text_of([c])) in row and f"{r['logit_max_abs_diff'][j]:.2e}" in row
            assert f"{r['target_margin'][node]:.3f}" in row
        # Cache: every compaction move, the lengths.
        cache = app.query_one("#cache-panel").plain
        assert f"new length          {r['cache_len_after']}" in cache
        for src, dst in zip(r["compact_src"], r["compact_dst"]):
            assert f"row {src:>7} -> {dst:<7}" in cache
    assert sha(trace) == before, "the app must never write to the trace"


@run_async
async def test_anomaly_navigation_matches_brute_force(trace, records):
    flags = brute_flags(records)
    anomalous = [i for i, f in enumerate(flags) if f]
    app = TraceApp(trace)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        visited = []
        for _ in range(6):
            await pilot.press("n")
            await settle(app, pilot)
            visited.append(app.cursor)
            names = [n for n in flags[app.cursor]]
            assert all(n in app.status_text.plain for n in names)
        assert visited == anomalous[1:7] if 0 in anomalous else anomalous[:6]
        await pilot.press("p")
        await settle(app, pilot)
        assert app.cursor == visited[-2]
        # The near-tie flip (synthetic divergence at step 7): the logits panel tells it from a bug.
        app.go_to(7)
        await settle(app, pilot)
        assert "golden divergence" in app.status_text.plain
        assert "near-tie flip" in app.query_one("#logits-panel").plain
        assert "x first mismatch at node 0: golden" in app.query_one("#tree-panel").plain
        app.go_to(21)
        await settle(app, pilot)
        assert "MISMATCH max |diff| 2.50e-01" in app.query_one("#cache-panel").plain


@run_async
async def test_bookmarks_goto_help_theme(trace):
    app = TraceApp(trace)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        for step in (30, 5):
            app.go_to(step)
            await settle(app, pilot)
            await pilot.press("b")
            assert "bookmarked" in app.status_text.plain
        app.go_to(0)
        await settle(app, pilot)
        seen = []
        for _ in range(3):
            await pilot.press("B")
            await settle(app, pilot)
            seen.append(app.cursor)
        assert seen == [5, 30, 5]
        await pilot.press("b")  # un-bookmark 5
        assert "bookmarked" not in app.status_text.plain and app.session.bookmarks == {30}
        await pilot.press("g")
        await pilot.pause()
        assert isinstance(app.screen, GoToStepScreen)
        await pilot.press("5", "7", "enter")
        await settle(app, pilot)
        assert app.cursor == 57
        await pilot.press("g", "9", "9", "9", "enter")
        await pilot.pause()
        assert isinstance(app.screen, GoToStepScreen)
        assert "not a step number" in str(app.screen.query_one("#goto-error").render())
        await pilot.press("escape")
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        assert "next / previous anomaly" in str(app.screen.query_one("#help-text").render())
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, HelpScreen)
        assert app.current_theme.dark
        await pilot.press("d")
        await settle(app, pilot)
        assert not app.current_theme.dark
        await pilot.press("d")
        assert app.current_theme.dark


@run_async
async def test_command_palette_goto_and_search(trace, records):
    app = TraceApp(trace)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"42")
        await pilot.pause(0.5)
        await pilot.press("enter")
        await settle(app, pilot)
        assert app.cursor == 42
        # Search by text: steps where a match starts in the concatenated output (brute force below).
        text, owner = "", []
        for i, r in enumerate(records):
            piece = text_of(r["committed_tokens"])
            text += piece
            owner += [i] * len(piece)
        brute = []
        for at in range(len(text)):
            if text.startswith("lazy", at) and owner[at] not in brute:
                brute.append(owner[at])
        assert len(brute) >= 2 and app.session.search("lazy") == brute[:20]
        assert app.session.search("7")[0] == 7
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"lazy")
        await pilot.pause(0.5)
        await pilot.press("down", "enter")  # the second hit
        await settle(app, pilot)
        assert app.cursor in brute[:20]


@run_async
async def test_run_view_numbers(trace, records):
    app = TraceApp(trace)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("4")
        await settle(app, pilot)
        text = app.query_one("#run-panel").plain
        tau = [len(r["accepted_nodes"]) for r in records]
        assert f"{len(tau)} steps, {sum(tau)} tokens, mean tau {sum(tau) / len(tau):.2f}" in text
        for t in range(1, 9):
            assert f"tau {t:>2} {tau.count(t):>7}" in text
        for d in range(1, 8):
            assert f"d {d:>2} {sum(x >= d + 1 for x in tau) / len(tau):>7.1%}" in text
        verify = sum(r["time_verify"] for r in records)
        assert f"verify" in text and (f"{verify:.2f} s" in text or f"{verify * 1e3:.2f} ms" in text)
        assert "decode  block_size 8, budget 16" in text
        assert text_of(records[0]["committed_tokens"]) in text
        for tab in ("1", "2", "3"):
            await pilot.press(tab)
        assert app.query_one("#tabs").active == "cache"


@run_async
async def test_works_at_80x24(trace):
    app = TraceApp(trace)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(app, pilot)
        await pilot.press("n", "2", "4", "1")
        await settle(app, pilot)
        assert app.query_one(StepList).size.height > 10
        assert app.query_one("#tree-panel").plain.startswith(f"step {app.cursor}")


@run_async
async def test_compare_aligns_by_position(trace_dir, records):
    a = small_trace(trace_dir, "budget16.h5", steps=60)
    b = small_trace(trace_dir, "budget4.h5", steps=60, budget=4, seed=3)
    other = small_records(60, budget=4, seed=3)
    app = TraceApp(a, compare=b)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("5")
        await settle(app, pilot)
        panel = app.query_one("#compare-panel")
        rows = app.query_one("#compare-rows")
        # Brute force: the position of every committed token in both runs, compared one by one.
        def stream(recs):
            out = {}
            for r in recs:
                for j, t in enumerate(r["committed_tokens"]):
                    out[r["prefix_len"] + 1 + j] = int(t)
            return out
        sa, sb = stream(records[:60]), stream(other)
        common = sorted(set(sa) & set(sb))
        wrong = [p for p in common if sa[p] != sb[p]]
        starts = sorted({r["prefix_len"] for r in records[:60]} | {r["prefix_len"] for r in other})
        assert rows.alignment.positions.tolist() == starts
        want_rows = sorted({max(i for i, s in enumerate(starts) if s < p) for p in wrong})
        assert np.flatnonzero(rows.alignment.differs).tolist() == want_rows
        assert f"{len(want_rows)} rows differ" in panel.header.plain
        if wrong:
            assert f"first differing token at position {wrong[0]}" in panel.header.plain
        # The compare cursor follows the current step of A.
        app.go_to(12)
        await settle(app, pilot)
        assert rows.alignment.positions[rows.cursor] == records[12]["prefix_len"]


FOLLOW_WRITER = textwrap.dedent("""
    import sys
    from kdspec.engine.bench.synthetic import synthetic_metadata, synthetic_records
    from kdspec.traces.writer import TraceWriter
    path, first = sys.argv[1], int(sys.argv[2])
    records = synthetic_records(first * 2)
    with TraceWriter(path, synthetic_metadata(), compression="lzf") as w:
        for _ in range(first):
            w.write_step(next(records))
        print("ready", flush=True)
        sys.stdin.readline()
        for r in records:
            w.write_step(r)
        print("done", flush=True)
        sys.stdin.readline()
""")


@run_async
async def test_follow_grows_while_recording(tmp_path):
    path = tmp_path / "live.h5"
    writer = subprocess.Popen([sys.executable, "-c", FOLLOW_WRITER, str(path), "15"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
        app = TraceApp(str(path), follow=True)
        async with app.run_test(size=SIZE) as pilot:
            await settle(app, pilot)
            assert app.session.num_steps == 15 and app.cursor == 14
            assert "following (recording)" in app.status_text.plain
            writer.stdin.write("more\n")
            writer.stdin.flush()
            assert writer.stdout.readline().strip() == "done"
            for _ in range(120):  # up to a minute on a loaded CI machine
                await pilot.pause(FOLLOW_INTERVAL)
                await settle(app, pilot)
                if app.session.num_steps == 30:
                    break
            assert app.session.num_steps == 30
            assert app.cursor == 29, "follow mode sticks to the newest step"
            assert "step 29/29" in app.status_text.plain
    finally:
        writer.stdin.close()  # EOF: every readline() in the writer returns, it finishes and exits
        try:
            writer.wait(timeout=60)
        except subprocess.TimeoutExpired:
            writer.kill()
            writer.wait()


@pytest.mark.parametrize("content", [b"", b"this is not hdf5 at all" * 100, None])
def test_bad_file_prints_one_line(tmp_path, capsys, content):
    path = tmp_path / "bad.h5"
    if content is not None:
        path.write_bytes(content)
    assert run_app(str(path)) == 2
    err = capsys.readouterr().err
    assert err.startswith("kdtree tui: error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_truncated_trace_prints_one_line(trace, tmp_path, capsys):
    cut = tmp_path / "cut.h5"
    data = open(trace, "rb").read()
    cut.write_bytes(data[: len(data) // 2])
    assert run_app(str(cut)) == 2
    err = capsys.readouterr().err
    assert err.startswith("kdtree tui: error: ") and err.count("\n") == 1 and "cut.h5" in err


@run_async
async def test_damaged_step_shows_message_not_traceback(trace):
    from kdspec.traces.reader import open_trace
    from kdspec.traces.schema import TraceError

    class Damaged:
        def __init__(self, path):
            self._r = open_trace(path)

        def __getattr__(self, name):
            return getattr(self._r, name)

        def step(self, index):
            if index == 3:
                raise TraceError(f"{trace}: dataset 'steps' is damaged or truncated (bad chunk)")
            return self._r.step(index)

    app = TraceApp(trace, opener=Damaged)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        app.go_to(3)
        await settle(app, pilot)
        assert "step 3:" in app.status_text.plain and "damaged" in app.status_text.plain
        await pilot.press("j")
        await settle(app, pilot)
        assert app.record.index == 4 and "damaged" not in app.status_text.plain


def test_app_never_loads_engine_or_numba():
    code = ("import sys, kdtree_tui.app; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('engine', 'numba', 'numba_kernels')); "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=os.getcwd())
    assert result.returncode == 0, result.stdout + result.stderr
