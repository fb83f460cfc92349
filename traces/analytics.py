"""Answers from a trace: why a step's tau was what it was, and over the whole trace acceptance per depth, where
the target's token sat in the drafter's list, how calibrated the drafter is, and which budget pays.

Definitions (d = 1..L a drafted depth; a step "reached depth d-1" when tau >= d, i.e. its accepted path holds
d nodes): the target's token at depth d is committed_tokens[d-1], the target's choice at accepted node d-1.
- acceptance: reached[d] = share of steps with tau >= d+1; conditional[d] = reached[d] / reached[d-1].
- rank histogram [L, K+1]: over steps that reached depth d-1, the drafter rank of the target's token at depth
  d (column K: not in the drafter's top-K).
- calibration: every (step, d, r) with tau >= d is one forecast: the drafter stated exp(lp[d-1, r]) that the
  target picks draft_ids[d-1, r]; the outcome is whether it did. Per (d, r): mean stated vs measured rate;
  binned by stated probability (BINS equal bins) for the reliability diagram; ECE = sum over bins of
  count / total x |measured - stated|. With K in the hundreds most forecasts are low-probability ranks the target
  rightly never picks, which pull the ECE toward 0; the top-1 ECE takes the rank-0 forecasts alone (the
  drafter's confidence in its best guess).
- budget curve, chain, cost model: traces/budget.py.
Everything is summed over blocks of steps, so a 100k-step trace never sits in memory at once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from kdspec.traces import budget as budget_mod
from kdspec.traces.budget import BudgetCurve, CostModel, budget_taus, chain_taus
from kdspec.traces.thresholds import Thresholds

BINS = 10
BLOCK_STEPS = 2048
DEFAULT_LOGIT_NOISE = Thresholds().logit_noise  # fp32: two logits each within the golden tolerance
FIELDS = ("tau", "num_nodes", "accepted_nodes", "committed_tokens", "draft_ids", "draft_logprobs",
          "tree_parents", "tree_ranks", "tree_tokens", "tree_scores", "target_choice")
OVERHEAD_STAGES = ("time_draft", "time_build", "time_accept", "time_compact")
CHECK_STEPS = 2000  # steps (evenly spread) whose tree is replayed to confirm it is the best-first build


# ------------------------------------------------------------------------------------------------ verdicts
@dataclass(frozen=True)
class Verdict:
    """kind: "no golden", "ok", "near-tie", "logit error" or "mismatch"; gap: the engine's logit of its token
    minus its logit of the golden token (None when unknown); reason: one line."""

    kind: str
    gap: Optional[float]
    reason: str


def near_tie_verdict(engine_token: int, golden_token: int, topk_ids, topk_logits, noise: float = DEFAULT_LOGIT_NOISE,
                     dlogit: float = float("nan")) -> Verdict:
    """Why the engine's token differs from the golden at one position, from the engine's top-T there.

    A flip is a near-tie only when the engine's logit gap between its token and the golden token is within
    the expected numeric noise ``noise`` (a golden token outside the engine's top-T is never one: its gap is at
    least the engine's top-1 minus its T-th logit). A gap within 2 |dlogit| (the measured engine-vs-golden
    error there) but above the noise is a "logit error": the logits are off by more than the precision allows.
    """
    engine_token, golden_token = int(engine_token), int(golden_token)
    if golden_token < 0:
        return Verdict("no golden", None, "no golden token recorded")
    if engine_token == golden_token:
        return Verdict("ok", 0.0, "engine token equals the golden")
    ids = np.asarray(topk_ids).tolist()
    logits = np.asarray(topk_logits, np.float64)
    if engine_token not in ids:
        return Verdict("mismatch", None, "the engine's token is outside its own top-k: gap unknown")
    mine = float(logits[ids.index(engine_token)])
    if golden_token not in ids:
        floor = mine - float(np.nanmin(logits[np.asarray(ids) >= 0]))
        return Verdict("mismatch", None, f"golden token outside the engine's top-{len(ids)} (gap >= {floor:.3g})")
    gap = mine - float(logits[ids.index(golden_token)])
    if gap <= noise:
        return Verdict("near-tie", gap, f"gap {gap:.3g} <= noise {noise:.3g}")
    if math.isfinite(dlogit) and gap <= 2 * abs(dlogit):
        return Verdict("logit error", gap, f"gap {gap:.3g} > noise {noise:.3g}, within 2|dlogit| {2 * abs(dlogit):.3g}")
    return Verdict("mismatch", gap, f"gap {gap:.3g} > noise {noise:.3g}")


# ----------------------------------------------------------------------------------------------- why tau
@dataclass(frozen=True)
class WhyTau:
    """One step's stop. depth: the first drafted depth the walk did not accept (None: every depth accepted);
    token: the target's token there (the bonus); rank / logprob: where the drafter had it (None: not in its
    top-K); in_tree: whether the tree held that node; budget_needed: the smallest budget B' whose best-first tree
    holds it (None: not drafted, or past the search limit); reason: one line."""

    step: int
    tau: int
    budget: int
    depth: Optional[int]
    token: int
    rank: Optional[int]
    logprob: Optional[float]
    in_tree: bool
    budget_needed: Optional[int]
    best_first: bool
    reason: str


def why_tau(record, budget: int, search_limit: int = budget_mod.SEARCH_LIMIT) -> WhyTau:
    """The "why this tau" of one StepRecord (traces.reader) of a trace recorded at ``budget``."""
    tau, n = int(record.tau), int(record.num_nodes)
    accepted = [int(a) for a in np.asarray(record.accepted_nodes)[:tau]]
    ids, lp = np.asarray(record.draft_ids), np.asarray(record.draft_logprobs, np.float32)
    depths = ids.shape[0] if ids.ndim == 2 and ids.size else 0
    token = int(record.bonus_token)
    best_first = budget_mod.is_best_first(record)
    base = dict(step=int(record.index), tau=tau, budget=int(budget), token=token, best_first=best_first)
    if tau > depths:
        why = "every drafted depth accepted (block full)" if depths else "no draft (AR step)"
        return WhyTau(**base, depth=None, rank=None, logprob=None, in_tree=False, budget_needed=None, reason=why)
    depth = tau
    row = ids[depth - 1].tolist()
    if token not in row:
        return WhyTau(**base, depth=depth, rank=None, logprob=None, in_tree=False, budget_needed=None,
                      reason=f"the target's token at depth {depth} is not in the drafter's top-{ids.shape[1]}")
    rank = row.index(token)
    tuples = budget_mod.rank_tuples(np.asarray(record.tree_parents)[:n], np.asarray(record.tree_ranks)[:n])
    wanted = tuples[accepted[-1]] + (rank,)
    in_tree = wanted in tuples
    needed = budget_mod.budget_to_include(lp, wanted, max(search_limit, n))
    if in_tree:
        why = "the tree held the target's token but the walk stopped: inconsistent trace"
    elif needed is None:
        why = f"drafter rank {rank}, outside the tree; not within the first {max(search_limit, n)} pops"
    elif needed <= budget:
        why = f"drafter rank {rank}; best-first order puts it at node {needed} <= B {budget}, yet the tree lacks it"
    else:
        why = f"drafter rank {rank}, outside the tree: budget {needed} would have included it"
    return WhyTau(**base, depth=depth, rank=rank, logprob=float(lp[depth - 1, rank]), in_tree=in_tree,
                  budget_needed=needed, reason=why)


# ----------------------------------------------------------------------------------------- whole trace
@dataclass(frozen=True)
class Calibration:
    """count / stated / measured [L, K] per (depth, rank); bin_edges [BINS+1]; bin_count / bin_stated /
    bin_measured [BINS] (NaN in empty bins); ece over the bins; top1_bin_count / top1_bin_stated /
    top1_bin_measured [BINS] and ece_top1: the same over the rank-0 forecasts alone."""

    count: np.ndarray
    stated: np.ndarray
    measured: np.ndarray
    bin_edges: np.ndarray
    bin_count: np.ndarray
    bin_stated: np.ndarray
    bin_measured: np.ndarray
    ece: float
    top1_bin_count: np.ndarray
    top1_bin_stated: np.ndarray
    top1_bin_measured: np.ndarray
    ece_top1: float


@dataclass(frozen=True)
class TraceAnalytics:
    """Whole-trace answers (module docstring). tau int64 [S]; reached / conditional [L]; rank_histogram int64
    [L, K+1]; stops {"block full", "not drafted", "outside the tree"}: steps by why they stopped."""

    num_steps: int
    num_depths: int
    draft_topk: int
    budget: int
    tau: np.ndarray
    reached: np.ndarray
    conditional: np.ndarray
    rank_histogram: np.ndarray
    calibration: Calibration
    stops: dict
    curve: BudgetCurve


class _Sums:
    """What analyze adds up block by block."""

    def __init__(self, depths: int, topk: int, budgets: list):
        self.ranks = np.zeros((depths, topk + 1), np.int64)
        self.cell_count, self.cell_stated, self.cell_hits = (np.zeros((depths, topk)) for _ in range(3))
        self.bin_count, self.bin_stated, self.bin_hits = (np.zeros(BINS) for _ in range(3))
        self.top1_count, self.top1_stated, self.top1_hits = (np.zeros(BINS) for _ in range(3))
        self.tau_at = np.zeros(len(budgets), np.int64)
        self.nodes_at = np.zeros(len(budgets), np.int64)
        self.chain_known = self.chain_sum_known = self.chain_sum_all = 0
        self.stops = {"block full": 0, "not drafted": 0, "outside the tree": 0}
        self.taus: list = []
        self.checked = self.not_best_first = 0

    def add(self, v: dict, first: int, stride: int, depths: int, topk: int, budgets: list) -> None:
        """Add steps first.. of one block (fields ``v``); replay the trees of the steps divisible by ``stride`` (0: none)."""
        tau = np.asarray(v["tau"], np.int64)
        self.taus.append(tau)
        nodes = np.asarray(v["num_nodes"], np.int64)
        self.tau_at += budget_taus(tau, v["accepted_nodes"], budgets).sum(axis=0)
        self.nodes_at += np.minimum(np.asarray(budgets)[None, :] + 1, nodes[:, None]).sum(axis=0)
        if not depths or not topk:
            self.stops["block full"] += len(tau)
            return
        ids, lp = np.asarray(v["draft_ids"]), np.asarray(v["draft_logprobs"], np.float64)
        committed = np.asarray(v["committed_tokens"])[:, :depths]
        reached = np.arange(1, depths + 1)[None, :] <= tau[:, None]               # [S, L]: tau >= d
        hit = (ids == committed[:, :, None]) & reached[:, :, None]                 # [S, L, K]
        rank = np.where(hit.any(axis=2), hit.argmax(axis=2), topk)                 # [S, L], K = absent
        for d in range(depths):
            self.ranks[d] += np.bincount(rank[reached[:, d], d], minlength=topk + 1)
        stated = np.exp(lp)
        forecast = reached[:, :, None] & (ids >= 0) & np.isfinite(stated)
        self.cell_count += forecast.sum(axis=0)
        self.cell_stated += np.where(forecast, stated, 0).sum(axis=0)
        self.cell_hits += (hit & forecast).sum(axis=0)
        b = np.clip((stated[forecast] * BINS).astype(np.int64), 0, BINS - 1)
        self.bin_count += np.bincount(b, minlength=BINS)
        self.bin_stated += np.bincount(b, stated[forecast], minlength=BINS)
        self.bin_hits += np.bincount(b, hit[forecast], minlength=BINS)
        top1 = forecast[:, :, 0]
        b = np.clip((stated[:, :, 0][top1] * BINS).astype(np.int64), 0, BINS - 1)
        self.top1_count += np.bincount(b, minlength=BINS)
        self.top1_stated += np.bincount(b, stated[:, :, 0][top1], minlength=BINS)
        self.top1_hits += np.bincount(b, hit[:, :, 0][top1], minlength=BINS)
        row = np.arange(len(tau))
        stop_rank = rank[row, np.minimum(tau, depths) - 1]
        full = tau > depths
        self.stops["block full"] += int(full.sum())
        self.stops["not drafted"] += int((~full & (stop_rank == topk)).sum())
        self.stops["outside the tree"] += int((~full & (stop_rank < topk)).sum())
        chain, known = chain_taus(tau, v["tree_parents"], v["tree_ranks"], v["target_choice"], ids, nodes)
        self.chain_known += int(known.sum())
        self.chain_sum_known += int(chain[known].sum())
        self.chain_sum_all += int(chain.sum())
        for i in range((-first) % stride, len(tau), stride) if stride else ():
            self.checked += 1
            self.not_best_first += not budget_mod.tree_is_best_first(
                nodes[i], v["tree_parents"][i], v["tree_ranks"][i], v["tree_tokens"][i], v["tree_scores"][i],
                ids[i], v["draft_logprobs"][i])


def analyze(reader, bench_rows: Optional[list] = None, check_steps: int = CHECK_STEPS,
            block: int = BLOCK_STEPS) -> TraceAnalytics:
    """Whole-trace analytics of a TraceReader (read in blocks of ``block`` steps). bench_rows: `kdtree bench
    --json` rows for the cost model (else it is fitted to the trace's own verify times). The first
    ``check_steps`` steps' trees (evenly spread; all of a shorter trace) are replayed to count those that are not
    the best-first build of their draft (about 70 us a step)."""
    dims, steps = reader.dims, int(reader.num_steps)
    depths, topk, budget = int(dims.num_depths), int(dims.draft_topk), int(dims.budget)
    if not dims.has_draft:
        depths = topk = 0
    budgets = list(range(budget + 1))
    sums = _Sums(depths, topk, budgets)
    stride = max(1, math.ceil(steps / check_steps)) if check_steps > 0 else 0
    names = [f for f in FIELDS if depths or not f.startswith("draft_")]  # AR traces store no draft fields
    for lo in range(0, steps, block):
        sums.add(reader.fields(names, lo, min(lo + block, steps)), lo, stride, depths, topk, budgets)
    times = reader.fields(("num_nodes", "time_verify") + OVERHEAD_STAGES)
    overhead = float(sum(np.nanmean(times[s]) if np.isfinite(times[s]).any() else 0.0 for s in OVERHEAD_STAGES))
    cost = budget_mod.bench_cost_model(bench_rows, overhead) if bench_rows is not None else None
    cost = cost or budget_mod.fit_cost_model(times["num_nodes"], times["time_verify"], overhead)
    return _finish(sums, steps, depths, topk, budget, budgets, cost)


def folded_rank_histogram(histogram: np.ndarray, shown: int) -> tuple[list[str], np.ndarray]:
    """(column labels, counts [L, <= shown + 2]) of a rank histogram [L, K+1] for display: ranks 0..shown-1 one
    column each, ranks shown..K-1 summed into "r{shown}+", then "absent" (the target's token not drafted)."""
    k = histogram.shape[1] - 1
    if k <= shown + 1:   # folding one rank into "rN+" saves nothing
        return [f"r{r}" for r in range(k)] + ["absent"], histogram
    folded = np.concatenate([histogram[:, :shown], histogram[:, shown:k].sum(axis=1, keepdims=True),
                             histogram[:, k:]], axis=1)
    return [f"r{r}" for r in range(shown)] + [f"r{shown}+", "absent"], folded


def binned_calibration(count: np.ndarray, stated_sum: np.ndarray,
                       hits: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """Per bin (forecasts ``count``, summed stated probability, hits) the mean stated probability and the measured
    rate (NaN in empty bins), and the ECE over the bins: the one definition (analyze, the spec bench)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        stated, measured = stated_sum / count, hits / count
    total = count.sum()
    ece = float(np.nansum(count / total * np.abs(measured - stated))) if total else float("nan")
    return stated, measured, ece


def _finish(s: _Sums, steps, depths, topk, budget, budgets, cost: Optional[CostModel]):
    tau = np.concatenate(s.taus) if s.taus else np.zeros(0, np.int64)
    with np.errstate(invalid="ignore", divide="ignore"):
        reached = np.array([np.mean(tau >= d + 1) if steps else np.nan for d in range(1, depths + 1)])
        conditional = reached / np.concatenate([[1.0], reached[:-1]]) if depths else reached
        stated, measured = s.cell_stated / s.cell_count, s.cell_hits / s.cell_count
    bin_stated, bin_measured, ece = binned_calibration(s.bin_count, s.bin_stated, s.bin_hits)
    top1_stated, top1_measured, ece_top1 = binned_calibration(s.top1_count, s.top1_stated, s.top1_hits)
    calibration = Calibration(s.cell_count.astype(np.int64), stated, measured, np.linspace(0, 1, BINS + 1),
                              s.bin_count.astype(np.int64), bin_stated, bin_measured, ece,
                              s.top1_count.astype(np.int64), top1_stated, top1_measured, ece_top1)
    mean_tau = (s.tau_at / steps).tolist() if steps else [float("nan")] * len(budgets)
    mean_nodes = (s.nodes_at / steps).tolist() if steps else [float("nan")] * len(budgets)
    step_s = tps = best = chain_tps = None
    chain_mean = s.chain_sum_known / s.chain_known if s.chain_known else None
    if cost is not None and steps:
        step_s = [float(cost.step_seconds(n)) for n in mean_nodes]
        tps = [t / x if x > 0 else float("nan") for t, x in zip(mean_tau, step_s)]
        best = int(budgets[int(np.nanargmax(tps))]) if np.isfinite(tps).any() else None
        if chain_mean is not None and depths:
            chain_tps = chain_mean / float(cost.step_seconds(depths + 1))
    curve = BudgetCurve(budgets, mean_tau, mean_nodes, step_s, tps, best, chain_mean, s.chain_known,
                        s.chain_sum_all / steps if steps and depths else None, chain_tps, cost, s.not_best_first, s.checked)
    return TraceAnalytics(steps, depths, topk, budget, tau, reached, conditional, s.ranks, calibration,
                          dict(s.stops), curve)
