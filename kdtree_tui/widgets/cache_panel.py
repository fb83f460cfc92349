"""The KV cache around one step: prefix, rows written by verify, compaction moves, agreement with golden."""
from __future__ import annotations

import numpy as np
from rich.text import Text

from kdspec.kdtree_tui.widgets.panel import TextPanel


ROWS = ("prefix length P", "verify wrote rows", "accepted nodes", "new length", "golden AR cache")
MOVES, MOVED, STAYS, DROPPED = "compaction moves", "moved", "stays", "rejected rows dropped"
TERMS = ROWS + (MOVES, MOVED, STAYS, DROPPED)  # each explained by screens.GLOSSARY


def render_cache(record, colours: dict, cache_threshold: float) -> Text:
    tau, n, p = int(record.tau), int(record.num_nodes), int(record.prefix_len)
    text = Text()
    text.append(f"step {record.index}\n", style=colours["label"])
    values = (f"{record.cache_len_before}",
              f"{p}..{p + n - 1} (N+1 = {n} tree nodes), length {record.cache_len_verify}",
              " > ".join(str(int(a)) for a in np.asarray(record.accepted_nodes)[:tau]),
              f"{record.cache_len_after} (P + tau = {p} + {tau})")
    for label, value in zip(ROWS, values):
        text.append(f"{label:<20}", style=colours["muted"])
        text.append(value + "\n")
    diff = float(record.cache_max_abs_diff)
    text.append(f"{ROWS[-1]:<20}", style=colours["muted"])
    if not np.isfinite(diff):
        text.append("not measured\n", style=colours["muted"])
    elif diff > cache_threshold:
        text.append(f"MISMATCH max |diff| {diff:.2e} > {cache_threshold:.0e}\n", style=colours["bad"])
    else:
        text.append(f"agrees, max |diff| {diff:.2e} <= {cache_threshold:.0e}\n", style=colours["ok"])
    text.append(f"{MOVES} (src -> dst)\n", style=colours["label"])
    for j in range(tau):
        src, dst = int(record.compact_src[j]), int(record.compact_dst[j])
        node = int(record.accepted_nodes[j])
        moved = src != dst
        text.append(f"  row {src:>7} -> {dst:<7} node {node:<4} ", style="" if moved else colours["muted"])
        text.append((MOVED if moved else STAYS) + "\n", style=colours["warn"] if moved else colours["muted"])
    text.append(f"  {n - tau} {DROPPED} ({p + tau}..{p + n - 1} now free)\n", style=colours["muted"])
    return text


class CachePanel(TextPanel):
    def show(self, record, colours: dict, cache_threshold: float) -> None:
        self.set_text(lambda: render_cache(record, colours, cache_threshold))
