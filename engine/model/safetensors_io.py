"""A small numpy reader and writer of the safetensors format (no pickle, no torch).

File layout: an 8-byte little-endian unsigned header length N, N bytes of UTF-8 JSON, then the raw
little-endian tensor bytes. The JSON maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin,
end]}`` (offsets relative to the first data byte) and may hold ``"__metadata__"`` (str -> str).

Supported dtypes: F32, F16, BF16, F8_E4M3, I64, I32. numpy has neither bfloat16 nor float8, so those are
handled as their bit patterns (uint16 / uint8) and decoded to float32 here:
- BF16 is the top half of a float32: widen by ``bits << 16``; encode with round-to-nearest-even.
- F8_E4M3 (``float8_e4m3fn``): 1 sign, 4 exponent (bias 7), 3 mantissa bits, no infinities, 0x7f / 0xff NaN,
  largest finite 448. Decoded through a 256-entry table; encoded by round-to-nearest-even, saturating at 448.

Reading memory-maps the file: tensors are views of one read-only map, so a big shard does not cost its size
twice in RAM. Writing goes to a temporary file renamed into place, so a map of the old file stays valid.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

import numpy as np

# safetensors dtype -> numpy dtype of the stored bit pattern (BF16 and F8_E4M3 are raw bits).
STORAGE_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "F8_E4M3": np.dtype("u1"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
}
FLOAT_DTYPES = ("F32", "F16", "BF16", "F8_E4M3")
_NATURAL_DTYPE = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
                  np.dtype(np.int64): "I64", np.dtype(np.int32): "I32"}

E4M3_MAX = 448.0
E4M3_NAN_CODE = 0x7F
_MAX_HEADER_BYTES = 100_000_000  # as the reference implementation: a larger header is garbage, not a model


class SafetensorsError(ValueError):
    """A file that is not valid safetensors; the message is one line naming the file."""


# -- bfloat16 -----------------------------------------------------------------------------------------------
def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """uint16 bf16 bit patterns [...] -> float32 [...] (exact: bf16 is the top half of a float32)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 [...] -> uint16 bf16 bit patterns, round-to-nearest-even; NaN stays a (quiet) NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    # Adding 0x7fff plus the lowest kept bit rounds the dropped half to nearest, ties to the even result.
    rounded = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    quiet_nan = (u >> np.uint32(16)) | np.uint32(0x0040)
    return np.where(nan, quiet_nan, rounded).astype(np.uint16)


# -- float8 e4m3fn ------------------------------------------------------------------------------------------
def _e4m3_table() -> np.ndarray:
    table = np.empty(256, dtype=np.float32)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exponent, mantissa = (code >> 3) & 0xF, code & 0x7
        if exponent == 0xF and mantissa == 0x7:
            table[code] = np.nan
        elif exponent == 0:  # subnormal: 0.mmm * 2^(1-7)
            table[code] = sign * mantissa * 2.0 ** -9
        else:
            table[code] = sign * (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)
    table.flags.writeable = False
    return table


E4M3_TABLE = _e4m3_table()  # float32 [256]: code -> value
_E4M3_POSITIVE = E4M3_TABLE[:0x7F].astype(np.float64)  # codes 0..126: the finite non-negative values, increasing


def e4m3_to_float32(codes: np.ndarray) -> np.ndarray:
    """uint8 e4m3fn codes [...] -> float32 values [...]."""
    return E4M3_TABLE[np.asarray(codes, dtype=np.uint8)]


def float32_to_e4m3(x: np.ndarray) -> np.ndarray:
    """float [...] -> uint8 e4m3fn codes: round-to-nearest-even, |x| > 448 (and inf) saturate to 448, NaN -> 0x7f."""
    x = np.asarray(x, dtype=np.float64)
    magnitude = np.minimum(np.abs(x), E4M3_MAX)
    # The grid spacing is 2^(E-3) in the binade [2^E, 2^(E+1)), and 2^-9 below the smallest normal 2^-6.
    _, exponent = np.frexp(magnitude)  # magnitude = f * 2^exponent, f in [0.5, 1)
    quantum = np.ldexp(1.0, np.maximum(exponent - 1, -6) - 3)
    on_grid = np.rint(magnitude / quantum) * quantum  # np.rint rounds halves to even, exact for powers of two
    codes = np.searchsorted(_E4M3_POSITIVE, on_grid).astype(np.uint8)
    codes |= np.where(np.signbit(x), np.uint8(0x80), np.uint8(0))
    return np.where(np.isnan(x), np.uint8(E4M3_NAN_CODE), codes).astype(np.uint8)


def decode_float32(dtype: str, stored: np.ndarray) -> np.ndarray:
    """A stored array (as returned by SafetensorsFile.get) -> a new float32 array."""
    if dtype == "BF16":
        return bf16_bits_to_float32(stored)
    if dtype == "F8_E4M3":
        return e4m3_to_float32(stored)
    return np.array(stored, dtype=np.float32)


# -- reading ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offset from the start of the data section
    end: int


def _parse_header(path: Path, header: object, data_len: int) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is not a JSON object")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise SafetensorsError(f"{path}: __metadata__ must map strings to strings")
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise SafetensorsError(f"{path}: tensor {name}: header entry is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in STORAGE_DTYPES:
            raise SafetensorsError(f"{path}: tensor {name}: unknown dtype {dtype!r} "
                                   f"(supported: {', '.join(STORAGE_DTYPES)})")
        if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
            raise SafetensorsError(f"{path}: tensor {name}: shape must be a list of non-negative integers, got {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise SafetensorsError(f"{path}: tensor {name}: data_offsets must be [begin, end] with 0 <= begin <= end, "
                                   f"got {offsets!r}")
        if offsets[1] > data_len:
            raise SafetensorsError(f"{path}: tensor {name}: data_offsets {offsets} run past the end of the data "
                                   f"({data_len} bytes; truncated file?)")
        nbytes = math.prod(shape) * STORAGE_DTYPES[dtype].itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise SafetensorsError(f"{path}: tensor {name}: data_offsets span {offsets[1] - offsets[0]} bytes, "
                                   f"{dtype} {shape} needs {nbytes}")
        tensors[name] = TensorInfo(dtype, tuple(shape), offsets[0], offsets[1])
    # Overlapping tensors would alias each other's bytes: a corrupt or hostile file.
    spans = sorted((t.begin, t.end, n) for n, t in tensors.items() if t.end > t.begin)
    for (_, prev_end, prev), (begin, _, name) in zip(spans, spans[1:]):
        if begin < prev_end:
            raise SafetensorsError(f"{path}: tensors {prev} and {name} overlap")
    return tensors, metadata


class SafetensorsFile:
    """One memory-mapped safetensors file.

    ``get(name)`` returns a read-only view of the map in the storage dtype (BF16 as uint16 bits, F8_E4M3 as
    uint8 codes); ``get_float32(name)`` decodes any float dtype to a new float32 array.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
        except OSError as e:
            raise SafetensorsError(f"{self.path}: cannot open ({e.strerror})") from None
        if not self.path.is_file():
            raise SafetensorsError(f"{self.path}: not a file")
        if size < 8:
            raise SafetensorsError(f"{self.path}: truncated: {size} bytes, shorter than the 8-byte header length")
        with open(self.path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > min(size - 8, _MAX_HEADER_BYTES):
                raise SafetensorsError(f"{self.path}: header length {header_len} exceeds the file ({size} bytes); "
                                       "truncated or not a safetensors file")
            raw_header = f.read(header_len)
            try:
                header = json.loads(raw_header.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
                raise SafetensorsError(f"{self.path}: header is not valid UTF-8 JSON "
                                       f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
            self.data_start = 8 + header_len
            self.tensors, self.metadata = _parse_header(self.path, header, size - self.data_start)
            # mmap of an empty data section is impossible; tensors are then all empty anyway.
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size > self.data_start else None

    def keys(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise SafetensorsError(f"{self.path}: no tensor {name}") from None

    def get(self, name: str) -> np.ndarray:
        t = self.info(name)
        dtype = STORAGE_DTYPES[t.dtype]
        if t.end == t.begin:
            return np.zeros(t.shape, dtype=dtype)
        # The view keeps the map alive; no copy is made.
        flat = np.frombuffer(self._map, dtype=dtype, count=(t.end - t.begin) // dtype.itemsize,
                             offset=self.data_start + t.begin)
        return flat.reshape(t.shape)

    def get_float32(self, name: str) -> np.ndarray:
        t = self.info(name)
        if t.dtype not in FLOAT_DTYPES:
            raise SafetensorsError(f"{self.path}: tensor {name} has integer dtype {t.dtype}, expected a float")
        return decode_float32(t.dtype, self.get(name))

    def close(self) -> None:
        # Views handed out keep the map alive; it then closes when the last one is freed.
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass
            self._map = None

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_file(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a file in its storage dtype (read-only views of the memory map)."""
    f = SafetensorsFile(path)
    return {name: f.get(name) for name in f.keys()}


# -- writing ------------------------------------------------------------------------------------------------
def encode(dtype: str, array: np.ndarray) -> np.ndarray:
    """An array -> its little-endian storage array for ``dtype``.

    Float arrays are rounded to BF16 / F8_E4M3 (nearest-even); uint16 arrays for BF16 and uint8 arrays for
    F8_E4M3 are taken as bit patterns already.
    """
    array = np.asarray(array)
    if dtype not in STORAGE_DTYPES:
        raise SafetensorsError(f"unknown dtype {dtype!r} (supported: {', '.join(STORAGE_DTYPES)})")
    storage = STORAGE_DTYPES[dtype]
    if dtype == "BF16" and array.dtype != np.uint16:
        return float32_to_bf16_bits(array)
    if dtype == "F8_E4M3" and array.dtype != np.uint8:
        return float32_to_e4m3(array)
    if dtype in ("BF16", "F8_E4M3"):
        return array
    if dtype.startswith("I") and not np.issubdtype(array.dtype, np.integer):
        raise SafetensorsError(f"cannot store a {array.dtype} array as {dtype}")
    return array.astype(storage, copy=False)


def save_file(path: str | Path, tensors: Mapping[str, np.ndarray], dtypes: Optional[Mapping[str, str]] = None,
              metadata: Optional[Mapping[str, str]] = None) -> int:
    """Write ``tensors`` (in the given order) to ``path``; returns the number of tensor data bytes.

    A tensor is stored as ``dtypes[name]`` when given (see ``encode``), else float32 -> F32, float16 -> F16,
    int64 -> I64, int32 -> I32.
    """
    path = Path(path)
    dtypes = dtypes or {}
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    blobs, offset = [], 0
    for name, array in tensors.items():
        array = np.asarray(array)
        dtype = dtypes.get(name) or _NATURAL_DTYPE.get(array.dtype)
        if dtype is None:
            raise SafetensorsError(f"{path}: tensor {name}: no safetensors dtype for numpy {array.dtype}; pass dtypes")
        stored = np.ascontiguousarray(encode(dtype, array))
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + stored.nbytes]}
        blobs.append(stored)
        offset += stored.nbytes
    raw_header = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw_header += b" " * (-len(raw_header) % 8)  # pad with spaces so the data starts 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw_header)))
        f.write(raw_header)
        for blob in blobs:
            f.write(blob.tobytes())
    os.replace(tmp, path)  # a new inode: maps of the previous file keep their bytes
    return offset
