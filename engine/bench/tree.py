"""Suite ``tree``: the batched GPU tree build (numba_kernels.tree.build) against the reference Python heapq
builder (engine.ddtree_ref.build_tree, one request after another), b = 64 requests, L = 15 depths, K = B.

Both build the same trees (the GPU one is checked bit-exact against the reference here before timing).
"""
from __future__ import annotations

import time

import numpy as np

from kdspec.engine.bench.common import progress, row, time_gpu
from kdspec.engine.golden import ddtree as ddtree_ref
from kdspec.numba_kernels.host_arrays import as_device_array as to_device
from kdspec.numba_kernels.tree import build as tree_build

SUITE = "tree"
TARGET_SPEEDUP = 100.0  # at budget 256, 64 requests


def random_drafts(requests: int, depths: int, top_k: int, seed: int = 0):
    """(logprobs float32 [b, L, K] log-softmax rows sorted descending, ids int32 [b, L, K] distinct per row)."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((requests, depths, top_k)).astype(np.float64) * 2.0
    logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    logprobs = -np.sort(-logprobs, axis=-1).astype(np.float32)
    ids = np.argsort(rng.random((requests, depths, max(top_k, 1))), axis=-1)[..., :top_k].astype(np.int32)
    return logprobs, ids


def run(quick: bool = False) -> list[dict]:
    requests, depths = (2, 3) if quick else (64, 15)
    budgets = (4, 8) if quick else (16, 64, 256, 1024)
    rows = []
    for budget in budgets:
        progress(f"tree: budget {budget}, {requests} requests, depth {depths}")
        top_k = budget
        logprobs, ids = random_drafts(requests, depths, top_k, seed=budget)
        roots = np.arange(requests, dtype=np.int32)
        prefix = np.full(requests, 100, dtype=np.int32)
        dev = [to_device(a) for a in (logprobs, ids, roots, prefix)]
        built = tree_build.build_trees(*dev, budget)
        got = built.to_host()
        for b in range(requests):  # the GPU trees must be the reference's before their speed means anything
            want = ddtree_ref.build_tree(logprobs[b], ids[b], int(roots[b]), budget, int(prefix[b]))
            count = int(got["num_nodes"][b])
            if count != want.num_nodes or not np.array_equal(got["parents"][b, :count], want.parents) \
                    or not np.array_equal(got["tokens"][b, :count], want.tokens):
                raise RuntimeError(f"tree: GPU build differs from the reference (budget {budget}, request {b})")
        # Timed as an engine runs it: inputs on the device, output buffers allocated once and reused.
        buffers = tree_build.TreeBatch.allocate(requests, budget)
        gpu = time_gpu(lambda: tree_build.build_trees(*dev, budget, out=buffers), warmup=1,
                       repeats=2 if quick else 10)

        def heapq_all():
            for b in range(requests):
                ddtree_ref.build_tree(logprobs[b], ids[b], int(roots[b]), budget, int(prefix[b]))
        repeats = 1 if (quick or budget >= 1024) else 3
        heap_times = []
        for _ in range(repeats):
            start = time.perf_counter()
            heapq_all()
            heap_times.append(time.perf_counter() - start)
        heap = float(np.median(heap_times))
        speedup = heap / gpu
        target = f">= {TARGET_SPEEDUP:g}x" if budget == 256 and not quick else None
        rows.append(row(SUITE, f"build b={requests} L={depths} B={budget}", gpu * 1e3, "ms", peer="heapq (Python)",
                        peer_value=heap * 1e3, ratio=speedup, target=target,
                        ok=(speedup >= TARGET_SPEEDUP) if target else None,
                        note=f"{requests * budget / gpu / 1e6:.3g} M nodes/s; ratio = heapq time / GPU time "
                             f"(GPU: one launch, device inputs, reused output buffers)"))
    return rows
