"""Per-step records (docs/architecture.md, "DDTree step record"): plain dicts of numpy arrays and scalars.

The decode loop hands each record to ``on_step``; that is how the trace writer plugs in (the engine never
imports traces/). With a golden run (engine.reference.GoldenRun of the same prompt) a record also carries
golden agreement: the golden tokens and max |engine - golden logit| at the committed positions, and the max
|engine - golden| over the compacted cache rows. Positions the golden run does not reach get -1 / NaN.
"""
from __future__ import annotations

import numpy as np

TARGET_TOPK = 8


def _host(rows) -> np.ndarray:
    """A cache slice as a numpy array (device arrays are copied to the host)."""
    return rows.copy_to_host() if hasattr(rows, "copy_to_host") else np.asarray(rows)


def cache_max_abs_diff(cache, golden_cache, start: int, stop: int) -> float:
    """max |cache - golden cache| over rows start..stop-1 of every layer's c and k_pe (rows the golden cache
    holds: stop is cut to its length); NaN when no row can be compared."""
    stop = min(stop, golden_cache.length)
    if stop <= start:
        return float("nan")
    worst = 0.0
    for ours, theirs in zip(cache.c + cache.k_pe, golden_cache.c + golden_cache.k_pe):
        worst = max(worst, float(np.max(np.abs(_host(ours[start:stop]) - np.asarray(theirs[start:stop])))))
    return worst


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


def ddtree_step_record(prefix_len, root, draft_ids, draft_logprobs, tree, logits, choice, accepted, bonus,
                       committed, cache_len_verify, times, cache, prompt, golden, topk=None,
                       cache_len_after=None) -> dict:
    """The record of one DDTree step (fields and meanings: docs/architecture.md). ``topk``: target_topk(logits)
    when already taken; ``cache_len_after``: the cache length after the step (default: cache.length now)."""
    accepted = np.asarray(accepted, dtype=np.int32)
    tau = len(accepted)
    topk_ids, topk_logits, margin = target_topk(logits) if topk is None else topk
    # The accepted nodes' logits chose the committed tokens, at positions P+1 .. P+tau.
    # Only a golden comparison needs the accepted rows' full logits (tau x V floats from the device).
    accepted_logits = (None if golden is None else
                       logits.rows(accepted) if hasattr(logits, "rows") else np.asarray(logits)[accepted])
    golden_tokens, logit_diff = golden_agreement(accepted_logits, prefix_len + 1 + np.arange(tau),
                                                 len(prompt), golden)
    record = {
        "prefix_len": int(prefix_len),
        "root_token": int(root),
        "draft_ids": np.asarray(draft_ids, dtype=np.int32),
        "draft_logprobs": np.asarray(draft_logprobs, dtype=np.float32),
        "tree_tokens": np.asarray(tree.tokens, dtype=np.int32),
        "tree_parents": np.asarray(tree.parents, dtype=np.int32),
        "tree_depths": np.asarray(tree.depths, dtype=np.int32),
        "tree_ranks": np.asarray(tree.ranks, dtype=np.int32),
        "tree_scores": np.asarray(tree.scores, dtype=np.float32),
        "target_choice": np.asarray(choice, dtype=np.int32),
        "target_topk_ids": topk_ids,
        "target_topk_logits": topk_logits,
        "target_margin": margin,
        "accepted_nodes": accepted,
        "bonus_token": int(bonus),
        "committed_tokens": np.asarray(committed, dtype=np.int32),
        "golden_tokens": golden_tokens,
        "logit_max_abs_diff": logit_diff,
        "cache_len_before": int(prefix_len),
        "cache_len_verify": int(cache_len_verify),
        "cache_len_after": int(cache.length if cache_len_after is None else cache_len_after),
        "compact_src": (prefix_len + accepted).astype(np.int32),
        "compact_dst": (prefix_len + np.arange(tau)).astype(np.int32),
        "cache_max_abs_diff": np.float32(np.nan if golden is None else
                                         cache_max_abs_diff(cache, golden.cache, prefix_len, prefix_len + tau)),
    }
    record.update({f"time_{stage}": float(seconds) for stage, seconds in times.items()})
    return record


class _OneNodeTree:
    """An AR step seen as a DDTree step: the root alone."""

    def __init__(self, root: int):
        self.tokens = np.array([root], dtype=np.int64)
        self.parents = np.array([-1], dtype=np.int32)
        self.depths = np.zeros(1, dtype=np.int32)
        self.ranks = np.zeros(1, dtype=np.int32)
        self.scores = np.zeros(1, dtype=np.float32)


def ar_step_record(prefix_len, root, logits, choice, times, cache, prompt, golden, topk=None,
                   cache_len_after=None) -> dict:
    """The record of one AR step: a one-node tree, tau 1, the chosen token as the bonus; no draft fields (L = 0,
    and the trace holds no draft fields when L*K == 0)."""
    bonus = int(np.asarray(choice)[0])
    empty = np.zeros((0, 0))
    record = ddtree_step_record(prefix_len, root, empty.astype(np.int32), empty.astype(np.float32),
                                _OneNodeTree(root), logits, choice, [0], bonus, [bonus], prefix_len + 1, times,
                                cache, prompt, golden, topk, cache_len_after)
    del record["draft_ids"], record["draft_logprobs"]
    return record
