"""tokenizer.py: BPE fitting on the training split, token streams, the standard-library decoder."""
import json

import numpy as np
import pytest

from kdspec.engine.train.errors import TrainError
from kdspec.engine.train.tokenizer import (EOD, EOD_ID, ByteLevelDecoder, check_vocab_size, document_bounds, encode_texts,
                                    fit_tokenizer, token_stream)

pytest.importorskip("tokenizers")

TEXTS = ['def add(a, b):\n    return a + b\n', 'class Point:\n    """A point."""\n\n    x = 0\n',
         'print("héllo, 世界")\n\tif x:\n        pass\n'] * 5


@pytest.mark.parametrize("size", [0, -1, 256, 1 << 17, 4096.0, True])
def test_bad_vocab_sizes_raise(size):
    with pytest.raises(TrainError, match="vocab size"):
        check_vocab_size(size)
    with pytest.raises(TrainError, match="vocab size"):
        fit_tokenizer(TEXTS, size)


def test_fit_is_deterministic_with_eod_first_and_bytes_next():
    a, b = fit_tokenizer(TEXTS, 300), fit_tokenizer(TEXTS, 300)
    assert a.to_str() == b.to_str()
    assert a.token_to_id(EOD) == EOD_ID
    assert 257 < a.get_vocab_size() <= 300
    vocab = json.loads(a.to_str())["model"]["vocab"]
    byte_ids = sorted(i for t, i in vocab.items() if len(t) == 1 and i != EOD_ID)
    assert byte_ids[:256] == list(range(1, 257))


def test_stream_layout_and_round_trip(tmp_path):
    tok = fit_tokenizer(TEXTS, 300)
    stream = token_stream(tok, TEXTS[:3])
    assert stream.dtype == np.uint16
    bounds = document_bounds(stream)
    assert len(bounds) == 3
    tok.save(str(tmp_path / "tokenizer.json"))
    decoder = ByteLevelDecoder.from_file(tmp_path / "tokenizer.json")
    for (a, b), text in zip(bounds, TEXTS[:3]):
        ids = stream[a:b].tolist()
        assert ids[0] == ids[-1] == EOD_ID and EOD_ID not in ids[1:-1]
        assert decoder.decode(ids) == text == tok.decode(ids[1:-1])


def test_eod_written_in_a_text_is_plain_bytes():
    tok = fit_tokenizer(TEXTS, 300)
    [ids] = encode_texts(tok, [f"x = '{EOD}'\n"])
    assert EOD_ID not in ids
    assert tok.decode(ids) == f"x = '{EOD}'\n"


def test_decoder_matches_tokenizers_on_every_token(tmp_path):
    tok = fit_tokenizer(TEXTS, 300)
    tok.save(str(tmp_path / "tokenizer.json"))
    decoder = ByteLevelDecoder.from_file(tmp_path / "tokenizer.json")
    ids = list(range(1, tok.get_vocab_size()))
    assert decoder.decode(ids).encode("utf-8", "replace") == tok.decode(ids).encode("utf-8", "replace")
