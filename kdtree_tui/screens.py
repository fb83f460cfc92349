"""Modal screens: help (keys, and every column and term the views show) and go to step N."""
from __future__ import annotations

import textwrap

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Input, Static

HELP_WIDTH = 72  # the help's text width: 78-cell box less border, padding and scroll bar (fits 80 columns)
KEY_WIDTH = 20
TERM_WIDTH = 14

HELP_ROWS = (
    ("j / down, k / up", "next / previous step"),
    ("pagedown / pageup", "10 steps forward / back"),
    ("home / end", "first / last step"),
    ("g", "go to step N"),
    ("n / p", "next / previous anomaly (divergence, |dlogit|, low tau, cache)"),
    ("b / B", "toggle bookmark / next bookmark (kept in a side file: see bookmarks)"),
    ("J / K", "scroll the view down / up half a page (also the mouse wheel)"),
    ("H / L", "scroll the view left / right (wide trees)"),
    ("tab / shift+tab", ("move the focus: step list, tab bar (left / right change the view), the view (up / "
                         "down / pageup / pagedown / home / end then scroll it; j / k still step)")),
    ("1 2 3 4 5 6", "tree, logits, cache, run, compare, analytics view"),
    ("f", "follow a trace being recorded (on / off)"),
    ("t", "anomaly thresholds of this trace (|dlogit|, cache, min tau)"),
    ("d", "dark / light theme"),
    ("ctrl+p", "command palette: go to step, search text"),
    ("?", "this help (esc, q or ? closes it; j / k, arrows, pageup / pagedown scroll it)"),
    ("q", "quit"),
)

# (section, ((terms, meaning), ...)): every column header, abbreviation and glyph the views show. The terms are
# the strings as shown; tests check each widget's exported headers against this table.
GLOSSARY = (
    ("terms", (
        (("tau", "τ"), ("tokens a step commits: the accepted drafted tokens plus the bonus (the target's own "
                        "next token), 1 .. L+1")),
        (("P",), "prefix length: tokens committed before the step (its first committed position is P+1)"),
        (("L", "K", "B"), ("drafted depths (block size - 1), the drafter's top-K per depth, the tree budget "
                           "(non-root nodes)")),
        (("golden",), "the float64 reference run of the same weights, position by position"),
        (("anomaly",), "a step flagged in the step list (thresholds: key t); n / p jump between them"),
    )),
    ("step list", (
        (("*",), "bookmarked step"),
        (("P",), "P<n>: prefix length before the step"),
        (("t",), "t<n>: tau of the step"),
        (("x",), "golden divergence: a committed token differs from the golden's"),
        (("d",), "|dlogit| over the threshold at a committed position"),
        (("s",), "short: tau below the threshold (DDTree runs)"),
        (("c",), "cache mismatch: the compacted KV cache differs from the golden's"),
    )),
    ("tree view (1)", (
        (("tree",), "the draft tree, depth-first; each node's mark and token, indented by depth"),
        (("o", "."), "accepted node (on the accepted path) / rejected node"),
        (("|-", "`-"), "branch guides, two cells a level; narrow panels use + and ` one cell a level"),
        (("+", "`"), "compact branch guides (a middle child / the last child)"),
        (("target",), ("the target's choice at the node: the token it predicts after the node's path (where "
                       "it equals a child's token the walk goes on to that child)")),
        (("node",), "node index, in pop order of the best-first build (0 = the root, the carried bonus)"),
        (("d",), "drafted depth of the node (root 0); its position is P + d"),
        (("r",), "drafter rank of the node's token at its depth (0 = the drafter's top choice)"),
        (("lp",), "the drafter's log-prob of the token at that rank and depth (nats)"),
        (("score",), ("cumulative log-prob of the node's path (sum of lp from the root): what the "
                      "best-first build pops by")),
        (("note",), "bonus or x (below) beside a node"),
        (("bonus",), "the last accepted node: its target choice is the bonus token, committed for free"),
        (("x",), ("the node where the engine's token first differs from the golden's (the line above the "
                  "table names the golden's token)")),
        (("accepted",), "the accepted path, root first"),
        (("why tau",), ("where the walk stopped: the depth, the token the target chose there, the drafter's "
                        "rank r and lp of it (or not drafted at all), whether the tree held it and the "
                        "smallest budget whose best-first tree would have (B is the trace's budget)")),
    )),
    ("logits view (2)", (
        (("pos",), "absolute position of the committed token (P+1 ..)"),
        (("node",), "the accepted node whose logits chose it"),
        (("engine",), "the engine's token there: the target's choice (committed)"),
        (("golden",), "the golden's token at the position (- when the golden does not reach it)"),
        (("|dlogit|",), "max over the vocabulary of |engine logit - golden logit| there"),
        (("margin",), "the target's top-1 minus top-2 logit: a small margin makes a flip a near-tie"),
        (("verdict",), "engine vs golden token (traces/analytics.py near_tie_verdict), one of:"),
        (("ok",), "the tokens agree"),
        (("near-tie",), ("a flip whose logit gap (engine's token minus the golden's, in the engine's own "
                         "logits) is within the numeric noise (2x the |dlogit| threshold)")),
        (("logits off",), ("a flip with a gap above the noise but within 2|dlogit|: the logits are off by "
                           "more than the precision allows (logit error)")),
        (("MISMATCH",), ("a flip the numbers do not explain: the gap exceeds both, or the golden token is "
                         "not even in the engine's top-k")),
        (("no golden",), "no golden token recorded at the position"),
        (("top-k",), "the target's top-8 tokens and logits at the node"),
        (("p",), "--save-logits traces: a token's softmax probability, engine and golden side by side"),
        (("TV",), "total variation: half the sum over the vocabulary of |p engine - p golden|"),
        (("max|Δ|",), "max over the vocabulary of |engine logit - golden logit| from the saved logits"),
    )),
    ("cache view (3)", (
        (("prefix length P",), "cache rows before the step"),
        (("verify wrote rows",), "the rows the verify forward wrote, one per tree node"),
        (("accepted nodes",), "the accepted path, whose rows are kept"),
        (("new length",), "cache length after compaction: P + tau"),
        (("golden AR cache",), "max |engine - golden| over the kept rows, against the threshold"),
        (("compaction moves",), "row P + accepted[j] moves to row P + j"),
        (("moved", "stays"), "a move that copies a row / one already in place"),
        (("rejected rows dropped",), "rows of rejected nodes, free again"),
    )),
    ("run view (4)", (
        (("model", "mode", "decode", "prompt"), "the trace's model, backend, decode settings and prompt"),
        (("tau histogram",), "steps by tau; the sparkline above it: tau over the steps"),
        (("acceptance by depth",), "share of steps whose accepted path reached depth d"),
        (("stage timings",), "draft, build, verify, accept, compact and trace write: total, per step"),
        (("output",), "the committed text around the current step (underlined)"),
    )),
    ("compare view (5)", (
        (("compare",), ("two traces (--compare) aligned by position: a row where either starts a step, "
                        "marked where their tokens differ")),
    )),
    ("analytics view (6)", (
        (("why this tau",), "the current step's stop, as in the tree view"),
        (("stops",), ("steps by why they stopped: block full, not drafted, outside the tree (a bigger "
                      "budget recovers those)")),
        (("acceptance",), "chart: share of steps whose path reached depth d"),
        (("given d-1",), "acceptance at d among steps that reached d-1"),
        (("tau over steps",), "chart: tau per step, averaged into one column per run of steps"),
        (("target token's rank",), ("rank histogram: per depth d, how often the target's token sat at "
                                    "drafter rank r (the gain of widening the tree)")),
        (("d",), "drafted depth"),
        (("rN", "rN+"), "drafter rank N / ranks N and up"),
        (("none",), "the target's token not in the drafter's top-K"),
        (("n",), "steps that reached the depth"),
        (("calibration",), ("reliability diagram: per bin of stated p (x), the measured rate at which the "
                            "target chose the token (bar); · marks the stated p (calibrated: bar ends there)")),
        (("ECE",), "expected calibration error: the count-weighted mean |measured - stated| over bins; top-1 ECE: "
                   "the same over the drafter's rank-0 forecasts alone (with a large K the low ranks pull ECE to 0)"),
        (("rN said→got",), "per depth, rank N's mean stated p -> measured rate"),
        (("budget curve",), ("the exact tau every budget B' <= B would have had on the same steps, with "
                             "tokens per second from a cost model of verify time")),
        (("B'",), "a smaller budget (non-root nodes)"),
        (("tau",), "mean tau at that budget"),
        (("tok/s",), "tokens per second at that budget (cost model)"),
        (("best",), "the budget with the most tokens per second"),
        (("chain",), "a chain of top-1 drafts (budget L), where the trace can tell"),
        (("cost",), "where the cost model comes from: the trace's timings or a kdtree bench file"),
    )),
)

BOOKMARKS = ("Bookmarks live in a side file, never in the trace (which is opened read-only): TRACE.bookmarks.json "
             "beside the trace when its directory is writable, else $XDG_STATE_HOME/kdtree/bookmarks/ "
             "(~/.local/state when unset). They load when the trace opens and are written (atomically) at "
             "every b. A damaged file is reported and kept aside as FILE.unusable when you next set one.")


def glossary_terms(section: str) -> set[str]:
    """The terms the help explains in ``section``."""
    return {term for name, entries in GLOSSARY if name == section for terms, _ in entries for term in terms}


def help_text(bookmark_path: str = "") -> Text:
    """Keys, then the glossary by view, then where bookmarks live; lines at most HELP_WIDTH cells."""
    text = Text("kdtree trace debugger\n", style="bold")
    text.append("scroll: j k, arrows, pageup pagedown, home end   close: esc q ?\n", style="italic")
    text.append("keys\n", style="bold underline")
    for keys, meaning in HELP_ROWS:
        _row(text, keys, meaning, KEY_WIDTH)
    for section, entries in GLOSSARY:
        text.append(f"\n{section}\n", style="bold underline")
        for terms, meaning in entries:
            _row(text, "  ".join(terms), meaning, TERM_WIDTH)
    text.append("\nbookmarks\n", style="bold underline")
    for line in textwrap.wrap(BOOKMARKS, HELP_WIDTH):
        text.append(line + "\n")
    if bookmark_path:
        for line in textwrap.wrap(f"This trace's: {bookmark_path}", HELP_WIDTH, subsequent_indent="  ",
                                  break_on_hyphens=False):
            text.append(line + "\n", style="italic")
    return text


def _row(text: Text, key: str, meaning: str, width: int) -> None:
    """``key`` in a column of ``width`` (alone on its line when longer), ``meaning`` wrapped beside it."""
    lines = textwrap.wrap(meaning, HELP_WIDTH - width, break_on_hyphens=False) or [""]
    if len(key) > width - 2:  # no two-cell gap before the meaning: a line of its own
        text.append(key + "\n", style="bold")
    else:
        text.append(f"{key:<{width}}", style="bold")
        text.append(lines.pop(0) + "\n")
    for line in lines:
        text.append(" " * width + line + "\n")


class HelpScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 78; max-width: 100%; height: auto; max-height: 100%;
                                  border: thick $primary; background: $surface; padding: 0 1; }
    HelpScreen > VerticalScroll > Static { width: auto; }
    """
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "close"),
                Binding("j", "scroll(1)", "down", show=False), Binding("k", "scroll(-1)", "up", show=False)]

    def __init__(self, bookmark_path: str = "") -> None:
        super().__init__()
        self.bookmark_path = bookmark_path

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-scroll"):
            yield Static(help_text(self.bookmark_path), id="help-text")

    def on_mount(self) -> None:
        self.query_one(VerticalScroll).focus()  # its arrow / page keys scroll the help

    def action_scroll(self, lines: int) -> None:
        self.query_one(VerticalScroll).scroll_relative(y=lines, animate=False)


class GoToStepScreen(ModalScreen[int | None]):
    """Asks for a step number; dismisses with it (or None)."""

    DEFAULT_CSS = """
    GoToStepScreen { align: center middle; }
    GoToStepScreen > Vertical { width: 40; height: auto; border: thick $primary; background: $surface; }
    """
    BINDINGS = [Binding("escape", "cancel", "cancel")]

    def __init__(self, num_steps: int) -> None:
        super().__init__()
        self.num_steps = num_steps

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(f"Go to step (0..{self.num_steps - 1}):")
            yield Input(placeholder="step number", id="goto-input", type="integer")
            yield Static("", id="goto-error")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        value = event.value.strip()
        if value.isdigit() and int(value) < self.num_steps:
            self.dismiss(int(value))
        else:
            self.query_one("#goto-error", Static).update(f"not a step number 0..{self.num_steps - 1}")

    def action_cancel(self) -> None:
        self.dismiss(None)
