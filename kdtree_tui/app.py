"""TraceApp: the Textual trace debugger. Reads traces only through traces.reader (never the engine).

Threads: one column worker reads the per-step columns after the first paint, the first screen's rows
first (a followed trace that grows: only the new rows); one exclusive step worker reads the current
step's record (from the first frame on), so scrubbing never blocks on the file and only the newest
step's record is shown. Step list rows whose columns are not read yet show placeholders.
"""
from __future__ import annotations

import gc
import os
import sys
from typing import Any, Callable, Mapping, Optional

from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, ScrollableContainer
from textual.widgets import Footer, Static, TabbedContent, TabPane
from textual.worker import WorkerState, get_current_worker

from kdspec.kdtree_tui.bookmarks import BookmarkFile
from kdspec.kdtree_tui.commands import StepCommands
from kdspec.kdtree_tui.messages import ColumnsLoaded, StepLoaded
from kdspec.kdtree_tui.palette import palette
from kdspec.kdtree_tui.screens import GoToStepScreen, HelpScreen
from kdspec.kdtree_tui.session import FIRST_ROWS, FLAG_NAMES, READ_ROWS, TraceSession
from kdspec.kdtree_tui.thresholds_screen import ThresholdsScreen
from kdspec.kdtree_tui.widgets.analytics_panel import AnalyticsPanel
from kdspec.kdtree_tui.widgets.cache_panel import CachePanel
from kdspec.kdtree_tui.widgets.compare_panel import ComparePanel
from kdspec.kdtree_tui.widgets.logits_panel import LogitsPanel
from kdspec.kdtree_tui.widgets.run_panel import RunPanel
from kdspec.kdtree_tui.widgets.step_list import StepList
from kdspec.kdtree_tui.widgets.tree_panel import TreePanel
from kdspec.traces.schema import TraceError

FOLLOW_INTERVAL = 0.5  # seconds between refresh() calls on a followed trace
TABS = ("tree", "logits", "cache", "run", "compare", "analytics")
READ_ERRORS = (TraceError, OSError, IndexError, KeyError, ValueError, RuntimeError)


class TraceApp(App[int]):
    """Step through one trace (optionally beside another). See HelpScreen for the keys."""

    CSS_PATH = "app.tcss"
    TITLE = "kdtree"
    COMMANDS = App.COMMANDS | {StepCommands}
    BINDINGS = [
        Binding("j,down", "step(1)", "step", key_display="j/k"),
        Binding("k,up", "step(-1)", "prev", show=False),
        Binding("pagedown", "step(10)", "+10", show=False),
        Binding("pageup", "step(-10)", "-10", show=False),
        Binding("home", "first", "first", show=False),
        Binding("end", "last", "last", show=False),
        Binding("g", "go_to_step", "go to"),
        Binding("n", "next_anomaly", "anomaly"),
        Binding("p", "previous_anomaly", "prev anomaly", show=False),
        Binding("b", "toggle_bookmark", "mark"),
        Binding("B", "next_bookmark", "next mark", show=False),
        Binding("J", "scroll_view(1)", "scroll", key_display="J/K"),
        Binding("K", "scroll_view(-1)", "scroll up", show=False),
        Binding("H", "scroll_view_x(-1)", "scroll left", show=False),
        Binding("L", "scroll_view_x(1)", "scroll right", show=False),
        Binding("1", "tab('tree')", "tree", show=False),
        Binding("2", "tab('logits')", "logits", show=False),
        Binding("3", "tab('cache')", "cache", show=False),
        Binding("4", "tab('run')", "run", show=False),
        Binding("5", "tab('compare')", "compare", show=False),
        Binding("6", "tab('analytics')", "analytics", show=False),
        Binding("f", "toggle_follow", "follow", show=False),
        Binding("t", "thresholds", "thresholds", show=False),
        Binding("d", "toggle_theme", "theme", show=False),
        Binding("question_mark", "help", "help", key_display="?"),
        Binding("q", "quit", "quit"),
    ]

    def __init__(self, path: str, compare: Optional[str] = None, follow: bool = False,
                 threshold_overrides: Optional[Mapping[str, Any]] = None, opener: Optional[Callable] = None) -> None:
        super().__init__()
        # Opening reads only metadata and the step count: TraceError here means a bad file. Each trace's
        # thresholds follow its own precision (traces.thresholds), overridden by the command line's values.
        self.session = TraceSession(path, threshold_overrides, opener)
        self.other = TraceSession(compare, threshold_overrides, opener) if compare else None
        # Bookmarks live in a side file (kdtree_tui/bookmarks.py), read on mount: the trace is never written.
        self.bookmark_file = BookmarkFile(path, str(self.session.metadata.get("start_time", "")))
        self.bookmark_message = ""  # why the side file was not loaded / saved (status line, until the next save)
        self.following = follow
        self.cursor = 0
        self.record = None
        self.message = ""
        self._at_end = follow  # follow mode starts at (and sticks to) the last step
        self._follow_timer = None
        self._froze_heap = False  # gc.freeze() ran (on_unmount undoes it)
        self.fatal: Optional[str] = None  # why the app stopped (one line; run_app prints it), exit status 2

    # -- layout ---------------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Static(id="status")
        with Horizontal(id="main"):
            yield StepList(self.session, id="steps")
            with TabbedContent(initial="tree", id="tabs"):
                with TabPane("1 Tree", id="tree"):
                    yield TreePanel(id="tree-panel")
                with TabPane("2 Logits", id="logits"):
                    yield LogitsPanel(id="logits-panel")
                with TabPane("3 Cache", id="cache"):
                    yield CachePanel(id="cache-panel")
                with TabPane("4 Run", id="run"):
                    yield RunPanel(self.session, id="run-panel")
                if self.other is not None:
                    with TabPane("5 Compare", id="compare"):
                        yield ComparePanel(self.session, self.other, id="compare-panel")
                with TabPane("6 Analytics", id="analytics"):
                    yield AnalyticsPanel(self.session, id="analytics-panel")
        yield Footer()

    def on_mount(self) -> None:
        self.theme_changed_signal.subscribe(self, lambda _theme: self.redraw())
        self.query_one(StepList).focus()
        self.session.bookmarks, self.bookmark_message = self.bookmark_file.load()
        if self.bookmark_message:
            self.notify(self.bookmark_message, severity="error", timeout=8)
        self.update_status()
        # The current step's record needs one row; the columns (one pass over every row) start after the
        # first frame, so they cannot delay it.
        self.go_to(self.session.num_steps - 1 if self._at_end else 0, force=True)
        self.call_after_refresh(self._load_columns_after_paint, 50)
        if self.following:
            self._follow_timer = self.set_interval(FOLLOW_INTERVAL, self.poll_trace)

    @property
    def colours(self) -> dict:
        return palette(self.current_theme.dark)

    def _load_columns_after_paint(self, tries: int) -> None:
        """Start the column worker once the step list has been drawn (tries: 10 ms waits left). A
        worker started earlier competes for the GIL with composing the first frame (up to 0.3 s slower)."""
        if self.query_one(StepList).painted or tries <= 0:
            self.load_columns()
        else:
            self.set_timer(0.01, lambda: self._load_columns_after_paint(tries - 1))

    # -- workers --------------------------------------------------------------------------------------
    @work(thread=True, exclusive=True, group="columns")
    def load_columns(self) -> None:
        """The first FIRST_ROWS steps' columns, then the rest in READ_ROWS pieces, each posted when read."""
        worker = get_current_worker()
        try:
            loaded, total = None, self.session.num_steps
            for stop in range(min(FIRST_ROWS, total), total, READ_ROWS) if total > FIRST_ROWS else ():
                loaded = self.session.read_columns(loaded, stop)
                self.post_message(ColumnsLoaded([loaded], partial=True))
                if worker.is_cancelled:
                    return
            loaded = self.session.read_columns(loaded)  # up to whatever the reader sees now
            other = [self.other.read_columns()] if self.other is not None else []
            if not worker.is_cancelled:
                self.post_message(ColumnsLoaded([loaded] + other))
        except READ_ERRORS as e:
            self.post_message(ColumnsLoaded(None, error=_one_line(e)))

    @work(thread=True, exclusive=True, group="step")
    def load_step(self, index: int) -> None:
        worker = get_current_worker()
        loaded = self.read_step(index)
        if not worker.is_cancelled:
            self.post_message(loaded)

    def read_step(self, index: int) -> StepLoaded:
        """Step ``index``'s record (one row of the file), or the error reading it."""
        try:
            return StepLoaded(index, self.session.step(index))
        except READ_ERRORS as e:
            return StepLoaded(index, None, error=f"step {index}: {_one_line(e)}")

    def _file_busy(self) -> bool:
        """Whether a worker is reading columns (h5py serialises reads: a step read would wait for it)."""
        return any(w.group in ("columns", "follow") and w.state in (WorkerState.PENDING, WorkerState.RUNNING)
                   for w in self.workers)

    @work(thread=True, exclusive=True, group="times")
    def load_stage_times(self) -> None:
        try:
            times = self.session.read_stage_times()
        except READ_ERRORS:
            return
        self.call_from_thread(self._install_stage_times, times)

    def _install_stage_times(self, times: dict) -> None:
        self.query_one(RunPanel).stage_times = times
        self.redraw_run()

    @work(thread=True, exclusive=True, group="follow")
    def poll_trace(self) -> None:
        """Follow: has the trace grown (or finished)? Then re-read the columns."""
        try:
            if self.session.refresh() and self.session.loaded:
                # Only the rows written since the last read (the installed columns are kept as they are).
                loaded = [self.session.read_columns(self.session.current_columns())]
                if self.other is not None:
                    loaded.append(self.other.read_columns(self.other.current_columns()))
                self.post_message(ColumnsLoaded(loaded))
        except READ_ERRORS as e:
            self.post_message(ColumnsLoaded(None, error=_one_line(e)))

    def on_columns_loaded(self, message: ColumnsLoaded) -> None:
        if message.error:
            if self.session.rows == 0:  # nothing to show: the step list and every view need the columns
                self.stop(message.error)
            else:                       # a followed trace that failed to grow: keep what was read
                self.show_error(message.error)
            return
        grew = message.columns[0].num_steps != self.session.num_steps
        self.session.install(message.columns[0])
        if self.other is not None and len(message.columns) > 1:
            self.other.install(message.columns[1])
        if self._both_loaded():
            self.query_one(ComparePanel).realign()
        self.query_one(StepList).reset()
        last = max(self.session.num_steps - 1, 0)
        target = last if self._at_end else min(self.cursor, last)
        if self.session.loaded:
            self.query_one(RunPanel).stage_times = None
            self.load_stage_times()
            self._freeze_heap()
        # Re-read the current record only when the trace grew (its last step's write time arrives late).
        self.go_to(target, force=grew or self.record is None)
        self.update_status()

    def _both_loaded(self) -> bool:
        return self.other is not None and self.session.loaded and self.other.loaded

    def on_step_loaded(self, message: StepLoaded) -> None:
        if message.index != self.cursor:
            return
        if message.error:
            self.show_error(message.error)
            return
        self.message = ""
        self.record = message.record
        self.redraw_step()
        self.update_status()

    # -- drawing --------------------------------------------------------------------------------------
    def redraw(self) -> None:
        self.query_one(StepList).reset()
        self.redraw_step()
        self.redraw_run()
        if self._both_loaded():
            self.query_one(ComparePanel).realign()
            self.query_one(ComparePanel).follow_step(self.cursor)

    def redraw_step(self) -> None:
        record, s, colours = self.record, self.session, self.colours
        if record is None:
            return
        self.query_one(TreePanel).show(record, s.vocabulary, colours, int(s.metadata.get("budget", 0) or 0))
        self.query_one(LogitsPanel).show(record, s.vocabulary, colours, s.thresholds.dlogit)
        self.query_one(CachePanel).show(record, colours, s.thresholds.cache)
        self.query_one(AnalyticsPanel).show_step(record)

    def redraw_run(self) -> None:
        if self.session.loaded:
            self.query_one(RunPanel).show(self.colours, self.cursor)

    def update_status(self) -> None:
        s, colours = self.session, self.colours
        text = Text()
        text.append(f" {s.name} ", style="bold")
        i = self.cursor
        if s.num_steps == 0:
            text.append(" no steps recorded yet" if s.loaded else " reading...")
        elif not s.has_row(i):
            text.append(f" step {i}/{s.num_steps - 1}  reading steps...")
        else:
            text.append(f" step {i}/{s.num_steps - 1}  P={int(s.columns['prefix_len'][i])} "
                        f"tau={int(s.columns['tau'][i])} ")
            flags = int(s.flags[i])
            names = [name for bit, name in FLAG_NAMES.items() if flags & bit]
            if names:
                text.append(" " + ", ".join(names) + " ", style=colours["bad"])
            if i in s.bookmarks:
                text.append(" bookmarked ", style=colours["bookmark"])
        if self.following:
            text.append(" following" + ("" if s.is_complete else " (recording)"), style=colours["warn"])
        if self.message:
            text.append("  " + self.message, style=colours["bad"])
        if self.bookmark_message:
            text.append("  " + self.bookmark_message, style=colours["bad"])
        self.status_text = text
        # One fixed-height line: a layout pass (and the frames it costs every step key) would change nothing.
        self.query_one("#status", Static).update(text, layout=False)

    def stop(self, reason: str) -> None:
        """End the app because the trace cannot be shown: exit status 2, ``reason`` printed by run_app."""
        if self.fatal is None:
            self.fatal = reason
        self.exit(return_code=2)

    def _handle_exception(self, error: Exception) -> None:
        """An unhandled exception: Textual (pinned, 8.2.8) would print a full-screen traceback and exit 1.
        What a damaged trace raises ends the app with one line instead (KDTREE_TUI_DEBUG=1 keeps Textual's
        traceback, for debugging the app itself)."""
        cause = getattr(error, "error", None)  # a worker's WorkerFailed carries the error it raised
        cause = cause if isinstance(cause, Exception) else error
        if os.environ.get("KDTREE_TUI_DEBUG") == "1" or not isinstance(cause, Exception):
            super()._handle_exception(error)
            return
        what = "" if isinstance(cause, TraceError) else f"{type(cause).__name__}: "
        self.fatal = self.fatal or f"{self.session.path}: cannot show this trace ({what}{_one_line(cause)})"
        self._return_code = 2
        self._exception_event.set()  # a test's pilot stops waiting (no exception to re-raise: it was reported)
        self._close_messages_no_wait()

    def show_error(self, message: str) -> None:
        self.message = message
        self.update_status()
        self.notify(message, severity="error", timeout=6)

    # -- navigation -----------------------------------------------------------------------------------
    def go_to(self, index: int, force: bool = False) -> None:
        """Make ``index`` (clamped) the current step and read its record in the background."""
        s = self.session
        if s.num_steps == 0:
            self.update_status()
            return
        index = max(0, min(int(index), s.num_steps - 1))
        self._at_end = self.following and index == s.num_steps - 1
        if index == self.cursor and not force and self.record is not None:
            return
        self.cursor = index
        self.query_one(StepList).cursor = index
        if self._both_loaded():
            self.query_one(ComparePanel).follow_step(index)
        if self.query_one(TabbedContent).active == "run":
            self.redraw_run()
        if self._file_busy():
            self.update_status()
            self.load_step(index)
        else:
            # One row, about a millisecond: read here, so the key's first frame already shows the step
            # (a worker's answer would come a frame later).
            self.on_step_loaded(self.read_step(index))

    def on_step_list_selected(self, message: StepList.Selected) -> None:
        self.go_to(message.index)

    def action_step(self, delta: int) -> None:
        self.go_to(self.cursor + delta)

    def action_first(self) -> None:
        self.go_to(0)

    def action_last(self) -> None:
        self.go_to(self.session.num_steps - 1)

    def action_go_to_step(self) -> None:
        if self.session.num_steps:
            self.push_screen(GoToStepScreen(self.session.num_steps),
                             lambda index: self.go_to(index) if index is not None else None)

    def _jump(self, found: Optional[int], what: str) -> None:
        if found is None:
            self.notify(f"no {what}", timeout=2)
        else:
            self.go_to(found)

    def action_next_anomaly(self) -> None:
        found = self.session.next_flagged(self.cursor, 1)
        self._jump(found, "anomaly after this step" if self.session.loaded or found is not None else
                   f"anomaly in the {self.session.rows} steps read so far")

    def action_previous_anomaly(self) -> None:
        self._jump(self.session.next_flagged(self.cursor, -1), "anomaly before this step")

    def action_toggle_bookmark(self) -> None:
        if self.session.num_steps:
            self.session.toggle_bookmark(self.cursor)
            saved, message = self.bookmark_file.save(self.session.bookmarks)
            self.query_one(StepList).refresh()
            self.bookmark_message = "" if saved else message
            self.update_status()
            if message:
                self.notify(message, severity="information" if saved else "error", timeout=6)

    def action_next_bookmark(self) -> None:
        self._jump(self.session.next_bookmark(self.cursor), "bookmarks (b sets one)")

    def action_tab(self, tab: str) -> None:
        if tab == "compare" and self.other is None:
            self.notify("no second trace (start with --compare OTHER)", timeout=3)
            return
        self._flush_tab(tab)
        self.query_one(TabbedContent).active = tab
        if tab == "run":
            self.redraw_run()

    def action_toggle_follow(self) -> None:
        self.following = not self.following
        if self.following and self._follow_timer is None:
            self._follow_timer = self.set_interval(FOLLOW_INTERVAL, self.poll_trace)
        elif not self.following and self._follow_timer is not None:
            self._follow_timer.stop()
            self._follow_timer = None
        self._at_end = self.following and self.cursor == self.session.num_steps - 1
        self.update_status()

    def action_toggle_theme(self) -> None:
        self.theme = "textual-light" if self.current_theme.dark else "textual-dark"

    def action_thresholds(self) -> None:
        self.push_screen(ThresholdsScreen(self.session.thresholds, self.session.metadata), self.set_thresholds)

    def set_thresholds(self, thresholds) -> None:
        """New anomaly thresholds for the shown trace (None: unchanged): flags, step list and views follow."""
        if thresholds is None:
            return
        self.session.set_thresholds(thresholds)
        self.query_one(StepList).reset()
        self.redraw_step()
        self.update_status()
        self.notify(f"anomalies: {thresholds.describe()}", timeout=4)

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.bookmark_file.path))

    def _shown_view(self):
        """The scrollable widget of the tab on screen (None: none)."""
        pane = self.query_one(TabbedContent).active_pane
        if pane is None:
            return None
        return next((w for w in pane.walk_children() if isinstance(w, ScrollableContainer)), None)

    def action_scroll_view(self, direction: int) -> None:
        """J / K: the view on screen half a page down (1) / up (-1)."""
        view = self._shown_view()
        if view is not None:
            view.scroll_relative(y=direction * max(1, view.scrollable_content_region.height // 2), animate=False)

    def action_scroll_view_x(self, direction: int) -> None:
        """H / L: the view on screen a quarter of its width left (-1) / right (1)."""
        view = self._shown_view()
        if view is not None:
            view.scroll_relative(x=direction * max(1, view.scrollable_content_region.width // 4), animate=False)

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        self._flush_tab(event.pane.id)
        if event.pane.id == "run":
            self.redraw_run()

    def _flush_tab(self, tab: Optional[str]) -> None:
        """A step panel only re-renders while its tab is shown (set_text): bring the one shown up to date."""
        panel = {"tree": TreePanel, "logits": LogitsPanel, "cache": CachePanel,
                 "analytics": AnalyticsPanel}.get(tab or "")
        if panel is not None:
            self.query_one(panel).flush()

    def _freeze_heap(self) -> None:
        """Once the columns are read, exempt every object alive now from the cyclic garbage collector.

        The startup heap (Textual, numpy, h5py, the widgets: ~80k objects) made each full collection,
        which the allocations of a few dozen step keys trigger, pause the app for 25-70 ms (the slowest
        keys); afterwards a full collection walks only objects made since. The few thousand unreachable
        startup objects frozen with them stay until on_unmount unfreezes the heap.
        """
        if not self._froze_heap:
            self._froze_heap = True
            gc.freeze()

    def on_unmount(self) -> None:
        self.session.close()
        if self.other is not None:
            self.other.close()
        if self._froze_heap:  # back to the collector (tests run many apps in one process)
            gc.unfreeze()


def _one_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def run_app(path: str, compare: Optional[str] = None, follow: bool = False, headless: bool = False,
            threshold_overrides: Optional[Mapping[str, Any]] = None) -> int:
    """Run the debugger on a trace; its exit status is the app's return code (0 after q). A file that is not a
    readable trace, or one the app cannot go on showing, prints one line and returns 2."""
    try:
        app = TraceApp(path, compare=compare, follow=follow, threshold_overrides=threshold_overrides)
    except TraceError as e:
        print(f"kdtree tui: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except (OSError, ValueError, TypeError, KeyError, IndexError, RuntimeError) as e:
        print(f"kdtree tui: error: {path}: cannot show this trace ({type(e).__name__}: {_one_line(e)})",
              file=sys.stderr)
        return 2
    app.run(headless=headless)
    if app.fatal:
        print(f"kdtree tui: error: {_one_line(app.fatal)}", file=sys.stderr)
    return app.return_code if app.return_code is not None else 0
