"""What a smaller tree budget would have done: the best-first pop order replayed from a step's recorded draft,
the exact tau of every budget B' <= B, the top-1 chain, and a cost model of the verify forward per budget.

docs/ddtree.md: node indices are the best-first pop order, so the budget-B' tree is nodes 0..B' of the recorded
tree, and every node's target choice depends only on its own path. The accept walk restricted to nodes 0..B'
therefore gives the exact tau of budget B'. The pop order past B (how large a budget a missing node needed) is
replayed here from the recorded draft log-probs with the reference rules: score(parent) + lp[depth-1, rank] in
float32; the higher score pops first, ties by the lexicographically smaller rank tuple. (traces imports nothing
of ours, so this is its own small heap, checked against engine/golden/ddtree.py in the tests.)

Dimension letters: S steps, L drafted depths, K drafter top-K, B budget (node fields [B+1]).
"""
from __future__ import annotations

import heapq
import math
import re
from dataclasses import dataclass
from typing import Optional

import numpy as np

# Pops replayed past the recorded tree when looking for a missing node (about 10 ms of Python per 2000).
SEARCH_LIMIT = 4096


@dataclass(frozen=True)
class PopOrder:
    """The first nodes of the best-first order: ranks[i] is node i's rank tuple (root ()), parents[i] its
    parent (root -1), scores[i] its float32 path score (root 0)."""

    ranks: list
    parents: list
    scores: list


def pop_order(draft_logprobs: np.ndarray, limit: int) -> PopOrder:
    """The root and the first ``limit`` non-root nodes a best-first build over ``draft_logprobs`` (float32 [L, K],
    rows sorted descending) pops: fewer when the L x K prefix space runs out."""
    lp = np.asarray(draft_logprobs, np.float32)
    depths, top_k = lp.shape if lp.ndim == 2 else (0, 0)
    ranks, parents, scores = [()], [-1], [np.float32(0.0)]
    heap: list = []  # (-score, rank tuple, parent node, score): rank tuples are unique, so ties stop there
    if depths and top_k and limit > 0:
        first = np.float32(np.float32(0.0) + lp[0, 0])
        heap.append((-float(first), (0,), 0, first))
    while heap and len(ranks) <= limit:
        _, path, parent, score = heapq.heappop(heap)
        node = len(ranks)
        ranks.append(path)
        parents.append(parent)
        scores.append(score)
        depth, rank = len(path), path[-1]
        if rank + 1 < top_k:  # next sibling
            sibling = np.float32(scores[parent] + lp[depth - 1, rank + 1])
            heapq.heappush(heap, (-float(sibling), path[:-1] + (rank + 1,), parent, sibling))
        if depth < depths:  # first child
            child = np.float32(score + lp[depth, 0])
            heapq.heappush(heap, (-float(child), path + (0,), node, child))
    return PopOrder(ranks, parents, scores)


def budget_to_include(draft_logprobs: np.ndarray, ranks: tuple, limit: int = SEARCH_LIMIT) -> Optional[int]:
    """The smallest budget B' whose best-first tree holds the node of rank tuple ``ranks`` (= its pop index),
    or None when it is not among the first ``limit`` pops (or not in the L x K space at all)."""
    ranks = tuple(int(r) for r in ranks)
    order = pop_order(draft_logprobs, limit)
    try:
        return order.ranks.index(ranks)
    except ValueError:
        return None


def rank_tuples(parents: np.ndarray, ranks: np.ndarray) -> list:
    """Each recorded node's rank tuple (root ()), from tree_parents and tree_ranks [N+1] (parents first)."""
    out: list = [()]
    for i in range(1, len(parents)):
        out.append(out[int(parents[i])] + (int(ranks[i]),))
    return out


def is_best_first(record) -> bool:
    """Whether a step's recorded tree (a StepRecord) is the best-first build of its recorded draft."""
    return tree_is_best_first(record.num_nodes, record.tree_parents, record.tree_ranks, record.tree_tokens,
                              record.tree_scores, record.draft_ids, record.draft_logprobs)


def tree_is_best_first(num_nodes, parents, ranks, tokens, scores, draft_ids, draft_logprobs) -> bool:
    """Whether a recorded tree (node fields [>= N+1], draft [L, K]) is the best-first build of its draft: the
    same rank tuples, parents, tokens and float32 scores, node for node (what the budget counterfactuals rely on)."""
    n = int(num_nodes)
    ids, lp = np.asarray(draft_ids), np.asarray(draft_logprobs, np.float32)
    if n == 1:
        return True
    if lp.ndim != 2 or lp.size == 0:
        return False
    order = pop_order(lp, n - 1)
    if len(order.ranks) != n:
        return False
    parents = np.asarray(parents)[:n]
    if order.ranks != rank_tuples(parents, np.asarray(ranks)[:n]) or order.parents != parents.tolist():
        return False
    replayed = [int(ids[len(r) - 1, r[-1]]) for r in order.ranks[1:]]
    return (replayed == np.asarray(tokens)[1:n].tolist()
            and np.array_equal(np.asarray(order.scores, np.float32), np.asarray(scores, np.float32)[:n]))


# ------------------------------------------------------------------------------------------- counterfactual tau
def budget_taus(tau: np.ndarray, accepted: np.ndarray, budgets) -> np.ndarray:
    """int64 [S, len(budgets)]: the tau each step would have had with the tree cut to nodes 0..B' (B' in budgets).

    tau int [S]; accepted int [S, L+1] (padded past tau). The restricted walk follows the recorded accepted path
    while its nodes are <= B' (the recorded walk took the lowest-index matching child, so a cut tree has no other
    match) and stops at the first node past B'.
    """
    tau = np.asarray(tau, np.int64)
    accepted = np.asarray(accepted, np.int64)
    width = accepted.shape[1] if accepted.ndim == 2 else 1
    on_path = np.arange(1, width)[None, :] < tau[:, None]                      # [S, L] path entries after the root
    out = np.empty((len(tau), len(budgets)), np.int64)
    for j, b in enumerate(budgets):
        kept = on_path & (accepted[:, 1:] <= b)
        out[:, j] = 1 + np.cumprod(kept, axis=1).sum(axis=1)
    return out


def chain_taus(tau, tree_parents, tree_ranks, target_choice, draft_ids, num_nodes) -> tuple[np.ndarray, np.ndarray]:
    """The tau of a chain of the drafter's top-1 token at every depth (budget L), and whether it is known.

    Walk: at chain node depth d-1, the target's choice there must equal the rank-0 draft token of depth d. The
    target's choice at a chain node is recorded only where the tree holds that node (every rank-0 descendant of
    the root); where the chain walk enters a node the tree lacks before depth L, the step's chain tau is only
    known to be at least the depth reached + 1. Returns (tau int64 [S], known bool [S]) - the lower bound where
    not known. All inputs padded per step as stored (node fields [S, B+1], draft_ids [S, L, K]).
    """
    parents, ranks = np.asarray(tree_parents), np.asarray(tree_ranks)
    choice, ids = np.asarray(target_choice), np.asarray(draft_ids)
    steps, width = parents.shape
    depths = ids.shape[1] if ids.ndim == 3 else 0
    node = np.arange(width)[None, :]
    valid = (node >= 1) & (node < np.asarray(num_nodes)[:, None]) & (ranks == 0) & (parents >= 0)
    rank0_child = np.full((steps, width), -1, np.int64)   # [s, j]: node j's rank-0 child, -1 when not in the tree
    rows, cols = np.nonzero(valid)
    rank0_child[rows, parents[rows, cols]] = cols
    row = np.arange(steps)
    out = np.ones(steps, np.int64)
    known = np.ones(steps, bool)
    current = np.zeros(steps, np.int64)
    alive = np.ones(steps, bool)
    for d in range(1, depths + 1):
        match = alive & (choice[row, current] == ids[:, d - 1, 0])
        out += match
        nxt = rank0_child[row, current]
        lost = match & (nxt < 0) & (d < depths)
        known &= ~lost
        alive = match & (nxt >= 0)
        current = np.where(alive, nxt, 0)
    return out, known


# -------------------------------------------------------------------------------------------------- cost model
@dataclass(frozen=True)
class CostModel:
    """Verify seconds of a tree of n nodes: piecewise-linear through ``points`` {nodes: seconds} (clamped at
    the ends; one point: flat), and the per-step seconds of every other stage (``overhead``). ``source`` says
    where the numbers came from, ``note`` what was assumed."""

    points: dict
    overhead: float
    source: str
    note: str = ""

    def verify_seconds(self, nodes) -> np.ndarray:
        xs = np.array(sorted(self.points), np.float64)
        ys = np.array([self.points[x] for x in sorted(self.points)], np.float64)
        return np.interp(np.asarray(nodes, np.float64), xs, ys)

    def step_seconds(self, nodes) -> np.ndarray:
        return self.overhead + self.verify_seconds(nodes)


def fit_cost_model(num_nodes: np.ndarray, time_verify: np.ndarray, overhead: float) -> Optional[CostModel]:
    """Verify time linear in nodes, least squares over the trace's steps; flat when the trace holds one tree
    size. None without a finite verify time."""
    n = np.asarray(num_nodes, np.float64)
    t = np.asarray(time_verify, np.float64)
    ok = np.isfinite(t) & (n >= 1)
    if not ok.any():
        return None
    n, t = n[ok], t[ok]
    sizes = np.unique(n)
    if len(sizes) < 2:
        return CostModel({1.0: float(t.mean()), float(sizes[0]): float(t.mean())}, overhead, "trace (flat)",
                         f"every step verified {int(sizes[0])} nodes: verify time taken as flat in tree size "
                         "(pass a `kdtree bench --json` file for measured times)")
    slope, intercept = np.polyfit(n, t, 1)
    slope = max(float(slope), 0.0)
    intercept = float(t.mean() - slope * n.mean()) if slope == 0.0 else float(intercept)
    lo, hi = 1.0, float(max(sizes.max(), 2))
    return CostModel({lo: intercept + slope * lo, hi: intercept + slope * hi}, overhead, "trace (linear fit)",
                     f"verify = {intercept * 1e3:.3g} ms + {slope * 1e6:.3g} us x nodes, fit over {len(t)} steps")


_BUDGET = re.compile(r"\bB=(\d+)\b")
_STAGE_VERIFY = re.compile(r"\bverify ([0-9.]+(?:e[-+]?\d+)?)")


def bench_cost_model(rows: list, overhead: float) -> Optional[CostModel]:
    """Verify time per tree size from `kdtree bench --json` rows: the e2e suite's "DDTree ... B=n tokens/s" rows
    (per-step stage times in their note, ms) and "... verify step B=n ..." rows (ms), at n + 1 nodes; the AR step
    at 1 node. None when the rows hold no such number."""
    points: dict = {}
    for r in rows if isinstance(rows, list) else []:
        if not isinstance(r, dict):
            continue
        metric, note, value = str(r.get("metric", "")), str(r.get("note", "")), r.get("value")
        found = _BUDGET.search(metric)
        if metric.startswith("AR step") and r.get("unit") == "ms" and _finite(value):
            points.setdefault(1.0, float(value) * 1e-3)
        if not found:
            continue
        nodes = float(int(found.group(1)) + 1)
        if "verify step" in metric and r.get("unit") == "ms" and _finite(value):
            points[nodes] = float(value) * 1e-3
        elif "ms/step" in note and _STAGE_VERIFY.search(note):
            points.setdefault(nodes, float(_STAGE_VERIFY.search(note).group(1)) * 1e-3)
    if not points:
        return None
    return CostModel(points, overhead, "bench", f"verify times of {len(points)} tree sizes from a bench file; "
                     "other stages from the trace")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class BudgetCurve:
    """From one trace recorded at budget B: per budget B' (``budgets``), the exact mean tau, mean verified
    nodes, modelled seconds per step and tokens per second; the chain (top-1 per depth, budget L); the best
    budget by tokens per second (None without a cost model)."""

    budgets: list
    mean_tau: list
    mean_nodes: list
    step_seconds: Optional[list]
    tokens_per_second: Optional[list]
    best_budget: Optional[int]
    chain_mean_tau: Optional[float]       # over the steps where the chain's tau is known
    chain_known_steps: int
    chain_lower_bound: Optional[float]    # over every step, unknown steps at their lower bound
    chain_tokens_per_second: Optional[float]
    cost: Optional[CostModel]
    steps_not_best_first: Optional[int] = None
    steps_checked: int = 0
