"""The bf16 rows around the grouped expert GEMMs (numba_kernels/moe/pair_rows.py) against numpy at toy sizes, under
the simulator in CI (marked sim) and for real on a GPU: gather and combine bit-exact (integer outputs and
roundings), SwiGLU within a bf16 ulp; outputs poisoned; rows of pairs with an out-of-range expert left untouched."""
import numpy as np
import pytest
from numba import cuda

from kdspec.engine.model.safetensors_io import float32_to_bf16_bits
from kdspec.numba_kernels.moe.experts import plan_pairs
from kdspec.numba_kernels.moe.pair_rows import combine_pair_rows, gather_pair_rows, swiglu_rows

pytestmark = pytest.mark.sim

POISON_WORD = np.uint32(0x7FC17FC1)  # two bf16 NaNs: any word a kernel leaves alone stays this


def _words(bf16_bits):
    """uint16 bf16 bits [rows, 2n] -> uint32 words [rows, n], column 2i in the low half."""
    return np.ascontiguousarray(bf16_bits, dtype=np.uint16).view(np.uint32)


def _widen(words):
    """uint32 words of bf16 pairs -> float64 [rows, 2n]."""
    return (words.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _routing(s, k, e, seed, out_of_range=False):
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((s, e)), axis=1)[:, :k].astype(np.int32)
    if out_of_range:
        ids[1, 0], ids[-1, k - 1] = e, -1
    return rng, ids


def _placed(ids, e):
    """The pairs a plan places, in the plan's order: by expert, ascending pair within one (numpy, independent)."""
    flat = ids.reshape(-1)
    return [p for expert in range(e) for p in np.flatnonzero(flat == expert)]


@pytest.mark.parametrize("out_of_range", [False, True])
def test_gather_places_each_pairs_token_as_bf16_in_expert_order(out_of_range):
    s, k, e, d = 5, 3, 4, 24
    rng, ids = _routing(s, k, e, 1, out_of_range)
    x = (rng.standard_normal((s, d)) * 3).astype(np.float32)
    x[2, 5] = np.float32(1 + 2 ** -8)  # a tie: nearest even rounds it down
    plan = plan_pairs(ids, e)
    rows = cuda.to_device(np.full((s * k, d // 2), POISON_WORD, np.uint32))
    pair_rows = cuda.to_device(np.full(s * k, -9, np.int32))
    gather_pair_rows(cuda.to_device(x), k, plan, rows=rows, pair_rows=pair_rows)
    rows, pair_rows = rows.copy_to_host(), pair_rows.copy_to_host()
    placed = _placed(ids, e)
    want = _words(float32_to_bf16_bits(x))
    for p, pair in enumerate(placed):
        assert pair_rows[pair] == p
        assert np.array_equal(rows[p], want[pair // k]), p
    assert (rows[len(placed):] == POISON_WORD).all()
    unplaced = sorted(set(range(s * k)) - set(placed))
    assert (pair_rows[unplaced] == -9).all() and len(unplaced) == (2 if out_of_range else 0)


def test_swiglu_rows_match_float64_within_a_bf16_rounding():
    s, k, e, f = 4, 2, 3, 20
    rng, ids = _routing(s, k, e, 2, out_of_range=True)
    plan = plan_pairs(ids, e)
    n_pairs = s * k
    gate_up = _words(float32_to_bf16_bits((rng.standard_normal((n_pairs, 2 * f)) * 4).astype(np.float32)))
    act = cuda.to_device(np.full((n_pairs, f // 2), POISON_WORD, np.uint32))
    swiglu_rows(cuda.to_device(gate_up), plan, out=act)
    act = act.copy_to_host()
    placed = len(_placed(ids, e))
    values = _widen(gate_up)
    gate, up = values[:, :f], values[:, f:]
    want = gate / (1 + np.exp(-gate)) * up
    got = _widen(act)
    assert np.isfinite(got[:placed]).all()
    np.testing.assert_allclose(got[:placed], want[:placed], rtol=2 ** -8, atol=1e-30)
    assert (act[placed:] == POISON_WORD).all()


@pytest.mark.parametrize("accumulate", [False, True])
def test_combine_sums_each_tokens_rows_in_slot_order(accumulate):
    s, k, e, d = 5, 3, 4, 24
    rng, ids = _routing(s, k, e, 3, out_of_range=True)
    weights = rng.random((s, k)).astype(np.float32)
    placed = _placed(ids, e)
    pair_rows = np.full(s * k, 10 ** 6, np.int32)  # unplaced pairs: a row far out of range, never to be read
    pair_rows[placed] = np.arange(len(placed), dtype=np.int32)
    down = _words(float32_to_bf16_bits(rng.standard_normal((s * k, d)).astype(np.float32)))
    y0 = rng.standard_normal((s, d)).astype(np.float32)
    out = cuda.to_device(y0 if accumulate else np.full((s, d), np.nan, np.float32))
    combine_pair_rows(cuda.to_device(down), cuda.to_device(pair_rows), cuda.to_device(ids), cuda.to_device(weights),
                      e, out=out, accumulate=accumulate)
    got = out.copy_to_host()
    values = _widen(down)
    want = y0.astype(np.float64) if accumulate else np.zeros((s, d))
    for t in range(s):
        for slot in range(k):
            if 0 <= ids[t, slot] < e:
                want[t] += float(weights[t, slot]) * values[pair_rows[t * k + slot]]
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_pair_rows_refuse_mismatched_shapes():
    s, k, e, d = 3, 2, 4, 8
    _, ids = _routing(s, k, e, 4)
    plan = plan_pairs(ids, e)
    with pytest.raises(ValueError, match="odd"):
        gather_pair_rows(np.zeros((s, 7), np.float32), k, plan)
    with pytest.raises(ValueError, match="plan"):
        gather_pair_rows(np.zeros((s + 1, d), np.float32), k, plan)
    with pytest.raises(ValueError, match="gate_up"):
        swiglu_rows(np.zeros((s * k, 3), np.uint32), plan)
    with pytest.raises(ValueError, match="accumulate needs out"):
        combine_pair_rows(np.zeros((s * k, d // 2), np.uint32), np.zeros(s * k, np.int32), ids,
                          np.ones((s, k), np.float32), e, accumulate=True)
