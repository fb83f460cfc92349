"""TextPanel: a scrollable Static showing one Rich Text, kept as ``.text`` (tests read ``.plain``)."""
from __future__ import annotations

from rich.text import Text
from textual.containers import VerticalScroll
from textual.widgets import Static


class TextPanel(VerticalScroll):
    """A scrolling panel whose content is re-rendered by ``render_text`` (subclasses) for each step."""

    DEFAULT_CSS = """
    TextPanel { height: 1fr; padding: 0 1; }
    TextPanel > Static { width: auto; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.text = Text("")
        self._body = Static(self.text)
        self._stale = False  # .text is newer than what the Static shows

    def compose(self):
        yield self._body

    def set_text(self, text: Text) -> None:
        """Show ``text``: now when the panel is on screen, else when it is shown (``flush``). Updating the
        Static relayouts the screen, which a hidden tab's panel need not cost every step."""
        self.text = text
        self._stale = True
        if self._shown():
            self.flush()

    def flush(self) -> None:
        """Put the latest text on screen (the panel's tab is about to be, or was just, shown)."""
        if self._stale:
            self._stale = False
            self._body.update(self.text)

    def on_show(self) -> None:
        self.flush()

    def _shown(self) -> bool:
        return all(node.display for node in self.ancestors_with_self)

    @property
    def plain(self) -> str:
        return self.text.plain
