"""Synthetic DDTree traces: consistent step records from a made-up drafter and target, written through
traces' writer. For the app's tests and for measuring the app on big traces (`kdtree bench tui`).

The "model" continues a fixed English passage (byte-level token ids): the target always predicts the
passage's next byte, except at injected anomaly steps; the drafter puts the passage's byte at rank 0
with a per-step hit probability and random distractors elsewhere. Trees are built best-first under the
budget exactly as DDTree does, accepted greedily, and compacted, so every record obeys the step record's
invariants (docs/architecture.md). No engine, no numba.

Dimension letters: L drafted depths (block_size - 1), K drafter top-K, B budget, N+1 tree nodes, T = 8.
"""
from __future__ import annotations

import heapq
import os
from typing import Iterator

import numpy as np

PASSAGE = (b"The quick brown fox jumps over the lazy dog. Speculative decoding drafts a tree of likely "
           b"continuations, verifies every node in one forward pass, and keeps the longest accepted path. ")
PASSAGE_IDS = np.frombuffer(PASSAGE, np.uint8).astype(np.int32)
TARGET_TOPK = 8
# Anomalies injected every ANOMALY_PERIOD steps (when anomalies=True), at these offsets in the period:
DIVERGE_OFFSET, DLOGIT_OFFSET, CACHE_OFFSET = 7, 13, 21
ANOMALY_PERIOD = 29


def passage_token(position: int) -> int:
    """The synthetic golden token at an absolute position (the passage repeated)."""
    return PASSAGE[position % len(PASSAGE)]


def _build_tree(logprobs: np.ndarray, ids: np.ndarray, root: int, budget: int):
    """Best-first tree of the B most probable prefixes (docs/ddtree.md rules, float32 scores)."""
    depth_limit, top_k = logprobs.shape
    tokens, parents, depths, ranks, scores = [root], [-1], [0], [0], [np.float32(0)]
    heap = []
    if depth_limit and top_k and budget:
        heap.append((-float(logprobs[0, 0]), (0,), 0, 1, 0, np.float32(logprobs[0, 0])))
    while heap and len(tokens) <= budget:
        _, path, parent, depth, rank, score = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(int(ids[depth - 1, rank]))
        parents.append(parent)
        depths.append(depth)
        ranks.append(rank)
        scores.append(score)
        if rank + 1 < top_k:  # next sibling: same parent, next rank
            sibling = np.float32(scores[parent] + logprobs[depth - 1, rank + 1])
            heapq.heappush(heap, (-float(sibling), path[:-1] + (rank + 1,), parent, depth, rank + 1, sibling))
        if depth < depth_limit:  # first child
            child = np.float32(score + logprobs[depth, 0])
            heapq.heappush(heap, (-float(child), path + (0,), node, depth + 1, 0, child))
    return (np.array(tokens, np.int32), np.array(parents, np.int32), np.array(depths, np.int32),
            np.array(ranks, np.int32), np.array(scores, np.float32))


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
    rest = top[:, None] - margin[:, None] - steps
    return ids.astype(np.int32), np.concatenate([top[:, None], rest], axis=1).astype(np.float32)


def synthetic_records(num_steps: int, *, block_size: int = 8, budget: int = 16, draft_topk: int = 4,
                      prompt_len: int = 16, seed: int = 0, anomalies: bool = True) -> Iterator[dict]:
    """Yield ``num_steps`` DDTree step records (plain dicts of numpy arrays / scalars).

    With ``anomalies``: every ANOMALY_PERIOD steps one golden divergence (a near-tie flip at the root,
    margin 0.01), one large |dlogit| (0.5) and one cache mismatch (0.25); other steps stay at ~1e-6.
    """
    rng = np.random.default_rng(seed)
    num_depths = block_size - 1
    prefix = prompt_len
    root = passage_token(prefix)
    for step in range(num_steps):
        phase = step % ANOMALY_PERIOD
        hit_rate = 0.7 + 0.3 * rng.random()
        # Drafter: the passage byte at rank 0 with probability hit_rate, else only distractors.
        golden_next = PASSAGE_IDS[(prefix + 1 + np.arange(num_depths)) % len(PASSAGE)]
        distractors = _distinct_others(rng, golden_next, draft_topk)
        hits = rng.random(num_depths) < hit_rate
        ids = np.where(hits[:, None], np.concatenate([golden_next[:, None], distractors[:, :-1]], axis=1),
                       distractors).astype(np.int32)
        logprobs = -np.sort(rng.exponential(1.0, size=(num_depths, draft_topk)).astype(np.float32), axis=1)
        logprobs[:, 0] *= 0.2
        tokens, parents, depths, ranks, scores = _build_tree(logprobs, ids, root, budget)
        num_nodes = len(tokens)
        # Target: the passage's next byte wherever the path so far is the passage, else a random byte.
        matches = (tokens == PASSAGE_IDS[(prefix + depths) % len(PASSAGE)]).tolist()
        on_passage = [True] * num_nodes
        for i in range(1, num_nodes):  # parents come before children
            on_passage[i] = on_passage[parents[i]] and matches[i]
        choice = np.where(on_passage, PASSAGE_IDS[(prefix + depths + 1) % len(PASSAGE)],
                          rng.integers(32, 127, size=num_nodes)).astype(np.int32)
        flip = anomalies and phase == DIVERGE_OFFSET
        if flip:  # a near-tie flip at the root: the engine's choice differs from the golden
            choice[0] = (passage_token(prefix + 1) - 32 + 1) % 95 + 32
        accepted = [0]
        parent_list, token_list, choice_list = parents.tolist(), tokens.tolist(), choice.tolist()
        while True:
            here = accepted[-1]
            child = next((c for c in range(here + 1, num_nodes)
                          if parent_list[c] == here and token_list[c] == choice_list[here]), None)
            if child is None:
                break
            accepted.append(child)
        accepted = np.array(accepted, np.int32)
        tau = len(accepted)
        bonus = int(choice[accepted[-1]])
        committed = np.concatenate([tokens[accepted[1:]], [bonus]]).astype(np.int32)
        golden = PASSAGE_IDS[(prefix + 1 + np.arange(tau)) % len(PASSAGE)]
        margin = (0.5 + 4 * rng.random(num_nodes)).astype(np.float32)
        if flip:
            margin[0] = 0.01
        topk_ids, topk_logits = _target_topk(rng, choice, margin)
        dlogit = (rng.random(tau) * 2e-6).astype(np.float32)
        if anomalies and phase == DLOGIT_OFFSET:
            dlogit[-1] = 0.5
        if flip:
            dlogit[0] = 0.02
        cache_diff = np.float32(0.25 if anomalies and phase == CACHE_OFFSET else rng.random() * 1e-6)
        times = rng.gamma(4.0, 1.0, size=5) * np.array([2e-4, 5e-5, 2e-3, 3e-5, 4e-5])
        yield {
            "prefix_len": prefix, "root_token": root, "draft_ids": ids, "draft_logprobs": logprobs,
            "tree_tokens": tokens, "tree_parents": parents, "tree_depths": depths, "tree_ranks": ranks,
            "tree_scores": scores, "target_choice": choice, "target_topk_ids": topk_ids,
            "target_topk_logits": topk_logits, "target_margin": margin, "accepted_nodes": accepted,
            "bonus_token": bonus, "committed_tokens": committed, "golden_tokens": golden,
            "logit_max_abs_diff": dlogit, "cache_len_before": prefix, "cache_len_verify": prefix + num_nodes,
            "cache_len_after": prefix + tau, "compact_src": (prefix + accepted).astype(np.int32),
            "compact_dst": (prefix + np.arange(tau)).astype(np.int32), "cache_max_abs_diff": cache_diff,
            "time_draft": times[0], "time_build": times[1], "time_verify": times[2],
            "time_accept": times[3], "time_compact": times[4],
        }
        prefix += tau
        root = bonus


def synthetic_metadata(*, block_size: int = 8, budget: int = 16, draft_topk: int = 4, prompt_len: int = 16,
                       seed: int = 0):
    """The trace writer's RunMetadata of a synthetic run."""
    from kdspec.traces.writer import RunMetadata

    return RunMetadata(
        decode_config={"mode": "ddtree", "block_size": block_size, "budget": budget, "topk": draft_topk,
                       "drafter": "synthetic", "temperature": 0.0, "seed": seed},
        model_config={"name": "tiny", "vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 2,
                      "tokenizer": "byte"},
        backend="synthetic", device="none", prompt_tokens=[passage_token(p) for p in range(prompt_len)])


def write_synthetic_trace(path: str | os.PathLike, num_steps: int, *, block_size: int = 8, budget: int = 16,
                          draft_topk: int = 4, prompt_len: int = 16, seed: int = 0, anomalies: bool = True,
                          finish: bool = True, force: bool = False, compression: str | None = "lzf") -> str:
    """Write an N-step synthetic DDTree trace through traces' writer; return the path.

    ``finish=False`` leaves the trace in the "recording" state (as a crashed or live run would).
    """
    from kdspec.traces.writer import TraceWriter

    meta = synthetic_metadata(block_size=block_size, budget=budget, draft_topk=draft_topk,
                              prompt_len=prompt_len, seed=seed)
    output, golden = [], []
    with TraceWriter(path, meta, compression=compression, force=force) as writer:
        for record in synthetic_records(num_steps, block_size=block_size, budget=budget, draft_topk=draft_topk,
                                        prompt_len=prompt_len, seed=seed, anomalies=anomalies):
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
    """`python -m kdtree_tui.synthetic PATH STEPS`: write a synthetic trace and print the time it took."""
    import argparse
    import time

    parser = argparse.ArgumentParser(prog="python -m kdtree_tui.synthetic")
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
