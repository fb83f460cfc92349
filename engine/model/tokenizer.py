"""Tokenizers of the models the engine runs: byte-level for the presets, byte-level BPE for model directories
that ship a tokenizer.json (Hugging Face `tokenizers` format).

Both give encode(text) -> ids (the BPE one opens with the model's bos token when config.json names one, as
training did), decode(ids) -> text, and token_bytes(id) -> the raw bytes of one token, which a trace stores for
its whole vocabulary so that a viewer shows text with neither the tokenizer library nor the model directory.
Decoding reads tokenizer.json with the standard library; only encoding needs the `tokenizers` package.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Optional

TOKENIZER_FILE = "tokenizer.json"


class TokenizerError(ValueError):
    """A tokenizer.json that cannot be read, or text that cannot be encoded; one line."""


class ByteTokenizer:
    """Token id = byte value (the presets). Ids >= 256 have no bytes."""

    name = "byte"
    bos_token_id: Optional[int] = None

    def encode(self, text: str) -> list[int]:
        return list(_utf8(text))

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if 0 <= token_id < 256 else b""

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self.token_bytes(int(i)) for i in ids).decode("utf-8", errors="replace")


@lru_cache(maxsize=1)
def _byte_of_symbol() -> dict[str, int]:
    """GPT-2's byte -> printable-symbol table, inverted (what the ByteLevel pre-tokenizer maps bytes to)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[chr(b)] = b
        else:
            symbols[chr(256 + extra)] = b
            extra += 1
    return symbols


class ByteLevelDecoder:
    """Token id -> bytes from a byte-level BPE tokenizer.json, with the standard library only."""

    def __init__(self, vocab: dict[str, int], special: dict[int, str]):
        byte_of = _byte_of_symbol()
        self.special = dict(special)
        size = max(list(vocab.values()) + list(self.special)) + 1
        self._bytes: list[bytes] = [b""] * size
        for token, i in vocab.items():
            if i in self.special:
                continue
            try:
                self._bytes[i] = bytes(byte_of[ch] for ch in token)
            except KeyError:
                raise TokenizerError(f"token {token!r} (id {i}) is not a byte-level symbol string") from None
        for i, content in self.special.items():
            self._bytes[i] = content.encode("utf-8")

    @classmethod
    def from_file(cls, path: str | Path) -> "ByteLevelDecoder":
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            vocab = raw["model"]["vocab"]
            special = {int(t["id"]): t["content"] for t in raw.get("added_tokens", []) if t.get("special")}
            return cls(vocab, special)
        except FileNotFoundError:
            raise TokenizerError(f"{path}: no such tokenizer file") from None
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, TokenizerError):
                raise
            raise TokenizerError(f"{path}: not a byte-level BPE tokenizer.json ({type(e).__name__})") from None

    @property
    def vocab_size(self) -> int:
        return len(self._bytes)

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        data = b"".join(self.token_bytes(int(i)) for i in ids if not (skip_special and int(i) in self.special))
        return data.decode("utf-8", errors="replace")


class BpeTokenizer:
    """A model directory's byte-level BPE (tokenizer.json); encode(text) opens with bos_token_id when set."""

    name = "bpe"

    def __init__(self, path: str | Path, bos_token_id: Optional[int] = None):
        self.path = Path(path)
        self.decoder = ByteLevelDecoder.from_file(self.path)
        self.bos_token_id = bos_token_id
        self._encoder = None

    def encode(self, text: str) -> list[int]:
        if self._encoder is None:
            try:
                from tokenizers import Tokenizer
            except ImportError:
                raise TokenizerError("encoding text for this model needs the `tokenizers` package "
                                     "(pip install tokenizers), or pass --prompt-ids") from None
            self._encoder = Tokenizer.from_file(str(self.path))
        ids = self._encoder.encode(_utf8(text).decode("utf-8"), add_special_tokens=False).ids
        return ([self.bos_token_id] if self.bos_token_id is not None else []) + list(ids)

    def token_bytes(self, token_id: int) -> bytes:
        return self.decoder.token_bytes(token_id)

    def decode(self, ids: Sequence[int]) -> str:
        return self.decoder.decode(ids)


def tokenizer_for(directory: Optional[Path], bos_token_id: Optional[int] = None):
    """The tokenizer of a model: BPE when ``directory`` holds tokenizer.json, else byte-level."""
    if directory is not None and (Path(directory) / TOKENIZER_FILE).is_file():
        return BpeTokenizer(Path(directory) / TOKENIZER_FILE, bos_token_id)
    return ByteTokenizer()


def vocabulary_bytes(tokenizer, vocab_size: int) -> list[bytes]:
    """token_bytes of every id 0..vocab_size-1 (what a trace stores for its viewer)."""
    return [tokenizer.token_bytes(i) for i in range(vocab_size)]


def _utf8(text: str) -> bytes:
    """text as UTF-8; a lone surrogate (undecodable bytes passed on a command line) is a one-line error."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TokenizerError(f"prompt is not valid UTF-8 text (character {e.start}); pass --prompt-ids instead") \
            from None


def encode(text: str) -> list[int]:
    """Byte-level encoding (the presets' tokenizer)."""
    return ByteTokenizer().encode(text)
