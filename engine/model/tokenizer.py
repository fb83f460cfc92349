"""Byte-level tokenizer for the presets: token id = byte value."""
from __future__ import annotations


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))
