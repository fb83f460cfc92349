"""Whole-trace summary numbers: acceptance, golden agreement, worst logit / cache difference, timings.

``summarize(...)`` works on plain arrays (so it is testable without a file); ``summarize_trace(reader)``
reads the arrays from a TraceReader.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from kdspec.traces.schema import TIME_COLUMNS


@dataclass
class TraceSummary:
    """Numbers over all steps of a trace.

    num_steps; mean_tau (mean acceptance length incl. the root, NaN without steps);
    tau_histogram {tau: steps with that tau} for tau = 1..L+1;
    per_depth_acceptance {d: fraction of steps whose accepted path reached depth d (tau >= d+1)}, d = 1..L;
    golden_match: every step's committed tokens equal its golden tokens where the golden reached (golden
    token >= 0), and the output equals the golden: for finished traces the recorded output equals the
    recorded golden, for unfinished ones every committed position has a golden token;
    first_divergence_step: first step whose committed tokens differ from its golden tokens where the
    golden reached (a -1 golden token: the golden run stopped short, e.g. at max_position_embeddings past
    the output), or None; max_logit_diff (NaN if never measured) at max_logit_diff_at
    (step, position j within the step's committed tokens) or None; max_cache_diff (NaN if never measured);
    output_tokens / golden_tokens: the recorded ones of a finished trace, else the first token (step 0's
    root, from the prefill) followed by the steps' committed / golden tokens;
    stage_time_totals {stage: seconds} for draft, build, verify, accept, compact, trace_write (NaN ignored).
    """

    num_steps: int
    mean_tau: float
    tau_histogram: dict[int, int]
    per_depth_acceptance: dict[int, float]
    golden_match: bool
    first_divergence_step: Optional[int]
    max_logit_diff: float
    max_logit_diff_at: Optional[tuple[int, int]]
    max_cache_diff: float
    output_tokens: np.ndarray
    golden_tokens: np.ndarray
    stage_time_totals: dict[str, float]


def generated_tokens(root: np.ndarray, tau: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """The first token (step 0's root, from the prefill), then each step's first tau entries of ``tokens``.

    root, tau: int [S]; tokens: int [S, L+1] padded. Returns int64 [1 + sum(tau)] (empty when S == 0).
    """
    tau = np.asarray(tau, dtype=np.int64)
    if tau.shape[0] == 0:
        return np.zeros(0, np.int64)
    valid = np.arange(np.shape(tokens)[1])[None, :] < tau[:, None]
    return np.concatenate([np.asarray(root)[:1], np.asarray(tokens)[valid]]).astype(np.int64)


def summarize(num_depths: int, root: np.ndarray, tau: np.ndarray, committed: np.ndarray, golden: np.ndarray,
              logit_diff: np.ndarray, cache_diff: np.ndarray, times: dict[str, np.ndarray],
              output_tokens: Optional[np.ndarray] = None,
              golden_output: Optional[np.ndarray] = None) -> TraceSummary:
    """Summary from padded per-step arrays.

    Args:
        num_depths: L. root: int [S], each step's root token. tau: int [S].
        committed, golden: int [S, L+1] padded with -1.
        logit_diff: float [S, L+1] padded with NaN. cache_diff: float [S].
        times: {column name: float [S]}. output_tokens / golden_output: recorded by finish (None while
            recording).
    """
    tau = np.asarray(tau, dtype=np.int64)
    num_steps = int(tau.shape[0])
    valid = np.arange(num_depths + 1)[None, :] < tau[:, None]          # [S, L+1] within tau
    tau_histogram = {t: int(np.count_nonzero(tau == t)) for t in range(1, num_depths + 2)}
    per_depth = {d: (float(np.count_nonzero(tau >= d + 1)) / num_steps if num_steps else float("nan"))
                 for d in range(1, num_depths + 1)}
    reached = valid & (np.asarray(golden) >= 0)
    differs = ((np.asarray(committed) != np.asarray(golden)) & reached).any(axis=1)
    first_divergence = int(np.argmax(differs)) if differs.any() else None
    finished = output_tokens is not None
    output = np.asarray(output_tokens, dtype=np.int64) if finished else generated_tokens(root, tau, committed)
    golden_out = np.asarray(golden_output, dtype=np.int64) if golden_output is not None else \
        generated_tokens(root, tau, golden)
    covered = np.array_equal(output, golden_out) if finished else bool((reached == valid).all())
    golden_match = first_divergence is None and covered

    diffs = np.where(valid, np.asarray(logit_diff, dtype=np.float64), np.nan)
    if (~np.isnan(diffs)).any():
        flat = int(np.nanargmax(diffs))
        at = divmod(flat, diffs.shape[1])
        max_logit, max_logit_at = float(diffs[at]), (int(at[0]), int(at[1]))
    else:
        max_logit, max_logit_at = float("nan"), None
    cache_diff = np.asarray(cache_diff, dtype=np.float64)
    max_cache = float(np.nanmax(cache_diff)) if (~np.isnan(cache_diff)).any() else float("nan")
    totals = {name.removeprefix("time_"): float(np.nansum(np.asarray(times[name], dtype=np.float64)))
              for name in TIME_COLUMNS if name in times}
    return TraceSummary(
        num_steps=num_steps, mean_tau=float(tau.mean()) if num_steps else float("nan"),
        tau_histogram=tau_histogram, per_depth_acceptance=per_depth, golden_match=bool(golden_match),
        first_divergence_step=first_divergence, max_logit_diff=max_logit, max_logit_diff_at=max_logit_at,
        max_cache_diff=max_cache, output_tokens=output, golden_tokens=golden_out, stage_time_totals=totals)


def summarize_trace(reader) -> TraceSummary:
    """Summary of the steps a TraceReader currently sees (one pass over the step rows)."""
    values = reader.fields(("root_token", "tau", "committed_tokens", "golden_tokens", "logit_max_abs_diff",
                            "cache_max_abs_diff") + TIME_COLUMNS)
    recorded_golden = reader.golden_tokens if reader.is_complete else None
    return summarize(
        reader.dims.num_depths, values["root_token"], values["tau"], values["committed_tokens"],
        values["golden_tokens"], values["logit_max_abs_diff"], values["cache_max_abs_diff"],
        {name: values[name] for name in TIME_COLUMNS},
        output_tokens=reader.output_tokens if reader.is_complete else None,
        golden_output=recorded_golden if recorded_golden is not None and recorded_golden.size else None)
