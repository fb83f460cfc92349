"""Compressor baselines on the held-out split, in bits per byte: what the model's cross-entropy must beat.

gzip: ``gzip.compress(data, compresslevel=9, mtime=0)`` (the ``gzip -9`` format without a file name).
xz: ``lzma.compress(data, preset=9)`` in the .xz container with its default CRC64 check (``xz -9``); with
``extreme=True``, preset ``9 | PRESET_EXTREME`` (``xz -9e``). Per file: each file compressed on its own,
total compressed bits / total raw bytes. Whole: the split's files concatenated in corpus order, compressed once.
"""
from __future__ import annotations

import gzip
import lzma
import platform
import zlib
from collections.abc import Sequence

from .errors import TrainError


def gzip_size(data: bytes) -> int:
    return len(gzip.compress(data, compresslevel=9, mtime=0))


def xz_size(data: bytes, extreme: bool = False) -> int:
    preset = 9 | lzma.PRESET_EXTREME if extreme else 9
    return len(lzma.compress(data, format=lzma.FORMAT_XZ, preset=preset))


def bits_per_byte(compressed_bytes: int, raw_bytes: int) -> float:
    return 8.0 * compressed_bytes / raw_bytes


def measure_baselines(files: Sequence[bytes], extreme: bool = False) -> dict:
    """gzip -9 and xz -9 bits/byte over ``files`` (each file's raw bytes), per file and whole; plain numbers."""
    raw = sum(len(d) for d in files)
    if raw == 0:
        raise TrainError("baselines need at least one non-empty held-out file")
    whole = b"".join(files)
    xz_name = "xz -9e" if extreme else "xz -9"
    return {
        "files": len(files),
        "raw_bytes": raw,
        "gzip_per_file": bits_per_byte(sum(gzip_size(d) for d in files), raw),
        "xz_per_file": bits_per_byte(sum(xz_size(d, extreme) for d in files), raw),
        "gzip_whole": bits_per_byte(gzip_size(whole), raw),
        "xz_whole": bits_per_byte(xz_size(whole, extreme), raw),
        "settings": f"gzip -9 (zlib {zlib.ZLIB_VERSION}, mtime=0, no file name); {xz_name} (liblzma, CRC64)",
        "python_version": platform.python_version(),
    }
