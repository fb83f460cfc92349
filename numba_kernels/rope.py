"""YaRN rotary embedding on adjacent pairs (x[2i], x[2i+1]), in place, from precomputed cos/sin tables.

The caller uploads the tables once (the engine: the float64 reference's cos/sin, YaRN blend and mscale ratio
included, for every position < max_position_embeddings, rounded to float32) as a RopeTable; a kernel only
gathers row positions[i]. One thread per (token, head, pair). A position outside the table writes NaN
(a visible failure rather than a silent wrong rotation).
Dimension letters: s tokens, h heads, r qk_rope_head_dim (r/2 pairs), P_max table rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import cuda

from kdspec.numba_kernels import kernel_cache
from kdspec.numba_kernels.host_arrays import as_device_array, is_device_array
from kdspec.numba_kernels.runtime import ON_SIMULATOR, device_function

ROPE_THREADS = 8 if ON_SIMULATOR else 256


@dataclass(frozen=True)
class RopeTable:
    """cos, sin: device float32 [P_max, r/2] (row p = angles of position p)."""
    cos: object
    sin: object

    @property
    def max_positions(self) -> int:
        return self.cos.shape[0]

    @property
    def pairs(self) -> int:
        return self.cos.shape[1]


@device_function(inline=True)
def rotate_pair(even, odd, cos, sin):
    """(even, odd) rotated by the angle whose cos/sin are given."""
    return even * cos - odd * sin, even * sin + odd * cos


@kernel_cache.jit
def rope_heads_kernel(x, cos_table, sin_table, positions):
    """x float32 [s, h, r] (any strides), rotated in place; positions int64 [s]. Grid over s*h*(r/2)."""
    tokens, heads, pairs = x.shape[0], x.shape[1], x.shape[2] // 2
    index = cuda.grid(1)
    if index >= tokens * heads * pairs:
        return
    pair = index % pairs
    head = (index // pairs) % heads
    token = index // (pairs * heads)
    position = positions[token]
    even = x[token, head, 2 * pair]
    odd = x[token, head, 2 * pair + 1]
    if position < 0 or position >= cos_table.shape[0]:
        x[token, head, 2 * pair] = math.nan
        x[token, head, 2 * pair + 1] = math.nan
        return
    even, odd = rotate_pair(even, odd, cos_table[position, pair], sin_table[position, pair])
    x[token, head, 2 * pair] = even
    x[token, head, 2 * pair + 1] = odd


@kernel_cache.jit
def rope_rows_kernel(x, cos_table, sin_table, positions):
    """x float32 [s, r] (any strides, e.g. the k_pe columns of kv_a), rotated in place; positions int64 [s]."""
    tokens, pairs = x.shape[0], x.shape[1] // 2
    index = cuda.grid(1)
    if index >= tokens * pairs:
        return
    pair = index % pairs
    token = index // pairs
    position = positions[token]
    even = x[token, 2 * pair]
    odd = x[token, 2 * pair + 1]
    if position < 0 or position >= cos_table.shape[0]:
        x[token, 2 * pair] = math.nan
        x[token, 2 * pair + 1] = math.nan
        return
    even, odd = rotate_pair(even, odd, cos_table[position, pair], sin_table[position, pair])
    x[token, 2 * pair] = even
    x[token, 2 * pair + 1] = odd


def check_positions(positions, tokens: int, table: RopeTable):
    """positions int64 [s] -> device array; a host array is range-checked against the table here."""
    if not is_device_array(positions):
        positions = np.asarray(positions)
        if positions.dtype != np.int64 or positions.shape != (tokens,):
            raise ValueError(f"positions must be int64 [{tokens}], got {positions.dtype} {positions.shape}")
        if tokens and (positions.min() < 0 or positions.max() >= table.max_positions):
            raise ValueError(f"positions must be in 0..{table.max_positions - 1}, got {positions.min()}.."
                             f"{positions.max()}")
    positions = as_device_array(positions)
    if positions.dtype != np.int64 or tuple(positions.shape) != (tokens,):
        raise ValueError(f"positions must be int64 [{tokens}], got {positions.dtype} {tuple(positions.shape)}")
    return positions


def apply_rope(x, table: RopeTable, positions, stream=0):
    """Rotate x in place and return it: x device float32 [s, h, r] (q_pe, may be a strided view of q) or
    [s, r] (k_pe); positions int64 [s] (numpy: range-checked; device: out-of-table rows become NaN)."""
    if not is_device_array(x):
        raise ValueError("x must be a device array (RoPE is applied in place)")
    x = as_device_array(x)
    if x.dtype != np.float32 or len(x.shape) not in (2, 3) or tuple(x.shape)[-1] != 2 * table.pairs:
        raise ValueError(f"x must be float32 [s, h, {2 * table.pairs}] or [s, {2 * table.pairs}], got "
                         f"{x.dtype} {tuple(x.shape)}")
    positions = check_positions(positions, x.shape[0], table)
    work = int(np.prod(x.shape)) // 2
    if work == 0:
        return x
    blocks = (work + ROPE_THREADS - 1) // ROPE_THREADS
    kernel = rope_heads_kernel if len(x.shape) == 3 else rope_rows_kernel
    kernel[blocks, ROPE_THREADS, stream](x, table.cos, table.sin, positions)
    return x
