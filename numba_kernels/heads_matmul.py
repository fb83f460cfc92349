"""Per-head products of absorbed MLA, batch-invariant: out[t, h, b] = sum_a x[t, h, a] * w[h, a, b].

The batch-invariant model's two per-head products (engine/device/model.py): q_lat = q_nope @ W_UK per head (a: the
nope dims, b: the latent) and o = o_lat @ W_UV^T per head (a: the latent, b: the value dims; W_UV stored
transposed, [h, c, v]). cuBLAS would pad them to a fixed row count like the dense products, with a strided copy
in and a transposing copy out; their weights are small (8 MB a layer at K2 sizes), so at an AR step's one row
this kernel reads them once and is done.

A block owns one head and ROWS token rows (1 for fewer than MANY_ROWS tokens, else MANY_ROWS: the same sums
either way). Thread (group g, pair p) owns columns 2p and 2p + 1 and sums, for each of its rows, x[t, h, a] *
w[h, a, b] over its group's contiguous range of a in increasing order (fp32 fma chains); the block then adds the
k_groups groups' sums in group order. The groups and ranges depend only on the weight's shape (A, B), so a row's
bits are the same at every row count and in every place of a tile.
Shapes: x float32 [s, h, A] (strided views fine); w float32 or bf16 bits (uint16 / int16) [h, A, B], B even;
out float32 [s, h, B] (C-contiguous).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32

from kdspec.numba_kernels import kernel_cache
from kdspec.numba_kernels.host_arrays import as_device_array, output, weight_view
from kdspec.numba_kernels.moe.experts import load_pair_bf16, load_pair_f32
from kdspec.numba_kernels.runtime import ON_SIMULATOR, device_function

THREADS = 16 if ON_SIMULATOR else 256  # most threads a block: column pairs x K groups
MANY_ROWS = 2 if ON_SIMULATOR else 8   # rows a block from this many tokens on (fewer: one row a block)
SUMS = 2 * MANY_ROWS                   # a thread's sums at most: two columns x its rows
PARTIAL_SUMS = SUMS * THREADS          # a block's sums, as the K groups hand them over

if ON_SIMULATOR:
    @device_function(inline=True)
    def _fma(a, b, c):
        return a * b + c
else:
    @device_function(inline=True)
    def _fma(a, b, c):
        return cuda.fma(a, b, c)


def k_groups(width_in: int, width_out: int) -> int:
    """K groups of a block for a weight [h, width_in, width_out]: as many as fit THREADS beside its column pairs,
    at most width_in (every group sums at least one a)."""
    return max(1, min(THREADS // max(1, width_out // 2), width_in))


@functools.lru_cache(maxsize=None)
def _kernel(rows: int, bf16: bool):
    """The kernel for blocks of ``rows`` rows and weights in fp32 or bf16 bits."""
    R = rows
    load_pair = load_pair_bf16 if bf16 else load_pair_f32

    @kernel_cache.jit
    def heads_matmul_kernel(x, w, groups, out):
        """x float32 [s, h, A]; w [h, A, B] (fp32, or bf16 bits as uint32 pairs [h, A, B/2]); groups: K groups;
        out float32 [s, h, B]. Grid (h, ceil(s / R)), block pairs x groups threads."""
        partial = cuda.shared.array(PARTIAL_SUMS, float32)  # [group, pair, 2R]
        acc = cuda.local.array(SUMS, float32)
        head, row0, tid = cuda.blockIdx.x, cuda.blockIdx.y * R, cuda.threadIdx.x
        tokens, width_in, pairs = x.shape[0], x.shape[2], out.shape[2] // 2
        group = tid // pairs
        pair = tid - group * pairs
        span = (width_in + groups - 1) // groups
        a_begin = group * span
        a_end = min(width_in, a_begin + span)
        for i in range(2 * R):
            acc[i] = float32(0.0)
        for a in range(a_begin, a_end):
            w_lo, w_hi = load_pair(w, head, a, pair)
            for r in range(R):
                row = row0 + r
                value = x[row, head, a] if row < tokens else float32(0.0)
                acc[2 * r] = _fma(value, w_lo, acc[2 * r])
                acc[2 * r + 1] = _fma(value, w_hi, acc[2 * r + 1])
        if groups > 1:
            for i in range(2 * R):
                partial[tid * 2 * R + i] = acc[i]
            cuda.syncthreads()  # every group's sums stored
            if group == 0:
                for i in range(2 * R):
                    total = partial[pair * 2 * R + i]
                    for g in range(1, groups):  # in group order: the same additions at every row count
                        total += partial[(g * pairs + pair) * 2 * R + i]
                    acc[i] = total
        if group == 0:
            for r in range(R):
                row = row0 + r
                if row < tokens:
                    out[row, head, 2 * pair] = acc[2 * r]
                    out[row, head, 2 * pair + 1] = acc[2 * r + 1]

    return heads_matmul_kernel


def heads_matmul(x, w, out=None, stream=0):
    """out[t, h, b] = sum_a x[t, h, a] * w[h, a, b] (device float32 [s, h, B]); see the module docstring."""
    x = as_device_array(x, "x")
    w = as_device_array(w, "w")
    if len(x.shape) != 3 or x.dtype != np.float32:
        raise ValueError(f"x must be float32 [s, h, A], got {x.dtype} {tuple(x.shape)}")
    tokens, heads, width_in = x.shape
    if len(w.shape) != 3 or w.shape[0] != heads or w.shape[1] != width_in or w.shape[2] % 2:
        raise ValueError(f"w must be [{heads}, {width_in}, B] with B even, got {tuple(w.shape)}")
    view, bf16 = weight_view(w, "w")
    width_out = w.shape[2]
    if width_out // 2 > THREADS:
        raise ValueError(f"w: {width_out} output columns, the kernel takes at most {2 * THREADS}")
    out = output(out, "out", (tokens, heads, width_out), stream)
    if tokens and heads and width_out:
        rows = MANY_ROWS if tokens >= MANY_ROWS else 1
        groups = k_groups(width_in, width_out)
        kernel = _kernel(rows, bf16)
        kernel[(heads, -(-tokens // rows)), (width_out // 2) * groups, stream](x, view, groups, out)
    return out
