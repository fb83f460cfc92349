"""RMSNorm, plain and fused with the residual add: one thread block per token row (grid-stride: the
simulator runs one block over all rows, numba_kernels.runtime.row_blocks).

out[i] = x[i] / sqrt(mean_j x[i, j]^2 + eps) * w, all in float32; the sum of squares is a block tree
reduction (numba_kernels.reductions.block_sum) of per-thread fp32 partial sums.
Dimension letters: s tokens, d width (hidden size, q_lora_rank or kv_lora_rank).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from kdspec.numba_kernels import kernel_cache
from kdspec.numba_kernels.host_arrays import as_device_array, is_device_array
from kdspec.numba_kernels.reductions import block_sum
from kdspec.numba_kernels.runtime import ON_SIMULATOR, device_function, row_blocks

NORM_THREADS = 4 if ON_SIMULATOR else 1024  # power of two (block_sum)
# Row elements a thread keeps in registers (columns tid + NORM_THREADS k): a row of up to NORM_THREADS x ROW_REGS
# (8192 on a GPU) is read once, all its loads (and the weight's) issued before the reduction, so that at s = 1,
# where one block streams a whole row, a norm costs one load latency, not a chain of them. Wider rows read the
# rest in a loop. The sum of squares runs over a thread's columns in increasing order either way.
ROW_REGS = 2 if ON_SIMULATOR else 8
COMPILE_OPTIONS = {} if ON_SIMULATOR else dict(launch_bounds=(NORM_THREADS, 1))


@device_function(inline=True)
def inverse_rms(row_sum_squares, width, eps):
    return float32(1.0) / math.sqrt(row_sum_squares / float32(width) + eps)


@kernel_cache.jit(**COMPILE_OPTIONS)
def rms_norm_kernel(x, weight, eps, out):
    """x float32 [s, d]; weight float32 [d]; eps float32; out float32 [s, d] (may alias x).
    Grid (row_blocks(s),): block b does rows b, b + gridDim, ..."""
    scratch = cuda.shared.array(NORM_THREADS, float32)
    kept = cuda.local.array(ROW_REGS, float32)
    kept_weight = cuda.local.array(ROW_REGS, float32)
    width, step, tid = x.shape[1], cuda.blockDim.x, cuda.threadIdx.x
    for row in range(cuda.blockIdx.x, x.shape[0], cuda.gridDim.x):  # block-uniform: block_sum may sync
        for k in range(ROW_REGS):  # constant trip count: unrolled, the loads issued together
            j = tid + k * step
            kept[k] = x[row, j] if j < width else float32(0.0)
            kept_weight[k] = weight[j] if j < width else float32(0.0)
        partial = float32(0.0)
        for k in range(ROW_REGS):
            partial += kept[k] * kept[k]
        for j in range(tid + ROW_REGS * step, width, step):
            partial += x[row, j] * x[row, j]
        inv = inverse_rms(block_sum(partial, scratch), width, eps)  # block_sum syncs: x read before out written
        for k in range(ROW_REGS):
            j = tid + k * step
            if j < width:
                out[row, j] = kept[k] * inv * kept_weight[k]
        for j in range(tid + ROW_REGS * step, width, step):
            out[row, j] = x[row, j] * inv * weight[j]


@kernel_cache.jit(**COMPILE_OPTIONS)
def add_rms_norm_kernel(x, residual, weight, eps, out):
    """residual += x, then out = rms_norm(residual) * weight. x, residual, out float32 [s, d];
    grid (row_blocks(s),), grid-stride over rows."""
    scratch = cuda.shared.array(NORM_THREADS, float32)
    kept = cuda.local.array(ROW_REGS, float32)
    kept_weight = cuda.local.array(ROW_REGS, float32)
    width, step, tid = x.shape[1], cuda.blockDim.x, cuda.threadIdx.x
    for row in range(cuda.blockIdx.x, x.shape[0], cuda.gridDim.x):
        for k in range(ROW_REGS):
            j = tid + k * step
            kept[k] = residual[row, j] + x[row, j] if j < width else float32(0.0)
            kept_weight[k] = weight[j] if j < width else float32(0.0)
        partial = float32(0.0)
        for k in range(ROW_REGS):
            j = tid + k * step
            if j < width:
                residual[row, j] = kept[k]
            partial += kept[k] * kept[k]
        for j in range(tid + ROW_REGS * step, width, step):
            value = residual[row, j] + x[row, j]
            residual[row, j] = value  # each thread re-reads only its own columns below
            partial += value * value
        inv = inverse_rms(block_sum(partial, scratch), width, eps)
        for k in range(ROW_REGS):
            j = tid + k * step
            if j < width:
                out[row, j] = kept[k] * inv * kept_weight[k]
        for j in range(tid + ROW_REGS * step, width, step):
            out[row, j] = residual[row, j] * inv * weight[j]


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
        rms_norm_kernel[row_blocks(x.shape[0]), NORM_THREADS, stream](x, weight, np.float32(eps), out)
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
        add_rms_norm_kernel[row_blocks(x.shape[0]), NORM_THREADS, stream](x, residual, weight, np.float32(eps), out)
    return out
