"""engine.ddtree_ref and engine.sampling_ref against independent brute-force implementations."""
import itertools

import numpy as np
import pytest

from kdspec.engine.golden import ddtree as ddtree_ref
from kdspec.engine.golden import sampling as sampling_ref


def random_draft(rng, depth_limit, top_k, tie_pool=None):
    """float32 [L, K] log-probs sorted descending (values from a small pool when tie_pool, to force ties)."""
    if tie_pool:
        pool = -np.float32(rng.integers(0, tie_pool, size=(depth_limit, top_k))) * np.float32(0.5)
        logprobs = pool.astype(np.float32)
    else:
        logprobs = np.log(rng.dirichlet(np.ones(top_k + 1), size=depth_limit)[:, :top_k]).astype(np.float32)
    logprobs = -np.sort(-logprobs, axis=1)
    ids = rng.integers(0, 50, size=(depth_limit, top_k))
    return logprobs.astype(np.float32), ids


def brute_force_prefixes(logprobs, budget):
    """The B most probable rank paths: every path up to depth L, sorted by (score desc, rank tuple asc)."""
    depth_limit, top_k = logprobs.shape
    paths = []
    for depth in range(1, depth_limit + 1):
        for path in itertools.product(range(top_k), repeat=depth):
            score = np.float32(0.0)
            for d, r in enumerate(path):
                score = np.float32(score + logprobs[d, r])
            paths.append((-float(score), path, score))
    paths.sort(key=lambda item: (item[0], item[1]))
    return [(p, s) for _, p, s in paths[:budget]]


def node_path(tree, node):
    path = []
    while node > 0:
        path.append(int(tree.ranks[node]))
        node = int(tree.parents[node])
    return tuple(reversed(path))


CASES = [(seed, tie) for seed in range(150) for tie in (None, 2, 3)]


@pytest.mark.parametrize("seed,tie_pool", CASES[::3] + CASES[1::3] + CASES[2::3])
def test_build_tree_is_the_budget_most_probable_prefixes(seed, tie_pool):
    rng = np.random.default_rng(seed)
    depth_limit, top_k = int(rng.integers(1, 5)), int(rng.integers(1, 5))
    while top_k ** depth_limit > 400:
        depth_limit -= 1
    budget = int(rng.integers(0, min(40, 2 * top_k ** depth_limit) + 1))
    logprobs, ids = random_draft(rng, depth_limit, top_k, tie_pool)
    prefix_len = int(rng.integers(0, 100))
    tree = ddtree_ref.build_tree(logprobs, ids, root_token=7, budget=budget, prefix_len=prefix_len)

    expected = brute_force_prefixes(logprobs, budget)
    assert tree.num_nodes == len(expected) + 1 <= budget + 1
    assert tree.tokens[0] == 7 and tree.parents[0] == -1 and tree.depths[0] == 0 and tree.scores[0] == 0
    for node, (path, score) in enumerate(expected, start=1):
        assert node_path(tree, node) == path
        assert tree.scores[node].tobytes() == np.float32(score).tobytes()
        assert tree.depths[node] == len(path)
        assert tree.ranks[node] == path[-1]
        assert tree.tokens[node] == ids[len(path) - 1, path[-1]]
        assert 0 <= tree.parents[node] < node
        assert tree.depths[tree.parents[node]] == len(path) - 1
    np.testing.assert_array_equal(tree.positions, prefix_len + tree.depths)
    for i in range(tree.num_nodes):
        ancestors = set()
        j = i
        while j >= 0:
            ancestors.add(j)
            j = int(tree.parents[j])
        assert set(np.flatnonzero(tree.visibility[i]).tolist()) == ancestors


def test_build_tree_ties_pick_smaller_rank_tuple():
    # every log-prob equal: scores tie per depth, so the order is breadth-first by rank tuple
    logprobs = np.full((3, 2), -1.0, dtype=np.float32)
    ids = np.arange(6).reshape(3, 2)
    tree = ddtree_ref.build_tree(logprobs, ids, root_token=0, budget=6, prefix_len=0)
    paths = [node_path(tree, n) for n in range(1, 7)]
    assert paths == [(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)]


def test_build_tree_chain_and_zero_logprob():
    # lp 0 at rank 0: child ties its parent, the parent (a prefix) must come first
    logprobs = np.array([[0.0, -1.0], [0.0, -1.0], [0.0, -1.0]], dtype=np.float32)
    tree = ddtree_ref.build_tree(logprobs, np.zeros((3, 2), int), root_token=1, budget=3, prefix_len=5)
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert tree.positions.tolist() == [5, 6, 7, 8]


@pytest.mark.parametrize("bad,message", [
    (dict(draft_logprobs=np.zeros((2, 2), np.float64)), "float32"),
    (dict(draft_logprobs=np.array([[-2.0, -1.0]], np.float32), draft_ids=np.zeros((1, 2), int)), "sorted"),
    (dict(draft_ids=np.zeros((2, 3), int)), r"\[L, K\]"),
    (dict(budget=-1), "budget"),
])
def test_build_tree_rejects_bad_input(bad, message):
    args = dict(draft_logprobs=np.zeros((2, 2), np.float32), draft_ids=np.zeros((2, 2), int), root_token=0,
                budget=3, prefix_len=0)
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        ddtree_ref.build_tree(**args)


def random_tree(rng, num_nodes, vocab):
    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, num_nodes)], dtype=np.int32)
    tokens = rng.integers(0, vocab, size=num_nodes)
    return parents, tokens


@pytest.mark.parametrize("seed", range(300))
def test_accept_matches_independent_walk(seed):
    rng = np.random.default_rng(seed)
    parents, tokens = random_tree(rng, int(rng.integers(1, 30)), vocab=int(rng.integers(1, 5)))
    choice = rng.integers(0, 5, size=len(parents))
    accepted, bonus = ddtree_ref.accept(parents, tokens, choice)
    # independent: scan all nodes in index order at each step (lowest matching child index)
    path = [0]
    while True:
        cur = path[-1]
        nxt = [i for i in range(len(parents)) if parents[i] == cur and tokens[i] == choice[cur]]
        if not nxt:
            break
        path.append(nxt[0])
    assert accepted.dtype == np.int32 and accepted.tolist() == path
    assert bonus == choice[path[-1]]


@pytest.mark.parametrize("seed", range(200))
def test_compact_rows_matches_copy_and_handles_hazard(seed):
    rng = np.random.default_rng(seed)
    num_nodes = int(rng.integers(1, 20))
    # increasing accepted list starting at 0; small gaps make accepted[k] == j for k < j likely
    accepted = np.concatenate([[0], np.sort(rng.choice(np.arange(1, num_nodes + 1), size=int(rng.integers(0, num_nodes)),
                                                          replace=False))]).astype(np.int32) if num_nodes > 1 else np.array([0], np.int32)
    prefix_len = int(rng.integers(0, 10))
    rows = rng.standard_normal((prefix_len + num_nodes + 3, 2, 3)).astype(np.float32)
    original = rows.copy()
    expected = original.copy()
    for j, a in enumerate(accepted):
        expected[prefix_len + j] = original[prefix_len + a]
    src, dst = ddtree_ref.compact_rows(rows, prefix_len, accepted)
    np.testing.assert_array_equal(rows, expected)
    assert src.tolist() == (prefix_len + accepted).tolist() and dst.tolist() == list(range(prefix_len, prefix_len + len(accepted)))


def test_compact_rows_hazard_explicit():
    rows = np.arange(6, dtype=np.float32)[:, None] * np.ones((1, 4), np.float32)
    ddtree_ref.compact_rows(rows, 1, np.array([0, 2, 3, 4]))  # row 3 <- 4 after row 2 <- 3 was read
    assert rows[:, 0].tolist() == [0, 1, 3, 4, 5, 5]


def test_compaction_moves_are_what_compact_applies():
    src, dst = ddtree_ref.compaction_moves(5, [0, 2, 3])
    assert src.dtype == dst.dtype == np.int32 and src.tolist() == [5, 7, 8] and dst.tolist() == [5, 6, 7]
    rows = np.arange(10, dtype=np.float32)
    ddtree_ref.move_rows(rows, src, dst)
    assert rows.tolist() == [0, 1, 2, 3, 4, 5, 7, 8, 8, 9]
    with pytest.raises(ValueError, match="compaction source rows 5..12 outside the cache of 10 rows"):
        ddtree_ref.move_rows(rows, *ddtree_ref.compaction_moves(5, [0, 7]))


# --- sampling reference -------------------------------------------------------------------------

def splitmix_python(z):
    mask = (1 << 64) - 1
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & mask
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def test_uniform_matches_python_int_hash():
    gamma = 0x9E3779B97F4A7C15
    mask = (1 << 64) - 1
    for seed, pos in [(0, 0), (1, 5), (2**40 + 3, 123456)]:
        key = splitmix_python((splitmix_python(seed) + pos * gamma) & mask)
        toks = [0, 1, 163839]
        expected = [((splitmix_python((key + (t + 1) * gamma) & mask) >> 11) + 0.5) * 2.0 ** -53 for t in toks]
        assert sampling_ref.uniform(seed, pos, np.array(toks)).tolist() == expected


def test_gumbel_noise_statistics_and_dependence():
    g = sampling_ref.gumbel_noise(3, 17, 200_000)
    assert abs(g.mean() - 0.5772156649) < 0.01 and abs(g.var() - np.pi ** 2 / 6) < 0.03
    assert np.array_equal(g[:100], sampling_ref.gumbel_noise(3, 17, 100))
    assert not np.array_equal(g[:100], sampling_ref.gumbel_noise(3, 18, 100))
    assert not np.array_equal(g[:100], sampling_ref.gumbel_noise(4, 17, 100))


def test_choose_token_greedy_ties_and_sampling_distribution():
    logits = np.array([1.0, 3.0, 3.0, 0.0], dtype=np.float32)
    assert sampling_ref.choose_token(logits, 0.0, 0, 0) == 1
    probs = np.exp(logits.astype(np.float64) / 2.0)
    probs /= probs.sum()
    counts = np.bincount([sampling_ref.choose_token(logits, 2.0, 9, p) for p in range(4000)], minlength=4)
    assert np.abs(counts / 4000 - probs).max() < 0.03


def test_topk_with_margin_ties_to_lower_id():
    logits = np.array([0.5, 2.0, -1.0, 2.0, 1.5], dtype=np.float32)
    ids, values, margin = sampling_ref.topk_with_margin(logits, 3)
    assert ids.tolist() == [1, 3, 4] and values.tolist() == [2.0, 2.0, 1.5] and margin == 0.0
    rng = np.random.default_rng(0)
    for _ in range(50):
        x = rng.integers(0, 6, size=30).astype(np.float32)
        ids, values, margin = sampling_ref.topk_with_margin(x, 5)
        brute = sorted(range(30), key=lambda i: (-x[i], i))
        assert ids.tolist() == brute[:5] and margin == x[brute[0]] - x[brute[1]]


@pytest.mark.parametrize("logprobs, ids_dtype, message", [
    ([[-1.0, np.nan, -3.0]], np.int32, "contain NaN"),
    ([[np.nan, -1.0]], np.int32, "contain NaN"),
    ([[np.nan]], np.int32, "contain NaN"),
    ([[-1.0, -0.5]], np.int32, "sorted descending"),
    ([[-1.0, -2.0], [-2.0, -1.0]], np.int32, "sorted descending"),
    ([[-1.0, -2.0]], np.float32, "must be integers"),
    ([[-1.0, -2.0]], np.bool_, "must be integers"),
])
def test_check_draft_names_what_is_wrong(logprobs, ids_dtype, message):
    logprobs = np.asarray(logprobs, dtype=np.float32)
    with pytest.raises(ValueError, match=message):
        ddtree_ref.check_draft(logprobs, np.zeros(logprobs.shape, dtype=ids_dtype), 4)


@pytest.mark.parametrize("logprobs", [[[-1.0]], [[-1.0, -1.0, -2.0]], [[0.0, -np.inf]], np.zeros((0, 3))])
def test_check_draft_takes_sorted_rows_ties_and_empty_drafts(logprobs):
    logprobs = np.asarray(logprobs, dtype=np.float32).reshape(-1, np.shape(logprobs)[-1])
    ddtree_ref.check_draft(logprobs, np.zeros(logprobs.shape, dtype=np.int64), 4)
