"""The whole run: metadata, tau over steps, tau histogram, per-depth acceptance, timings, output text."""
from __future__ import annotations

from typing import Optional

import numpy as np
from rich.text import Text
from textual.containers import VerticalScroll
from textual.widgets import Sparkline, Static

from kdspec.kdtree_tui.session import TraceSession, format_seconds, tokens_text

ROWS = ("model", "mode", "decode", "prompt")
SECTIONS = ("tau histogram", "acceptance by depth", "stage timings", "output")
TERMS = ROWS + SECTIONS  # each explained by screens.GLOSSARY
OUTPUT_WINDOW = 300  # steps of output text shown either side of the current step
BAR = 24
SPARK_BUCKETS = 512


def render_metadata(session: TraceSession, colours: dict) -> Text:
    m = session.metadata
    model = m.get("model_config") or {}
    decode = m.get("decode_config") or {}
    text = Text()
    text.append(f"{session.name}", style=colours["label"])
    text.append(f"  {m.get('status', '?')}  schema {m.get('schema_version', '?')}\n", style=colours["muted"])
    model_bits = [str(model.get("name", "?"))] + [f"{k} {model[k]}" for k in
                  ("hidden_size", "num_hidden_layers", "n_routed_experts", "vocab_size") if k in model]
    decode_bits = [f"{k} {v}" for k, v in decode.items() if k != "tokenizer"]
    values = (", ".join(model_bits), f"{session.mode}, backend {m.get('backend', '?')}, device {m.get('device', '?')}, "
              f"seed {m.get('seed', '?')}", ", ".join(decode_bits),
              repr(tokens_text(np.asarray(m.get("prompt_tokens", [])).tolist(), session.vocabulary)))
    for label, value in zip(ROWS, values):
        text.append(f"{label:<8}", style=colours["muted"])
        text.append(value + "\n")
    return text


def render_stats(session: TraceSession, colours: dict, stage_times: Optional[dict]) -> Text:
    """tau histogram, per-depth acceptance and stage timings, all from the per-step columns."""
    tau = np.asarray(session.columns.get("tau", np.zeros(0, np.int64)))
    text = Text()
    steps = len(tau)
    tokens = int(tau.sum())
    mean = tokens / steps if steps else float("nan")
    text.append(f"{steps} steps, {tokens} tokens, mean tau {mean:.2f}, "
                f"{int(np.count_nonzero(session.flags))} anomalous steps\n", style=colours["label"])
    max_tau = int(tau.max()) if steps else 1
    width = max(max_tau, int(session.metadata.get("block_size", max_tau) or max_tau))
    counts = np.bincount(tau, minlength=width + 1) if steps else np.zeros(width + 1, int)
    text.append(f"{SECTIONS[0]}\n", style=colours["label"])
    top = max(int(counts.max()), 1)
    for t in range(1, width + 1):
        bar = "#" * int(round(BAR * counts[t] / top))
        text.append(f"  tau {t:>2} {counts[t]:>7} ")
        text.append(bar + "\n", style=colours["step_a"])
    text.append(f"{SECTIONS[1]} (steps whose accepted path reached depth d)\n", style=colours["label"])
    for d in range(1, width):
        rate = float(np.mean(tau >= d + 1)) if steps else 0.0
        text.append(f"  d {d:>2} {rate:>7.1%} ")
        text.append("#" * int(round(BAR * rate)) + "\n", style=colours["step_b"])
    text.append(f"{SECTIONS[2]} (total, per step)\n", style=colours["label"])
    if stage_times is None:
        text.append("  reading...\n", style=colours["muted"])
    else:
        for name, values in stage_times.items():
            values = values[np.isfinite(values)]
            total = float(values.sum()) if values.size else float("nan")
            per = total / values.size if values.size else float("nan")
            text.append(f"  {name[5:]:<12} {format_seconds(total):>10} {format_seconds(per):>10}\n")
    return text


def render_output(session: TraceSession, colours: dict, cursor: int) -> Text:
    """Committed text of the steps around ``cursor``, each step's tokens in alternating colours."""
    text = Text()
    if not session.loaded or session.num_steps == 0:
        return text
    lo, hi = max(0, cursor - OUTPUT_WINDOW), min(session.num_steps, cursor + OUTPUT_WINDOW + 1)
    text.append(f"{SECTIONS[3]}, steps {lo}..{hi - 1} (current step underlined)\n", style=colours["label"])
    for i in range(lo, hi):
        style = colours["step_a" if i % 2 == 0 else "step_b"]
        if i == cursor:
            style += " underline reverse"
        text.append(session.committed_text(i), style=style)
    return text


def sparkline_data(tau: np.ndarray, buckets: int = SPARK_BUCKETS) -> list[float]:
    """tau over steps, averaged into at most ``buckets`` equal runs of steps (100k steps stay cheap)."""
    tau = np.asarray(tau, np.float64)
    if len(tau) <= buckets:
        return tau.tolist()
    edges = np.linspace(0, len(tau), buckets + 1).astype(np.int64)
    return (np.add.reduceat(tau, edges[:-1]) / np.diff(edges)).tolist()


class RunPanel(VerticalScroll):
    DEFAULT_CSS = """
    RunPanel { padding: 0 1; }
    RunPanel > Sparkline { height: 3; margin: 0 0 1 0; }
    RunPanel > Static { width: 100%; }
    """

    def __init__(self, session: TraceSession, **kwargs) -> None:
        super().__init__(**kwargs)
        self.session = session
        self.stage_times: Optional[dict] = None
        self.texts = {"meta": Text(), "stats": Text(), "output": Text()}
        self._sparkline_source = None

    def compose(self):
        yield Static(id="run-meta")
        yield Sparkline([], id="run-tau")
        yield Static(id="run-stats")
        yield Static(id="run-output")

    def show(self, colours: dict, cursor: int) -> None:
        s = self.session
        self.texts = {"meta": render_metadata(s, colours), "stats": render_stats(s, colours, self.stage_times),
                      "output": render_output(s, colours, cursor)}
        for key, widget_id in (("meta", "#run-meta"), ("stats", "#run-stats"), ("output", "#run-output")):
            self.query_one(widget_id, Static).update(self.texts[key])
        tau = s.columns.get("tau")
        if tau is not None and self._sparkline_source is not tau:
            self._sparkline_source = tau
            self.query_one("#run-tau", Sparkline).data = sparkline_data(tau)

    @property
    def plain(self) -> str:
        return "\n".join(t.plain for t in self.texts.values())
