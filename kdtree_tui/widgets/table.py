"""Fixed-width text tables that fit the width a panel gets: the columns that do not fit are dropped, least
important first (pure functions, no Textual). A column's name is its header; screens.GLOSSARY explains each."""
from __future__ import annotations

import textwrap
from dataclasses import dataclass

from rich.text import Text

ELLIPSIS = "…"


@dataclass(frozen=True)
class Column:
    """name: the header; width: cells; align: "<" or ">"; drop: 0 = always shown, else the columns with the
    highest drop go first when the table is too wide."""

    name: str
    width: int
    align: str = ">"
    drop: int = 0


def fit(columns: tuple[Column, ...], width: int, gap: int = 1) -> tuple[Column, ...]:
    """``columns`` (in their order) less the most droppable ones until the row fits ``width`` cells."""
    shown = list(columns)
    while table_width(shown, gap) > width:
        droppable = [c for c in shown if c.drop]
        if not droppable:
            break
        shown.remove(max(droppable, key=lambda c: c.drop))
    return tuple(shown)


def table_width(columns, gap: int = 1) -> int:
    return sum(c.width for c in columns) + gap * max(0, len(columns) - 1)


def cell(text: str, width: int, align: str = "<") -> str:
    """``text`` in exactly ``width`` cells: padded, or cut with an ellipsis."""
    if len(text) > width:
        text = text[:max(0, width - 1)] + ELLIPSIS if width > 0 else ""
    return f"{text:{align}{width}}"


def header(columns, gap: int = 1) -> str:
    return (" " * gap).join(cell(c.name, c.width, c.align) for c in columns)


def wrapped(text: Text, line: str, width: int, style: str = "", indent: str = "  ") -> Text:
    """``line`` appended to ``text`` wrapped at ``width`` (continuations indented by ``indent``)."""
    for part in textwrap.wrap(line, max(20, width), subsequent_indent=indent, break_on_hyphens=False) or [""]:
        text.append(part + "\n", style=style)
    return text


def wrapped_chunks(text: Text, chunks: list[str], width: int, style: str = "", first: str = "  ",
                   indent: str = "    ", sep: str = "  ") -> Text:
    """``chunks`` joined by ``sep`` and appended to ``text`` in lines of at most ``width`` cells, never breaking
    a chunk (one longer than a line gets a line of its own); the first line starts with ``first``, the rest
    with ``indent``."""
    line = first
    for chunk in chunks:
        if line.strip() and len(line) + len(sep) + len(chunk) > width:
            text.append(line + "\n", style=style)
            line = indent
        line += (sep if line.strip() else "") + chunk
    if line.strip():
        text.append(line + "\n", style=style)
    return text


def token_cell(shown: str, width: int) -> str:
    """A token's repr cut to ``width`` cells (the ellipsis inside the quotes, so it still reads as a token)."""
    if len(shown) <= width:
        return shown
    return shown[:max(1, width - 2)] + ELLIPSIS + shown[-1]
