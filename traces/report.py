"""Text and JSON reports of a trace, and the integrity check behind `kdtree info` and `kdtree check`."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from kdspec.traces.reader import TraceReader
from kdspec.traces.summary import generated_tokens


def _fmt(x: float, spec: str = ".3g") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def info_text(reader: TraceReader) -> str:
    """A human summary of a trace, a few lines."""
    meta, s = reader.metadata, reader.summary()
    model = meta.get("model_config", {}).get("name", "?")
    lines = [
        f"trace      {reader.path}  (schema {meta['schema_version']}, {meta['status']})",
        f"model      {model}  backend {meta['backend']}  device {meta['device']}  mode {meta['mode']}  "
        f"seed {meta['seed']}",
        f"shape      block_size {meta['block_size']}  budget {meta['budget']}  draft top-K {meta['draft_topk']}  "
        f"prompt {len(reader.prompt_tokens)} tokens",
        f"steps      {s.num_steps}  tokens {len(s.output_tokens)}  mean tau {_fmt(s.mean_tau, '.2f')}",
        "tau hist   " + "  ".join(f"{t}:{n}" for t, n in s.tau_histogram.items()),
    ]
    if s.per_depth_acceptance:
        lines.append("reached d  " + "  ".join(f"{d}:{p:.2f}" for d, p in s.per_depth_acceptance.items()))
    if s.golden_match:
        golden = "tokens equal"
    elif s.first_divergence_step is not None:
        golden = f"DIVERGES at step {s.first_divergence_step}"
    else:
        golden = "recorded output differs from the recorded golden"
    where = "" if s.max_logit_diff_at is None else f" at step {s.max_logit_diff_at[0]}, position {s.max_logit_diff_at[1]}"
    lines.append(f"golden     {golden}; worst |dlogit| {_fmt(s.max_logit_diff)}{where}")
    lines.append(f"cache      worst |dcache| {_fmt(s.max_cache_diff)}")
    times = "  ".join(f"{name} {_fmt(total * 1e3, '.1f')}" for name, total in s.stage_time_totals.items())
    lines.append(f"time (ms)  {times}")
    return "\n".join(lines)


def info_json(reader: TraceReader) -> dict[str, Any]:
    """JSON-serialisable summary (plain ints, floats, lists; NaN becomes None)."""
    meta, s = reader.metadata, reader.summary()

    def num(x):
        return None if x is None or (isinstance(x, float) and math.isnan(x)) else x

    return {
        "path": reader.path, "schema_version": meta["schema_version"], "status": meta["status"],
        "model": meta.get("model_config", {}).get("name"), "model_config": meta.get("model_config"),
        "decode_config": meta.get("decode_config"), "backend": meta["backend"], "device": meta["device"],
        "mode": meta["mode"], "seed": meta["seed"], "start_time": meta["start_time"],
        "end_time": meta["end_time"] or None, "versions": meta.get("versions"),
        "prompt_tokens": [int(t) for t in reader.prompt_tokens],
        "num_steps": s.num_steps, "mean_accept": num(s.mean_tau),
        "tau_histogram": {str(t): n for t, n in s.tau_histogram.items()},
        "per_depth_acceptance": {str(d): p for d, p in s.per_depth_acceptance.items()},
        "output_tokens": [int(t) for t in s.output_tokens], "golden_tokens": [int(t) for t in s.golden_tokens],
        "golden_match": s.golden_match, "first_divergence_step": s.first_divergence_step,
        "max_logit_diff": num(s.max_logit_diff),
        "max_logit_diff_at": list(s.max_logit_diff_at) if s.max_logit_diff_at else None,
        "max_cache_diff": num(s.max_cache_diff),
        "stage_time_totals": {k: num(v) for k, v in s.stage_time_totals.items()},
    }


def check(reader: TraceReader) -> tuple[int, str]:
    """(0, message) when the trace is complete, internally consistent and equal to the golden; else (1, why).

    Consistency: the recorded output is the first token (step 0's root, from the prefill) followed by the
    steps' committed tokens, cut inside the last step (it may overshoot max_new_tokens); each step
    commits the tokens of its accepted nodes after the root, then its bonus token; the next step starts
    at prefix_len + tau with that bonus as its root. Damage raises TraceError (the caller exits 2).
    """
    if not reader.is_complete:
        return 1, f"trace is not complete (status {reader.metadata.get('status')!r})"
    n = reader.num_steps
    tau, prefix = reader.column("tau"), reader.column("prefix_len")
    root, bonus = reader.column("root_token"), reader.column("bonus_token")
    committed, golden = reader.field("committed_tokens"), reader.field("golden_tokens")
    accepted, tree = reader.field("accepted_nodes"), reader.field("tree_tokens")
    num_nodes = reader.column("num_nodes")
    for i in range(n):
        t = int(tau[i])
        if accepted[i, 0] != 0 or (accepted[i, :t] < 0).any() or (accepted[i, :t] >= num_nodes[i]).any():
            return 1, f"step {i}: accepted_nodes {accepted[i, :t].tolist()} is not a path of the step's tree"
        path_tokens = tree[i][accepted[i, 1:t]]
        if not np.array_equal(committed[i, :t - 1], path_tokens) \
                or committed[i, t - 1] != bonus[i]:
            return 1, f"step {i}: committed tokens are not the accepted path's tokens followed by the bonus token"
        if i + 1 < n and (prefix[i + 1] != prefix[i] + t or root[i + 1] != bonus[i]):
            return 1, f"step {i + 1}: does not continue step {i} (prefix_len {prefix[i + 1]} vs {prefix[i] + t}, " \
                      f"root {root[i + 1]} vs bonus {bonus[i]})"
    output = reader.output_tokens
    if n:
        # The output is the prefill's token (step 0's root) then every step's committed tokens; the last
        # step may commit past max_new_tokens, so the output ends somewhere inside the last step's tokens.
        generated = generated_tokens(root, tau, committed)
        shortest = len(generated) - int(tau[-1]) + 1
        if not shortest <= len(output) <= len(generated) or not np.array_equal(output, generated[:len(output)]):
            return 1, (f"recorded output ({len(output)} tokens) differs from the steps' tokens ({len(generated)} "
                       f"tokens: the first token, then each step's committed tokens)")
    s = reader.summary()
    if s.first_divergence_step is not None:
        i = s.first_divergence_step
        j = int(np.argmax(committed[i] != golden[i]))
        return 1, (f"diverges from the golden at step {i}, position {j}: "
                   f"token {committed[i, j]} vs golden {golden[i, j]}")
    if not s.golden_match:
        return 1, f"recorded output differs from the recorded golden ({len(s.golden_tokens)} tokens)"
    return 0, (f"ok: {len(output)} tokens in {n} steps equal the golden; worst |dlogit| {_fmt(s.max_logit_diff)}, "
               f"worst |dcache| {_fmt(s.max_cache_diff)}")
