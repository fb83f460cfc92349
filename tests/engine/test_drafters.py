"""engine.drafters: oracle and noisy-oracle properties, reproducibility, parse_drafter."""
import numpy as np
import pytest

from kdspec.engine.decode.drafters import (
    SENTINEL_LOGPROB,
    DrafterSpec,
    NoisyOracleDrafter,
    OracleDrafter,
    parse_drafter,
)
from kdspec.engine.golden import ddtree as ddtree_ref

VOCAB = 50


def golden_sequence(length=400, seed=1):
    return np.random.default_rng(seed).integers(0, VOCAB, size=length)


def check_rows(ids, logprobs, depths, top_k, vocab=VOCAB):
    assert ids.shape == logprobs.shape == (depths, top_k)
    assert ids.dtype == np.int32 and logprobs.dtype == np.float32
    assert ((ids >= 0) & (ids < vocab)).all()
    for row in ids:
        assert len(set(row.tolist())) == top_k, f"repeated id in {row}"
    assert (np.diff(logprobs, axis=1) < 0).all(), "log-probs must be strictly descending"
    assert np.isfinite(logprobs).all() and (logprobs <= 0).all()


@pytest.mark.parametrize("depths,top_k", [(7, 7), (3, 1), (1, 5), (5, VOCAB)])
def test_oracle_rank0_is_golden_and_rows_are_valid(depths, top_k):
    golden = golden_sequence()
    drafter = OracleDrafter(golden, depths, top_k, VOCAB)
    for position in (0, 5, 123, len(golden) - depths - 1):
        ids, logprobs = drafter.draft(golden[:position], golden[position], position)
        check_rows(ids, logprobs, depths, top_k)
        np.testing.assert_array_equal(ids[:, 0], golden[position + 1:position + 1 + depths])


def test_oracle_sentinel_past_the_golden_end():
    golden = golden_sequence(20)
    drafter = OracleDrafter(golden, 7, 4, VOCAB)
    ids, logprobs = drafter.draft(golden[:16], golden[16], 16)  # depths 1..3 known, 4..7 past the end
    check_rows(ids, logprobs, 7, 4)
    np.testing.assert_array_equal(ids[:3, 0], golden[17:20])
    assert (logprobs[3:] <= SENTINEL_LOGPROB).all() and (logprobs[:3] > SENTINEL_LOGPROB).all()


def test_oracle_tree_with_block8_budget7_is_the_golden_chain():
    # the tau = 8 promise: best-first pops the 7 rank-0 nodes before any sibling
    golden = golden_sequence()
    ids, logprobs = OracleDrafter(golden, 7, 7, VOCAB).draft(golden[:10], golden[10], 10)
    tree = ddtree_ref.build_tree(logprobs, ids, int(golden[10]), 7, 10)
    np.testing.assert_array_equal(tree.parents, np.arange(-1, 7))
    np.testing.assert_array_equal(tree.ranks, 0)
    np.testing.assert_array_equal(tree.tokens, golden[10:18])


@pytest.mark.parametrize("p", [0.0, 0.3, 0.6, 0.9, 1.0])
def test_noisy_hit_rate_near_p_and_misses_move_or_drop_golden(p):
    golden = golden_sequence(4001, seed=2)
    top_k = 6
    drafter = NoisyOracleDrafter(golden, p, seed=11, num_depths=1, top_k=top_k, vocab=VOCAB)
    hits = moved = dropped = 0
    for position in range(4000):
        ids, logprobs = drafter.draft(golden[:position], golden[position], position)
        check_rows(ids, logprobs, 1, top_k)
        g = golden[position + 1]
        rank = drafter.golden_rank(position + 1)
        if rank == 0:
            hits += 1
            assert ids[0, 0] == g
        elif rank < 0:
            dropped += 1
            assert g not in ids[0]
        else:
            moved += 1
            assert ids[0, rank] == g and ids[0, 0] != g
    n = 4000
    sigma = np.sqrt(p * (1 - p) / n)
    assert abs(hits / n - p) <= 4 * sigma + 1e-12, (hits / n, p)
    if p < 1:
        misses = moved + dropped
        assert abs(dropped / misses - 0.5) < 0.1  # even odds between moving and dropping


def test_noisy_is_keyed_by_seed_and_absolute_position():
    golden = golden_sequence()
    a = NoisyOracleDrafter(golden, 0.5, seed=3, num_depths=7, top_k=5, vocab=VOCAB)
    b = NoisyOracleDrafter(golden, 0.5, seed=3, num_depths=7, top_k=5, vocab=VOCAB)
    other = NoisyOracleDrafter(golden, 0.5, seed=4, num_depths=7, top_k=5, vocab=VOCAB)
    ids_a, lp_a = a.draft(golden[:40], golden[40], 40)
    ids_b, lp_b = b.draft(golden[:40], golden[40], 40)
    np.testing.assert_array_equal(ids_a, ids_b)
    np.testing.assert_array_equal(lp_a, lp_b)
    # a later step drafting the same absolute positions sees the same rows (depth d at 40 == depth d-3 at 43)
    ids_later, _ = a.draft(golden[:43], golden[43], 43)
    np.testing.assert_array_equal(ids_later[:4], ids_a[3:])
    ranks = [a.golden_rank(q) for q in range(300)]
    assert ranks != [other.golden_rank(q) for q in range(300)]


def test_noisy_with_full_vocabulary_moves_instead_of_dropping():
    vocab = 6
    golden = np.random.default_rng(0).integers(0, vocab, size=300)
    drafter = NoisyOracleDrafter(golden, 0.2, seed=0, num_depths=3, top_k=vocab, vocab=vocab)
    for position in range(0, 290, 3):
        ids, logprobs = drafter.draft(golden[:position], golden[position], position)
        check_rows(ids, logprobs, 3, vocab, vocab)  # each row a permutation of the vocabulary


def test_noisy_p1_equals_oracle():
    golden = golden_sequence()
    oracle = OracleDrafter(golden, 7, 7, VOCAB)
    noisy = NoisyOracleDrafter(golden, 1.0, seed=9, num_depths=7, top_k=7, vocab=VOCAB)
    for position in range(0, 300, 17):
        for x, y in zip(oracle.draft(golden[:position], golden[position], position),
                        noisy.draft(golden[:position], golden[position], position)):
            np.testing.assert_array_equal(x, y)


def test_parse_drafter():
    assert parse_drafter("oracle") == DrafterSpec("oracle")
    assert parse_drafter("noisy:0.6") == DrafterSpec("noisy", 0.6)
    assert str(parse_drafter("noisy:0.25")) == "noisy:0.25"
    golden = golden_sequence()
    built = parse_drafter("noisy:0.6").build(golden, 7, 7, VOCAB, seed=2)
    assert isinstance(built, NoisyOracleDrafter) and built.p == 0.6 and built.seed == 2
    assert type(parse_drafter("oracle").build(golden, 7, 7, VOCAB)) is OracleDrafter


@pytest.mark.parametrize("spec,message", [
    ("noisy:1.5", "noisy hit rate must be a number in"),
    ("noisy:x", "noisy hit rate must be a number in"),
    ("noisy:nan", "noisy hit rate must be a number in"),
    ("trained", "unknown drafter"),
    (3, "drafter must be a string"),
])
def test_parse_drafter_rejects(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_drafter(spec)


@pytest.mark.parametrize("kwargs,message", [
    (dict(top_k=VOCAB + 1), "top_k must be in 1..vocab"),
    (dict(top_k=0), "top_k must be in 1..vocab"),
    (dict(num_depths=-1), "num_depths must be >= 0"),
    (dict(golden_tokens=[1, VOCAB]), "golden_tokens must be in 0.."),
    (dict(golden_tokens=[[1, 2]]), "golden_tokens must be a 1-D"),
])
def test_oracle_rejects_bad_arguments(kwargs, message):
    args = dict(golden_tokens=[1, 2, 3], num_depths=3, top_k=4, vocab=VOCAB) | kwargs
    with pytest.raises(ValueError, match=message):
        OracleDrafter(**args)


@pytest.mark.parametrize("p,seed,message", [(1.2, 0, r"p must be in \[0, 1\]"), (0.5, -1, "seed must be >= 0")])
def test_noisy_rejects_bad_arguments(p, seed, message):
    with pytest.raises(ValueError, match=message):
        NoisyOracleDrafter([1, 2, 3], p, seed, 3, 4, VOCAB)


def test_oracle_draft_equals_its_rows_one_by_one_across_blocks_and_past_the_end():
    from kdspec.engine.decode.drafters import ORACLE_BLOCK
    golden = np.random.default_rng(2).integers(0, 50, ORACLE_BLOCK + 40)
    drafter = OracleDrafter(golden, 5, 7, 50)
    for position in [0, 1, ORACLE_BLOCK - 6, ORACLE_BLOCK - 5, ORACLE_BLOCK - 1, ORACLE_BLOCK, len(golden) - 6,
                     len(golden) - 3, len(golden) + 10]:
        ids, logprobs = drafter.draft(golden[:position], int(golden[min(position, len(golden) - 1)]), position)
        rows = [drafter._row(position + depth) for depth in range(1, 6)]
        assert ids.dtype == np.int32 and logprobs.dtype == np.float32
        assert np.array_equal(ids, np.stack([r[0] for r in rows])), position
        assert np.array_equal(logprobs, np.stack([r[1] for r in rows])), position
        assert ids.flags.writeable and logprobs.flags.writeable
