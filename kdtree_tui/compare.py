"""Comparing two traces (no Textual): what differs between their runs, whether they committed the same text,
and aligning them by committed position.

Row r of an alignment is a position P where a step of A or of B starts (its prefix_len). Both traces
commit the same text when they agree, so the rows where both start a step show where their step
boundaries coincide; a row differs when the tokens the two traces commit from P up to the next row differ.
Two traces are called identical only when their model and prompt are the same and they committed the same
tokens, as many of them: tokens at equal positions after different prompts are not comparable text.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kdspec.kdtree_tui.session import TraceSession
from kdspec.traces.schema import TraceError
from kdspec.traces.thresholds import trace_precision

# What a compare header lists for each run; a field whose values differ is marked.
RUN_FIELDS = ("model", "drafter", "mode", "budget", "block", "backend", "precision", "seed", "temperature")


@dataclass
class Alignment:
    """R rows: positions int64 [R]; a_step, b_step int64 [R] (-1: that trace has no step starting there);
    differs bool [R]; first_difference: position of the first differing token, or None."""

    positions: np.ndarray
    a_step: np.ndarray
    b_step: np.ndarray
    differs: np.ndarray
    first_difference: int | None

    @property
    def num_rows(self) -> int:
        return int(self.positions.shape[0])

    def row_of_a_step(self, step: int) -> int:
        hits = np.flatnonzero(self.a_step == step)
        return int(hits[0]) if hits.size else 0


def committed_stream(session: TraceSession) -> tuple[int, np.ndarray]:
    """(first position, int64 tokens): the tokens committed by all steps, at positions P0+1, P0+2, ..."""
    c = session.columns
    if session.num_steps == 0:
        return 0, np.zeros(0, np.int64)
    tau = c["tau"]
    valid = np.arange(c["committed_tokens"].shape[1])[None, :] < tau[:, None]
    return int(c["prefix_len"][0]) + 1, c["committed_tokens"][valid].astype(np.int64)


def align(a: TraceSession, b: TraceSession) -> Alignment:
    pa, pb = a.columns["prefix_len"].astype(np.int64), b.columns["prefix_len"].astype(np.int64)
    positions = np.union1d(pa, pb)
    a_step = np.full(positions.shape, -1, np.int64)
    b_step = np.full(positions.shape, -1, np.int64)
    a_step[np.searchsorted(positions, pa)] = np.arange(len(pa))
    b_step[np.searchsorted(positions, pb)] = np.arange(len(pb))
    # Token-by-token comparison of the committed streams at equal absolute positions.
    start_a, tokens_a = committed_stream(a)
    start_b, tokens_b = committed_stream(b)
    start = max(start_a, start_b)
    stop = min(start_a + len(tokens_a), start_b + len(tokens_b))
    wrong_positions = np.zeros(0, np.int64)
    if stop > start:
        seg_a = tokens_a[start - start_a:stop - start_a]
        seg_b = tokens_b[start - start_b:stop - start_b]
        wrong_positions = start + np.flatnonzero(seg_a != seg_b)
    # A row covers the tokens at positions (P_r, P_{r+1}]: it differs if any wrong position falls there.
    row_of_wrong = np.searchsorted(positions, wrong_positions, side="left") - 1
    differs = np.zeros(positions.shape, bool)
    differs[row_of_wrong[row_of_wrong >= 0]] = True
    first = int(wrong_positions[0]) if wrong_positions.size else None
    return Alignment(positions, a_step, b_step, differs, first)


def run_facts(session: TraceSession) -> dict[str, Any]:
    """RUN_FIELDS of one trace, from its metadata (a field the trace lacks reads "?")."""
    meta = session.metadata
    decode = meta.get("decode_config") if isinstance(meta.get("decode_config"), dict) else {}
    model = meta.get("model_config") if isinstance(meta.get("model_config"), dict) else {}
    mode = str(decode.get("mode", meta.get("mode", "?")))
    recorded = meta.get("drafter") if isinstance(meta.get("drafter"), dict) else {}
    drafter = recorded.get("name") or decode.get("drafter") or ("none (AR)" if mode == "ar" else "?")
    return {"model": model.get("name", "?"), "drafter": str(drafter), "mode": mode,
            "budget": decode.get("budget", meta.get("budget", "?")),
            "block": decode.get("block_size", meta.get("block_size", "?")), "backend": meta.get("backend", "?"),
            "precision": trace_precision(meta), "seed": decode.get("seed", meta.get("seed", "?")),
            "temperature": decode.get("temperature", "?")}


@dataclass(frozen=True)
class Comparison:
    """identical: same model (name and configuration), same prompt, the same committed tokens, as many;
    differences: the RUN_FIELDS whose values differ; reasons: why not identical (empty when identical)."""

    identical: bool
    differences: tuple[str, ...]
    reasons: tuple[str, ...]


def compare_runs(a: TraceSession, b: TraceSession, alignment: Alignment) -> Comparison:
    facts_a, facts_b = run_facts(a), run_facts(b)
    differences = tuple(name for name in RUN_FIELDS if facts_a[name] != facts_b[name])
    reasons = []
    model_a, model_b = a.metadata.get("model_config"), b.metadata.get("model_config")
    if facts_a["model"] != facts_b["model"]:
        reasons.append(f"different models ({facts_a['model']} / {facts_b['model']})")
    elif _model_weights_config(model_a) != _model_weights_config(model_b):
        reasons.append("different model configurations")
    prompt_a, prompt_b = _prompt(a), _prompt(b)
    same_prompt = prompt_a is not None and prompt_b is not None and np.array_equal(prompt_a, prompt_b)
    if not same_prompt:
        reasons.append("different prompts")
    elif alignment.first_difference is not None:
        reasons.append(f"first differing token at position {alignment.first_difference}")
    else:
        # Finished traces are compared by their outputs (a DDTree run's last step may commit past max_new_tokens,
        # an AR run's first token is the prefill's); one still recording, by what it committed so far.
        out_a, out_b = _output(a), _output(b)
        if out_a is not None and out_b is not None:
            if len(out_a) != len(out_b):
                reasons.append(f"A's output has {len(out_a)} tokens, B's {len(out_b)}")
            elif not np.array_equal(out_a, out_b):
                reasons.append("the recorded outputs differ")
        else:
            (_, tokens_a), (_, tokens_b) = committed_stream(a), committed_stream(b)
            if len(tokens_a) != len(tokens_b):
                reasons.append(f"A committed {len(tokens_a)} tokens so far, B {len(tokens_b)}")
    return Comparison(not reasons, differences, tuple(reasons))


def _output(session: TraceSession):
    """The output a finished trace recorded (int64), or None while it is recording (or has none)."""
    if session.metadata.get("status") != "complete":
        return None
    try:
        output = np.asarray(session.reader.output_tokens, np.int64)
    except (TraceError, KeyError, ValueError, OSError):   # damaged: compare what the steps committed instead
        return None
    return output if len(output) else None


def _model_weights_config(model: Any) -> Any:
    """A model configuration without what does not change the model's function (its name; the weight dtype is
    a run difference, reported as precision)."""
    if not isinstance(model, dict):
        return model
    return {k: v for k, v in model.items() if k not in ("name", "weight_dtype")}


def _prompt(session: TraceSession):
    prompt = session.metadata.get("prompt_tokens")
    return None if prompt is None else np.asarray(prompt, np.int64)
