"""Top-k of any k (numba_kernels.topk_select, reached through sampling.topk_rows for k > MAX_TOPK) and the row
log-softmax (sampling.log_softmax_rows) against numpy: bit-exact ids, values and margins with ties -> lower id,
outputs poisoned; log-softmax within float32 rounding of float64."""
import numpy as np
import pytest
from numba import cuda

from kdspec.numba_kernels import sampling, topk_select

POISON_INT = -123456


def reference_topk(values: np.ndarray, k: int):
    order = np.lexsort((np.broadcast_to(np.arange(values.shape[1]), values.shape), -values.astype(np.float64)),
                       axis=1)[:, :k]
    top = np.take_along_axis(values, order, axis=1)
    return order.astype(np.int32), top, (top[:, 0] - top[:, 1]).astype(np.float32)


def random_values(rng, rows, vocab, kind):
    if kind == "ties":  # few distinct values: ties inside the top-k and across its boundary
        return (rng.integers(-4, 4, (rows, vocab)) * 0.5).astype(np.float32)
    if kind == "zeros":  # +0.0 and -0.0 are equal (ties -> lower id), both above the negatives
        values = -np.abs(rng.standard_normal((rows, vocab))).astype(np.float32)
        values[:, rng.choice(vocab, vocab // 3, replace=False)] = np.float32(-0.0)
        values[:, rng.choice(vocab, vocab // 4, replace=False)] = np.float32(0.0)
        return values
    return (3 * rng.standard_normal((rows, vocab))).astype(np.float32)  # signs mixed, all distinct


@pytest.mark.sim
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kind", ["distinct", "ties", "zeros"])
def test_topk_of_many_matches_numpy(seed, kind):
    rng = np.random.default_rng([seed, len(kind)])
    rows, vocab = int(rng.integers(1, 5)), int(rng.integers(sampling.MAX_TOPK + 1, 300))
    k = int(rng.integers(sampling.MAX_TOPK + 1, vocab + 1)) if seed % 3 else vocab  # k = V: the whole row
    values = random_values(rng, rows, vocab, kind)
    want_ids, want_values, want_margins = reference_topk(values, k)
    ids, top, margins = sampling.topk_rows(cuda.to_device(values), k)
    np.testing.assert_array_equal(ids.copy_to_host(), want_ids)
    assert top.copy_to_host().tobytes() == want_values.tobytes()  # bit-exact: -0.0 stays -0.0
    np.testing.assert_array_equal(margins.copy_to_host(), want_margins)


@pytest.mark.sim
def test_select_kernel_writes_every_output_slot():
    rng = np.random.default_rng(7)
    values = random_values(rng, 3, 70, "ties")
    k = 40
    ids = cuda.to_device(np.full((3, k), POISON_INT, np.int32))
    top = cuda.to_device(np.full((3, k), np.nan, np.float32))
    margins = cuda.to_device(np.full(3, np.nan, np.float32))
    scratch = cuda.to_device(np.full((3, k), POISON_INT, np.int32))
    device = cuda.to_device(values)
    topk_select.select_topk_kernel[1, topk_select.SELECT_THREADS](device, device.view(np.uint32),
                                                                  topk_select.id_digits(70), ids, top, margins,
                                                                  scratch)
    want_ids, want_values, want_margins = reference_topk(values, k)
    np.testing.assert_array_equal(ids.copy_to_host(), want_ids)
    np.testing.assert_array_equal(top.copy_to_host(), want_values)
    np.testing.assert_array_equal(margins.copy_to_host(), want_margins)


@pytest.mark.sim
def test_topk_rows_keeps_its_argument_rules():
    values = np.zeros((2, 20), np.float32)
    with pytest.raises(ValueError, match="k must be in 1..V=20"):
        sampling.topk_rows(values, 21)
    with pytest.raises(ValueError, match="k must be in 2..V"):
        topk_select.topk_select_rows(values, 1)
    assert topk_select.id_digits(256) == 1 and topk_select.id_digits(257) == 2 and topk_select.id_digits(1) == 1


@pytest.mark.sim
@pytest.mark.parametrize("seed", range(4))
def test_log_softmax_rows_matches_float64(seed):
    rng = np.random.default_rng(seed)
    rows, vocab = int(rng.integers(1, 8)), int(rng.integers(1, 400))
    logits = (4 * rng.standard_normal((rows, vocab)) + rng.normal(0, 30, (rows, 1))).astype(np.float32)
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    want = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    out = cuda.to_device(np.full((rows, vocab), np.nan, np.float32))
    got = sampling.log_softmax_rows(cuda.to_device(logits), out=out).copy_to_host()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-6)
    in_place = cuda.to_device(logits)
    sampling.log_softmax_rows(in_place, out=in_place)
    np.testing.assert_allclose(in_place.copy_to_host(), want, atol=2e-5, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab, k", [(4096, 64), (4096, 256), (163840, 1024)])
def test_topk_of_many_at_real_vocabularies(vocab, k):
    rng = np.random.default_rng(vocab + k)
    values = random_values(rng, 7, vocab, "distinct")
    values[3] = random_values(rng, 1, vocab, "ties")[0]
    want = reference_topk(values, k)
    got = [a.copy_to_host() for a in sampling.topk_rows(cuda.to_device(values), k)]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    logits = values * np.float32(2)
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    want_lp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(sampling.log_softmax_rows(logits).copy_to_host(), want_lp, atol=1e-4)
