"""Tree-build sweep: every make_build_kernel variant bit-exact against the heapq reference, then its speed.

    python3 -m tools.sweeps.tree          (H200: ~1-2 min)
    python3 -m tools.sweeps.tree --sim    (CUDA simulator, toy sizes: a few seconds; the times mean nothing)

1. correctness: b=64 requests, L=15 depths, K=B in 16, 64, 256, 1024 (kdspec.engine.bench.tree.random_drafts,
   as `kdtree bench tree`), and the same shapes with log-probs rounded to a few values (exact score ties
   everywhere); every output of every variant (padding and the visibility bitmask included) compared
   bit-exact with engine.ddtree_ref.build_tree; outputs poisoned before each check.
2. timing (CUDA events, median of 15 after 3 warmups), device inputs, output buffers reused:
   "call" = events around one build_trees call (what `kdtree bench tree` times, host launch cost included);
   "queued" = 20 back-to-back calls between two events / 20 (the kernel, the launch overhead hidden);
   "host" = perf_counter around those 20 calls / 20 (the Python launch cost alone);
   the heapq reference (Python, one request after another) timed once per budget, as the bench does.
3. registers / local memory (spills) / shared memory per variant; a table last, then the best variant per
   budget: make it make_build_kernel's defaults in numba_kernels/tree_build.py if it is not already.
"""
import os
import statistics
import sys
import time

if "--sim" in sys.argv[1:]:  # before numba is imported: the simulator is chosen at import time
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

from kdspec.engine.bench.tree import random_drafts  # noqa: E402
from kdspec.engine.golden import ddtree as ddtree_ref  # noqa: E402
from kdspec.numba_kernels.runtime import ON_SIMULATOR
from kdspec.numba_kernels.tree import build as tree_build  # noqa: E402
from tools.sweeps.report import kernel_resources, log  # noqa: E402

REQUESTS, DEPTHS = (2, 3) if ON_SIMULATOR else (64, 15)
BUDGETS = (4, 8) if ON_SIMULATOR else (16, 64, 256, 1024)
DECISIVE_BUDGET = BUDGETS[-2]  # the bench's target point (B=256 on a GPU)
WARMUP, REPEATS, QUEUED = (1, 2, 2) if ON_SIMULATOR else (3, 15, 20)
# make_build_kernel keyword arguments (the simulator has no warp reductions: `redux` changes nothing there)
VARIANTS = {
    "default": dict(),
    "shfl max": dict(redux=False),
    "no lp stage": dict(stage_logprobs=False),
    "unroll 2": dict(scan_unroll=2),
    "unroll 8": dict(scan_unroll=8),
}
FIELDS = ("tokens", "parents", "depths", "ranks", "scores", "positions", "num_nodes", "visibility")



def inputs(budget: int, tied: bool):
    """(logprobs float32 [b, L, K], ids int32 [b, L, K], roots int32 [b], prefix int32 [b]) with K = B."""
    logprobs, ids = random_drafts(REQUESTS, DEPTHS, budget, seed=budget + tied)
    if tied:  # a few distinct values: exact score ties everywhere (rows stay sorted descending)
        logprobs = np.round(logprobs * 2.0).clip(-3.0, None).astype(np.float32) / np.float32(2.0)
    roots = np.arange(REQUESTS, dtype=np.int32) + 7
    prefix = (np.arange(REQUESTS, dtype=np.int32) * 13 + 100).astype(np.int32)
    return logprobs, ids, roots, prefix


def expected(logprobs, ids, roots, prefix, budget: int) -> dict:
    """The reference trees laid out as the kernel's padded outputs (bitmask packed little-endian in uint32)."""
    nodes = budget + 1
    words = (nodes + 31) // 32
    want = dict(tokens=np.full((REQUESTS, nodes), -1, np.int32), parents=np.full((REQUESTS, nodes), -1, np.int32),
                depths=np.full((REQUESTS, nodes), -1, np.int32), ranks=np.full((REQUESTS, nodes), -1, np.int32),
                scores=np.full((REQUESTS, nodes), -np.inf, np.float32),
                positions=np.full((REQUESTS, nodes), -1, np.int32), num_nodes=np.zeros(REQUESTS, np.int32),
                visibility=np.zeros((REQUESTS, nodes, words), np.uint32))
    for r in range(REQUESTS):
        tree = ddtree_ref.build_tree(logprobs[r], ids[r], int(roots[r]), budget, int(prefix[r]))
        n = tree.num_nodes
        want["num_nodes"][r] = n
        for name in FIELDS[:6]:
            want[name][r, :n] = getattr(tree, name)
        bits = np.zeros((nodes, words * 32), dtype=bool)
        bits[:n, :n] = tree.visibility
        want["visibility"][r] = np.packbits(bits, axis=1, bitorder="little").view(np.uint32)
    return want


def poison(batch: tree_build.TreeBatch) -> None:
    for name in FIELDS:
        array = getattr(batch, name)
        fill = 0xDEADBEEF if array.dtype == np.uint32 else (np.nan if array.dtype.kind == "f" else -7)
        array.copy_to_device(np.full(array.shape, fill, dtype=array.dtype))


def time_call(fn) -> tuple[float, float, float]:
    """Median seconds (one call between events, per call of QUEUED back-to-back calls, host per call of those);
    perf_counter for all three under the simulator."""
    for _ in range(WARMUP):
        fn()
    cuda.synchronize()
    singles, queued, host = [], [], []
    for _ in range(REPEATS):
        if ON_SIMULATOR:
            start = time.perf_counter()
            fn()
            singles.append(time.perf_counter() - start)
            queued.append(singles[-1])
            host.append(singles[-1])
            continue
        begin, end = cuda.event(), cuda.event()
        begin.record()
        fn()
        end.record()
        end.synchronize()
        singles.append(begin.elapsed_time(end) / 1e3)
        begin.record()
        start = time.perf_counter()
        for _ in range(QUEUED):
            fn()
        host.append((time.perf_counter() - start) / QUEUED)
        end.record()
        end.synchronize()
        queued.append(begin.elapsed_time(end) / 1e3 / QUEUED)
    return statistics.median(singles), statistics.median(queued), statistics.median(host)



def main() -> int:
    log(f"tree sweep: {'CUDA simulator (times mean nothing)' if ON_SIMULATOR else cuda.get_current_device().name}; "
        f"b={REQUESTS} L={DEPTHS} K=B")
    kernels = {name: tree_build.make_build_kernel(**flags) for name, flags in VARIANTS.items()}
    failures = []
    results = {}  # (variant, budget) -> (call s, queued s, host s)
    heapq_seconds = {}
    for budget in BUDGETS:
        working = dict(kernels)
        for tied in (False, True):
            host = inputs(budget, tied)
            want = expected(*host, budget)
            dev = [cuda.to_device(a) for a in host]
            for name, kernel in list(working.items()):
                out = tree_build.TreeBatch.allocate(REQUESTS, budget)
                poison(out)
                try:
                    got = tree_build.build_trees(*dev, budget, out=out, kernel=kernel).to_host()
                except Exception as error:  # noqa: BLE001 - a variant that fails to compile or launch: drop it
                    log(f"check B={budget:5d} {name:12s} ERROR {type(error).__name__}: {str(error)[:300]}")
                    failures.append((name, budget, tied, "error"))
                    del working[name]
                    continue
                bad = [field for field in FIELDS if got[field].tobytes() != want[field].tobytes()]
                if bad:
                    failures.append((name, budget, tied, bad))
                log(f"check B={budget:5d} {'tied' if tied else 'rand'} {name:12s} "
                    f"{'ok' if not bad else f'MISMATCH {bad}'}")
        host = inputs(budget, False)
        dev = [cuda.to_device(a) for a in host]
        start = time.perf_counter()  # the reference, one request after another, as the bench times it
        for r in range(REQUESTS):
            ddtree_ref.build_tree(host[0][r], host[1][r], int(host[2][r]), budget, int(host[3][r]))
        heapq_seconds[budget] = time.perf_counter() - start
        for name, kernel in working.items():
            if any(f[0] == name and f[1] == budget for f in failures):
                continue  # a wrong variant's speed means nothing
            out = tree_build.TreeBatch.allocate(REQUESTS, budget)
            results[name, budget] = time_call(
                lambda: tree_build.build_trees(*dev, budget, out=out, kernel=kernel))
            call, queued, host_call = results[name, budget]
            log(f"time  B={budget:5d} {name:12s} call {call * 1e3:8.4f} ms  queued {queued * 1e3:8.4f} ms  "
                f"host {host_call * 1e3:8.4f} ms  heapq/call {heapq_seconds[budget] / call:8.1f}x")

    log("\n== registers per variant ==")
    for name, kernel in kernels.items():
        log(f"{name:12s} {VARIANTS[name] or '(make_build_kernel defaults)'}: "
            f"{kernel_resources(kernel, ON_SIMULATOR)}")

    log(f"\n== tree build: b={REQUESTS} L={DEPTHS} K=B, ms (call = events around one build_trees call; "
        "queued = back-to-back average) ==")
    log(f"{'variant':16s} " + " ".join(f"{'B=' + str(b) + ' call':>13s} {'queued':>8s}" for b in BUDGETS))
    nan = (float("nan"),) * 3
    for name in VARIANTS:
        log(f"{name:16s} " + " ".join(f"{results.get((name, b), nan)[0] * 1e3:13.4f} "
                                      f"{results.get((name, b), nan)[1] * 1e3:8.4f}" for b in BUDGETS))
    log(f"{'heapq (Python)':16s} " + " ".join(f"{heapq_seconds[b] * 1e3:13.2f} {'':>8s}" for b in BUDGETS))
    log(f"{'heapq / default':16s} " + " ".join(
        f"{heapq_seconds[b] / results.get(('default', b), nan)[0]:12.1f}x {'':>8s}" for b in BUDGETS))
    for budget in BUDGETS:
        timed = [name for name in VARIANTS if (name, budget) in results]
        if not timed:
            log(f"best B={budget}: none (every variant failed)")
            continue
        best = min(timed, key=lambda name: results[name, budget][0])
        log(f"best B={budget}: {best} {VARIANTS[best] or ''} ({results[best, budget][0] * 1e3:.4f} ms a call, "
            f"{heapq_seconds[budget] / results[best, budget][0]:.1f}x heapq; default "
            f"{results.get(('default', budget), nan)[0] * 1e3:.4f} ms)"
            + ("  <- the bench's target point" if budget == DECISIVE_BUDGET else ""))
    if failures:
        log(f"CHECKS FAILED: {len(failures)}: {failures}")
        return 1
    log("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
