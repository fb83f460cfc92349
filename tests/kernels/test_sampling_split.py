"""Split-vocabulary argmax / top-k (numba_kernels.sampling, chunk then merge) against numpy references:
bit-exact ids, values and margins, ties -> lower id, outputs poisoned."""
import numpy as np
import pytest
from numba import cuda

from kdspec.numba_kernels import sampling

pytestmark = pytest.mark.sim


def _reference_topk(logits: np.ndarray, k: int):
    order = np.lexsort((np.broadcast_to(np.arange(logits.shape[1]), logits.shape), -logits.astype(np.float64)), axis=1)
    top = np.take_along_axis(logits, order[:, :max(k, 2)], axis=1)
    margin = top[:, 0] - top[:, 1] if logits.shape[1] > 1 else np.full(len(logits), np.inf, np.float32)
    return order[:, :k].astype(np.int32), top[:, :k], margin.astype(np.float32)


def _logits(rows, vocab, seed, tied):
    rng = np.random.default_rng(seed)
    if tied:  # few distinct values: ties inside and across chunks
        return rng.integers(-3, 4, (rows, vocab)).astype(np.float32)
    return rng.standard_normal((rows, vocab)).astype(np.float32)


@pytest.mark.parametrize("rows, vocab, chunk, k, tied, seed", [
    (1, 37, 8, 4, False, 0), (3, 64, 16, 5, True, 1), (2, 50, 7, 1, True, 2), (1, 9, 4, 8, True, 3),
    (4, 33, 32, 2, False, 4), (2, 40, 5, 3, True, 5),
    (2, 700, 300, 4, True, 6), (1, 1000, 1000, 3, False, 7)])  # many entries a thread, a partial last round
def test_split_topk_and_argmax_match_numpy(rows, vocab, chunk, k, tied, seed):
    logits = _logits(rows, vocab, seed, tied)
    want_ids, want_values, want_margin = _reference_topk(logits, k)
    ids, values, margins = sampling.topk_rows(cuda.to_device(logits), k, split_chunk=chunk)
    np.testing.assert_array_equal(ids.copy_to_host(), want_ids)
    np.testing.assert_array_equal(values.copy_to_host(), want_values)
    np.testing.assert_array_equal(margins.copy_to_host(), want_margin)
    argmax = sampling.argmax_rows(cuda.to_device(logits), split_chunk=chunk).copy_to_host()
    np.testing.assert_array_equal(argmax, want_ids[:, 0])


def test_split_outputs_are_fully_written():
    logits = _logits(2, 30, 7, True)
    ids = cuda.to_device(np.full((2, 3, 2), -7, np.int32))
    values = cuda.to_device(np.full((2, 3, 2), np.nan, np.float32))
    sampling.chunk_candidates_kernel[(3, 2), sampling.ROW_THREADS](cuda.to_device(logits), 10, ids, values)
    got_ids, got_values = ids.copy_to_host(), values.copy_to_host()
    for c in range(3):  # each chunk's best two, in top-k order
        part = logits[:, 10 * c:10 * c + 10]
        want_ids, want_values, _ = _reference_topk(part, 2)
        np.testing.assert_array_equal(got_ids[:, c], want_ids + 10 * c)
        np.testing.assert_array_equal(got_values[:, c], want_values)


def test_large_vocab_takes_the_split_path(monkeypatch):
    logits = _logits(1, 40, 9, True)
    monkeypatch.setattr(sampling, "SPLIT_MIN_VOCAB", 16)
    monkeypatch.setattr(sampling, "SPLIT_CHUNK", 8)
    calls = []
    original = sampling._split_topk
    monkeypatch.setattr(sampling, "_split_topk", lambda *a: calls.append(a[6]) or original(*a))  # the chunk
    ids, _, _ = sampling.topk_rows(cuda.to_device(logits), 3)
    assert calls == [8]
    np.testing.assert_array_equal(ids.copy_to_host(), _reference_topk(logits, 3)[0])


@pytest.mark.parametrize("vocab, tied", [(5, True), (300, True), (1000, False)])
def test_unsplit_topk_matches_numpy(vocab, tied):
    """One block a row (topk_rows_kernel), with fewer entries than threads and with many a thread: numpy's top-k,
    ties included."""
    logits = _logits(3, vocab, 8, tied)
    assert vocab <= sampling.SPLIT_MIN_VOCAB
    want_ids, want_values, want_margin = _reference_topk(logits, min(4, vocab))
    ids, values, margins = sampling.topk_rows(cuda.to_device(logits), want_ids.shape[1])
    np.testing.assert_array_equal(ids.copy_to_host(), want_ids)
    np.testing.assert_array_equal(values.copy_to_host(), want_values)
    np.testing.assert_array_equal(margins.copy_to_host(), want_margin)


@pytest.mark.parametrize("rows", [1, 7, 64, 256, 4096])
@pytest.mark.parametrize("vocab", [8193, 163840])
def test_split_chunk_for_keeps_launches_near_split_blocks(rows, vocab):
    """The launch shape rule: SPLIT_CHUNK at least, doubled while more than SPLIT_BLOCKS blocks, MAX_SPLIT_CHUNK at
    most (the chunk is a launch shape; the bits are the same at every chunk, test above)."""
    chunk = sampling.split_chunk_for(rows, vocab)
    blocks = rows * -(-vocab // chunk)
    assert sampling.SPLIT_CHUNK <= chunk <= sampling.MAX_SPLIT_CHUNK
    assert blocks <= sampling.SPLIT_BLOCKS or chunk == sampling.MAX_SPLIT_CHUNK
    if chunk > sampling.SPLIT_CHUNK:  # the next shorter chunk had too many blocks
        assert rows * -(-vocab // (chunk // 2)) > sampling.SPLIT_BLOCKS
