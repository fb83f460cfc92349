"""The tree of one step: every proposed node, the target's choice there, the accepted path and bonus."""
from __future__ import annotations

import numpy as np
from rich.text import Text

from kdspec.kdtree_tui.session import Vocabulary, token_text
from kdspec.kdtree_tui.widgets.panel import TextPanel


def first_mismatch(record) -> int | None:
    """Index j of the first committed position whose token differs from the golden, or None."""
    tau = int(record.tau)
    golden = np.asarray(record.golden_tokens)[:tau]
    committed = np.asarray(record.committed_tokens)[:tau]
    wrong = np.flatnonzero((committed != golden) & (golden >= 0))
    return int(wrong[0]) if wrong.size else None


def node_logprob(record, node: int) -> float:
    """The drafter's log-prob of the node's token at its depth (its score minus its parent's)."""
    depth, rank = int(record.tree_depths[node]), int(record.tree_ranks[node])
    draft = np.asarray(record.draft_logprobs)
    if draft.ndim == 2 and 0 < depth <= draft.shape[0] and rank < draft.shape[1] and np.isfinite(draft[depth - 1, rank]):
        return float(draft[depth - 1, rank])
    return float(record.tree_scores[node] - record.tree_scores[record.tree_parents[node]])


def render_tree(record, vocabulary: Vocabulary, colours: dict) -> Text:
    """Indented tree, nodes in depth-first order of pop index.

    Per node: token, depth d, drafter rank r, draft log-prob lp, path score, and the target's choice
    (-> tok). Accepted nodes bold with a dot, the bonus token after the last one, rejected branches dimmed,
    the node where the engine's choice first differs from the golden marked with an x.
    """
    n = int(record.num_nodes)
    parents = np.asarray(record.tree_parents)[:n]
    accepted = [int(a) for a in np.asarray(record.accepted_nodes)[:int(record.tau)]]
    on_path = set(accepted)
    mismatch = first_mismatch(record)
    mismatch_node = accepted[mismatch] if mismatch is not None else None
    children: dict[int, list[int]] = {i: [] for i in range(n)}
    for i in range(1, n):
        children[int(parents[i])].append(i)
    text = Text()
    text.append(f"step {record.index}  P={record.prefix_len}  nodes {n}  tau {record.tau}  "
                f"accepted {' > '.join(map(str, accepted))}  bonus ", style=colours["label"])
    text.append(repr(token_text(record.bonus_token, vocabulary)), style=colours["bonus"])
    text.append("\n")
    # Iterative DFS (a 512-node chain would overflow nothing, but keep it flat anyway).
    stack = [(0, "", True, True)]
    while stack:
        node, prefix, last, is_root = stack.pop()
        style = colours["accepted"] if node in on_path else colours["rejected"]
        guide = "" if is_root else prefix + ("`-" if last else "|-")
        text.append(guide, style=colours["muted"])
        text.append("o " if node in on_path else ". ", style=style)
        token = repr(token_text(record.tree_tokens[node], vocabulary))
        text.append(f"{token:<7}", style=style)
        text.append(f"#{node:<3} d{int(record.tree_depths[node])} r{int(record.tree_ranks[node])} ", style=style)
        if not is_root:
            text.append(f"lp {node_logprob(record, node):+.2f} score {float(record.tree_scores[node]):+.2f} ",
                        style=style)
        choice = repr(token_text(record.target_choice[node], vocabulary))
        text.append(f"-> {choice}", style=style if node in on_path else colours["muted"])
        if node == accepted[-1]:
            text.append("  bonus", style=colours["bonus"])
        if node == mismatch_node:
            golden = token_text(record.golden_tokens[mismatch], vocabulary)
            text.append(f"  x first mismatch: golden {golden!r}", style=colours["bad"])
        text.append("\n")
        kids = children[node]
        child_prefix = "" if is_root else prefix + ("  " if last else "| ")
        for k, child in reversed(list(enumerate(kids))):
            stack.append((child, child_prefix, k == len(kids) - 1, False))
    return text


class TreePanel(TextPanel):
    """The current step's draft tree (see render_tree)."""

    def show(self, record, vocabulary: Vocabulary, colours: dict) -> None:
        self.set_text(lambda: render_tree(record, vocabulary, colours))
