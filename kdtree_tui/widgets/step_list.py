"""StepList: one line per step, drawn with the Line API so a 100k-step trace scrolls instantly.

Each line comes from the session's columns (read once), never from the file; a step whose columns are
not read yet shows a placeholder. Rendered strips sit in a small LRU cache (a few screens) keyed by
everything they show (step, cursor, bookmark, width, theme); the cache is cleared when the columns are
replaced (more rows read, follow mode) or the theme changes.
"""
from __future__ import annotations

from rich.style import Style
from rich.text import Text
from textual.binding import Binding
from textual.cache import LRUCache
from textual.events import Click
from textual.geometry import Region, Size
from textual.message import Message
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

from kdspec.kdtree_tui.palette import palette
from kdspec.kdtree_tui.session import CACHE, DIVERGED, DLOGIT, LOW_TAU, TraceSession

FLAG_MARKS = ((DIVERGED, "x", "bad"), (DLOGIT, "d", "warn"), (LOW_TAU, "s", "warn"), (CACHE, "c", "bad"))
BOOKMARK, PREFIX, TAU = "*", "P", "t"  # a line: bookmark mark, step, P<prefix length>, t<tau>, flags, text
TERMS = (BOOKMARK, PREFIX, TAU) + tuple(mark for _, mark, _ in FLAG_MARKS)  # each explained by screens.GLOSSARY


class StepList(ScrollView, can_focus=True):
    """The steps of a trace; ``cursor`` is the current step (the app owns navigation)."""

    DEFAULT_CSS = """
    StepList { width: 36; border-right: solid $primary-muted; overflow-x: hidden; }
    StepList > .step-list--cursor { background: $primary 40%; text-style: bold; }
    """
    COMPONENT_CLASSES = {"step-list--cursor"}
    # The scroll keys move the current step instead of only scrolling (ScrollView would take them).
    BINDINGS = [Binding("down", "app.step(1)", show=False), Binding("up", "app.step(-1)", show=False),
                Binding("pagedown", "app.step(10)", show=False), Binding("pageup", "app.step(-10)", show=False),
                Binding("home", "app.first", show=False), Binding("end", "app.last", show=False)]
    # repaint=False: watch_cursor repaints what changed (the whole list only when it scrolls).
    cursor: reactive[int] = reactive(0, always_update=True, repaint=False)

    class Selected(Message):
        """The user clicked a step."""

        def __init__(self, index: int) -> None:
            super().__init__()
            self.index = index

    def __init__(self, session: TraceSession, **kwargs) -> None:
        super().__init__(**kwargs)
        self.session = session
        self._strips: LRUCache[tuple, Strip] = LRUCache(1024)
        self.painted = False  # a line has been drawn (the app waits for it to start reading columns)
        self._base_style = Style()  # self.rich_style, set per frame by render_lines

    def on_mount(self) -> None:
        self.reset()

    def reset(self) -> None:
        """The columns or the theme changed: forget rendered lines and resize."""
        self._strips.clear()
        self.virtual_size = Size(self.size.width, max(self.session.num_steps, 1))
        self.refresh()

    def watch_cursor(self, old: int, new: int) -> None:
        top = self.scroll_offset.y
        self.scroll_to_region(Region(0, new, 1, 1), animate=False, force=True, immediate=True)
        if self.scroll_offset.y == top:  # a scroll repaints every line itself; else only the two cursor rows
            self.refresh_line(old)
            self.refresh_line(new)

    def render_lines(self, crop: Region) -> list[Strip]:
        # The widget's style, once per frame: rich_style walks every ancestor (0.1 ms a call, per line).
        self._base_style = self.rich_style
        return super().render_lines(crop)

    def render_line(self, y: int) -> Strip:
        self.painted = True
        scroll_x, scroll_y = self.scroll_offset
        index = scroll_y + y
        width = self.scrollable_content_region.width
        base = self._base_style
        if index >= self.session.num_steps:
            return Strip.blank(width, base)
        is_cursor = index == self.cursor
        if not self.session.has_row(index):
            strip = Strip(list(Text(f" {index:>6} reading...", style="italic").render(self.app.console)))
            strip = strip.crop_extend(0, width, base)
            if is_cursor:
                strip = strip.apply_style(self.get_component_rich_style("step-list--cursor"))
            return strip.crop(scroll_x, scroll_x + width)
        key = (index, is_cursor, index in self.session.bookmarks, width, self.app.current_theme.name)
        strip = self._strips.get(key)
        if strip is None:
            text = self.line_text(index)
            strip = Strip(list(text.render(self.app.console))).crop_extend(0, width, base)
            if is_cursor:
                strip = strip.apply_style(self.get_component_rich_style("step-list--cursor"))
            self._strips[key] = strip
        return strip.crop(scroll_x, scroll_x + width)

    def line_text(self, index: int) -> Text:
        """``  step  P=prefix  tau  flags  committed text`` for one step."""
        s, colours = self.session, palette(self.app.current_theme.dark)
        c = s.columns
        flags = int(s.flags[index])
        text = Text()
        text.append(BOOKMARK if index in s.bookmarks else " ", style=colours["bookmark"])
        text.append(f"{index:>6} ")
        text.append(f"{PREFIX}{int(c['prefix_len'][index]):<6}", style=colours["muted"])
        text.append(f"{TAU}{int(c['tau'][index]):<2} ")
        for bit, mark, colour in FLAG_MARKS:
            text.append(mark if flags & bit else " ", style=colours[colour])
        text.append(" ")
        text.append(s.committed_line(index), style=colours["step_a" if index % 2 == 0 else "step_b"])
        return text

    def on_click(self, event: Click) -> None:
        index = int(self.scroll_offset.y + event.y)
        if 0 <= index < self.session.num_steps:
            self.post_message(self.Selected(index))
