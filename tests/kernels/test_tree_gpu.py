"""Tree/sampling kernels at realistic sizes on a real GPU, bit-exact against the references.

Budget up to 1024 with 64 requests, depth 15, K 8 and K = B (every build kernel variant); vocabulary 163840 for argmax / top-k / sampling;
block reductions at warp-multiple widths (the shuffle path the simulator never runs); build speed
against the Python heapq builder.
"""

import numpy as np
import pytest
from numba import cuda, float64, int32
from test_tree import expected_build, poisoned, random_drafts, run_build

from kdspec.engine.golden import ddtree as ddtree_ref
from kdspec.engine.golden import sampling as sampling_ref
from kdspec.numba_kernels import sampling
from kdspec.numba_kernels.reductions import INT32_MAX, block_argmax, block_max, block_sum
from kdspec.numba_kernels.tree import accept as tree_accept
from kdspec.numba_kernels.tree import build as tree_build
from kdspec.numba_kernels.tree import compact as kv_compact

pytestmark = pytest.mark.gpu

VOCAB = 163840


@pytest.mark.parametrize("budget,tie_pool", [(1024, None), (1024, 5), (256, None), (63, 3), (1, None)])
def test_build_trees_realistic_bit_exact(budget, tie_pool):
    rng = np.random.default_rng(budget)
    logprobs, ids = random_drafts(rng, 64, 15, 8, tie_pool)
    ids = rng.integers(0, VOCAB, size=ids.shape).astype(np.int32)
    roots = rng.integers(0, VOCAB, size=64).astype(np.int32)
    prefix_lens = rng.integers(0, 100_000, size=64).astype(np.int32)
    got = run_build(logprobs, ids, roots, prefix_lens, budget)
    exp = expected_build(logprobs, ids, roots, prefix_lens, budget)
    for name in exp:
        assert got[name].tobytes() == exp[name].tobytes(), name


VARIANTS = [dict(), dict(redux=False), dict(stage_logprobs=False), dict(scan_unroll=1), dict(scan_unroll=2),
            dict(scan_unroll=8)]


@pytest.mark.parametrize("budget,tied", [(1024, False), (1024, True), (256, False), (256, True), (33, True)])
@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_build_trees_bench_shapes_every_variant(budget, tied, variant):
    """The bench's inputs (K = B, so L*K passes the shared log-prob cache at B=1024), one full warp per request
    (the shuffle reductions), each kernel variant; tied: log-probs from 4 values (exact ties everywhere)."""
    from kdspec.engine.bench.tree import random_drafts as bench_drafts
    logprobs, ids = bench_drafts(64, 15, budget, seed=budget)
    if tied:
        logprobs = np.round(logprobs * 2.0).clip(-3.0, None).astype(np.float32) / np.float32(2.0)
    rng = np.random.default_rng(budget)
    roots = rng.integers(0, VOCAB, size=64).astype(np.int32)
    prefix_lens = rng.integers(0, 100_000, size=64).astype(np.int32)
    kernel = tree_build.make_build_kernel(**VARIANTS[variant])
    got = run_build(logprobs, ids, roots, prefix_lens, budget, kernel, tree_build.BUILD_THREADS)
    exp = expected_build(logprobs, ids, roots, prefix_lens, budget)
    for name in exp:
        assert got[name].tobytes() == exp[name].tobytes(), name


def test_accept_trees_realistic():
    rng = np.random.default_rng(11)
    batch, budget, depth_limit = 64, 1024, 15
    logprobs, ids = random_drafts(rng, batch, depth_limit, 8, None)
    ids = rng.integers(0, 4, size=ids.shape).astype(np.int32)  # tiny vocabulary: long accepted paths
    trees = [ddtree_ref.build_tree(logprobs[r], ids[r], 0, budget, 0) for r in range(batch)]
    parents = np.full((batch, budget + 1), -1, np.int32)
    tokens = np.full((batch, budget + 1), -1, np.int32)
    choice = rng.integers(0, 4, size=(batch, budget + 1)).astype(np.int32)
    for r, t in enumerate(trees):
        parents[r, :t.num_nodes] = t.parents
        tokens[r, :t.num_nodes] = t.tokens
    num_nodes = np.array([t.num_nodes for t in trees], np.int32)
    accepted = poisoned((batch, depth_limit + 1), np.int32)
    tau = poisoned(batch, np.int32)
    bonus = poisoned(batch, np.int32)
    tree_accept.accept_trees_kernel[batch, tree_accept.ACCEPT_THREADS](parents, tokens, choice, num_nodes,
                                                                       accepted, tau, bonus)
    for r, t in enumerate(trees):
        path, bonus_token = ddtree_ref.accept(t.parents, t.tokens, choice[r, :t.num_nodes])
        padded = np.full(depth_limit + 1, -1, np.int32)
        padded[:len(path)] = path
        assert accepted.copy_to_host()[r].tolist() == padded.tolist()
        assert tau.copy_to_host()[r] == len(path) and bonus.copy_to_host()[r] == bonus_token


def test_compact_rows_realistic():
    rng = np.random.default_rng(12)
    layers, width, batch, accept_width = 8, 576, 16, 16
    span = 40
    cache = rng.standard_normal((layers, batch * span, width)).astype(np.float32)
    bases = (np.arange(batch) * span).astype(np.int32)
    accepted = np.full((batch, accept_width), -1, np.int32)
    tau = rng.integers(1, accept_width + 1, size=batch).astype(np.int32)
    expected = cache.copy()
    for r in range(batch):
        path = np.concatenate([[0], np.cumsum(rng.integers(1, 3, size=tau[r] - 1))]).astype(np.int32)
        accepted[r, :tau[r]] = path
        for layer in range(layers):
            ddtree_ref.compact_rows(expected[layer], int(bases[r]), path)
    device_cache = cuda.to_device(cache)
    kv_compact.compact_rows(device_cache, bases, accepted, tau)
    assert device_cache.copy_to_host().tobytes() == expected.tobytes()


def test_sampling_full_vocabulary():
    rng = np.random.default_rng(13)
    rows = 16
    logits = rng.standard_normal((rows, VOCAB)).astype(np.float32)
    logits[3, [5, 900, 163839]] = 50.0  # ties at the max: lowest id wins
    logits[4] = 1.0  # all equal
    ids = poisoned(rows, np.int32)
    sampling.argmax_rows_kernel[rows, sampling.ROW_THREADS](logits, ids)
    assert ids.copy_to_host().tolist() == [int(np.argmax(row)) for row in logits]

    k = 16
    top_ids, top_values, margins = poisoned((rows, k), np.int32), poisoned((rows, k), np.float32), poisoned(rows, np.float32)
    sampling.topk_rows_kernel[rows, sampling.ROW_THREADS](logits, top_ids, top_values, margins)
    for r in range(rows):
        ref_ids, ref_values, ref_margin = sampling_ref.topk_with_margin(logits[r], k)
        assert top_ids.copy_to_host()[r].tolist() == ref_ids.tolist()
        assert top_values.copy_to_host()[r].tobytes() == ref_values.tobytes()
        assert margins.copy_to_host()[r].tobytes() == np.float32(ref_margin).tobytes()

    positions = rng.integers(0, 1 << 20, size=rows).astype(np.int64)
    for temperature in (0.6, 1.0):
        ids = poisoned(rows, np.int32)
        sampling.sample_rows_kernel[rows, sampling.ROW_THREADS](logits, temperature, np.uint64(12345), positions, ids)
        assert ids.copy_to_host().tolist() == [
            sampling_ref.choose_token(logits[r], temperature, 12345, int(positions[r])) for r in range(rows)]


WIDE = 1024


@cuda.jit
def wide_reduce_kernel(values, maxes, sums, arg_ids):
    scratch = cuda.shared.array(WIDE, float64)
    scratch_ids = cuda.shared.array(WIDE, int32)
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    value = values[row, tid]
    maxes[row, tid] = block_max(value, scratch)
    sums[row, tid] = block_sum(value, scratch)
    best, best_id = block_argmax(value, int32(tid), scratch, scratch_ids)
    arg_ids[row, tid] = best_id


@pytest.mark.parametrize("width", [32, 64, 256, 1024])
def test_block_reductions_shuffle_path(width):
    rng = np.random.default_rng(width)
    values = rng.integers(-4, 4, size=(8, width)).astype(np.float64)
    maxes, sums = poisoned((8, width), np.float64), poisoned((8, width), np.float64)
    arg_ids = poisoned((8, width), np.int32)
    wide_reduce_kernel[8, width](values, maxes, sums, arg_ids)
    for row in range(8):
        assert (maxes.copy_to_host()[row] == values[row].max()).all()
        assert (sums.copy_to_host()[row] == values[row].sum()).all()  # small integers: exact in any order
        assert (arg_ids.copy_to_host()[row] == int(np.argmax(values[row]))).all()
    assert INT32_MAX > width
