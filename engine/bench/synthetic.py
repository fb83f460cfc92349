"""Synthetic DDTree traces: consistent step records from a made-up drafter and target, written through
traces' writer. For the debugger's tests and for measuring it on big traces (`kdtree bench tui`: the command
line hands ``write_synthetic_trace`` to kdtree_tui/bench.py, which may not import the engine).

The "model" continues a fixed English passage (byte-level token ids): the target always predicts the
passage's next byte, except at injected anomaly steps; the drafter puts the passage's byte at rank 0
with a per-step hit probability and random distractors elsewhere. Trees are built best-first under the
budget and accepted greedily by the reference algorithms (engine.golden.ddtree), and the records are built by
the engine's record builder (engine.decode.records), so every record obeys the step record's invariants
(docs/trace-format.md). No numba.

Dimension letters: L drafted depths (block_size - 1), K drafter top-K, B budget, N+1 tree nodes, T = 8.
"""
from __future__ import annotations

import os
from typing import Iterator, Optional

import numpy as np

from kdspec.engine.decode.records import StepOutcome, TargetReadout, step_record
from kdspec.engine.golden import ddtree
from kdspec.traces.schema import STAGES, TARGET_TOPK
from kdspec.traces.writer import RunMetadata, TraceWriter

PASSAGE = (b"The quick brown fox jumps over the lazy dog. Speculative decoding drafts a tree of likely "
           b"continuations, verifies every node in one forward pass, and keeps the longest accepted path. ")
PASSAGE_IDS = np.frombuffer(PASSAGE, np.uint8).astype(np.int32)
# Anomalies injected every ANOMALY_PERIOD steps (when anomalies=True), at these offsets in the period:
DIVERGE_OFFSET, DLOGIT_OFFSET, CACHE_OFFSET = 7, 13, 21
ANOMALY_PERIOD = 29


def passage_token(position: int) -> int:
    """The synthetic golden token at an absolute position (the passage repeated)."""
    return PASSAGE[position % len(PASSAGE)]


def _distinct_others(rng: np.random.Generator, avoid: np.ndarray, count: int) -> np.ndarray:
    """[n, count] printable byte ids, distinct within a row and never equal to ``avoid`` [n].

    Offsets 1 + s + 13 j (s < 5, j < 7) are distinct and nonzero modulo the 95 printable bytes.
    """
    shift = rng.integers(0, 5, size=(avoid.shape[0], 1))
    offsets = 1 + shift + 13 * np.arange(count)[None, :]
    return (32 + (avoid[:, None] - 32 + offsets) % 95).astype(np.int32)


def _target_topk(rng: np.random.Generator, choice: np.ndarray, margin: np.ndarray):
    """Top-T ids [n, T] (choice first) and descending logits [n, T] whose top-1 minus top-2 is ``margin``."""
    n = choice.shape[0]
    ids = np.concatenate([choice[:, None], _distinct_others(rng, choice, TARGET_TOPK - 1)], axis=1)
    top = (8.0 + rng.random(n)).astype(np.float32)
    steps = np.cumsum(rng.random((n, TARGET_TOPK - 1)).astype(np.float32) * 0.5, axis=1)
    rest = top[:, None] - margin[:, None] - (steps - steps[:, :1])  # the runner-up exactly ``margin`` below
    return ids.astype(np.int32), np.concatenate([top[:, None], rest], axis=1).astype(np.float32)


def _draft(rng: np.random.Generator, prefix: int, num_depths: int, draft_topk: int):
    """The drafter: the passage's byte at rank 0 with a per-step hit rate, else only distractors.
    Returns (ids int32 [L, K], logprobs float32 [L, K] sorted descending)."""
    hit_rate = 0.7 + 0.3 * rng.random()
    golden_next = PASSAGE_IDS[(prefix + 1 + np.arange(num_depths)) % len(PASSAGE)]
    distractors = _distinct_others(rng, golden_next, draft_topk)
    hits = rng.random(num_depths) < hit_rate
    ids = np.where(hits[:, None], np.concatenate([golden_next[:, None], distractors[:, :-1]], axis=1),
                   distractors).astype(np.int32)
    logprobs = -np.sort(rng.exponential(1.0, size=(num_depths, draft_topk)).astype(np.float32), axis=1)
    logprobs[:, 0] *= 0.2
    return ids, logprobs


def _target_choice(rng: np.random.Generator, tree: ddtree.Tree, prefix: int) -> np.ndarray:
    """The target: the passage's next byte wherever the path so far is the passage, else a random byte."""
    matches = (tree.tokens == PASSAGE_IDS[(prefix + tree.depths) % len(PASSAGE)]).tolist()
    on_passage = [True] * tree.num_nodes
    for i in range(1, tree.num_nodes):  # parents come before children
        on_passage[i] = on_passage[tree.parents[i]] and matches[i]
    return np.where(on_passage, PASSAGE_IDS[(prefix + tree.depths + 1) % len(PASSAGE)],
                    rng.integers(32, 127, size=tree.num_nodes)).astype(np.int32)


def _golden_fields(rng: np.random.Generator, prefix: int, tau: int, phase: Optional[int], flip: bool) -> dict:
    """golden_tokens, logit_max_abs_diff, cache_max_abs_diff of a step: ~1e-6 differences, or the anomalies of
    its ``phase`` (None: no anomalies)."""
    dlogit = (rng.random(tau) * 2e-6).astype(np.float32)
    if phase == DLOGIT_OFFSET:
        dlogit[-1] = 0.5
    if flip:
        dlogit[0] = 0.02
    return {"golden_tokens": PASSAGE_IDS[(prefix + 1 + np.arange(tau)) % len(PASSAGE)],
            "logit_max_abs_diff": dlogit,
            "cache_max_abs_diff": np.float32(0.25 if phase == CACHE_OFFSET else rng.random() * 1e-6)}


def synthetic_records(num_steps: int, *, block_size: int = 8, budget: int = 16, draft_topk: int = 4,
                      prompt_len: int = 16, seed: int = 0, anomalies: bool = True) -> Iterator[dict]:
    """Yield ``num_steps`` DDTree step records (plain dicts of numpy arrays / scalars).

    With ``anomalies``: every ANOMALY_PERIOD steps one golden divergence (a genuine near-tie flip at the root:
    the golden token is the engine's runner-up, 1e-4 below its choice), one large |dlogit| (0.5) and one cache
    mismatch (0.25); other steps stay at ~1e-6.
    """
    rng = np.random.default_rng(seed)
    prefix = prompt_len
    root = passage_token(prefix)
    for step in range(num_steps):
        phase = step % ANOMALY_PERIOD if anomalies else None
        flip = phase == DIVERGE_OFFSET
        ids, logprobs = _draft(rng, prefix, block_size - 1, draft_topk)
        tree = ddtree.build_tree(logprobs, ids, root, budget, prefix)
        choice = _target_choice(rng, tree, prefix)
        if flip:  # a near-tie flip at the root: the engine's choice differs from the golden
            choice[0] = (passage_token(prefix + 1) - 32 + 1) % 95 + 32
        accepted, bonus = ddtree.accept(tree.parents, tree.tokens, choice)
        tau = len(accepted)
        margin = (0.5 + 4 * rng.random(tree.num_nodes)).astype(np.float32)
        if flip:
            margin[0] = 1e-4
        topk_ids, topk_logits = _target_topk(rng, choice, margin)
        if flip:  # the golden token is the runner-up (distinct from the others: they are choice + 1..83)
            topk_ids[0, 1] = passage_token(prefix + 1)
        golden = _golden_fields(rng, prefix, tau, phase, flip)
        times = rng.gamma(4.0, 1.0, size=5) * np.array([2e-4, 5e-5, 2e-3, 3e-5, 4e-5])
        outcome = StepOutcome(prefix, root, tree, None, choice, accepted, bonus,
                              ddtree.compaction_moves(prefix, accepted), cache_len_verify=prefix + tree.num_nodes,
                              cache_len_after=prefix + tau, times=dict(zip(STAGES, times)), draft=(ids, logprobs))
        yield {**step_record(outcome, TargetReadout(topk_ids, topk_logits, margin)), **golden}
        prefix += tau
        root = bonus


def synthetic_metadata(*, block_size: int = 8, budget: int = 16, draft_topk: int = 4, prompt_len: int = 16,
                       seed: int = 0):
    """The trace writer's RunMetadata of a synthetic run."""
    return RunMetadata(
        decode_config={"mode": "ddtree", "block_size": block_size, "budget": budget, "topk": draft_topk,
                       "drafter": "synthetic", "temperature": 0.0, "seed": seed},
        model_config={"name": "tiny", "vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 2,
                      "tokenizer": "byte"},
        backend="synthetic", device="none", prompt_tokens=[passage_token(p) for p in range(prompt_len)])


def write_synthetic_trace(path: str | os.PathLike, num_steps: int, *, finish: bool = True, force: bool = False,
                          compression: str | None = "lzf", **shape) -> str:
    """Write an N-step synthetic DDTree trace through traces' writer; return the path.

    shape: synthetic_records' keywords (block_size, budget, draft_topk, prompt_len, seed, anomalies).
    ``finish=False`` leaves the trace in the "recording" state (as a crashed or live run would).
    """
    meta = synthetic_metadata(**{k: v for k, v in shape.items() if k != "anomalies"})
    output, golden = [], []
    with TraceWriter(path, meta, compression=compression, force=force) as writer:
        for record in synthetic_records(num_steps, **shape):
            writer.write_step(record)
            if not output:  # the output starts with the prefill's token: the first step's root
                output.append(int(record["root_token"]))
                golden.append(int(record["root_token"]))
            output.extend(record["committed_tokens"].tolist())
            golden.extend(record["golden_tokens"].tolist())
        if finish:
            writer.finish(output, golden)
    return os.fspath(path)


def main(argv: list[str] | None = None) -> int:
    """`python -m kdspec.engine.bench.synthetic PATH STEPS`: write a synthetic trace and print the time it took."""
    import argparse
    import time

    parser = argparse.ArgumentParser(prog="python -m kdspec.engine.bench.synthetic")
    parser.add_argument("path")
    parser.add_argument("steps", type=int)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    write_synthetic_trace(args.path, args.steps, force=args.force)
    print(f"{args.steps} steps -> {args.path} in {time.perf_counter() - start:.1f} s "
          f"({os.path.getsize(args.path) / max(args.steps, 1):.0f} bytes/step)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
