"""Text charts drawn with Rich Text (no Textual): vertical column charts with a y axis and x labels, horizontal
bars. Pure functions of their numbers, so the tests read the drawing back as plain text."""
from __future__ import annotations

import math

import numpy as np
from rich.text import Text

EIGHTHS = " ▁▂▃▄▅▆▇█"


def column(value: float, top: float, height: int, row: int) -> str:
    """The block character of a column of ``value`` (0..top over ``height`` rows) at ``row`` (0 = the top row)."""
    if not math.isfinite(value) or top <= 0:
        return " "
    filled = max(0.0, min(1.0, value / top)) * height - (height - 1 - row)
    return EIGHTHS[int(round(max(0.0, min(1.0, filled)) * 8))]


def column_chart(values: list, top: float, height: int, y_labels: dict, x_labels: list, colours: dict,
                 style: str, cell: int = 1, gap: int = 0, marks: list | None = None) -> Text:
    """Columns of ``values`` (0..top), each ``cell`` characters wide with ``gap`` blanks after it.

    y_labels {row: label} (row 0 the top) right-aligned in a fixed gutter beside the axis; x_labels: one string per
    column (cut to the column's width) or, for dense charts, [(column, label)] pairs placed under those columns.
    marks: per column a value drawn as "·" in the gap-free cell right after the bar (a reference level), or None.
    """
    gutter = max((len(s) for s in y_labels.values()), default=0)
    text = Text()
    for row in range(height):
        text.append(f"{y_labels.get(row, ''):>{gutter}}┤" if row in y_labels else " " * gutter + "│",
                    style=colours["muted"])
        for i, v in enumerate(values):
            text.append(column(v, top, height, row) * cell, style=style)
            if gap:
                mark = marks[i] if marks else None
                here = mark is not None and math.isfinite(mark) and _row_of(mark, top, height) == row
                text.append("·" if here else " ", style=colours["bonus"])
                text.append(" " * (gap - 1))
        text.append("\n")
    width = len(values) * (cell + gap)
    text.append(" " * gutter + "└" + "─" * width + "\n", style=colours["muted"])
    axis = [" "] * width
    if x_labels and isinstance(x_labels[0], tuple):
        for col, label in x_labels:
            at = min(max(0, col * (cell + gap)), max(0, width - len(label)))
            axis[at:at + len(label)] = label
    else:
        for i, label in enumerate(x_labels):
            axis[i * (cell + gap):i * (cell + gap) + cell + gap] = f"{label:<{cell + gap}}"[:cell + gap]
    text.append(" " * (gutter + 1) + "".join(axis[:width]) + "\n", style=colours["muted"])
    return text


def _row_of(value: float, top: float, height: int) -> int:
    """The row (0 = top) where a level of ``value`` (0..top) sits."""
    level = max(0.0, min(1.0, value / top)) * height
    return max(0, min(height - 1, height - int(math.ceil(level)) if level > 0 else height - 1))


def hbar(value: float, top: float, width: int) -> str:
    """A horizontal bar of ``value`` (0..top) in ``width`` cells, eighths at its end."""
    if not math.isfinite(value) or top <= 0 or width <= 0:
        return ""
    eighths = int(round(max(0.0, min(1.0, value / top)) * width * 8))
    full, part = divmod(eighths, 8)
    return "█" * full + ("▏▎▍▌▋▊▉"[part - 1] if part else "")


def bucket_means(values, buckets: int) -> list:
    """``values`` averaged over at most ``buckets`` equal runs of consecutive entries (one per chart column)."""
    values = np.asarray(values, np.float64)
    if len(values) <= buckets:
        return values.tolist()
    edges = len(values) * np.arange(buckets + 1) // buckets
    return (np.add.reduceat(values, edges[:-1]) / np.diff(edges)).tolist()
