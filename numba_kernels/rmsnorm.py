"""RMSNorm, plain and fused with the residual add: one thread block per token row (grid-stride: the
simulator runs one block over all rows, numba_kernels.runtime.row_blocks).

out[i] = x[i] / sqrt(mean_j x[i, j]^2 + eps) * w, all in float32; the sum of squares is a block tree
reduction (numba_kernels.reductions.block_sum) of per-thread fp32 partial sums.
Dimension letters: s tokens, d width (hidden size, q_lora_rank or kv_lora_rank).

At s = 1 one block streams the whole row, and the norm is bound by its instructions (the address arithmetic of
each access), not its bytes. So a thread works on quads of 4 columns, read and written in one 16-byte access
where the row allows it (``vectorized``: d a multiple of 4 and every row 16-byte aligned), and the accesses skip
Numba's negative-index wraparound (intrinsics.py); the loops are while loops. Thread t takes quads t, t +
NORM_THREADS, ...; its partial sum adds its quads' squares in increasing column order. Where the row does not
allow 16-byte accesses the other kernel reads the same quads element by element (zeros past d), so both kernels
give a row the same bits.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32

from kdspec.numba_kernels import kernel_cache
from kdspec.numba_kernels.host_arrays import as_device_array, device_address, is_device_array
from kdspec.numba_kernels.intrinsics import at2, at2_put, at2x4, at2x4_put
from kdspec.numba_kernels.reductions import block_sum
from kdspec.numba_kernels.runtime import INLINE_DEVICE, ON_SIMULATOR, device_function, row_blocks

NORM_THREADS = 4 if ON_SIMULATOR else 256  # power of two (block_sum)
QUAD = 4  # columns a thread reads in one access
# Quads a thread keeps in registers: a row of up to NORM_THREADS x ROW_QUADS x 4 columns (8192 on a GPU) is read
# once, all its loads (and the weight's) issued before the reduction, so that a norm costs one load latency, not a
# chain of them. Wider rows read the rest in a loop.
ROW_QUADS = 2 if ON_SIMULATOR else 8
KEPT = QUAD * ROW_QUADS


@device_function(inline=True)
def inverse_rms(row_sum_squares, width, eps):
    return float32(1.0) / math.sqrt(row_sum_squares / float32(width) + eps)


@device_function(inline=True)
def _quad_of_elements(a, row, column, width):
    """a[row, column .. column + 3] read one by one, zeros past width."""
    return (at2(a, row, column) if column < width else float32(0.0),
            at2(a, row, column + 1) if column + 1 < width else float32(0.0),
            at2(a, row, column + 2) if column + 2 < width else float32(0.0),
            at2(a, row, column + 3) if column + 3 < width else float32(0.0))


@device_function(inline=True)
def _put_quad_of_elements(a, row, column, width, v0, v1, v2, v3):
    at2_put(a, row, column, v0)
    if column + 1 < width:
        at2_put(a, row, column + 1, v1)
    if column + 2 < width:
        at2_put(a, row, column + 2, v2)
    if column + 3 < width:
        at2_put(a, row, column + 3, v3)


@device_function(inline=True)
def _quad_vector(a, row, column, width):
    return at2x4(a, row, column)


@device_function(inline=True)
def _put_quad_vector(a, row, column, width, v0, v1, v2, v3):
    at2x4_put(a, row, column, v0, v1, v2, v3)


@device_function(inline=True)
def _sum_squares(partial, v0, v1, v2, v3):
    partial += v0 * v0
    partial += v1 * v1
    partial += v2 * v2
    return partial + v3 * v3


@functools.lru_cache(maxsize=None)
def norm_kernels(vectorized: bool):
    """(rms_norm_kernel, add_rms_norm_kernel) with 16-byte quad accesses (vectorized) or element ones."""
    load, store = (_quad_vector, _put_quad_vector) if vectorized else (_quad_of_elements, _put_quad_of_elements)

    @device_function(**INLINE_DEVICE)
    def kept_sum_squares(kept):
        """The squares of the quads kept in registers, summed in column order."""
        partial = float32(0.0)
        for k in range(ROW_QUADS):
            partial = _sum_squares(partial, kept[4 * k], kept[4 * k + 1], kept[4 * k + 2], kept[4 * k + 3])
        return partial

    @device_function(**INLINE_DEVICE)
    def write_normed(source, weight, out, row, first, step, width, kept, kept_weight, inv):
        """out[row] = the row * inv * weight: the kept quads (source's row as read), then source's columns past them."""
        for k in range(ROW_QUADS):
            column = first + k * step
            if column < width:
                store(out, row, column, width, kept[4 * k] * inv * kept_weight[4 * k],
                      kept[4 * k + 1] * inv * kept_weight[4 * k + 1], kept[4 * k + 2] * inv * kept_weight[4 * k + 2],
                      kept[4 * k + 3] * inv * kept_weight[4 * k + 3])
        column = first + ROW_QUADS * step
        while column < width:
            v0, v1, v2, v3 = load(source, row, column, width)
            w0, w1, w2, w3 = load(weight, 0, column, width)
            store(out, row, column, width, v0 * inv * w0, v1 * inv * w1, v2 * inv * w2, v3 * inv * w3)
            column += step

    @kernel_cache.jit
    def rms_norm_kernel(x, weight, eps, out):
        """x float32 [s, d]; weight float32 [1, d]; eps float32; out float32 [s, d] (may alias x).
        Grid (row_blocks(s),), NORM_THREADS threads: block b does rows b, b + gridDim, ..."""
        scratch = cuda.shared.array(NORM_THREADS, float32)
        kept = cuda.local.array(KEPT, float32)
        kept_weight = cuda.local.array(KEPT, float32)
        width, step, first = x.shape[1], QUAD * cuda.blockDim.x, QUAD * cuda.threadIdx.x
        row = cuda.blockIdx.x
        while row < x.shape[0]:  # block-uniform: block_sum syncs
            for k in range(ROW_QUADS):  # constant trip count: unrolled, the loads issued together
                column = first + k * step
                if column < width:
                    kept[4 * k], kept[4 * k + 1], kept[4 * k + 2], kept[4 * k + 3] = load(x, row, column, width)
                    (kept_weight[4 * k], kept_weight[4 * k + 1], kept_weight[4 * k + 2],
                     kept_weight[4 * k + 3]) = load(weight, 0, column, width)
                else:
                    kept[4 * k] = kept[4 * k + 1] = kept[4 * k + 2] = kept[4 * k + 3] = float32(0.0)
            partial = kept_sum_squares(kept)
            column = first + ROW_QUADS * step
            while column < width:
                v0, v1, v2, v3 = load(x, row, column, width)
                partial = _sum_squares(partial, v0, v1, v2, v3)
                column += step
            inv = inverse_rms(block_sum(partial, scratch), width, eps)  # block_sum syncs: x read before out written
            write_normed(x, weight, out, row, first, step, width, kept, kept_weight, inv)
            row += cuda.gridDim.x

    @kernel_cache.jit
    def add_rms_norm_kernel(x, residual, weight, eps, out):
        """residual += x, then out = rms_norm(residual) * weight. x, residual, out float32 [s, d]; weight float32
        [1, d]; grid (row_blocks(s),), NORM_THREADS threads, grid-stride over rows."""
        scratch = cuda.shared.array(NORM_THREADS, float32)
        kept = cuda.local.array(KEPT, float32)
        kept_weight = cuda.local.array(KEPT, float32)
        width, step, first = x.shape[1], QUAD * cuda.blockDim.x, QUAD * cuda.threadIdx.x
        row = cuda.blockIdx.x
        while row < x.shape[0]:  # block-uniform: block_sum syncs
            for k in range(ROW_QUADS):
                column = first + k * step
                if column < width:
                    r0, r1, r2, r3 = load(residual, row, column, width)
                    x0, x1, x2, x3 = load(x, row, column, width)
                    kept[4 * k], kept[4 * k + 1], kept[4 * k + 2], kept[4 * k + 3] = r0 + x0, r1 + x1, r2 + x2, r3 + x3
                    (kept_weight[4 * k], kept_weight[4 * k + 1], kept_weight[4 * k + 2],
                     kept_weight[4 * k + 3]) = load(weight, 0, column, width)
                    store(residual, row, column, width, kept[4 * k], kept[4 * k + 1], kept[4 * k + 2],
                          kept[4 * k + 3])
                else:
                    kept[4 * k] = kept[4 * k + 1] = kept[4 * k + 2] = kept[4 * k + 3] = float32(0.0)
            partial = kept_sum_squares(kept)
            column = first + ROW_QUADS * step
            while column < width:
                r0, r1, r2, r3 = load(residual, row, column, width)
                x0, x1, x2, x3 = load(x, row, column, width)
                v0, v1, v2, v3 = r0 + x0, r1 + x1, r2 + x2, r3 + x3
                store(residual, row, column, width, v0, v1, v2, v3)  # each thread re-reads only its own columns
                partial = _sum_squares(partial, v0, v1, v2, v3)
                column += step
            inv = inverse_rms(block_sum(partial, scratch), width, eps)
            write_normed(residual, weight, out, row, first, step, width, kept, kept_weight, inv)
            row += cuda.gridDim.x

    return rms_norm_kernel, add_rms_norm_kernel


def vectorizable(*arrays) -> bool:
    """Whether every 2-D float32 array's rows start 16-byte aligned and hold whole quads (element accesses
    otherwise: the same bits)."""
    return all(a.shape[1] % QUAD == 0 and a.strides[1] == 4 and (a.shape[0] == 1 or a.strides[0] % 16 == 0)
               and device_address(a) % 16 == 0 for a in arrays)


def _check(name: str, array, shape: tuple | None = None) -> None:
    if array.dtype != np.float32:
        raise ValueError(f"{name} must be float32, got {array.dtype}")
    if shape is not None and tuple(array.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(array.shape)}")


def _check_norm_inputs(x, weight, out, eps):
    if len(x.shape) != 2:
        raise ValueError(f"x must be float32 [s, d], got shape {tuple(x.shape)}")
    _check("x", x)
    _check("weight", weight, (x.shape[1],))
    if not weight.is_c_contiguous():
        raise ValueError("weight must be contiguous")
    if out is not None:
        _check("out", out, tuple(x.shape))
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")


def rms_norm(x, weight, eps: float, out=None, stream=0):
    """RMSNorm of x float32 [s, d] with weight float32 [d] -> out float32 [s, d] (device; may be x itself)."""
    x, weight = as_device_array(x), as_device_array(weight)
    out = None if out is None else as_device_array(out)
    _check_norm_inputs(x, weight, out, eps)
    if out is None:
        out = cuda.device_array(x.shape, dtype=np.float32, stream=stream)
    if x.shape[0] > 0:
        weight = weight.reshape(1, weight.shape[0])
        kernel = norm_kernels(vectorizable(x, weight, out))[0]
        kernel[row_blocks(x.shape[0]), NORM_THREADS, stream](x, weight, np.float32(eps), out)
    return out


def add_rms_norm(x, residual, weight, eps: float, out=None, stream=0):
    """Fused pre-norm step: residual += x (in place, device float32 [s, d]); returns rms_norm(residual) * weight."""
    if not is_device_array(residual):
        raise ValueError("residual must be a device array (it is updated in place)")
    x, residual, weight = as_device_array(x), as_device_array(residual), as_device_array(weight)
    out = None if out is None else as_device_array(out)
    _check_norm_inputs(x, weight, out, eps)
    _check("residual", residual, tuple(x.shape))
    if out is None:
        out = cuda.device_array(x.shape, dtype=np.float32, stream=stream)
    if x.shape[0] > 0:
        weight = weight.reshape(1, weight.shape[0])
        kernel = norm_kernels(vectorizable(x, residual, weight, out))[1]
        kernel[row_blocks(x.shape[0]), NORM_THREADS, stream](x, residual, weight, np.float32(eps), out)
    return out
