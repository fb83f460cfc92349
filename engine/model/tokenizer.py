"""Byte-level tokenizer for the presets: token id = byte value (ids >= 256 decode to a placeholder)."""
from __future__ import annotations


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids) -> str:
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def token_text(token_id: int) -> str:
    """A printable rendering of one token for display."""
    if 32 <= token_id < 127:
        return chr(token_id)
    return f"<{token_id}>"
