"""The anomaly thresholds screen (key t): shows the trace's precision defaults and lets the user change them."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Static

from kdspec.traces.thresholds import Thresholds, thresholds_for

FIELDS = (("dlogit", "|dlogit| over"), ("cache", "cache diff over"), ("min_tau", "tau under (DDTree)"))


def parse_thresholds(current: Thresholds, values: dict[str, str]) -> Thresholds:
    """The thresholds the inputs say (an empty input keeps the current value); ValueError names a bad one."""
    changes = {}
    for name, label in FIELDS:
        text = values.get(name, "").strip()
        if not text:
            continue
        try:
            changes[name] = int(text) if name == "min_tau" else float(text)
        except ValueError:
            raise ValueError(f"{label}: not a number: {text!r}") from None
    updated = current.with_values(**changes)
    return updated if updated == current else Thresholds(updated.dlogit, updated.cache, updated.min_tau, "custom")


class ThresholdsScreen(ModalScreen[Thresholds | None]):
    """Edit what counts as an anomaly; dismisses with the new Thresholds (None: unchanged). ctrl+r restores the
    defaults of the trace's precision (from its ``metadata``)."""

    DEFAULT_CSS = """
    ThresholdsScreen { align: center middle; }
    ThresholdsScreen > Vertical { width: 64; height: auto; border: thick $primary; background: $surface;
                                  padding: 0 1; }
    ThresholdsScreen Input { width: 100%; }
    """
    BINDINGS = [Binding("escape", "cancel", "cancel"), Binding("ctrl+r", "reset", "defaults")]

    def __init__(self, current: Thresholds, metadata: dict) -> None:
        super().__init__()
        self.current, self.metadata = current, metadata

    def compose(self) -> ComposeResult:
        defaults = thresholds_for(self.metadata)
        with Vertical():
            yield Static(f"Anomaly thresholds. Now: {self.current.describe()}\n"
                         f"This trace's {defaults.precision} defaults: {defaults.values_text()}\n"
                         "enter: apply   ctrl+r: the defaults   escape: cancel", id="thresholds-now")
            for name, label in FIELDS:
                yield Static(label)
                yield Input(value=_shown(getattr(self.current, name)), id=f"threshold-{name}",
                            type="integer" if name == "min_tau" else "text")
            yield Static("", id="thresholds-error")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        values = {name: self.query_one(f"#threshold-{name}", Input).value for name, _ in FIELDS}
        try:
            updated = parse_thresholds(self.current, values)
        except ValueError as e:
            self.query_one("#thresholds-error", Static).update(str(e))
            return
        self.dismiss(None if updated == self.current else updated)

    def action_reset(self) -> None:
        defaults = thresholds_for(self.metadata)
        self.dismiss(None if defaults == self.current else defaults)

    def action_cancel(self) -> None:
        self.dismiss(None)


def _shown(value) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"
