"""Golden vs engine at each committed position: tokens, |dlogit|, the top-1/top-2 margin, target top-k."""
from __future__ import annotations

import numpy as np
from rich.text import Text

from kdspec.kdtree_tui.session import Vocabulary, token_text
from kdspec.kdtree_tui.widgets.panel import TextPanel
from kdspec.traces.analytics import near_tie_verdict


def verdict(engine: int, golden: int, topk_ids, topk_logits, dlogit: float, noise: float) -> tuple[str, str]:
    """(word, palette key) from traces.analytics.near_tie_verdict: a flip is a near-tie only when the engine's own
    logit gap between its token and the golden token is within ``noise`` (a golden token outside the engine's
    top-k never is); within 2|dlogit| but above the noise the logits are off."""
    v = near_tie_verdict(engine, golden, topk_ids, topk_logits, noise, dlogit)
    if v.kind in ("no golden", "ok"):
        return v.kind, "muted" if v.kind == "no golden" else "ok"
    if v.kind == "near-tie":
        return "near-tie flip", "warn"
    if v.kind == "logit error":
        return f"flip: logits off (gap {v.gap:.2g})", "bad"
    if v.gap is None:
        return "MISMATCH (golden not in top-k)", "bad"
    return f"MISMATCH (gap {v.gap:.2g})", "bad"


def render_logits(record, vocabulary: Vocabulary, colours: dict, dlogit_threshold: float) -> Text:
    """One block per committed position j (absolute position P+1+j), chosen at accepted node j."""
    tau = int(record.tau)
    accepted = np.asarray(record.accepted_nodes)[:tau]
    text = Text()
    text.append(f"step {record.index}: {tau} committed positions {record.prefix_len + 1}.."
                f"{record.prefix_len + tau}\n", style=colours["label"])
    text.append(f"{'pos':>7} {'node':>4}  {'engine':<7} {'golden':<7} {'|dlogit|':>9} {'margin':>7}  verdict\n",
                style=colours["muted"])
    for j in range(tau):
        node = int(accepted[j])
        engine, golden = int(record.committed_tokens[j]), int(record.golden_tokens[j])
        dlogit = float(record.logit_max_abs_diff[j])
        margin = float(record.target_margin[node])
        word, key = verdict(engine, golden, np.asarray(record.target_topk_ids)[node],
                            np.asarray(record.target_topk_logits)[node], dlogit, 2 * dlogit_threshold)
        text.append(f"{record.prefix_len + 1 + j:>7} {node:>4}  ")
        text.append(f"{token_text(engine, vocabulary)!r:<7} ", style=colours["accepted"])
        text.append(f"{token_text(golden, vocabulary)!r:<7} " if golden >= 0 else f"{'-':<7} ")
        style = colours["bad"] if dlogit > dlogit_threshold else ""
        text.append(f"{dlogit:>9.2e}" if np.isfinite(dlogit) else f"{'-':>9}", style=style)
        text.append(f" {margin:>7.3f}  ")
        text.append(word + "\n", style=colours[key])
        ids = np.asarray(record.target_topk_ids)[node]
        logits = np.asarray(record.target_topk_logits)[node]
        top = "  ".join(f"{token_text(t, vocabulary)!r} {v:.2f}" for t, v in zip(ids, logits) if t >= 0)
        text.append(f"{'':>13}top-k {top}\n", style=colours["muted"])
    return text


class LogitsPanel(TextPanel):
    def show(self, record, vocabulary: Vocabulary, colours: dict, dlogit_threshold: float) -> None:
        self.set_text(lambda: render_logits(record, vocabulary, colours, dlogit_threshold))
