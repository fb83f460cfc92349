"""The help screen explains every column, abbreviation and glyph the views show, and every key: each widget's
exported header list is checked against the help's glossary, and the exported lists against what the widgets
actually draw (so a new column without help fails here). The help fits 80x24 and 120x40 and scrolls to its end.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
from kdspec.kdtree_tui.app import TraceApp
from kdspec.kdtree_tui.palette import palette
from kdspec.kdtree_tui.screens import GLOSSARY, HELP_ROWS, HELP_WIDTH, HelpScreen, glossary_terms, help_text
from kdspec.kdtree_tui.session import BYTES
from kdspec.kdtree_tui.widgets import analytics_panel, cache_panel, logits_panel, run_panel, step_list, tree_panel
from kdspec.traces import open_trace
from kdspec.traces.analytics import analyze
from test_tui_helpers import run_async, screen_text, settle, small_trace
from textual.containers import VerticalScroll

COLOURS = palette(True)
# widget module -> the help section that explains it
SECTIONS = {tree_panel: "tree view (1)", logits_panel: "logits view (2)", cache_panel: "cache view (3)",
            run_panel: "run view (4)", analytics_panel: "analytics view (6)", step_list: "step list"}


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    return small_trace(tmp_path_factory.mktemp("help"), steps=40)


def glossary_lines(section: str) -> list[str]:
    """The rendered help's lines of ``section`` (between its heading and the next blank line)."""
    lines = help_text().plain.split("\n")
    start = lines.index(section) + 1
    end = lines.index("", start)
    return lines[start:end]


@pytest.mark.parametrize("module", list(SECTIONS), ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_every_exported_term_has_a_glossary_entry(module):
    section = SECTIONS[module]
    missing = [term for term in module.TERMS if term not in glossary_terms(section)]
    assert not missing, f"{section}: no help for {missing}"
    # ... and the rendered help shows the term at the start of an entry (its terms are joined by two spaces)
    starts = [re.split(r"\s{2,}", line)[:4] for line in glossary_lines(section) if not line.startswith(" ")]
    shown = {term for cells in starts for term in cells}
    for term in module.TERMS:
        assert term in shown, (section, term)


def test_the_terms_the_brief_names_are_explained():
    for section, term in (("terms", "tau"), ("terms", "τ"), ("terms", "P"), ("tree view (1)", "d"),
                          ("tree view (1)", "r"), ("tree view (1)", "lp"), ("tree view (1)", "score"),
                          ("logits view (2)", "margin"), ("logits view (2)", "verdict"),
                          ("logits view (2)", "|dlogit|")):
        assert term in glossary_terms(section), term


def header_words(line: str) -> list[str]:
    return line.split()


def test_tree_and_logits_headers_are_the_exported_lists(trace):
    """What the panels draw as their header rows is exactly the exported HEADERS (wide), or a sub-list in the
    same order (narrow): a column added to the drawing but not to HEADERS (so not to the help) fails."""
    with open_trace(trace) as reader:
        record = reader.step(9)
    for width in (200, 60, 42, 30):
        tree = tree_panel.render_tree(record, BYTES, COLOURS, width, 16).plain.split("\n")
        head = header_words(next(line for line in tree if line.startswith(tree_panel.TREE + " ")))
        logits = logits_panel.render_logits(record, BYTES, COLOURS, 1e-4, width).plain.split("\n")
        lhead = header_words(next(line for line in logits if line.endswith(logits_panel.VERDICT)))
        for got, exported in ((head, tree_panel.HEADERS), (lhead, logits_panel.HEADERS)):
            if width == 200:
                assert tuple(got) == exported
            else:
                assert [h for h in exported if h in got] == got, (width, got)
    for word in logits_panel.VERDICT_WORDS:
        assert word in glossary_terms("logits view (2)")


def test_analytics_headers_are_the_exported_lists(trace):
    with open_trace(trace) as reader:
        analytics = analyze(reader)
    lines = analytics_panel.render_analytics(analytics, COLOURS, 84).plain.split("\n")
    rank_head = next(lines[i + 1] for i, line in enumerate(lines) if line.startswith("target token's rank"))
    generic = [re.sub(r"^r\d+\+$", "rN+", re.sub(r"^r\d+$", "rN", w)) for w in rank_head.split()]
    assert set(generic) <= set(analytics_panel.RANK_HEAD), generic
    budget_head = next(lines[i + 1] for i, line in enumerate(lines) if line.startswith("budget curve"))
    assert budget_head.split() == list(analytics_panel.BUDGET_HEAD[:3])
    calibration_head = next(line for line in lines if "said→got" in line)
    assert re.sub(r"r\d+ said→got", "rN said→got", calibration_head).split() == ["d"] + ["rN", "said→got"] * 3
    titles = {line.split(":")[0] for line in lines if line and not line.startswith(" ")}
    for section in ("stops", "acceptance", "calibration", "budget curve"):
        assert any(t.startswith(section) for t in titles), section


def test_step_list_terms_are_what_a_line_shows(trace):
    from kdspec.kdtree_tui.session import TraceSession

    session = TraceSession(trace)
    try:
        session.install(session.read_columns())
        session.bookmarks = {7}
        flagged = int(np.flatnonzero(session.flags)[0])

        class Stub(step_list.StepList):  # line_text without an app: it only needs the palette
            app = type("A", (), {"current_theme": type("T", (), {"dark": True})()})()

        widget = Stub(session)
        line = widget.line_text(7).plain
        assert line.startswith(step_list.BOOKMARK) and f" {step_list.PREFIX}{session.columns['prefix_len'][7]}" in line
        assert f"{step_list.TAU}{session.columns['tau'][7]}" in line
        m = re.match(r"^.\s*\d+ P\d+\s+t\d+\s+(?P<marks>.{4}) ", widget.line_text(flagged).plain)
        assert m and m["marks"].strip() and set(m["marks"].split()) <= set(step_list.TERMS)
    finally:
        session.close()


def test_every_key_binding_is_in_the_help():
    """Each key of the app's bindings (and the help's own) is named in the keys table."""
    named = set()
    for keys, _ in HELP_ROWS:
        named |= {k for k in re.split(r"[\s/,]+", keys) if k}
    aliases = {"question_mark": "?", "escape": "esc"}
    for binding in TraceApp.BINDINGS + HelpScreen.BINDINGS:
        for key in binding.key.split(","):
            key = aliases.get(key, key)
            assert key in named or key in HELP_ROWS[-2][1], key


def test_help_lines_fit_its_width():
    for path in ("", "/a/very/long/path/" * 12 + "trace.h5.bookmarks.json"):
        too_wide = [line for line in help_text(path).plain.split("\n") if len(line) > HELP_WIDTH]
        assert not too_wide, too_wide
    assert len({name for name, _ in GLOSSARY}) == len(GLOSSARY)


@pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=["80x24", "120x40"])
@run_async
async def test_help_fits_and_scrolls_to_its_end(trace, size):
    app = TraceApp(trace)
    async with app.run_test(size=size) as pilot:
        await settle(app, pilot)
        await pilot.press("question_mark")
        await settle(app, pilot)
        assert isinstance(app.screen, HelpScreen)
        scroll = app.screen.query_one(VerticalScroll)
        assert scroll.region.width <= size[0] and scroll.region.height <= size[1]
        assert scroll.max_scroll_x == 0, "no line is wider than the help"
        assert scroll.max_scroll_y > 0, "the help is longer than the terminal: it scrolls"
        first = screen_text(app)
        assert "kdtree trace debugger" in first and "close: esc q ?" in first
        await pilot.press("j", "j", "j")
        await settle(app, pilot)
        assert scroll.scroll_y == 3
        for _ in range(60):
            await pilot.press("pagedown")
        await settle(app, pilot)
        assert scroll.scroll_y == scroll.max_scroll_y
        last = screen_text(app)
        assert "This trace's:" in last and "kdtree trace debugger" not in last
        await pilot.press("escape")
        await settle(app, pilot)
        assert not isinstance(app.screen, HelpScreen)
