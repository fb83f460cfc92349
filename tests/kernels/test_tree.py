"""Tree build / accept / compaction / sampling kernels against the references, bit-exact.

Every output is poisoned before the launch and compared in full afterwards (padding included), so an
unwritten element fails. Toy cases (simulator, marked sim) are seeded loops: random log-probs with deliberate
ties, budgets 1..64, depths 1..16, top-K 1..8, batches 1..8, compaction patterns where accepted[k] == j for
k < j. The same checks at K2 sizes (marked gpu): budgets up to 1024 with 64 requests, depth 15, K 8 and K = B
(every build kernel variant on a full warp), vocabulary 163840 for argmax / top-k / sampling, block reductions
at warp-multiple widths (the shuffle path the simulator never runs).
"""
import math

import numpy as np
import pytest
from kernel_checks import by_size
from numba import cuda, float64, int32

from kdspec.engine.golden import ddtree as ddtree_ref
from kdspec.engine.golden import sampling as sampling_ref
from kdspec.numba_kernels import sampling
from kdspec.numba_kernels.reductions import INT32_MAX, block_argmax, block_max, block_sum
from kdspec.numba_kernels.tree import accept as tree_accept
from kdspec.numba_kernels.tree import build as tree_build
from kdspec.numba_kernels.tree import compact as kv_compact

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

POISON_INT = -7
VOCAB = 163840  # K2's


def poisoned(shape, dtype):
    fill = np.nan if np.dtype(dtype).kind == "f" else (0xDEADBEEF if np.dtype(dtype) == np.uint32 else POISON_INT)
    return cuda.to_device(np.full(shape, fill, dtype=dtype))


def random_drafts(rng, batch, depth_limit, top_k, tie_pool):
    """float32 [b, L, K] log-probs sorted descending (from a small value pool when tie_pool), ids [b, L, K]."""
    if tie_pool:
        logprobs = -rng.integers(0, tie_pool, size=(batch, depth_limit, top_k)).astype(np.float32) * np.float32(0.25)
    else:
        logprobs = np.log(rng.dirichlet(np.ones(top_k + 1), size=(batch, depth_limit))[..., :top_k]).astype(np.float32)
    logprobs = -np.sort(-logprobs, axis=2)
    ids = rng.integers(0, 1000, size=(batch, depth_limit, top_k)).astype(np.int32)
    return logprobs.astype(np.float32), ids


# --- reductions.py block reductions --------------------------------------------------------------------

WIDE = 1024  # the widest block probed


@cuda.jit
def reduce_probe_kernel(values, maxes, sums, arg_values, arg_ids):
    scratch = cuda.shared.array(WIDE, float64)
    scratch_ids = cuda.shared.array(WIDE, int32)
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    value = values[row, tid]
    maxes[row, tid] = block_max(value, scratch)
    sums[row, tid] = block_sum(value, scratch)
    index = int32(tid) if not math.isinf(value) else int32(INT32_MAX)
    best, best_id = block_argmax(value, index, scratch, scratch_ids)
    arg_values[row, tid] = best
    arg_ids[row, tid] = best_id


@pytest.mark.parametrize("size,width", by_size([1, 2, 8], [32, 64, 256, 1024]))
def test_block_reductions_every_thread_gets_the_result(size, width):
    """Toy widths: shared-memory trees (row 0 all -inf: the argmax index stays INT32_MAX); K2 widths: the
    warp-shuffle path the simulator never runs."""
    rng = np.random.default_rng(width)
    if size == "toy":
        rows, values = 6, rng.integers(-3, 3, size=(6, width)).astype(np.float64)  # small range: many ties
        values[0] = -np.inf
    else:
        rows, values = 8, rng.integers(-4, 4, size=(8, width)).astype(np.float64)
    assert INT32_MAX > width
    maxes, sums, arg_values = (poisoned((rows, width), np.float64) for _ in range(3))
    arg_ids = poisoned((rows, width), np.int32)
    reduce_probe_kernel[rows, width](values, maxes, sums, arg_values, arg_ids)
    for row in range(rows):
        assert (maxes.copy_to_host()[row] == values[row].max()).all()
        assert (sums.copy_to_host()[row] == values[row].sum()).all()  # small integers: exact in any order
        expected_id = int(np.argmax(values[row])) if np.isfinite(values[row]).any() else INT32_MAX
        assert (arg_ids.copy_to_host()[row] == expected_id).all()
        assert (arg_values.copy_to_host()[row] == values[row].max()).all()


# --- tree build ----------------------------------------------------------------------------------

def run_build(logprobs, ids, roots, prefix_lens, budget, kernel=None, lanes=None):
    """Launch the build kernel (default build_trees_kernel, BUILD_THREADS lanes) on poisoned outputs."""
    batch, nodes = logprobs.shape[0], budget + 1
    out = tree_build.TreeBatch(packed=poisoned((len(tree_build.OUTPUT_ROWS), batch, nodes), np.int32),
                               num_nodes=poisoned(batch, np.int32),
                               visibility=poisoned((batch, nodes, (nodes + 31) // 32), np.uint32))
    out.scores.copy_to_device(np.full((batch, nodes), np.nan, np.float32))  # NaN bits, not -7
    kernel = kernel or tree_build.build_trees_kernel
    kernel[batch, lanes or tree_build.BUILD_THREADS](logprobs, ids, roots, prefix_lens, budget, out.packed,
                                                     out.num_nodes, out.visibility)
    return out.to_host()


def expected_build(logprobs, ids, roots, prefix_lens, budget):
    """Reference trees laid out as the kernel's padded outputs."""
    batch, nodes = logprobs.shape[0], budget + 1
    words = (nodes + 31) // 32
    exp = dict(tokens=np.full((batch, nodes), -1, np.int32), parents=np.full((batch, nodes), -1, np.int32),
               depths=np.full((batch, nodes), -1, np.int32), ranks=np.full((batch, nodes), -1, np.int32),
               scores=np.full((batch, nodes), -np.inf, np.float32), positions=np.full((batch, nodes), -1, np.int32),
               num_nodes=np.zeros(batch, np.int32), visibility=np.zeros((batch, nodes, words), np.uint32))
    for r in range(batch):
        tree = ddtree_ref.build_tree(logprobs[r], ids[r], int(roots[r]), budget, int(prefix_lens[r]))
        n = tree.num_nodes
        exp["num_nodes"][r] = n
        for name in ("tokens", "parents", "depths", "ranks", "scores", "positions"):
            exp[name][r, :n] = getattr(tree, name)
        bits = np.zeros((nodes, words * 32), dtype=bool)
        bits[:n, :n] = tree.visibility
        exp["visibility"][r] = np.packbits(bits, axis=1, bitorder="little").view(np.uint32)
    return exp


def build_inputs(size, case):
    """(log-probs, ids, roots, prefix_lens, budget): toy case = a seed of random shapes; K2 case = (budget,
    tie_pool) with 64 requests, L = 15, K = 8 and K2's vocabulary."""
    if size == "toy":
        rng = np.random.default_rng(1000 + case)
        batch = int(rng.integers(1, 9))
        depth_limit = int(rng.integers(1, 17))
        top_k = int(rng.integers(1, 9))
        budget = int(rng.integers(1, 65))
        logprobs, ids = random_drafts(rng, batch, depth_limit, top_k, [None, 2, 3, 5][case % 4])
        roots = rng.integers(0, 1000, size=batch).astype(np.int32)
        prefix_lens = rng.integers(0, 500, size=batch).astype(np.int32)
        return logprobs, ids, roots, prefix_lens, budget
    budget, tie_pool = case
    rng = np.random.default_rng(budget)
    logprobs, ids = random_drafts(rng, 64, 15, 8, tie_pool)
    ids = rng.integers(0, VOCAB, size=ids.shape).astype(np.int32)
    roots = rng.integers(0, VOCAB, size=64).astype(np.int32)
    prefix_lens = rng.integers(0, 100_000, size=64).astype(np.int32)
    return logprobs, ids, roots, prefix_lens, budget


@pytest.mark.parametrize("size,case", by_size(range(70), [(1024, None), (1024, 5), (256, None), (63, 3), (1, None)]))
def test_build_trees_bit_exact(size, case):
    logprobs, ids, roots, prefix_lens, budget = build_inputs(size, case)
    got = run_build(logprobs, ids, roots, prefix_lens, budget)
    exp = expected_build(logprobs, ids, roots, prefix_lens, budget)
    for name in exp:
        assert got[name].tobytes() == exp[name].tobytes(), name


# The simulator's default is one lane per request (its barriers are slow); the toy cases run several lanes
# (the strided frontier scan, the reduction through shared memory, bitmask chunks of `lanes` rows) and kernel
# variants. The K2 cases: the bench's inputs (K = B, so L*K passes the shared log-prob cache at B=1024) on one
# full warp per request (the shuffle reductions), each variant; tied: log-probs from 4 values (ties everywhere).
TOY_VARIANTS = [dict(), dict(scan_unroll=8), dict(stage_logprobs=False, scan_unroll=1), dict(scan_unroll=2)]
VARIANTS = [dict(), dict(redux=False), dict(stage_logprobs=False), dict(scan_unroll=1), dict(scan_unroll=2),
            dict(scan_unroll=8)]


def variant_inputs(size, case):
    """(log-probs, ids, roots, prefix_lens, budget, kernel, lanes): toy case = (lanes, variant index),
    K2 case = (budget, tied, variant index)."""
    if size == "toy":
        lanes, variant = case
        rng = np.random.default_rng(5000 + 10 * lanes + variant)
        batch = 2
        depth_limit = int(rng.integers(2, 10))
        top_k = int(rng.integers(2, 7))
        budget = int(rng.integers(20, 45))
        logprobs, ids = random_drafts(rng, batch, depth_limit, top_k, [None, 2, 3, 2][variant])
        roots = rng.integers(0, 1000, size=batch).astype(np.int32)
        prefix_lens = rng.integers(0, 500, size=batch).astype(np.int32)
        return (logprobs, ids, roots, prefix_lens, budget, tree_build.make_build_kernel(**TOY_VARIANTS[variant]),
                lanes)
    from kdspec.engine.bench.tree import random_drafts as bench_drafts
    budget, tied, variant = case
    logprobs, ids = bench_drafts(64, 15, budget, seed=budget)
    if tied:
        logprobs = np.round(logprobs * 2.0).clip(-3.0, None).astype(np.float32) / np.float32(2.0)
    rng = np.random.default_rng(budget)
    roots = rng.integers(0, VOCAB, size=64).astype(np.int32)
    prefix_lens = rng.integers(0, 100_000, size=64).astype(np.int32)
    return (logprobs, ids, roots, prefix_lens, budget, tree_build.make_build_kernel(**VARIANTS[variant]),
            tree_build.BUILD_THREADS)


@pytest.mark.parametrize("size,case", by_size(
    [(lanes, variant) for lanes in (2, 3, 4) for variant in range(len(TOY_VARIANTS))],
    [(budget, tied, variant) for budget, tied in [(1024, False), (1024, True), (256, False), (256, True), (33, True)]
     for variant in range(len(VARIANTS))]))
def test_build_trees_variants_and_lanes_bit_exact(size, case):
    logprobs, ids, roots, prefix_lens, budget, kernel, lanes = variant_inputs(size, case)
    got = run_build(logprobs, ids, roots, prefix_lens, budget, kernel, lanes)
    exp = expected_build(logprobs, ids, roots, prefix_lens, budget)
    for name in exp:
        assert got[name].tobytes() == exp[name].tobytes(), name


@pytest.mark.sim
@pytest.mark.parametrize("depth_limit,top_k,budget,tie_pool,lanes", [
    (3, 2000, 40, 2, 3),  # L*K past the shared log-prob cache: each row's first columns staged
    (80, 1, 70, None, 3),  # K = 1: one chain deeper than any drafter's L
    (6, 5, 100, 3, 3),  # 4 bitmask words per row, more than the lanes: chunks of 3 rows cross words unevenly
    (15, 8, tree_build.MAX_BUDGET, 3, 1),  # the largest budget: 33 bitmask words per row
])
def test_build_trees_edge_shapes_bit_exact(depth_limit, top_k, budget, tie_pool, lanes):
    rng = np.random.default_rng(depth_limit * top_k)
    logprobs, ids = random_drafts(rng, 1, depth_limit, top_k, tie_pool)
    roots, prefix_lens = np.array([3], np.int32), np.array([9], np.int32)
    got = run_build(logprobs, ids, roots, prefix_lens, budget, lanes=lanes)
    exp = expected_build(logprobs, ids, roots, prefix_lens, budget)
    for name in exp:
        assert got[name].tobytes() == exp[name].tobytes(), name


@pytest.mark.sim
@pytest.mark.parametrize("lanes", [1, 3])
def test_build_trees_ranks_past_the_staged_columns(lanes):
    """L so deep that 2 columns per row are staged: log-probs -1 - r/100 pop siblings of every rank first, so
    ranks 2.. are read from global memory."""
    _, cache_floats = tree_build.shared_layout(4)
    depth_limit, top_k = cache_floats // 3 + 1, 8
    logprobs = np.broadcast_to(np.float32(-1.0) - np.arange(top_k, dtype=np.float32) / np.float32(100.0),
                               (1, depth_limit, top_k)).astype(np.float32)
    ids = np.random.default_rng(3).integers(0, 1000, size=(1, depth_limit, top_k)).astype(np.int32)
    roots, prefix_lens = np.array([3], np.int32), np.array([9], np.int32)
    got = run_build(logprobs, ids, roots, prefix_lens, 40, lanes=lanes)
    exp = expected_build(logprobs, ids, roots, prefix_lens, 40)
    assert exp["ranks"].max() == top_k - 1
    for name in exp:
        assert got[name].tobytes() == exp[name].tobytes(), name


@pytest.mark.sim
def test_build_trees_budget_zero_and_exhausted_space():
    rng = np.random.default_rng(5)
    logprobs, ids = random_drafts(rng, 2, 2, 2, None)  # 2 + 4 = 6 prefixes in all
    for budget in (0, 6, 9):
        got = run_build(logprobs, ids, np.array([1, 2], np.int32), np.array([0, 3], np.int32), budget)
        exp = expected_build(logprobs, ids, np.array([1, 2]), np.array([0, 3]), budget)
        assert got["num_nodes"].tolist() == [min(budget, 6) + 1] * 2
        for name in exp:
            assert got[name].tobytes() == exp[name].tobytes(), name


@pytest.mark.sim
def test_build_trees_launcher_checks_and_returns_device_arrays():
    rng = np.random.default_rng(6)
    logprobs, ids = random_drafts(rng, 2, 3, 2, 2)
    out = tree_build.build_trees(logprobs, ids, np.array([1, 2]), np.array([4, 5]), 5).to_host()
    exp = expected_build(logprobs, ids, np.array([1, 2]), np.array([4, 5]), 5)
    assert all(out[name].tobytes() == exp[name].tobytes() for name in exp)
    with pytest.raises(ValueError, match="budget"):
        tree_build.build_trees(logprobs, ids, np.array([1, 2]), np.array([4, 5]), tree_build.MAX_BUDGET + 1)
    with pytest.raises(ValueError, match="float32"):
        tree_build.build_trees(logprobs.astype(np.float64), ids, np.array([1, 2]), np.array([4, 5]), 5)
    with pytest.raises(ValueError, match=r"\[b="):
        tree_build.build_trees(logprobs, ids, np.array([1]), np.array([4, 5]), 5)


@pytest.mark.sim
def test_build_trees_reuses_output_buffers():
    """A reused TreeBatch is fully rewritten: a second, smaller build leaves nothing of the first."""
    rng = np.random.default_rng(8)
    buffers = tree_build.TreeBatch.allocate(3, 6)
    for top_k in (3, 1):  # K = 1 builds a chain: fewer nodes than the first build's
        logprobs, ids = random_drafts(rng, 3, 4, top_k, 2)
        roots, prefix = np.array([7, 8, 9]), np.array([0, 3, 6])
        out = tree_build.build_trees(logprobs, ids, roots, prefix, 6, out=buffers)
        assert out is buffers
        got, exp = out.to_host(), expected_build(logprobs, ids, roots, prefix, 6)
        assert all(got[name].tobytes() == exp[name].tobytes() for name in exp)
    with pytest.raises(ValueError, match="out holds trees"):
        tree_build.build_trees(logprobs, ids, roots, prefix, 5, out=buffers)


# --- accept --------------------------------------------------------------------------------------

@pytest.mark.parametrize("size,case", by_size(range(40), [11]))
def test_accept_trees_bit_exact(size, case):
    """Toy: random shapes, vocabulary 3; K2: 64 requests, B = 1024, L = 15, K = 8, vocabulary 4 (tiny
    vocabularies: repeated sibling tokens, frequent matches, long accepted paths)."""
    if size == "toy":
        rng = np.random.default_rng(2000 + case)
        batch = int(rng.integers(1, 9))
        depth_limit = int(rng.integers(1, 9))
        top_k = int(rng.integers(1, 4))
        budget = int(rng.integers(1, 33))
        logprobs, ids = random_drafts(rng, batch, depth_limit, top_k, 3)
        vocab = 3
        ids %= vocab
    else:
        rng = np.random.default_rng(case)
        batch, budget, depth_limit, vocab = 64, 1024, 15, 4
        logprobs, ids = random_drafts(rng, batch, depth_limit, 8, None)
        ids = rng.integers(0, vocab, size=ids.shape).astype(np.int32)
    trees = [ddtree_ref.build_tree(logprobs[r], ids[r], 0, budget, 0) for r in range(batch)]
    nodes = budget + 1
    parents = np.full((batch, nodes), -1, np.int32)
    tokens = np.full((batch, nodes), -1, np.int32)
    choice = rng.integers(0, vocab, size=(batch, nodes)).astype(np.int32)
    num_nodes = np.array([t.num_nodes for t in trees], np.int32)
    for r, t in enumerate(trees):
        parents[r, :t.num_nodes] = t.parents
        tokens[r, :t.num_nodes] = t.tokens
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


@pytest.mark.sim
def test_accept_trees_launcher_shapes():
    accepted, tau, bonus = tree_accept.accept_trees(np.array([[-1, 0]]), np.array([[5, 6]]), np.array([[6, 2]]),
                                                    np.array([2]), depth_limit=3)
    assert accepted.copy_to_host().tolist() == [[0, 1, -1, -1]] and tau.copy_to_host().tolist() == [2]
    assert bonus.copy_to_host().tolist() == [2]
    with pytest.raises(ValueError, match=r"\[b, N\+1\]"):
        tree_accept.accept_trees(np.array([[-1, 0]]), np.array([[5]]), np.array([[6, 2]]), np.array([2]), 3)


# --- compaction ----------------------------------------------------------------------------------

def hazard_accepted(rng, width):
    """An increasing accepted list from 0 with gaps of 1 or 2: a gap of 2 followed by more moves makes
    accepted[k] == j for some k < j (row P+j is read for move k after move j wrote it, if done naively)."""
    tau = int(rng.integers(1, width + 1))
    steps = rng.integers(1, 3, size=tau - 1)
    return np.concatenate([[0], np.cumsum(steps)]).astype(np.int32)


def compact_inputs(size, case):
    """(cache [layers, rows, width], bases [b], accepted paths, accept width): toy = random shapes with the
    hazard pattern; K2 = 8 layers of K2's 576-wide rows, 16 requests, paths up to 16 rows."""
    rng = np.random.default_rng(3000 + case if size == "toy" else case)
    if size == "toy":
        batch = int(rng.integers(1, 5))
        layers = int(rng.integers(1, 4))
        width = int(rng.integers(1, 10))
        accept_width = int(rng.integers(1, 9))
        paths = [hazard_accepted(rng, accept_width) for _ in range(batch)]
        span = max(int(p[-1]) for p in paths) + 1
        bases = (np.arange(batch) * (span + 2) + rng.integers(0, 2, size=batch)).astype(np.int32)  # disjoint
        capacity = int(bases.max()) + span + 1
        cache = rng.standard_normal((layers, capacity, width)).astype(np.float32)
        return cache, bases, paths, accept_width
    layers, width, batch, accept_width, span = 8, 576, 16, 16, 40
    cache = rng.standard_normal((layers, batch * span, width)).astype(np.float32)
    bases = (np.arange(batch) * span).astype(np.int32)
    tau = rng.integers(1, accept_width + 1, size=batch)
    paths = [np.concatenate([[0], np.cumsum(rng.integers(1, 3, size=tau[r] - 1))]).astype(np.int32)
             for r in range(batch)]
    return cache, bases, paths, accept_width


@pytest.mark.parametrize("size,case", by_size(range(40), [12]))
def test_compact_rows_all_layers_bit_exact(size, case):
    cache, bases, paths, accept_width = compact_inputs(size, case)
    layers, batch = cache.shape[0], len(paths)
    accepted = np.full((batch, accept_width), -1, np.int32)
    tau = np.array([len(p) for p in paths], np.int32)
    for r, p in enumerate(paths):
        accepted[r, :len(p)] = p
    expected = cache.copy()
    for layer in range(layers):
        for r, p in enumerate(paths):
            ddtree_ref.compact_rows(expected[layer], int(bases[r]), p)
    device_cache = cuda.to_device(cache)
    src, dst = kv_compact.compact_rows(device_cache, bases, accepted, tau)
    assert device_cache.copy_to_host().tobytes() == expected.tobytes()
    for r, p in enumerate(paths):
        assert src[r, :len(p)].tolist() == (bases[r] + p).tolist()
        assert dst[r, :len(p)].tolist() == (bases[r] + np.arange(len(p))).tolist()
        assert (src[r, len(p):] == -1).all() and (dst[r, len(p):] == -1).all()


@pytest.mark.sim
def test_compact_rows_hazard_explicit():
    cache = np.arange(2 * 7 * 3, dtype=np.float32).reshape(2, 7, 3)
    device_cache = cuda.to_device(cache)
    kv_compact.compact_rows(device_cache, np.array([1]), np.array([[0, 2, 3, 4, 5]]), np.array([5]))
    expected = cache.copy()
    expected[:, 2:6] = cache[:, 3:7]  # rows 1+j <- 1+accepted[j]: row 3 read before it is overwritten
    assert np.array_equal(device_cache.copy_to_host(), expected)
    with pytest.raises(ValueError, match="device array"):
        kv_compact.compact_rows(cache, np.array([1]), np.array([[0]]), np.array([1]))
    with pytest.raises(ValueError, match="outside the cache"):
        kv_compact.compact_rows(device_cache, np.array([5]), np.array([[0, 3]]), np.array([2]))


# --- sampling ------------------------------------------------------------------------------------

def random_logits(rng, rows, vocab, ties):
    if ties:
        return rng.integers(-3, 3, size=(rows, vocab)).astype(np.float32)
    return rng.standard_normal((rows, vocab)).astype(np.float32)


def sampling_inputs(size, case):
    """(logits [rows, V], k, seed, positions [rows], temperatures): toy = random small vocabularies (ties in
    every other case); K2 = 16 rows of K2's vocabulary with a tie at the max and an all-equal row."""
    if size == "toy":
        rng = np.random.default_rng(4000 + case)
        rows = int(rng.integers(1, 5))
        vocab = int(rng.integers(1, 120))
        logits = random_logits(rng, rows, vocab, ties=case % 2 == 0)
        k = int(rng.integers(1, min(16, vocab) + 1))
        seed = int(rng.integers(0, 2 ** 63))
        positions = rng.integers(0, 10_000, size=rows).astype(np.int64)
        return logits, k, seed, positions, (float(rng.choice([0.3, 1.0, 2.5])),)
    rng = np.random.default_rng(case)
    logits = rng.standard_normal((16, VOCAB)).astype(np.float32)
    logits[3, [5, 900, 163839]] = 50.0  # ties at the max: lowest id wins
    logits[4] = 1.0  # all equal
    positions = rng.integers(0, 1 << 20, size=16).astype(np.int64)
    return logits, 16, 12345, positions, (0.6, 1.0)


@pytest.mark.parametrize("size,case", by_size(range(24), [13]))
def test_argmax_topk_sample_rows_bit_exact(size, case):
    logits, k, seed, positions, temperatures = sampling_inputs(size, case)
    rows = logits.shape[0]
    threads = sampling.ROW_THREADS

    ids = poisoned(rows, np.int32)
    sampling.argmax_rows_kernel[rows, threads](logits, ids)
    assert ids.copy_to_host().tolist() == [sampling_ref.choose_token(row, 0.0, 0, 0) for row in logits]

    top_ids, top_values = poisoned((rows, k), np.int32), poisoned((rows, k), np.float32)
    margins = poisoned(rows, np.float32)
    sampling.topk_rows_kernel[rows, threads](logits, top_ids, top_values, margins)
    for r in range(rows):
        ref_ids, ref_values, ref_margin = sampling_ref.topk_with_margin(logits[r], k)
        assert top_ids.copy_to_host()[r].tolist() == ref_ids.tolist()
        assert top_values.copy_to_host()[r].tobytes() == ref_values.tobytes()
        assert margins.copy_to_host()[r].tobytes() == np.float32(ref_margin).tobytes()

    for temperature in temperatures:
        ids = poisoned(rows, np.int32)
        sampling.sample_rows_kernel[rows, threads](logits, temperature, np.uint64(seed), positions, ids)
        assert ids.copy_to_host().tolist() == [
            sampling_ref.choose_token(logits[r], temperature, seed, int(positions[r])) for r in range(rows)]


@pytest.mark.sim
def test_sampling_launchers():
    logits = np.array([[0.0, 2.0, 2.0], [5.0, -1.0, 4.0]], np.float32)
    assert sampling.sample_rows(logits, 0.0, 1, np.array([0, 1])).copy_to_host().tolist() == [1, 0]
    ids, values, margins = sampling.topk_rows(logits, 2)
    assert ids.copy_to_host().tolist() == [[1, 2], [0, 2]] and margins.copy_to_host().tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match="k must be"):
        sampling.topk_rows(logits, 4)
    with pytest.raises(ValueError, match="float32"):
        sampling.argmax_rows(logits.astype(np.float64))
