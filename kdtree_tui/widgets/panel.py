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

    def compose(self):
        yield self._body

    def set_text(self, text: Text) -> None:
        self.text = text
        self._body.update(text)

    @property
    def plain(self) -> str:
        return self.text.plain
