"""TextPanel: a scrollable view of one Rich Text, kept as ``.text`` (tests read ``.plain``), drawn with the
Line API (like the step list): a new step's text repaints only the panel's visible lines.

A Static inside a VerticalScroll re-measured and re-rendered the whole text and relaid out the screen twice
per step (its size changed, then its scroll container's), which cost each step key two extra frames.
"""
from __future__ import annotations

from typing import Callable, Union

from rich.style import Style
from rich.text import Text
from textual.geometry import Region, Size
from textual.scroll_view import ScrollView
from textual.selection import Selection
from textual.strip import Strip
from textual.widget import Widget

TextSource = Union[Text, Callable[[], Text]]
DEFAULT_TEXT_WIDTH = 76  # a panel's text width before its first layout (an 80-column terminal's modal)


class TextPanel(ScrollView):
    """A scrolling panel whose content is re-rendered by ``render_text`` (subclasses) for each step."""

    DEFAULT_CSS = """
    TextPanel { height: 1fr; padding: 0 1; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._text = Text("")
        self._make_text: Callable[[], Text] | None = None  # deferred .text (set while hidden)
        self._lines: list[Text] = []         # .text split at newlines (what is on screen)
        self._strips: dict[int, Strip] = {}  # line index -> rendered line (no base style), current lines only
        self._stale = False                  # .text is newer than what is on screen
        self._base_style = Style()           # self.rich_style, set per frame by render_lines

    @property
    def text(self) -> Text:
        """The latest text given to set_text (made now if it was deferred)."""
        if self._make_text is not None:
            self._text, self._make_text = self._make_text(), None
        return self._text

    @property
    def plain(self) -> str:
        return self.text.plain

    def set_text(self, text: TextSource) -> None:
        """Show ``text`` (or what a callable returns: made only when needed): now when the panel is on
        screen, else when it is shown (``flush``), so a hidden tab's panel costs a step key nothing."""
        self._text, self._make_text = (text, None) if isinstance(text, Text) else (Text(""), text)
        self._stale = True
        if self._shown():
            self.flush()

    def flush(self) -> None:
        """Put the latest text on screen (the panel's tab is about to be, or was just, shown)."""
        if not self._stale:
            return
        self._stale = False
        self._lines = self.text.split("\n")  # a trailing newline ends the last line, it adds none
        self._strips.clear()
        width = max((line.cell_len for line in self._lines), default=0)
        self._set_virtual_size(Size(width, len(self._lines)))
        self.refresh()

    def _set_virtual_size(self, size: Size) -> None:
        """The scrollable size, without relaying out the screen when only the scroll range changes.

        Assigning ``virtual_size`` relays out the whole screen, and after any layout Textual repaints every
        ScrollView's scroll bar in a frame of its own. The panel's region does not depend on its content
        (``1fr`` of the tab), so that layout would only update the scroll bars and the scroll range, which
        is what Widget._scroll_update does (textual is pinned in pyproject.toml). A scroll bar that has to
        appear or disappear still relays out (its reactive asks for a layout).
        """
        if size == self.virtual_size:
            return
        if not self.container_size:  # not laid out yet: the first layout sizes everything
            self.virtual_size = size
            return
        self.set_reactive(Widget.virtual_size, size)
        self._scroll_update(size)

    def on_show(self) -> None:
        self.flush()

    def text_width(self) -> int:
        """The cells a line may take without a horizontal scroll: the content width less the vertical scroll bar
        (counted whether or not it shows now, so the answer does not change when a longer text brings it);
        DEFAULT_TEXT_WIDTH before the panel is laid out."""
        width = self.scrollable_content_region.width
        if width <= 0:
            return DEFAULT_TEXT_WIDTH
        return width - (0 if self.show_vertical_scrollbar else self.styles.scrollbar_size_vertical)

    def render_lines(self, crop: Region) -> list[Strip]:
        # The widget's style, once per frame: rich_style walks every ancestor (0.1 ms a call, per line).
        self._base_style = self.rich_style
        return super().render_lines(crop)

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        index = scroll_y + y
        width = self.scrollable_content_region.width
        base = self._base_style
        if index >= len(self._lines):
            return Strip.blank(width, base)
        strip = self._strips.get(index)
        if strip is None:
            strip = self._render_text_line(index)
        # The base style under the text's own (it changes with the theme and focus; a Strip caches this).
        # Offsets: which character is where, for selecting text with the mouse.
        return strip.apply_style(base).crop_extend(scroll_x, scroll_x + width, base).apply_offsets(scroll_x, index)

    def _render_text_line(self, index: int) -> Strip:
        """Line ``index`` as a Strip (no base style), the mouse selection highlighted; cached without one."""
        line = self._lines[index]
        selection = self.text_selection
        span = selection.get_span(index) if selection is not None else None
        if span is not None:
            start, end = span
            line = line.copy()
            line.stylize(self.screen.get_component_rich_style("screen--selection"), start,
                         len(line) if end == -1 else end)
        strip = Strip(list(line.render(self.app.console)), line.cell_len)
        if selection is None:
            self._strips[index] = strip
        return strip

    def get_selection(self, selection: Selection) -> tuple[str, str] | None:
        """The selected text (lines as on screen)."""
        return selection.extract("\n".join(line.plain for line in self._lines)), "\n"

    def selection_updated(self, selection: Selection | None) -> None:
        self._strips.clear()
        self.refresh()

    def _shown(self) -> bool:
        return all(node.display for node in self.ancestors_with_self)
