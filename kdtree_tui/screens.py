"""Modal screens: help (key bindings) and go to step N."""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Static

HELP_ROWS = (
    ("j / down, k / up", "next / previous step"),
    ("pagedown / pageup", "10 steps forward / back"),
    ("home / end", "first / last step"),
    ("g", "go to step N"),
    ("n / p", "next / previous anomaly (divergence, |dlogit|, low tau, cache)"),
    ("b / B", "toggle bookmark / next bookmark"),
    ("1 2 3 4 5 6", "tree, logits, cache, run, compare, analytics view"),
    ("f", "follow a trace being recorded (on / off)"),
    ("d", "dark / light theme"),
    ("ctrl+p", "command palette: go to step, search text"),
    ("?", "this help"),
    ("q", "quit"),
)
LEGEND = ("step list: * bookmark, P prefix length, t tau, flags x divergence, d |dlogit|, s short (low tau), "
          "c cache mismatch; tree: o accepted, . rejected, -> the target's choice")


class HelpScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > Vertical { width: 78; height: auto; max-height: 95%; border: thick $primary; background: $surface; padding: 0 1; }
    """
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "close")]

    def compose(self) -> ComposeResult:
        text = Text("kdtree trace debugger: keys\n", style="bold")
        for keys, meaning in HELP_ROWS:
            text.append(f"{keys:<20}", style="bold")
            text.append(meaning + "\n")
        text.append("\n" + LEGEND, style="italic")
        with Vertical():
            yield Static(text, id="help-text")


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
