"""The analytics view: why the current step's tau was what it was, then the whole trace's acceptance per depth,
tau over steps, the rank of the target's token in the drafter's list, the drafter's calibration and the budget
curve (traces/analytics.py computes them, in a worker, when the view is first shown)."""
from __future__ import annotations

import math
import textwrap
from typing import Callable, Optional

import numpy as np
from rich.text import Text

from kdspec.kdtree_tui.palette import palette
from kdspec.kdtree_tui.widgets.charts import bucket_means, column_chart, hbar
from kdspec.kdtree_tui.widgets.panel import TextPanel
from kdspec.traces.analytics import TraceAnalytics, WhyTau, analyze, folded_rank_histogram, why_tau
from kdspec.traces.analytics_report import shown_budgets
from kdspec.traces.schema import TraceError

CHART_HEIGHT = 6
RELIABILITY_HEIGHT = 8
RANK_COLUMNS = 6   # ranks shown one column each; the rest summed into "rN+"
WHY_SEARCH = 1024  # pops replayed per step key to find the budget a missing node needed
READ_ERRORS = (TraceError, OSError, IndexError, KeyError, ValueError, RuntimeError)
# Section titles and table headers (rN: drafter rank N; rN+: ranks N and up), each explained by screens.GLOSSARY.
SECTIONS = ("stops", "acceptance", "given d-1", "tau over steps", "target token's rank", "calibration", "ECE",
            "budget curve", "chain", "cost")
RANK_HEAD = ("d", "rN", "rN+", "none", "n")
CALIBRATION_HEAD = ("d", "rN said→got")
BUDGET_HEAD = ("B'", "tau", "tok/s", "best")
TERMS = SECTIONS + RANK_HEAD + CALIBRATION_HEAD + BUDGET_HEAD


def render_why(why: Optional[WhyTau], token_text: Callable[[int], str], colours: dict, width: int = 76) -> Text:
    """The current step's stop: the depth, the target's token, the drafter's rank / lp and the budget needed."""
    text = Text()
    if why is None:
        return text
    if why.depth is None:
        return _wrapped(text, f"step {why.step}: tau {why.tau}, {why.reason}", width, colours["label"])
    _wrapped(text, f"step {why.step}: tau {why.tau}; depth {why.depth}: target chose {token_text(why.token)!r}",
             width, colours["label"])
    if why.rank is None:
        _wrapped(text, "  not in the drafter's top-K", width, colours["bad"])
    else:
        needed = "beyond the search" if why.budget_needed is None else f"budget {why.budget_needed} holds it"
        _wrapped(text, f"  drafter rank {why.rank}, lp {why.logprob:+.2f} (p {math.exp(why.logprob):.2f})", width, "")
        _wrapped(text, f"  in tree: {'yes' if why.in_tree else 'no'}; {needed}", width, colours["warn"])
    if not why.best_first:
        _wrapped(text, "  tree is not the best-first build of its draft", width, colours["bad"])
    return text


def render_acceptance(a: TraceAnalytics, colours: dict, width: int) -> Text:
    text = Text("acceptance: share of steps reaching d\n", style=colours["label"])
    if not a.num_depths:
        return text.append("  no drafted depths (AR trace)\n", style=colours["muted"])
    cell, gap = (2, 1) if a.num_depths <= 12 else (1, 0)
    labels = {0: "100%", CHART_HEIGHT // 2: "50%"}
    text.append_text(column_chart(a.reached.tolist(), 1.0, CHART_HEIGHT, labels, [f"{d}" for d in range(1, a.num_depths + 1)],
                                  colours, colours["step_b"], cell, gap))
    return _wrapped(text, "  given d-1: " + " ".join(_pct(c) for c in a.conditional), width, colours["muted"])


def render_tau_over_steps(a: TraceAnalytics, colours: dict, width: int) -> Text:
    top = a.num_depths + 1
    mean = float(a.tau.mean()) if a.num_steps else float("nan")
    text = Text(f"tau over steps (mean {mean:.2f}, max {top})\n", style=colours["label"])
    if not a.num_steps:
        return text
    gutter = len(str(top))
    cols = max(8, width - gutter - 2)
    values = bucket_means(a.tau, cols)
    last = f"{a.num_steps - 1}"
    xs = [(0, "0"), (len(values) // 2 - 2, "step"), (len(values) - len(last), last)]
    text.append_text(column_chart(values, top, CHART_HEIGHT, {0: str(top), CHART_HEIGHT - 1: "1"}, xs, colours,
                                  colours["step_a"]))
    return text


def render_rank_histogram(a: TraceAnalytics, colours: dict) -> Text:
    text = Text("target token's rank in the drafter list\n", style=colours["label"])
    if not a.num_depths:
        return text
    labels, histogram = folded_rank_histogram(a.rank_histogram, RANK_COLUMNS)
    heads = labels[:-1] + [RANK_HEAD[3]]
    text.append(f"{RANK_HEAD[0]:>4}" + "".join(f"{h:>5}" for h in heads) + f"{RANK_HEAD[-1]:>7}\n",
                style=colours["muted"])
    for d, row in enumerate(histogram, 1):
        cells = [int(c) for c in row]
        n = int(row.sum())
        text.append(f"{d:>4}")
        best = int(np.argmax(cells)) if n else -1
        for i, c in enumerate(cells):
            style = colours["bad"] if i == len(cells) - 1 and c else colours["accepted"] if i == best else ""
            text.append(f"{_pct(c / n) if n else '-':>5}", style=style)
        text.append(f"{n:>7}\n", style=colours["muted"])
    return text


def render_reliability(a: TraceAnalytics, colours: dict, width: int) -> Text:
    c = a.calibration
    text = Text()
    _wrapped(text, f"calibration: ECE {c.ece:.3f} over {int(c.bin_count.sum())} forecasts; top-1 ECE "
                   f"{c.ece_top1:.3f} over {int(c.top1_bin_count.sum())}", width, colours["label"])
    if not c.bin_count.sum():
        return text
    xs = [(0, "0"), (5, ".5"), (len(c.bin_count) - 1, "1")]
    text.append_text(column_chart(c.bin_measured.tolist(), 1.0, RELIABILITY_HEIGHT, {0: "1.0", RELIABILITY_HEIGHT // 2: ".5"},
                                  xs, colours, colours["step_a"], 2, 1, c.bin_stated.tolist()))
    _wrapped(text, "  x: stated p; bar: measured rate; · stated (calibrated: the bar ends at its ·)", width,
             colours["muted"])
    ranks = min(a.draft_topk, 3)
    text.append(f"{CALIBRATION_HEAD[0]:>4}" + "".join(f"{f'r{r} said→got':>12}" for r in range(ranks)) + "\n",
                style=colours["muted"])
    for d in range(a.num_depths):
        cells = [f"{c.stated[d, r]:.2f}→{c.measured[d, r]:.2f}" if c.count[d, r] else "-" for r in range(ranks)]
        text.append(f"{d + 1:>4}" + "".join(f"{x:>12}" for x in cells) + "\n")
    return text


def render_budget_curve(a: TraceAnalytics, colours: dict, width: int) -> Text:
    curve = a.curve
    rate = curve.tokens_per_second
    text = Text("budget curve: exact tau per budget B'\n", style=colours["label"])
    text.append(f"{BUDGET_HEAD[0]:>5} {BUDGET_HEAD[1]:>6} {BUDGET_HEAD[2]:>8}\n", style=colours["muted"])
    values = rate if rate is not None else curve.mean_tau
    top = max((v for v in values if math.isfinite(v)), default=1.0)
    for i in shown_budgets(curve.budgets, curve.best_budget):
        b = curve.budgets[i]
        best = b == curve.best_budget
        text.append(f"{b:>5} {curve.mean_tau[i]:>6.2f} {rate[i] if rate else float('nan'):>8.1f} ",
                    style=colours["accepted"] if best else "")
        text.append(hbar(values[i], top, max(4, width - 27)), style=colours["step_b"])
        text.append(" best\n" if best else "\n", style=colours["bonus"])
    if a.num_depths:
        chain = "unknown" if curve.chain_mean_tau is None else f"{curve.chain_mean_tau:.2f}"
        line = f"chain (top-1 per depth, budget {a.num_depths}): tau {chain} on {curve.chain_known_steps}/" \
               f"{a.num_steps} steps"
        if curve.chain_known_steps < a.num_steps:
            line += " (the rest: a chain node not in the tree)"
        if curve.chain_tokens_per_second is not None:
            line += f", {curve.chain_tokens_per_second:.1f} tok/s"
        _wrapped(text, line, width, colours["muted"])
    if curve.cost is not None:
        _wrapped(text, f"cost: {curve.cost.source}; {curve.cost.note}", width, colours["muted"])
    if curve.steps_not_best_first:
        _wrapped(text, f"{curve.steps_not_best_first}/{curve.steps_checked} checked trees are not best-first: "
                 "smaller budgets are estimates", width, colours["bad"])
    return text


def render_analytics(a: TraceAnalytics, colours: dict, width: int) -> Text:
    """Every whole-trace section, one after the other."""
    c = a.curve
    text = _wrapped(Text(), f"{a.num_steps} steps, L {a.num_depths}, K {a.draft_topk}, B {a.budget}; best budget "
                    f"{'-' if c.best_budget is None else c.best_budget}", width, colours["muted"])
    _wrapped(text, "stops: " + ", ".join(f"{k} {v}" for k, v in a.stops.items()), width, colours["muted"])
    for part in (render_acceptance(a, colours, width), render_tau_over_steps(a, colours, width),
                 render_rank_histogram(a, colours), render_reliability(a, colours, width),
                 render_budget_curve(a, colours, width)):
        text.append_text(part)
        text.append("\n")
    return text


def _wrapped(text: Text, line: str, width: int, style: str) -> Text:
    """``line`` appended to ``text`` wrapped at ``width`` (continuations indented by two)."""
    for part in textwrap.wrap(line, max(30, width), subsequent_indent="  "):
        text.append(part + "\n", style=style)
    return text


def _pct(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x:.0%}"


class AnalyticsPanel(TextPanel):
    """Key 6. The whole-trace analytics are computed once per step count, in a thread, when first shown."""

    def __init__(self, session, **kwargs) -> None:
        super().__init__(**kwargs)
        self.session = session
        self.analytics: Optional[TraceAnalytics] = None
        self.error = ""
        self.record = None
        self._computed_for = -1        # step count the analytics are of (or being computed for)
        self._trace_text: tuple = ((), Text())  # (key, render_analytics of it)

    def on_mount(self) -> None:
        self.app.theme_changed_signal.subscribe(self, lambda _theme: self.redraw())

    def on_show(self) -> None:
        steps = int(self.session.num_steps)
        if steps != self._computed_for:
            self._computed_for = steps
            self.run_worker(self._analyze, thread=True, exclusive=True, group="analytics")
        super().on_show()

    def _analyze(self) -> None:
        try:
            result, error = analyze(self.session.reader), ""
        except READ_ERRORS as e:  # a damaged trace: say so in the view, never take the app down
            result, error = None, str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        self.app.call_from_thread(self._install, result, error)

    def _install(self, analytics: Optional[TraceAnalytics], error: str) -> None:
        self.analytics, self.error = analytics, error
        self.redraw()

    def show_step(self, record) -> None:
        """The current step (its "why" heads the view)."""
        self.record = record
        self.redraw()

    def redraw(self) -> None:
        self.set_text(self.render_text)

    def render_text(self) -> Text:
        colours = palette(self.app.current_theme.dark)
        width = self.scrollable_content_region.width or 76
        if not self.show_vertical_scrollbar:  # the text is long: the scroll bar arrives with it
            width -= self.styles.scrollbar_size_vertical
        text = Text()
        if self.record is not None:
            budget = int(self.session.metadata.get("budget", 0) or 0)
            why = why_tau(self.record, budget, WHY_SEARCH)
            text.append_text(render_why(why, self.session.vocabulary.token_text, colours, width))
        if self.error:
            return text.append(f"analytics: {self.error}\n", style=colours["bad"])
        if self.analytics is None:
            return text.append("computing analytics...\n", style=colours["muted"])
        key = (id(self.analytics), self.app.current_theme.name, width)
        if self._trace_text[0] != key:
            self._trace_text = (key, render_analytics(self.analytics, colours, width))
        text.append_text(self._trace_text[1])
        return text
