"""Token embedding: gather rows of the table [V, d] for token ids [s] into float32 [s, d].

The table is float32, or bf16 stored as int16/uint16 bit patterns; a bf16 value widens exactly to the
float32 whose bits are (bits << 16), so that variant writes uint32 bits into a uint32 view of the output.
An id outside 0..V-1 (possible only for ids already on the device; host ids are checked) gives a NaN row.
Dimension letters: s tokens, d hidden, V vocab.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, uint32

from kdspec.numba_kernels import kernel_cache
from kdspec.numba_kernels.host_arrays import as_device_array, is_device_array
from kdspec.numba_kernels.runtime import ON_SIMULATOR, row_blocks

EMBED_THREADS = 8 if ON_SIMULATOR else 256
QUIET_NAN_BITS = 0x7FC00000
BF16_DTYPES = (np.int16, np.uint16)


@kernel_cache.jit
def embed_float32_kernel(table, token_ids, out):
    """table float32 [V, d]; token_ids int [s]; out float32 [s, d]. Grid (row_blocks(s), ceil(d / threads)),
    grid-stride over tokens."""
    column = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if column >= out.shape[1]:
        return
    for token in range(cuda.blockIdx.x, token_ids.shape[0], cuda.gridDim.x):
        row = token_ids[token]
        if row < 0 or row >= table.shape[0]:
            out[token, column] = math.nan
        else:
            out[token, column] = table[row, column]


@kernel_cache.jit
def embed_bf16_kernel(table_bits, token_ids, out_bits):
    """table_bits int16/uint16 [V, d] (bf16 patterns); out_bits: uint32 view of the float32 [s, d] output.
    Grid as embed_float32_kernel."""
    column = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if column >= out_bits.shape[1]:
        return
    for token in range(cuda.blockIdx.x, token_ids.shape[0], cuda.gridDim.x):
        row = token_ids[token]
        if row < 0 or row >= table_bits.shape[0]:
            out_bits[token, column] = uint32(QUIET_NAN_BITS)
        else:
            # mask first: an int16 pattern sign-extends when widened
            out_bits[token, column] = (uint32(table_bits[row, column]) & uint32(0xFFFF)) << uint32(16)


def embed_tokens(table, token_ids, out=None, stream=0):
    """Rows table[token_ids] as float32 [s, d] (device). table [V, d] float32 or bf16 bits (int16/uint16);
    token_ids int32/int64 [s] (numpy: range-checked here)."""
    table = as_device_array(table)
    if len(table.shape) != 2 or not (table.dtype == np.float32 or table.dtype in BF16_DTYPES):
        raise ValueError(f"table must be [V, d] float32 or int16/uint16 bf16 bits, got {table.dtype} "
                         f"{tuple(table.shape)}")
    vocab, width = table.shape
    if not is_device_array(token_ids):
        token_ids = np.asarray(token_ids)
        if token_ids.ndim == 1 and len(token_ids) and (token_ids.min() < 0 or token_ids.max() >= vocab):
            raise ValueError(f"token ids must be in 0..{vocab - 1}, got {token_ids.min()}..{token_ids.max()}")
    token_ids = as_device_array(token_ids)
    if len(token_ids.shape) != 1 or token_ids.dtype not in (np.int32, np.int64):
        raise ValueError(f"token_ids must be int32/int64 [s], got {token_ids.dtype} {tuple(token_ids.shape)}")
    tokens = token_ids.shape[0]
    if out is None:
        out = cuda.device_array((tokens, width), dtype=np.float32, stream=stream)
    out = as_device_array(out)
    if out.dtype != np.float32 or tuple(out.shape) != (tokens, width):
        raise ValueError(f"out must be float32 [{tokens}, {width}], got {out.dtype} {tuple(out.shape)}")
    if tokens == 0 or width == 0:
        return out
    grid = (row_blocks(tokens), (width + EMBED_THREADS - 1) // EMBED_THREADS)
    if table.dtype == np.float32:
        embed_float32_kernel[grid, EMBED_THREADS, stream](table, token_ids, out)
    else:
        embed_bf16_kernel[grid, EMBED_THREADS, stream](table, token_ids, out.view(np.uint32))
    return out
