"""What the incremental drawing paths put on screen: step keys repaint only what changed (no layout pass, the
step list's two cursor rows, the text panel's scroll range set without a layout), so every frame they leave
must equal a full relayout and repaint of the same state; the text panel's scroll range and lines must
follow its text (expected values from plain string splits and the CSS sizes, not from the panel).
"""
from __future__ import annotations

import re

from rich.text import Text
from test_tui_helpers import run_async, settle, small_trace
from textual.app import App

from kdspec.kdtree_tui.app import TraceApp
from kdspec.kdtree_tui.widgets.panel import TextPanel
from kdspec.kdtree_tui.widgets.step_list import StepList

SIZE = (100, 30)


def _screen(app) -> str:
    """The screen as SVG, without the per-export unique id (it hashes the time, not the content)."""
    return re.sub(r"terminal-\d+", "terminal", app.export_screenshot())


async def _full_repaint(app, pilot) -> None:
    """Forget every widget's rendered lines and relay out the screen."""
    for widget in app.screen.walk_children(with_self=True):
        widget.refresh()
    app.screen.refresh(layout=True)
    await settle(app, pilot)


@run_async
async def test_incremental_frames_equal_a_full_repaint(tmp_path):
    trace = small_trace(tmp_path)
    app = TraceApp(trace)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        # Within the visible rows (two cursor rows repainted), scrolling, jumps, other tabs, back, focus on
        # the tree panel, the light theme.
        for keys in (["j", "j", "j"], ["k"], ["pagedown", "pagedown", "pagedown"], ["end"], ["home"], ["n"],
                     ["2", "j"], ["3", "j", "j"], ["1", "k"], ["n", "n", "n"], ["tab", "tab", "j", "j"], ["d", "j"]):
            await pilot.press(*keys)
            await settle(app, pilot)
            drawn = _screen(app)
            await _full_repaint(app, pilot)
            assert _screen(app) == drawn, keys
            assert app.query_one(StepList).cursor == app.cursor


class _PanelApp(App):
    CSS = "TextPanel { width: 40; height: 12; }"

    def compose(self):
        yield TextPanel(id="panel")


def _lines(count: int, width: int) -> str:
    return "".join(f"{i:03d} " + "x" * (i % (width - 3)) + "\n" for i in range(count))


def _visible(panel: TextPanel) -> list[str]:
    return [panel.render_line(y).text.rstrip() for y in range(panel.scrollable_content_region.height)]


@run_async
async def test_text_panel_scroll_range_follows_the_text():
    app = _PanelApp()
    async with app.run_test(size=(60, 20)) as pilot:
        panel = app.query_one(TextPanel)
        height = 12  # no horizontal scroll bar: every line is narrower than 40 - 2 padding - 2 scroll bar
        for count, scroll_to_end in ((50, True), (20, False), (5, False), (30, True), (30, False)):
            plain = _lines(count, 30)
            panel.set_text(Text(plain))
            await pilot.pause()
            want = plain.split("\n")[:-1]  # the text ends with a newline: it ends the last line
            assert panel.virtual_size.height == count
            assert panel.virtual_size.width == max(len(line) for line in want)
            assert panel.show_vertical_scrollbar == (count > height)
            assert not panel.show_horizontal_scrollbar
            assert panel.scrollable_content_region.height == height
            assert panel.max_scroll_y == max(0, count - height)
            # A shorter text pulls a scrolled-down view back to its own last page.
            assert 0 <= panel.scroll_y <= panel.max_scroll_y
            top = int(panel.scroll_y)
            assert _visible(panel) == ([line.rstrip() for line in want[top:top + height]] + [""] * height)[:height]
            if scroll_to_end:
                panel.scroll_end(animate=False, immediate=True)
                await pilot.pause()
                assert panel.scroll_y == max(0, count - height)
                assert _visible(panel)[-1] == want[-1].rstrip()


@run_async
async def test_hidden_text_panel_makes_its_text_only_when_read_or_shown():
    app = _PanelApp()
    async with app.run_test(size=(60, 20)) as pilot:
        panel = app.query_one(TextPanel)
        made = []

        def make() -> Text:
            made.append(1)
            return Text("one\ntwo\n")

        panel.display = False
        await pilot.pause()
        panel.set_text(make)
        assert made == []
        assert panel.plain == "one\ntwo\n" and made == [1]
        panel.set_text(make)
        panel.display = True
        await pilot.pause()
        assert len(made) == 2
        assert _visible(panel)[:3] == ["one", "two", ""]


@run_async
async def test_text_panel_text_selects_with_the_mouse():
    app = _PanelApp()
    async with app.run_test(size=(60, 20)) as pilot:
        panel = app.query_one(TextPanel)
        plain = _lines(30, 30)
        panel.set_text(Text(plain))
        await pilot.pause()
        panel.scroll_to(y=4, animate=False, immediate=True)
        await pilot.pause()
        # Drag from column 2 of the second visible line to column 5 of the fourth, both characters included
        # (padding: 1 column).
        await pilot.mouse_down(panel, offset=(1 + 2, 1))
        await pilot.hover(panel, offset=(1 + 5, 3))
        await pilot.mouse_up(panel, offset=(1 + 5, 3))
        await pilot.pause()
        lines = plain.split("\n")
        want = "\n".join([lines[5][2:], lines[6], lines[7][:6]])
        assert app.screen.get_selected_text() == want
