"""Golden vs engine at each committed position: tokens, |dlogit|, the top-1/top-2 margin, the verdict, the target's
top-k; and, where the trace stores them (``kdtree record --save-logits``), the engine's and the golden's full
distributions there. Laid out for the width the panel gets: engine, golden, margin and verdict always show;
narrow panels move node, |dlogit| and pos (in that order) to the line under the row and shorten the verdict."""
from __future__ import annotations

import numpy as np
from rich.text import Text

from kdspec.kdtree_tui.session import Vocabulary, token_text
from kdspec.kdtree_tui.widgets.panel import TextPanel
from kdspec.kdtree_tui.widgets.table import (Column, cell, fit, header, table_width, token_cell, wrapped,
                                              wrapped_chunks)
from kdspec.traces.analytics import near_tie_verdict

COLUMNS = (Column("pos", 0, drop=1), Column("node", 0, drop=3), Column("engine", 0, "<"), Column("golden", 0, "<"),
           Column("|dlogit|", 9, drop=2), Column("margin", 0))
VERDICT = "verdict"
HEADERS = tuple(c.name for c in COLUMNS) + (VERDICT,)
TOPK = "top-k"  # the line under each row: the target's top-k there
# Verdict words (traces.analytics.near_tie_verdict's kinds), short forms for narrow panels.
VERDICT_WORDS = ("ok", "no golden", "near-tie", "logits off", "MISMATCH")
DIST_TOP = 4   # tokens of each distribution shown
DIST_TERMS = ("p", "TV", "max|Δ|")
TERMS = HEADERS + VERDICT_WORDS + (TOPK,) + DIST_TERMS  # each explained by screens.GLOSSARY
WIDE = 90


def verdict(engine: int, golden: int, topk_ids, topk_logits, dlogit: float, noise: float) -> tuple[str, str, str, str]:
    """(word, short word, palette key, reason) from traces.analytics.near_tie_verdict: a flip is a near-tie only
    when the engine's own logit gap between its token and the golden token is within ``noise`` (a golden token
    outside the engine's top-k never is); within 2|dlogit| but above the noise the logits are off."""
    v = near_tie_verdict(engine, golden, topk_ids, topk_logits, noise, dlogit)
    if v.kind in ("no golden", "ok"):
        return v.kind, v.kind, "muted" if v.kind == "no golden" else "ok", ""
    if v.kind == "near-tie":
        return "near-tie flip", "near-tie", "warn", v.reason
    if v.kind == "logit error":
        return f"flip: logits off (gap {v.gap:.2g})", "logits off", "bad", v.reason
    if v.gap is None:
        return "MISMATCH (golden not in top-k)", "MISMATCH", "bad", v.reason
    return f"MISMATCH (gap {v.gap:.2g})", "MISMATCH", "bad", v.reason


def render_logits(record, vocabulary: Vocabulary, colours: dict, dlogit_threshold: float, width: int = 100) -> Text:
    """One row per committed position j (absolute position P+1+j), chosen at accepted node j, then the saved
    distributions (render_distributions)."""
    tau = int(record.tau)
    accepted = np.asarray(record.accepted_nodes)[:tau]
    ids_all, logits_all = np.asarray(record.target_topk_ids), np.asarray(record.target_topk_logits)
    text = Text()
    below = "; full distributions below (J scrolls)" if getattr(record, "logits", None) is not None else ""
    wrapped(text, f"step {record.index}: {tau} committed positions {record.prefix_len + 1}..{record.prefix_len + tau}"
            f"{below}", width, colours["label"])
    cap = 14 if width >= WIDE else 9
    rows = []
    for j in range(tau):
        node = int(accepted[j])
        engine, golden = int(record.committed_tokens[j]), int(record.golden_tokens[j])
        dlogit = float(record.logit_max_abs_diff[j])
        words = verdict(engine, golden, ids_all[node], logits_all[node], dlogit, 2 * dlogit_threshold)
        rows.append({"pos": str(record.prefix_len + 1 + j), "node": str(node),
                     "engine": token_cell(repr(token_text(engine, vocabulary)), cap),
                     "golden": token_cell(repr(token_text(golden, vocabulary)), cap) if golden >= 0 else "-",
                     "|dlogit|": f"{dlogit:.2e}" if np.isfinite(dlogit) else "-",
                     "margin": f"{float(record.target_margin[node]):.3f}", "words": words,
                     "bad_dlogit": dlogit > dlogit_threshold, "node_index": node})
    sized = tuple(Column(c.name, max([c.width, len(c.name)] + [len(r[c.name]) for r in rows]), c.align, c.drop)
                  for c in COLUMNS)
    shown = fit(sized, width - 1 - len("near-tie"))
    room = width - table_width(shown) - 1
    short = any(len(r["words"][0]) > room for r in rows)
    text.append(header(shown) + " " + VERDICT + "\n", style=colours["muted"])
    dropped = [c for c in sized if c not in shown]
    for r in rows:
        for k, column in enumerate(shown):
            style = colours["accepted"] if column.name == "engine" else \
                colours["bad"] if column.name == "|dlogit|" and r["bad_dlogit"] else ""
            text.append((" " if k else "") + cell(r[column.name], column.width, column.align), style=style)
        word, short_word, key, reason = r["words"]
        text.append(" " + (short_word if short else word) + "\n", style=colours[key])
        details = [f"{c.name} {r[c.name]}" for c in dropped]
        if short and reason:
            details.append(f"why: {reason}")
        ids, values = ids_all[r["node_index"]], logits_all[r["node_index"]]
        top = [f"{token_text(t, vocabulary)!r} {v:.2f}" for t, v in zip(ids, values) if t >= 0]
        top = [f"{TOPK} {top[0]}"] + top[1:] if top else [TOPK]
        wrapped_chunks(text, details + top, width, colours["muted"])
    text.append("\n")
    text.append_text(render_distributions(record, vocabulary, colours, width))
    return text


def softmax(logits: np.ndarray) -> np.ndarray:
    """float64 probabilities of one row of logits [V]."""
    x = np.asarray(logits, np.float64)
    e = np.exp(x - np.max(x))
    return e / e.sum()


def render_distributions(record, vocabulary: Vocabulary, colours: dict, width: int = 100) -> Text:
    """Per committed position, the engine's and the golden's top DIST_TOP tokens with their softmax p, the total
    variation TV = 1/2 sum |p - q| over the vocabulary and max |engine - golden logit| (from the trace's
    ``logits`` / ``golden_logits``; a line saying what is missing when it has not got them)."""
    text = Text()
    engine_rows = getattr(record, "logits", None)
    golden_rows = getattr(record, "golden_logits", None)
    if engine_rows is None:
        return wrapped(text, "full distributions: not in this trace (kdtree record --save-logits stores them)",
                       width, colours["muted"])
    wrapped(text, f"full distributions at the committed positions: top {DIST_TOP} by p (softmax), engine vs golden",
            width, colours["label"])
    if golden_rows is None:
        wrapped(text, "golden distributions not stored (a trace recorded before golden_logits existed)", width,
                colours["muted"])
    cap = 14 if width >= WIDE else 10
    token_w = max(5, min(cap, (width - 2 - 3) // 2 - 6))
    for j in range(int(record.tau)):
        p = softmax(engine_rows[j])
        golden = np.asarray(golden_rows[j], np.float64) if golden_rows is not None else None
        known = golden is not None and bool(np.isfinite(golden).all())
        line = f"pos {record.prefix_len + 1 + j}"
        if known:
            q = softmax(golden)
            tv = 0.5 * float(np.abs(p - q).sum())
            worst = float(np.max(np.abs(np.asarray(engine_rows[j], np.float64) - golden)))
            line += f"  TV {tv:.3g}  max|Δ| {worst:.2e}"
        elif golden is not None:
            line += "  golden not recorded here"
        wrapped(text, line, width, colours["label"])
        halves = [("engine", p)] + ([("golden", q)] if known else [])
        text.append("  " + "   ".join(cell(f"{name} p", token_w + 6) for name, _ in halves) + "\n",
                    style=colours["muted"])
        tops = [np.argsort(-probs, kind="stable")[:DIST_TOP] for _, probs in halves]
        for i in range(min(DIST_TOP, len(p))):
            for (name, probs), order in zip(halves, tops):
                t = int(order[i])
                style = colours["accepted"] if name == "engine" and t == int(record.committed_tokens[j]) else ""
                text.append("  " if name == "engine" else "   ")
                text.append(cell(token_cell(repr(token_text(t, vocabulary)), token_w), token_w) + f" {probs[t]:.3f}",
                            style=style)
            text.append("\n")
    return text


class LogitsPanel(TextPanel):
    """The current step's committed positions (see render_logits), laid out for the panel's width."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._shown_for: tuple = ()
        self._width = 0

    def show(self, record, vocabulary: Vocabulary, colours: dict, dlogit_threshold: float) -> None:
        self._shown_for = (record, vocabulary, colours, dlogit_threshold)
        self.set_text(self._render)

    def _render(self) -> Text:
        self._width = self.text_width()
        return render_logits(*self._shown_for, self._width)

    def on_resize(self) -> None:
        if self._shown_for and self.text_width() != self._width:
            self.set_text(self._render)
