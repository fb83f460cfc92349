"""windows.py: every held-out prediction once, files never mixed, batches cut to their longest window."""
import numpy as np
import pytest

from kdspec.engine.train.errors import TrainError
from kdspec.engine.train.tokenizer import EOD_ID
from kdspec.engine.train.windows import IGNORE, eval_windows


def stream_of(docs):
    out = [EOD_ID]
    for d in docs:
        out += d + [EOD_ID]
    return np.array(out, dtype=np.uint16)


@pytest.mark.parametrize("context", [1, 3, 4, 100])
def test_every_prediction_once(context):
    docs = [[5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15, 16]]
    stream = stream_of(docs)
    w = eval_windows(stream, context)
    assert w.predictions == len(stream) - 1
    pairs = []
    for x, y, n in zip(w.inputs, w.targets, w.lengths):
        assert (y[n:] == IGNORE).all() and (y[:n] != IGNORE).all()
        pairs += list(zip(x[:n].tolist(), y[:n].tolist()))
    expected = []
    for d in docs:
        seq = [EOD_ID] + d + [EOD_ID]
        expected += list(zip(seq[:-1], seq[1:]))
    assert sorted(pairs) == sorted(expected)
    assert list(w.lengths) == sorted(w.lengths, reverse=True)
    assert sum(len(y[y != IGNORE]) for _, y in w.batches(2)) == w.predictions
    assert all(x.shape[1] == max(1, int((y != IGNORE).sum(axis=1).max())) for x, y in w.batches(2))


def test_window_never_spans_two_files():
    docs = [[5, 6], [7, 8]]
    w = eval_windows(stream_of(docs), 10)
    assert sorted(w.lengths.tolist()) == [3, 3]


def test_stream_must_be_framed_by_eod():
    with pytest.raises(TrainError):
        eval_windows(np.array([5, 6, EOD_ID], dtype=np.uint16), 4)
