"""Reports of traces.analytics: the per-step "why this tau" and the whole-trace analytics as text (`kdtree info`)
and as JSON-serialisable dicts (`kdtree info --json`)."""
from __future__ import annotations

import json
import math
from dataclasses import asdict
from typing import Any, Callable, Optional

import numpy as np

from kdspec.traces.analytics import TraceAnalytics, WhyTau, analyze, folded_rank_histogram, why_tau

SHOWN_RANKS = 16   # drafter ranks `kdtree info` shows one column each; the rest summed into "rN+" (JSON has all)


def why_json(why: WhyTau) -> dict[str, Any]:
    return {k: getattr(why, k) for k in WhyTau.__dataclass_fields__}


def why_text(why: WhyTau, token_text: Callable[[int], str] = str) -> str:
    lines = [f"step {why.step}  tau {why.tau}  budget {why.budget}"]
    if why.depth is None:
        lines.append(f"stop       {why.reason}; bonus {token_text(why.token)}")
    else:
        lines.append(f"stop       depth {why.depth}: the target chose {token_text(why.token)}")
        drafted = "no" if why.rank is None else f"rank {why.rank}, lp {why.logprob:+.3f} (p {math.exp(why.logprob):.3f})"
        lines += [f"drafter    {drafted}", f"in tree    {'yes' if why.in_tree else 'no'}",
                  f"budget     {'-' if why.budget_needed is None else why.budget_needed} needed"
                  f" (recorded {why.budget})", f"why        {why.reason}"]
    if not why.best_first:
        lines.append("warning    the recorded tree is not the best-first build of its draft: budgets are estimates")
    return "\n".join(lines)


def analytics_json(a: TraceAnalytics) -> dict[str, Any]:
    """JSON-serialisable analytics (NaN becomes None)."""
    c, curve = a.calibration, a.curve
    cost = None if curve.cost is None else {**asdict(curve.cost), "points": {str(int(k)): v for k, v in
                                                                              curve.cost.points.items()}}
    out = {
        "num_steps": a.num_steps, "num_depths": a.num_depths, "draft_topk": a.draft_topk, "budget": a.budget,
        "acceptance": {"reached": a.reached.tolist(), "conditional": a.conditional.tolist()},
        "stops": a.stops,
        "rank_histogram": {"ranks": list(range(a.draft_topk)) + ["absent"], "counts": a.rank_histogram.tolist()},
        "calibration": {"count": c.count.tolist(), "stated": c.stated.tolist(), "measured": c.measured.tolist(),
                        "bins": {"edges": c.bin_edges.tolist(), "count": c.bin_count.tolist(),
                                 "stated": c.bin_stated.tolist(), "measured": c.bin_measured.tolist()},
                        "ece": c.ece,
                        "top1": {"count": c.top1_bin_count.tolist(), "stated": c.top1_bin_stated.tolist(),
                                 "measured": c.top1_bin_measured.tolist(), "ece": c.ece_top1}},
        "budget_curve": {"budgets": curve.budgets, "mean_tau": curve.mean_tau, "mean_nodes": curve.mean_nodes,
                         "step_seconds": curve.step_seconds, "tokens_per_second": curve.tokens_per_second,
                         "best_budget": curve.best_budget, "cost_model": cost,
                         "steps_not_best_first": curve.steps_not_best_first, "steps_checked": curve.steps_checked,
                         "chain": {"mean_tau": curve.chain_mean_tau, "known_steps": curve.chain_known_steps,
                                   "lower_bound_mean_tau": curve.chain_lower_bound,
                                   "tokens_per_second": curve.chain_tokens_per_second}},
    }
    return json.loads(json.dumps(out, default=float).replace("NaN", "null"))


def shown_budgets(budgets: list, best: Optional[int], most: int = 24) -> list:
    """The budgets a table shows: all up to ``most``, else 0..8, powers of two, the last and the best."""
    if len(budgets) <= most:
        return list(budgets)
    last = budgets[-1]
    keep = set(range(min(9, last + 1))) | {2 ** k for k in range(last.bit_length()) if 2 ** k <= last} | {last}
    if best is not None:
        keep.add(best)
    return sorted(keep)


def analytics_text(a: TraceAnalytics) -> str:
    """A few dozen lines for `kdtree info`."""
    def pct(x):
        return "  -  " if not np.isfinite(x) else f"{x:5.1%}"

    lines = [f"analytics  {a.num_steps} steps, L {a.num_depths}, K {a.draft_topk}, B {a.budget}"]
    if a.num_depths:
        lines.append("accept d   " + "  ".join(f"{d}:{pct(r)}" for d, r in enumerate(a.reached, 1)))
        lines.append("given d-1  " + "  ".join(f"{d}:{pct(r)}" for d, r in enumerate(a.conditional, 1)))
        lines.append("stops      " + "  ".join(f"{k} {v}" for k, v in a.stops.items()))
        labels, histogram = folded_rank_histogram(a.rank_histogram, SHOWN_RANKS)
        widths = [max(4, len(label)) for label in labels]
        lines.append("rank of the target's token in the drafter's list, per depth (steps)")
        lines.append("  depth   " + " ".join(f"{label:>{w}}" for label, w in zip(labels, widths)))
        lines += [f"  d {d:>2}    " + " ".join(f"{n:>{w}}" for n, w in zip(row, widths))
                  for d, row in enumerate(histogram, 1)]
        c = a.calibration
        lines.append(f"calibration ECE {c.ece:.3f} over {int(c.bin_count.sum())} forecasts, top-1 ECE {c.ece_top1:.3f} "
                     f"over {int(c.top1_bin_count.sum())} (stated -> measured, n)")
        lines += [f"  p {lo:.1f}-{hi:.1f}  {s:.3f} -> {m:.3f}  {n}" for lo, hi, s, m, n in
                  zip(c.bin_edges[:-1], c.bin_edges[1:], c.bin_stated, c.bin_measured, c.bin_count) if n]
    curve = a.curve
    lines.append("budget     B'  mean tau  nodes  ms/step  tok/s" + ("" if curve.cost else "   (no verify times)"))
    for i in shown_budgets(curve.budgets, curve.best_budget):
        row = f"  {curve.budgets[i]:>10}  {curve.mean_tau[i]:8.3f}  {curve.mean_nodes[i]:5.1f}"
        if curve.step_seconds is not None:
            row += f"  {curve.step_seconds[i] * 1e3:7.3f}  {curve.tokens_per_second[i]:7.1f}"
            row += "  <- best" if curve.budgets[i] == curve.best_budget else ""
        lines.append(row)
    if a.num_depths:
        if curve.chain_mean_tau is None:
            chain = f"unknown on every step (the tree lacks a chain node), at least {curve.chain_lower_bound:.3f}"
        else:
            chain = f"mean tau {curve.chain_mean_tau:.3f} on {curve.chain_known_steps}/{a.num_steps} steps"
            if curve.chain_known_steps < a.num_steps:
                chain += f" (the rest: the tree lacks a chain node; over all steps at least {curve.chain_lower_bound:.3f})"
            if curve.chain_tokens_per_second is not None:
                chain += f", {curve.chain_tokens_per_second:.1f} tok/s"
        lines.append(f"chain      top-1 per depth (budget {a.num_depths}): {chain}")
    if curve.cost is not None:
        lines.append(f"cost       {curve.cost.source}: {curve.cost.note}")
    if curve.steps_not_best_first:
        lines.append(f"warning    {curve.steps_not_best_first} of {curve.steps_checked} checked steps' trees are not "
                     "the best-first build of their draft: smaller budgets are estimates")
    return "\n".join(lines)


def load_bench_rows(path: str) -> list:
    """The rows of a `kdtree bench --json` file; ValueError (one line) when it is not such a file."""
    try:
        with open(path) as f:
            rows = json.load(f)
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{path}: not a `kdtree bench --json` file (a list of rows)")
    return rows


def step_report(reader, index: int, as_json: bool = False) -> str:
    """`kdtree info TRACE --step N`: the step's "why this tau" (text, or JSON). IndexError for a step out of range."""
    why = why_tau(reader.step(index), int(reader.dims.budget))
    if as_json:
        return json.dumps(why_json(why), indent=2)
    byte_level = reader.metadata.get("tokenizer", "byte") == "byte"
    return why_text(why, lambda t: f"{t} ({chr(t)!r})" if byte_level and 32 <= t < 127 else str(t))


def trace_report(reader, bench_rows: Optional[list] = None) -> tuple[str, dict]:
    """(text, JSON dict) of the whole-trace analytics, for `kdtree info`."""
    analytics = analyze(reader, bench_rows)
    return analytics_text(analytics), analytics_json(analytics)
