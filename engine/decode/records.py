"""Per-step records: plain dicts of numpy arrays and scalars keyed by the trace schema's field names
(kdspec.traces.schema.STEP_FIELDS, minus the fields the writer derives; docs/trace-format.md).

The decode loop hands each record to ``on_step``; that is how the trace writer plugs in. A step's record is
built from its ``StepOutcome`` (what the step computed) and its ``TargetReadout`` (what was read from the
target's logits before the step ended). With a golden run (``GoldenCompare``) a record also carries golden
agreement: the golden tokens and max |engine - golden logit| at the committed positions, and the max
|engine - golden| over the compacted cache rows. Positions the golden run does not reach get -1 / NaN.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from kdspec.traces.schema import TARGET_TOPK

# Record keys beyond the schema's fields (DecodeConfig.record_logits): the engine's full logits of the committed
# positions and, with a golden run, the golden's there (traces.schema.LOGITS_KEYS).
EXTRA_FIELDS = ("logits", "golden_logits")


@dataclass
class StepOutcome:
    """What one step computed. AR steps are a one-node tree with no draft.

    tree: tokens, parents, depths, ranks, scores [N+1] (engine.golden.ddtree.Tree or ``OneNodeTree``);
    logits [N+1, V] (numpy or DeviceLogits); choice [N+1] (target's token after each node); accepted int32
    [tau]; moves (src, dst) int32 [tau], the compaction's row moves; cache lengths after the verify forward
    and after the step; times: seconds per stage; draft: (ids int32 [L, K], logprobs float32 [L, K]) or None.
    In a run that builds no records, a step on the device leaves logits, choice and moves None and its tree a
    ``TreeTokens`` (what only records read is not read back or built: it is host time in every step).
    """

    prefix_len: int
    root: int
    tree: Any
    logits: Any
    choice: np.ndarray
    accepted: np.ndarray
    bonus: int
    moves: tuple[np.ndarray, np.ndarray]
    cache_len_verify: int
    cache_len_after: int
    times: dict[str, float]
    draft: Optional[tuple[np.ndarray, np.ndarray]] = None

    @property
    def committed(self) -> list[int]:
        """The tokens the step commits: the accepted drafted tokens, then the bonus."""
        accepted = np.asarray(self.accepted)
        drafted = np.asarray(self.tree.tokens)[accepted[1:]].tolist() if len(accepted) > 1 else []
        return [int(t) for t in drafted] + [int(self.bonus)]


@dataclass
class TargetReadout:
    """What a record needs from the target's logits, read before the step ends (device reads then):
    the top-T ids / logits [N+1, T] and margins [N+1]; the accepted rows' logits [tau, V] when asked for."""

    topk_ids: np.ndarray
    topk_logits: np.ndarray
    margin: np.ndarray
    accepted_logits: Optional[np.ndarray] = None


@dataclass(frozen=True)
class GoldenCompare:
    """A golden run of the same prompt (engine.golden.model.GoldenRun), the prompt's length and the engine's
    cache (its compacted rows are compared once the step is done)."""

    run: Any
    prompt_len: int
    cache: Any


class TreeTokens:
    """A step's tree as a run that builds no records sees it: the node tokens [N+1] alone (what the committed
    tokens are read from)."""

    def __init__(self, tokens: np.ndarray):
        self.tokens = tokens

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)


class OneNodeTree:
    """An AR step seen as a DDTree step: the root alone."""

    def __init__(self, root: int):
        self.tokens = np.array([root], dtype=np.int64)
        self.parents = np.array([-1], dtype=np.int32)
        self.depths = np.zeros(1, dtype=np.int32)
        self.ranks = np.zeros(1, dtype=np.int32)
        self.scores = np.zeros(1, dtype=np.float32)


def _host(rows) -> np.ndarray:
    """A cache slice as a numpy array (device arrays are copied to the host)."""
    return rows.copy_to_host() if hasattr(rows, "copy_to_host") else np.asarray(rows)


def cache_max_abs_diff(cache, golden_cache, start: int, stop: int) -> float:
    """max |cache - golden cache| over rows start..stop-1 of every layer's c and k_pe (rows the golden cache
    holds: stop is cut to its length); NaN when no row can be compared."""
    stop = min(stop, golden_cache.length)
    if stop <= start:
        return float("nan")
    worst = [float(np.max(np.abs(_host(ours[start:stop]) - np.asarray(theirs[start:stop]))))
             for ours, theirs in zip(cache.c + cache.k_pe, golden_cache.c + golden_cache.k_pe)]
    return float(np.max(worst))  # np.max, not max(): a NaN difference must stay NaN


def golden_agreement(logits: np.ndarray, positions: np.ndarray, prompt_len: int, golden):
    """Golden tokens int32 [s] and max |logit diff| float32 [s] for engine logits [s, V] choosing the tokens at
    absolute ``positions`` [s]; -1 / NaN where the golden run (or the comparison) is absent."""
    s = len(positions)
    tokens = np.full(s, -1, dtype=np.int32)
    diffs = np.full(s, np.nan, dtype=np.float32)
    if golden is None:
        return tokens, diffs
    index = np.asarray(positions) - prompt_len  # golden.tokens[i] sits at position prompt_len + i
    for j, i in enumerate(index):
        if 0 <= i < len(golden.tokens):
            tokens[j] = golden.tokens[i]
            diffs[j] = np.max(np.abs(np.asarray(logits[j], dtype=np.float64) - golden.logits[i]))
    return tokens, diffs


def golden_logit_rows(positions: np.ndarray, prompt_len: int, golden) -> np.ndarray:
    """float64 [s, V]: the golden run's logits that chose the tokens at absolute ``positions`` [s] (NaN rows where
    it does not reach), indexed as golden_agreement does."""
    out = np.full((len(positions), golden.logits.shape[1]), np.nan)
    for j, i in enumerate(np.asarray(positions) - prompt_len):
        if 0 <= i < len(golden.tokens):
            out[j] = golden.logits[i]
    return out


def target_topk(logits: np.ndarray, k: int = TARGET_TOPK):
    """Per node of logits [N+1, V]: top-k ids int32 [N+1, k], logits float32 [N+1, k] (ties -> lower id; past
    V padded with -1 / NaN) and the top-1 minus top-2 margin float32 [N+1] (+inf when V == 1)."""
    if hasattr(logits, "topk"):  # logits still on the device: top-k there, only [N+1, k] comes back
        return logits.topk(k)
    logits = np.asarray(logits)
    width = min(k, logits.shape[1])
    order = np.lexsort((np.broadcast_to(np.arange(logits.shape[1]), logits.shape), -logits.astype(np.float64)),
                       axis=1)
    top = np.take_along_axis(logits, order[:, :max(width, 2)], axis=1)
    margin = top[:, 0] - top[:, 1] if logits.shape[1] > 1 else np.full(len(logits), np.inf)
    ids = np.full((len(logits), k), -1, dtype=np.int32)  # V < k: padded with -1 / NaN like the trace
    values = np.full((len(logits), k), np.nan, dtype=np.float32)
    ids[:, :width], values[:, :width] = order[:, :width], top[:, :width]
    return ids, values, margin.astype(np.float32)


def read_target(step: StepOutcome, accepted_rows: bool) -> TargetReadout:
    """The step's top-T per node and, with ``accepted_rows``, the accepted nodes' full logits [tau, V] (a
    golden comparison or record_logits: tau x V floats from the device)."""
    logits = step.logits
    rows = None
    if accepted_rows:
        rows = logits.rows(step.accepted) if hasattr(logits, "rows") else np.asarray(logits)[step.accepted]
    return TargetReadout(*target_topk(logits), accepted_logits=rows)


def step_record(step: StepOutcome, target: TargetReadout, golden: Optional[GoldenCompare] = None,
                keep_logits: bool = False) -> dict:
    """The record of one step (fields: docs/trace-format.md). AR steps have no draft fields (L = 0, and the
    trace holds none when L*K == 0). ``keep_logits``: also ``logits`` float32 [tau, V] and, with a golden run,
    ``golden_logits`` float64 [tau, V]."""
    prefix_len, tau = step.prefix_len, len(step.accepted)
    tree = step.tree
    # The accepted nodes' logits chose the committed tokens, at positions P+1 .. P+tau.
    positions = prefix_len + 1 + np.arange(tau)
    if golden is None:
        golden_tokens, logit_diff = golden_agreement(None, positions, 0, None)
        cache_diff = np.nan
    else:
        golden_tokens, logit_diff = golden_agreement(target.accepted_logits, positions, golden.prompt_len,
                                                     golden.run)
        cache_diff = cache_max_abs_diff(golden.cache, golden.run.cache, prefix_len, prefix_len + tau)
    record = {
        "prefix_len": int(prefix_len),
        "root_token": int(step.root),
        "tree_tokens": np.asarray(tree.tokens, dtype=np.int32),
        "tree_parents": np.asarray(tree.parents, dtype=np.int32),
        "tree_depths": np.asarray(tree.depths, dtype=np.int32),
        "tree_ranks": np.asarray(tree.ranks, dtype=np.int32),
        "tree_scores": np.asarray(tree.scores, dtype=np.float32),
        "target_choice": np.asarray(step.choice, dtype=np.int32),
        "target_topk_ids": target.topk_ids,
        "target_topk_logits": target.topk_logits,
        "target_margin": target.margin,
        "accepted_nodes": np.asarray(step.accepted, dtype=np.int32),
        "bonus_token": int(step.bonus),
        "committed_tokens": np.asarray(step.committed, dtype=np.int32),
        "golden_tokens": golden_tokens,
        "logit_max_abs_diff": logit_diff,
        "cache_len_before": int(prefix_len),
        "cache_len_verify": int(step.cache_len_verify),
        "cache_len_after": int(step.cache_len_after),
        "compact_src": np.asarray(step.moves[0], dtype=np.int32),
        "compact_dst": np.asarray(step.moves[1], dtype=np.int32),
        "cache_max_abs_diff": np.float32(cache_diff),
    }
    if step.draft is not None:
        record["draft_ids"] = np.asarray(step.draft[0], dtype=np.int32)
        record["draft_logprobs"] = np.asarray(step.draft[1], dtype=np.float32)
    record.update({f"time_{stage}": float(seconds) for stage, seconds in step.times.items()})
    if keep_logits:
        record["logits"] = np.asarray(target.accepted_logits, dtype=np.float32)
        if golden is not None:
            record["golden_logits"] = golden_logit_rows(positions, golden.prompt_len, golden.run)
    return record
