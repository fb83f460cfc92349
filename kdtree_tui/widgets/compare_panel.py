"""Two traces side by side, one row per committed position where either starts a step (Line API)."""
from __future__ import annotations

from rich.text import Text
from textual.cache import LRUCache
from textual.containers import Vertical
from textual.geometry import Region, Size
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.widgets import Static

from kdspec.kdtree_tui.compare import RUN_FIELDS, Alignment, align, compare_runs, run_facts
from kdspec.kdtree_tui.palette import palette
from kdspec.kdtree_tui.session import TraceSession


class AlignedRows(ScrollView, can_focus=False):
    DEFAULT_CSS = """
    AlignedRows > .aligned-rows--cursor { background: $primary 40%; }
    """
    COMPONENT_CLASSES = {"aligned-rows--cursor"}
    cursor: reactive[int] = reactive(0, always_update=True)

    def __init__(self, a: TraceSession, b: TraceSession, **kwargs) -> None:
        super().__init__(**kwargs)
        self.a, self.b = a, b
        self.alignment: Alignment | None = None
        self._strips: LRUCache[tuple, Strip] = LRUCache(512)

    def set_alignment(self, alignment: Alignment) -> None:
        self.alignment = alignment
        self._strips.clear()
        self.virtual_size = Size(self.size.width, alignment.num_rows)
        self.refresh()

    def watch_cursor(self, row: int) -> None:
        self.scroll_to_region(Region(0, row, 1, 1), animate=False, force=True, immediate=True)
        self.refresh()

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        row = scroll_y + y
        width = self.scrollable_content_region.width
        if self.alignment is None or row >= self.alignment.num_rows:
            return Strip.blank(width, self.rich_style)
        key = (row, row == self.cursor, width, self.app.current_theme.name)
        strip = self._strips.get(key)
        if strip is None:
            strip = Strip(list(self.row_text(row, width).render(self.app.console))).crop_extend(0, width, self.rich_style)
            if row == self.cursor:
                strip = strip.apply_style(self.get_component_rich_style("aligned-rows--cursor"))
            self._strips[key] = strip
        return strip

    def row_text(self, row: int, width: int) -> Text:
        """``P  A: step tau text  |  B: step tau text``, the row in red when the two commit different tokens."""
        al, colours = self.alignment, palette(self.app.current_theme.dark)
        half = max((width - 12) // 2, 10)
        differs = bool(al.differs[row])
        text = Text()
        text.append("!" if differs else " ", style=colours["diff"])
        text.append(f"{int(al.positions[row]):>7}  ", style=colours["muted"])
        for session, step, end in ((self.a, int(al.a_step[row]), " | "), (self.b, int(al.b_step[row]), "")):
            if step < 0:
                cell = Text(f"{'':<{half}}")
            else:
                tau = int(session.columns["tau"][step])
                cell = Text(f"{step:>6} t{tau:<2} ")
                cell.append(session.committed_line(step), style=colours["diff"] if differs else colours["accepted"])
                cell.truncate(half, pad=True)
            text.append_text(cell)
            text.append(end, style=colours["muted"])
        return text


class ComparePanel(Vertical):
    DEFAULT_CSS = """
    ComparePanel > #compare-header { height: auto; padding: 0 1; }
    ComparePanel > AlignedRows { height: 1fr; }
    """

    def __init__(self, a: TraceSession, b: TraceSession, **kwargs) -> None:
        super().__init__(**kwargs)
        self.a, self.b = a, b
        self.header = Text()

    def compose(self):
        yield Static(id="compare-header")
        yield AlignedRows(self.a, self.b, id="compare-rows")

    def realign(self) -> None:
        """Both traces' columns are loaded: recompute the alignment and the header."""
        alignment = align(self.a, self.b)
        rows = self.query_one(AlignedRows)
        rows.set_alignment(alignment)
        colours = palette(self.app.current_theme.dark)
        self.header = compare_header(self.a, self.b, alignment, colours)
        self.query_one("#compare-header", Static).update(self.header)

    def follow_step(self, a_step: int) -> None:
        rows = self.query_one(AlignedRows)
        if rows.alignment is not None:
            rows.cursor = rows.alignment.row_of_a_step(a_step)


def compare_header(a: TraceSession, b: TraceSession, alignment: Alignment, colours: dict) -> Text:
    """Per trace its name, run (model, drafter, mode, budget, backend, precision, seed; what differs between the two
    in the warning colour), steps and mean tau; then the verdict: identical only when model, prompt and every
    committed token agree, else why not."""
    comparison = compare_runs(a, b, alignment)
    header = Text()
    for label, s in (("A", a), ("B", b)):
        facts = run_facts(s)
        tau = s.columns["tau"]
        header.append(f"{label}: {s.name}  ", style="bold")
        for name in RUN_FIELDS:
            header.append(f"{name} {facts[name]}  ", style=colours["warn"] if name in comparison.differences else "")
        header.append(f"{s.num_steps} steps, mean tau {tau.mean() if len(tau) else float('nan'):.2f}\n")
    both = int(((alignment.a_step >= 0) & (alignment.b_step >= 0)).sum())
    header.append(f"{alignment.num_rows} step starts, {both} shared; {int(alignment.differs.sum())} rows differ; ",
                  style=colours["label"])
    if comparison.identical:
        header.append("same model and prompt, committed tokens identical", style=colours["ok"])
    else:
        header.append("the runs differ: " + "; ".join(comparison.reasons), style=colours["diff"])
    return header
