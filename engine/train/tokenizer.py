"""The byte-level BPE: fitted with Hugging Face ``tokenizers`` on the training split, and a pure-Python decoder.

Id 0 is the end-of-document token ``<|endoftext|>``; ids 1..256 hold the 256 byte symbols, the rest are
merges. A split's token stream is ``EOD f1 EOD f2 ... EOD fn EOD`` as uint16 (each file opens with EOD, which
serves as its beginning-of-sequence, and the stream closes with one), so the GPU side needs no tokenizers
library: ``ByteLevelDecoder`` (engine/model/tokenizer.py) reads tokenizer.json with the standard library alone.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kdspec.engine.model.tokenizer import TOKENIZER_FILE, ByteLevelDecoder  # noqa: F401  (the decoder lives with the model)

from .errors import TrainError

EOD = "<|endoftext|>"
EOD_ID = 0
SPECIAL_TOKENS = (EOD,)
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
MAX_VOCAB_SIZE = 1 << 16  # token streams are uint16


def check_vocab_size(vocab_size) -> int:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or \
            not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise TrainError(f"vocab size must be an integer in {MIN_VOCAB_SIZE}..{MAX_VOCAB_SIZE} (256 bytes + "
                         f"{len(SPECIAL_TOKENS)} special), got {vocab_size!r}")
    return vocab_size


def fit_tokenizer(texts: Sequence[str], vocab_size: int):
    """A ``tokenizers.Tokenizer``: byte-level BPE of at most ``vocab_size`` ids fitted on ``texts``.

    GPT-2's pre-tokenizer regex, no prefix space, merges of pairs seen at least twice. Fewer ids than asked
    come out only when the texts run out of such pairs.
    """
    check_vocab_size(vocab_size)
    if not texts:
        raise TrainError("tokenizer needs at least one training text")
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise TrainError("fitting the tokenizer needs the `tokenizers` package (pip install tokenizers)") from None
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer, length=len(texts))
    if tokenizer.token_to_id(EOD) != EOD_ID:
        raise TrainError(f"tokenizer put {EOD} at id {tokenizer.token_to_id(EOD)}, expected {EOD_ID}")
    return tokenizer


def load_tokenizer(path: str | Path):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TrainError("encoding text needs the `tokenizers` package (pip install tokenizers)") from None
    return Tokenizer.from_file(str(path))


def encode_texts(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Each text's ids; ``<|endoftext|>`` written inside a text is encoded as plain bytes, never as EOD."""
    tokenizer.encode_special_tokens = True
    try:
        return [e.ids for e in tokenizer.encode_batch(list(texts), add_special_tokens=False)]
    finally:
        tokenizer.encode_special_tokens = False


def token_stream(tokenizer, texts: Sequence[str]) -> np.ndarray:
    """uint16 [EOD f1 EOD f2 ... EOD fn EOD] of ``texts`` in order."""
    if tokenizer.get_vocab_size() > MAX_VOCAB_SIZE:
        raise TrainError(f"vocabulary of {tokenizer.get_vocab_size()} ids does not fit uint16")
    pieces = [np.array([EOD_ID], dtype=np.uint16)]
    for ids in encode_texts(tokenizer, texts):
        pieces.append(np.asarray(ids, dtype=np.uint16))
        pieces.append(np.array([EOD_ID], dtype=np.uint16))
    return np.concatenate(pieces)


def document_bounds(stream: np.ndarray) -> list[tuple[int, int]]:
    """(start, stop) of each document's sequence ``EOD t1 .. tn EOD`` (both EODs included) in a stream."""
    eods = np.flatnonzero(stream == EOD_ID)
    if len(eods) < 2 or eods[0] != 0 or eods[-1] != len(stream) - 1:
        raise TrainError("token stream must open and close with the end-of-document token")
    return [(int(a), int(b) + 1) for a, b in zip(eods[:-1], eods[1:])]
