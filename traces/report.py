"""Text and JSON reports of a trace, and the integrity check behind `kdtree info` and `kdtree check`."""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import numpy as np

from kdspec.traces.reader import TraceReader
from kdspec.traces.summary import generated_tokens
from kdspec.traces.thresholds import FLAG_KEYS, Thresholds, count_flags, thresholds_for


def _fmt(x: float, spec: str = ".3g") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def drafter_text(meta: dict) -> str:
    """The run's drafter: its name (the run metadata's, else the decode_config's) and a trained one's digest."""
    drafter = meta.get("drafter") if isinstance(meta.get("drafter"), dict) else {}
    decode = meta.get("decode_config") if isinstance(meta.get("decode_config"), dict) else {}
    name = drafter.get("name") or decode.get("drafter") or ("none (AR)" if meta.get("mode") == "ar" else "?")
    digest = drafter.get("digest")
    return f"{name}" + (f"  digest {str(digest)[:16]}" if digest else "")


def anomalies_text(reader: TraceReader, thresholds: Thresholds) -> str:
    """One line: how many steps each anomaly flags under ``thresholds``, and the first of each."""
    found = count_flags(reader, thresholds)
    parts = [f"{key} {found[key]}" + (f" (first step {found['first'][key]})" if found[key] else "")
             for key in FLAG_KEYS.values()]
    return f"anomalies  {', '.join(parts)}; {thresholds.describe()}"


def info_text(reader: TraceReader, thresholds: Optional[Thresholds] = None) -> str:
    """A human summary of a trace, a few lines. ``thresholds``: what counts as an anomaly (default: the
    trace's precision's, traces.thresholds)."""
    meta, s = reader.metadata, reader.summary()
    model = meta.get("model_config", {}).get("name", "?")
    lines = [
        f"trace      {reader.path}  (schema {meta['schema_version']}, {meta['status']})",
        f"model      {model}  backend {meta['backend']}  device {meta['device']}  mode {meta['mode']}  "
        f"seed {meta['seed']}",
        f"shape      block_size {meta['block_size']}  budget {meta['budget']}  draft top-K {meta['draft_topk']}  "
        f"prompt {len(reader.prompt_tokens)} tokens",
        f"drafter    {drafter_text(meta)}",
        f"steps      {s.num_steps}  tokens {len(s.output_tokens)}  mean tau {_fmt(s.mean_tau, '.2f')}",
        "tau hist   " + "  ".join(f"{t}:{n}" for t, n in s.tau_histogram.items()),
    ]
    if s.per_depth_acceptance:
        lines.append("reached d  " + "  ".join(f"{d}:{p:.2f}" for d, p in s.per_depth_acceptance.items()))
    if recorded_without_golden(reader):
        golden = "none (recorded with --golden none): nothing compared"
    elif s.golden_match:
        golden = "tokens equal"
    elif s.first_divergence_step is not None:
        golden = f"DIVERGES at step {s.first_divergence_step}"
    else:
        golden = "recorded output differs from the recorded golden"
    where = "" if s.max_logit_diff_at is None else f" at step {s.max_logit_diff_at[0]}, position {s.max_logit_diff_at[1]}"
    lines.append(f"golden     {golden}; worst |dlogit| {_fmt(s.max_logit_diff)}{where}")
    lines.append(f"cache      worst |dcache| {_fmt(s.max_cache_diff)}")
    lines.append(anomalies_text(reader, thresholds or thresholds_for(meta)))
    times = "  ".join(f"{name} {_fmt(total * 1e3, '.1f')}" for name, total in s.stage_time_totals.items())
    lines.append(f"time (ms)  {times}")
    return "\n".join(lines)


def info_json(reader: TraceReader, thresholds: Optional[Thresholds] = None) -> dict[str, Any]:
    """JSON-serialisable summary (plain ints, floats, lists; NaN becomes None)."""
    meta, s = reader.metadata, reader.summary()
    thresholds = thresholds or thresholds_for(meta)

    def num(x):
        return None if x is None or (isinstance(x, float) and math.isnan(x)) else x

    return {
        "path": reader.path, "schema_version": meta["schema_version"], "status": meta["status"],
        "model": meta.get("model_config", {}).get("name"), "model_config": meta.get("model_config"),
        "decode_config": meta.get("decode_config"), "drafter": meta.get("drafter"),
        "time_golden": num(meta.get("time_golden")), "backend": meta["backend"], "device": meta["device"],
        "mode": meta["mode"], "seed": meta["seed"], "start_time": meta["start_time"],
        "end_time": meta["end_time"] or None, "versions": meta.get("versions"),
        "prompt_tokens": [int(t) for t in reader.prompt_tokens],
        "num_steps": s.num_steps, "mean_accept": num(s.mean_tau),
        "tau_histogram": {str(t): n for t, n in s.tau_histogram.items()},
        "per_depth_acceptance": {str(d): p for d, p in s.per_depth_acceptance.items()},
        "output_tokens": [int(t) for t in s.output_tokens], "golden_tokens": [int(t) for t in s.golden_tokens],
        "golden_match": None if recorded_without_golden(reader) else s.golden_match,
        "first_divergence_step": s.first_divergence_step,
        "max_logit_diff": num(s.max_logit_diff),
        "max_logit_diff_at": list(s.max_logit_diff_at) if s.max_logit_diff_at else None,
        "max_cache_diff": num(s.max_cache_diff),
        "stage_time_totals": {k: num(v) for k, v in s.stage_time_totals.items()},
        "thresholds": {"dlogit": thresholds.dlogit, "cache": thresholds.cache, "min_tau": thresholds.min_tau,
                       "precision": thresholds.precision},
        "anomalies": count_flags(reader, thresholds),
    }


# Steps per read in check(): its memory stays bounded on long traces of wide trees.
CHECK_BLOCK_STEPS = 4096


def recorded_without_golden(reader: TraceReader) -> bool:
    """Whether the run was recorded without a golden (``kdtree record --golden none``: decode_config's golden)."""
    return (reader.metadata.get("decode_config") or {}).get("golden") == "none"


def check(reader: TraceReader) -> tuple[int, str]:
    """(0, message) when the trace is complete, internally consistent and equal to the golden; else (1, why).
    A trace recorded without a golden (``recorded_without_golden``) passes when intact, and says so.

    Consistency (``consistency_problem``): every step's tree, accepted path, committed tokens, cache lengths
    and compaction moves agree; each step starts where the previous one ended; a difference measured
    against the golden is finite. The recorded output is the first token (step 0's root, from the prefill)
    followed by the steps' committed tokens, cut inside the last step (it may overshoot max_new_tokens).
    Damage raises TraceError (the caller exits 2).
    """
    if not reader.is_complete:
        return 1, f"trace is not complete (status {reader.metadata.get('status')!r})"
    problem = consistency_problem(reader)
    if problem:
        return 1, problem
    n = reader.num_steps
    output = reader.output_tokens
    if n:
        tau, root = reader.column("tau"), reader.column("root_token")
        committed = reader.field("committed_tokens")
        # The output is the prefill's token (step 0's root) then every step's committed tokens; the last
        # step may commit past max_new_tokens, so the output ends somewhere inside the last step's tokens.
        generated = generated_tokens(root, tau, committed)
        shortest = len(generated) - int(tau[-1]) + 1
        if not shortest <= len(output) <= len(generated) or not np.array_equal(output, generated[:len(output)]):
            return 1, (f"recorded output ({len(output)} tokens) differs from the steps' tokens ({len(generated)} "
                       f"tokens: the first token, then each step's committed tokens)")
    if recorded_without_golden(reader):
        return _check_without_golden(reader, len(output), n)
    if n:  # tau and root as read above
        stepped_golden = generated_tokens(root, tau, reader.field("golden_tokens"))[:len(output)]
        recorded_golden = reader.golden_tokens
        reached = stepped_golden >= 0
        if not reached.all():   # -1 (not reached) is fine past the output only: the last step's overshoot
            k = int(np.argmin(reached))
            return 1, f"output token {k} has no golden token in its step (the golden run did not reach it)"
        if len(recorded_golden) == len(output) and not np.array_equal(recorded_golden[reached], stepped_golden[reached]):
            return 1, "recorded golden differs from the steps' golden tokens"
    s = reader.summary()
    if s.first_divergence_step is not None:
        i = s.first_divergence_step
        committed, golden = reader.field("committed_tokens", i, i + 1)[0], reader.field("golden_tokens", i, i + 1)[0]
        j = int(np.argmax((committed != golden) & (golden >= 0)))
        return 1, (f"diverges from the golden at step {i}, position {j}: "
                   f"token {committed[j]} vs golden {golden[j]}")
    if not s.golden_match:
        return 1, f"recorded output differs from the recorded golden ({len(s.golden_tokens)} tokens)"
    return 0, (f"ok: {len(output)} tokens in {n} steps equal the golden; worst |dlogit| {_fmt(s.max_logit_diff)}, "
               f"worst |dcache| {_fmt(s.max_cache_diff)}")


def _check_without_golden(reader: TraceReader, tokens: int, steps: int) -> tuple[int, str]:
    """check() of an intact trace recorded without a golden: none of its steps may carry golden tokens."""
    for start in range(0, steps, CHECK_BLOCK_STEPS):
        golden = reader.field("golden_tokens", start, min(steps, start + CHECK_BLOCK_STEPS))
        if (golden >= 0).any():
            step = start + int(np.argmax((golden >= 0).any(axis=1)))
            return 1, f"recorded without a golden (--golden none), yet step {step} carries golden tokens"
    if len(reader.golden_tokens):
        return 1, "recorded without a golden (--golden none), yet the trace holds golden tokens"
    return 0, f"ok: {tokens} tokens in {steps} steps, intact; no golden to compare (recorded with --golden none)"


def consistency_problem(reader: TraceReader) -> Optional[str]:
    """Why the steps of a trace do not fit together (the first failing step's reason, one line), or None.

    Per step: 1 <= N+1 <= B+1 nodes and 1 <= tau <= min(L+1, N+1); the tree's root is node 0 (parent -1,
    depth 0, the root token) and every other node's parent an earlier node, one depth up; the accepted path
    runs from the root down parent links; the committed tokens are the path's tokens after the root, then
    the bonus, each the target's choice at the node before; cache lengths P, P+N+1, P+tau; the compaction
    moves rows P+accepted[j] to P+j; a logit or cache difference measured against the golden (golden
    token >= 0) is finite. Across steps: step 0 starts at the prompt's length, each next step at
    prefix_len + tau with the bonus as its root. A trace without steps has at most the prefill's token.
    """
    n = reader.num_steps
    if n == 0:
        output = reader.output_tokens
        return None if len(output) <= 1 else \
            f"no step rows, yet the recorded output has {len(output)} tokens"
    d = reader.dims
    c = reader.fields(["tau", "num_nodes", "prefix_len", "root_token", "bonus_token", "cache_len_before",
                       "cache_len_verify", "cache_len_after", "cache_max_abs_diff"])
    tau, nodes, prefix = c["tau"], c["num_nodes"], c["prefix_len"]
    bad: list[tuple[str, np.ndarray, Callable[[int], str]]] = []
    bad_counts = (nodes < 1) | (nodes > d.node_width) | (tau < 1) | (tau > np.minimum(d.path_width, nodes))
    bad.append(("counts", bad_counts, lambda i: f"step {i}: num_nodes {nodes[i]} / tau {tau[i]} out of range "
                f"(1 <= num_nodes <= {d.node_width}, 1 <= tau <= min({d.path_width}, num_nodes))"))
    start = np.concatenate([[len(reader.prompt_tokens)], prefix[:-1] + tau[:-1]])
    follows = np.concatenate([[True], c["root_token"][1:] == c["bonus_token"][:-1]])
    bad.append(("chain", (prefix != start) | ~follows, lambda i: (
        f"step 0: prefix_len {prefix[0]} is not the prompt's length {len(reader.prompt_tokens)}" if i == 0 else
        f"step {i}: does not continue step {i - 1} (prefix_len {prefix[i]} vs {start[i]}, root "
        f"{c['root_token'][i]} vs bonus {c['bonus_token'][i - 1]})")))
    for name, want in (("cache_len_before", prefix), ("cache_len_verify", prefix + nodes),
                       ("cache_len_after", prefix + tau)):
        got = c[name]
        bad.append((name, got != want, lambda i, name=name, got=got, want=want:
                    f"step {i}: {name} {got[i]} is not {int(want[i])}"))
    blocks = [_block_problems(reader, lo, min(lo + CHECK_BLOCK_STEPS, n), c)
              for lo in range(0, n, CHECK_BLOCK_STEPS)]
    for kind, text in BLOCK_CHECKS:
        mask = np.concatenate([b[kind][0] for b in blocks])
        where = np.concatenate([b[kind][1] for b in blocks])
        bad.append((kind, mask, lambda i, text=text, where=where: f"step {i}: {text.format(at=where[i])}"))
    firsts = [(int(np.argmax(mask)), order) for order, (_, mask, _) in enumerate(bad) if mask.any()]
    if not firsts:
        return None
    step, order = min(firsts)
    return bad[order][2](step)


# The per-step checks over the step fields (_block_problems): kind -> message ({at}: the failing node or
# position).
BLOCK_CHECKS = (
    ("root", "node 0 is not the root (parent -1, depth 0, the root token)"),
    ("parents", "node {at}'s parent is not an earlier node of the tree (tree_parents point back to the root)"),
    ("depths", "node {at}'s depth is not its parent's plus one (tree_depths)"),
    ("path", "accepted_nodes is not a root-to-node path of the step's tree (position {at})"),
    ("committed", "committed tokens are not the accepted path's tokens followed by the bonus token"),
    ("choice", "committed token {at} is not the target's choice at the accepted node before it (target_choice)"),
    ("compact", "compaction moves are not rows P+accepted[j] -> P+j (position {at})"),
    ("dlogit", "|dlogit| at position {at} is not finite though the golden was compared"),
    ("dcache", "|dcache| is not finite though the golden cache was compared"),
)


def _block_problems(reader: TraceReader, lo: int, hi: int, c: dict) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """For steps [lo, hi): {kind: (bad [hi-lo] bool, where [hi-lo] int: the first bad node / position)}."""
    f = reader.fields(["tree_parents", "tree_depths", "tree_tokens", "target_choice", "accepted_nodes",
                       "committed_tokens", "golden_tokens", "logit_max_abs_diff", "compact_src", "compact_dst"],
                      lo, hi)
    tau, nodes, prefix = c["tau"][lo:hi, None], c["num_nodes"][lo:hi, None], c["prefix_len"][lo:hi, None]
    parents, depths = f["tree_parents"].astype(np.int64), f["tree_depths"].astype(np.int64)
    width, path_width = parents.shape[1], f["accepted_nodes"].shape[1]
    node, pos = np.arange(width)[None, :], np.arange(path_width)[None, :]
    is_node, on_path = node < nodes, pos < tau
    rows = np.arange(hi - lo)[:, None]
    out = {}
    root_ok = (parents[:, 0] == -1) & (depths[:, 0] == 0) & (f["tree_tokens"][:, 0] == c["root_token"][lo:hi])
    out["root"] = (~root_ok, np.zeros(hi - lo, np.int64))
    later = is_node & (node > 0)
    out["parents"] = _first_bad(later & ~((parents >= 0) & (parents < node)))
    parent_depth = depths[rows, np.clip(parents, 0, width - 1)]
    out["depths"] = _first_bad(later & (depths != parent_depth + 1))
    accepted = f["accepted_nodes"].astype(np.int64)
    safe = np.clip(accepted, 0, width - 1)
    previous = np.concatenate([np.full((hi - lo, 1), -1), accepted[:, :-1]], axis=1)
    linked = np.where(pos == 0, accepted == 0,
                      (accepted > 0) & (accepted < nodes) & (parents[rows, safe] == previous))
    out["path"] = _first_bad(on_path & ~linked)
    # committed[j] is node accepted[j+1]'s token for j < tau-1, the bonus at j = tau-1
    next_token = f["tree_tokens"][rows, np.clip(np.concatenate([accepted[:, 1:], accepted[:, -1:]], axis=1), 0,
                                                width - 1)]
    expected = np.where(pos == tau - 1, c["bonus_token"][lo:hi, None], next_token)
    out["committed"] = _first_bad(on_path & (f["committed_tokens"] != expected))
    out["choice"] = _first_bad(on_path & (f["target_choice"][rows, safe] != f["committed_tokens"]))
    moves = (f["compact_src"] != prefix + accepted) | (f["compact_dst"] != prefix + pos)
    out["compact"] = _first_bad(on_path & moves)
    measured = on_path & (f["golden_tokens"] >= 0)
    out["dlogit"] = _first_bad(measured & ~np.isfinite(f["logit_max_abs_diff"]))
    cache_measured = f["golden_tokens"][:, 0] >= 0
    out["dcache"] = (cache_measured & ~np.isfinite(c["cache_max_abs_diff"][lo:hi]), np.zeros(hi - lo, np.int64))
    return out


def _first_bad(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(any bad per row [R], index of the first bad column per row [R]) of a bool [R, W] mask."""
    return mask.any(axis=1), np.argmax(mask, axis=1)
