"""The tree of one step: every proposed node, the target's choice there, the accepted path and bonus, and why the
walk stopped where it did (traces.analytics.why_tau). Laid out for the width the panel gets: the target's choice
always shows; narrow panels drop score, d, node, lp, r in that order and indent one cell a level instead of two."""
from __future__ import annotations

import numpy as np
from rich.text import Text

from kdspec.kdtree_tui.session import Vocabulary, token_text
from kdspec.kdtree_tui.widgets.panel import TextPanel
from kdspec.kdtree_tui.widgets.table import Column, cell, fit, header, token_cell, wrapped
from kdspec.traces.analytics import WhyTau, why_tau

WHY_SEARCH = 1024  # pops replayed per step key to find the budget a missing node needed
TREE, NOTE = "tree", "note"  # the first column (guides, mark, token) and the last (bonus, first mismatch)
# Between them, in order; drop: which go first when the panel is narrow (highest first).
COLUMNS = (Column("target", 0, "<"), Column("node", 0, drop=3), Column("d", 0, drop=4), Column("r", 0, drop=1),
           Column("lp", 0, drop=2), Column("score", 0, drop=5))
HEADERS = (TREE,) + tuple(c.name for c in COLUMNS) + (NOTE,)
# Tree glyphs: the node's mark and the guides (full: two cells a level; compact: one).
ACCEPTED, REJECTED = "o", "."
FULL_GUIDES = {"branch": "|-", "last": "`-", "through": "| ", "after": "  "}
COMPACT_GUIDES = {"branch": "+", "last": "`", "through": "|", "after": " "}
BONUS, MISMATCH = "bonus", "x"  # notes: the last accepted node (its choice is the bonus), the first mismatch
GLYPHS = (ACCEPTED, REJECTED) + tuple(FULL_GUIDES[k] for k in ("branch", "last")) + \
    tuple(COMPACT_GUIDES[k] for k in ("branch", "last")) + (BONUS, MISMATCH)
ACCEPTED_LABEL, WHY_LABEL = "accepted", "why tau"  # the lines above the table
TERMS = HEADERS + GLYPHS + (ACCEPTED_LABEL, WHY_LABEL)  # each explained by screens.GLOSSARY
WIDE = 90        # panels this wide get longer token cells
NOTE_ROOM = 8    # cells kept for the note ("bonus x") when fitting the columns


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


def why_line(why: WhyTau | None, token_text_of) -> str:
    """traces.analytics.why_tau's answer in one line: where the walk stopped, the target's token there, where the
    drafter had it, whether the tree held it and the smallest budget whose best-first tree would have."""
    if why is None:
        return f"{WHY_LABEL}: cannot tell (the step's tree or draft is damaged)"
    head = f"{WHY_LABEL} {why.tau}: "
    if why.depth is None:
        return head + why.reason
    text = head + f"depth {why.depth}: target chose {token_text_of(why.token)!r}"
    if why.rank is None:
        text += ", not in the drafter's top-K (no budget helps)"
    else:
        needed = "no budget within the search holds it" if why.budget_needed is None else \
            f"budget {why.budget_needed} holds it (B {why.budget})"
        text += f", drafter r{why.rank} lp {why.logprob:+.2f}, {'in' if why.in_tree else 'not in'} tree; {needed}"
    if not why.best_first:
        text += "; the tree is not the best-first build of its draft"
    return text


def _guides(parents: np.ndarray, n: int, guides: dict) -> tuple[list[int], list[str]]:
    """Nodes in depth-first order (children by index) and each one's guide string."""
    children: dict[int, list[int]] = {i: [] for i in range(n)}
    for i in range(1, n):
        children[int(parents[i])].append(i)
    order, prefixes = [], []
    stack = [(0, "", True, True)]
    while stack:  # iterative: a deep chain never nears the recursion limit
        node, prefix, last, is_root = stack.pop()
        order.append(node)
        prefixes.append("" if is_root else prefix + guides["last" if last else "branch"])
        kids = children[node]
        child_prefix = "" if is_root else prefix + guides["after" if last else "through"]
        for k, child in reversed(list(enumerate(kids))):
            stack.append((child, child_prefix, k == len(kids) - 1, False))
    return order, prefixes


def _cells(record, n: int) -> dict[str, list[str]]:
    """Every node's value of each column between tree and note (root: no lp / score)."""
    lp = [""] + [f"{node_logprob(record, i):+.2f}" for i in range(1, n)]
    score = [""] + [f"{float(record.tree_scores[i]):+.2f}" for i in range(1, n)]
    return {"node": [str(i) for i in range(n)], "d": [str(int(record.tree_depths[i])) for i in range(n)],
            "r": [str(int(record.tree_ranks[i])) for i in range(n)], "lp": lp, "score": score}


def render_tree(record, vocabulary: Vocabulary, colours: dict, width: int = 100, budget: int | None = None) -> Text:
    """The step's header, "why this tau" (with ``budget``, the trace's B), then one row per node in depth-first
    order: the indented token (o accepted, . rejected), the target's choice there and the drafter's numbers; the
    last accepted node's note says bonus, the node where the engine's choice first differs from the golden x."""
    n = int(record.num_nodes)
    accepted = [int(a) for a in np.asarray(record.accepted_nodes)[:int(record.tau)]]
    on_path = set(accepted)
    mismatch = first_mismatch(record)
    mismatch_node = accepted[mismatch] if mismatch is not None else None
    text = Text()
    wrapped(text, f"step {record.index}  P={record.prefix_len}  nodes {n}  tau {record.tau}  bonus "
            f"{token_text(record.bonus_token, vocabulary)!r}", width, colours["label"])
    wrapped(text, f"{ACCEPTED_LABEL} " + " > ".join(map(str, accepted)), width, colours["label"])
    if budget is not None:
        try:
            why = why_tau(record, budget, WHY_SEARCH)
        except (ValueError, IndexError, KeyError):  # a damaged record: the rest of the view still shows
            why = None
        wrapped(text, why_line(why, vocabulary.token_text), width, colours["warn"])
    if mismatch is not None:
        wrapped(text, f"x first mismatch at node {mismatch_node}: golden "
                f"{token_text(record.golden_tokens[mismatch], vocabulary)!r}", width, colours["bad"])

    cap = 16 if width >= WIDE else 10
    tokens = [token_cell(repr(token_text(t, vocabulary)), cap) for t in np.asarray(record.tree_tokens)[:n]]
    choices = [token_cell(repr(token_text(t, vocabulary)), cap) for t in np.asarray(record.target_choice)[:n]]
    values = {**_cells(record, n), "target": choices}
    sized = tuple(Column(c.name, max([len(c.name)] + [len(v) for v in values[c.name]]), c.align, c.drop)
                  for c in COLUMNS)
    token_w = max(len(t) for t in tokens)
    parents = np.asarray(record.tree_parents)[:n]
    order, prefixes = _guides(parents, n, FULL_GUIDES)
    tree_w = max(len(p) for p in prefixes) + 2 + token_w
    least = sum(c.width + 1 for c in sized if c.name in ("target", "r", "lp"))
    if tree_w + 1 + least > width:  # indent one cell a level
        order, prefixes = _guides(parents, n, COMPACT_GUIDES)
        tree_w = max(len(p) for p in prefixes) + 2 + token_w
    tree_w = max(tree_w, len(TREE))
    shown = fit(sized, width - tree_w - 1 - NOTE_ROOM)
    text.append(cell(TREE, tree_w) + " " + header(shown) + " " + NOTE + "\n", style=colours["muted"])
    for node, prefix in zip(order, prefixes):
        style = colours["accepted"] if node in on_path else colours["rejected"]
        text.append(prefix, style=colours["muted"])
        text.append(f"{ACCEPTED if node in on_path else REJECTED} ", style=style)
        text.append(cell(tokens[node], tree_w - len(prefix) - 2), style=style)
        for column in shown:  # the target's choice off the accepted path: muted (it was never committed)
            muted = column.name == "target" and node not in on_path
            text.append(" " + cell(values[column.name][node], column.width, column.align),
                        style=colours["muted"] if muted else style)
        if node == accepted[-1]:
            text.append(" " + BONUS, style=colours["bonus"])
        if node == mismatch_node:
            text.append(" " + MISMATCH, style=colours["bad"])
        text.append("\n")
    return text


class TreePanel(TextPanel):
    """The current step's draft tree (see render_tree), laid out for the panel's width."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._shown_for: tuple = ()   # (record, vocabulary, colours, budget) of the text on screen
        self._width = 0

    def show(self, record, vocabulary: Vocabulary, colours: dict, budget: int | None = None) -> None:
        self._shown_for = (record, vocabulary, colours, budget)
        self.set_text(self._render)

    def _render(self) -> Text:
        record, vocabulary, colours, budget = self._shown_for
        self._width = self.text_width()
        return render_tree(record, vocabulary, colours, self._width, budget)

    def on_resize(self) -> None:
        if self._shown_for and self.text_width() != self._width:
            self.set_text(self._render)
