"""The bf16 rows around the grouped GEMMs of the routed experts (engine/device/grouped_experts.py): one MoE layer's
P = s*k (token, slot) pairs in the expert order of a plan (moe/experts.plan_pairs), one row each.

- ``gather_pair_rows``: rows[p] = bf16(x[t]) for the pair t*k + slot placed at p, and pair_rows[t*k + slot] = p.
- ``swiglu_rows``: act[p] = bf16(silu(gate[p]) * up[p]) in fp32, from the first product's bf16 rows [gate | up].
- ``combine_pair_rows``: y[t] (+)= sum over slots in order of w[t, slot] * down[pair_rows[t*k + slot]] in fp32.

One kernel each where torch took three to five (conversions, index_select, a scatter into an fp32 copy), and no
[P, d] fp32 array. bf16 rows are uint32 words (column 2i in the low half, 2i + 1 in the high), so d and F are
even; rounding to bf16 is to nearest even (experts_tc.bf16_rne). Only the plan's placed rows (p < expert_offsets[e])
are written and read: a pair with an out-of-range expert id has no row and adds nothing. Every kernel works per row,
so a row's bits do not depend on how many rows share the launch (the batch invariance a verify forward needs).
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, uint32

from kdspec.numba_kernels import kernel_cache
from kdspec.numba_kernels.host_arrays import as_device_array as as_device
from kdspec.numba_kernels.host_arrays import check_array, output
from kdspec.numba_kernels.intrinsics import at, at2, at2_put, at_put
from kdspec.numba_kernels.moe.experts import ExpertPlan, bf16x2, silu
from kdspec.numba_kernels.moe.experts_tc import bf16_rne
from kdspec.numba_kernels.runtime import ON_SIMULATOR, row_blocks

ROW_THREADS = 8 if ON_SIMULATOR else 256


@kernel_cache.jit
def _gather_pair_rows(x, k, sorted_pairs, expert_offsets, rows, pair_rows):
    """rows[p, i] = bf16(x[t, 2i]) | bf16(x[t, 2i + 1]) << 16 and pair_rows[pair] = p for pair = sorted_pairs[p] =
    t*k + slot, p < expert_offsets[-1]. x float32 [s, d]; rows uint32 [P, d/2]; pair_rows int32 [P].
    Grid (ceil(d/2 / ROW_THREADS), row_blocks(P)), grid-stride over p."""
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i >= rows.shape[1]:
        return
    placed = at(expert_offsets, expert_offsets.shape[0] - 1)
    p = cuda.blockIdx.y
    while p < placed:
        pair = at(sorted_pairs, p)
        t = pair // k
        at2_put(rows, p, i, bf16_rne(at2(x, t, 2 * i)) | (bf16_rne(at2(x, t, 2 * i + 1)) << uint32(16)))
        if i == 0:
            at_put(pair_rows, pair, p)
        p += cuda.gridDim.y


@kernel_cache.jit
def _swiglu_rows(gate_up, expert_offsets, act):
    """act[p, i] = bf16(silu(g) * u) for columns 2i and 2i + 1, p < expert_offsets[-1]. gate_up uint32 [P, F] (F/2
    gate words, then F/2 up words); act uint32 [P, F/2]. Grid (ceil(F/2 / ROW_THREADS), row_blocks(P))."""
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    half = act.shape[1]
    if i >= half:
        return
    placed = at(expert_offsets, expert_offsets.shape[0] - 1)
    p = cuda.blockIdx.y
    while p < placed:
        gate_low, gate_high = bf16x2(at2(gate_up, p, i))
        up_low, up_high = bf16x2(at2(gate_up, p, half + i))
        at2_put(act, p, i, bf16_rne(silu(gate_low) * up_low) | (bf16_rne(silu(gate_high) * up_high) << uint32(16)))
        p += cuda.gridDim.y


@functools.lru_cache(maxsize=None)
def _combine_kernel(k: int):
    """The combine for k slots a token, unrolled (as moe/experts.combine_kernel: every slot's loads issued first)."""
    @kernel_cache.jit
    def combine_pair_rows(down, pair_rows, expert_ids, expert_weights, n_experts, accumulate, y):
        """y[t, 2j + h] = (y[t, 2j + h] if accumulate else 0) + sum over slots in order of w[t, slot] * half h of
        down[pair_rows[t*k + slot], j]; slots with an out-of-range expert id add nothing. down uint32 [P, d/2];
        pair_rows int32 [P]; expert_ids int32 [s, k]; expert_weights float32 [s, k]; y float32 [s, d].
        Grid (ceil(d/2 / ROW_THREADS), row_blocks(s)), grid-stride over tokens."""
        j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if j >= down.shape[1]:
            return
        t = cuda.blockIdx.y
        while t < y.shape[0]:
            low = float32(0.0)
            high = float32(0.0)
            for slot in range(k):  # constant trip count: unrolled
                expert = at2(expert_ids, t, slot)
                if 0 <= expert < n_experts:  # only placed pairs have a row
                    weight = at2(expert_weights, t, slot)
                    value_low, value_high = bf16x2(at2(down, at(pair_rows, t * k + slot), j))
                    low = low + weight * value_low
                    high = high + weight * value_high
            if accumulate:
                low = at2(y, t, 2 * j) + low
                high = at2(y, t, 2 * j + 1) + high
            at2_put(y, t, 2 * j, low)
            at2_put(y, t, 2 * j + 1, high)
            t += cuda.gridDim.y
    return combine_pair_rows


def _words(array, name, rows, words):
    """``array`` on the device, checked as uint32 [rows, words] (bf16 pairs); int32 bits are viewed as uint32."""
    array = as_device(array, name)
    if np.dtype(array.dtype) == np.int32:
        array = array.view(np.uint32)
    check_array(array, name, (rows, words), [np.uint32])
    return array


def _check_plan(plan: ExpertPlan, n_pairs: int):
    if plan.sorted_pairs.shape[0] != n_pairs:
        raise ValueError(f"plan: sized for {plan.sorted_pairs.shape[0]} pairs, need {n_pairs}")


def gather_pair_rows(x, k: int, plan: ExpertPlan, *, rows=None, pair_rows=None, stream=0):
    """The plan's pairs as bf16 rows in expert order. x float32 [s, d] (d even); plan from plan_pairs over int32
    [s, k] ids -> (rows uint32 [s*k, d/2], pair_rows int32 [s*k]): see the module docstring."""
    x = as_device(x, "x")
    check_array(x, "x", (None, None), [np.float32])
    s, d = x.shape
    if d % 2:
        raise ValueError(f"x: width {d} is odd (bf16 rows are column pairs)")
    n_pairs = s * k
    _check_plan(plan, n_pairs)
    rows = cuda.device_array((n_pairs, d // 2), np.uint32, stream=stream) if rows is None \
        else _words(rows, "rows", n_pairs, d // 2)
    if pair_rows is None:
        pair_rows = cuda.device_array(n_pairs, np.int32, stream=stream)
    else:
        pair_rows = as_device(pair_rows, "pair_rows")
        check_array(pair_rows, "pair_rows", (n_pairs,), [np.int32])
    if n_pairs and d:
        _gather_pair_rows[(math.ceil(d // 2 / ROW_THREADS), row_blocks(n_pairs)), ROW_THREADS, stream](
            x, k, plan.sorted_pairs, plan.expert_offsets, rows, pair_rows)
    return rows, pair_rows


def swiglu_rows(gate_up, plan: ExpertPlan, *, out=None, stream=0):
    """bf16(silu(gate) * up) of the first grouped product's rows. gate_up uint32 (or int32 bits) [P, F] = bf16
    [P, 2F] (gate columns first; F even) -> uint32 [P, F/2] = bf16 [P, F]."""
    gate_up = as_device(gate_up, "gate_up")
    if len(gate_up.shape) != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up: shape {tuple(gate_up.shape)}, expected bf16 pairs [P, F] with F even")
    n_pairs, half = gate_up.shape[0], gate_up.shape[1] // 2
    gate_up = _words(gate_up, "gate_up", n_pairs, 2 * half)
    _check_plan(plan, n_pairs)
    act = cuda.device_array((n_pairs, half), np.uint32, stream=stream) if out is None \
        else _words(out, "out", n_pairs, half)
    if n_pairs and half:
        _swiglu_rows[(math.ceil(half / ROW_THREADS), row_blocks(n_pairs)), ROW_THREADS, stream](
            gate_up, plan.expert_offsets, act)
    return act


def combine_pair_rows(down, pair_rows, expert_ids, expert_weights, n_experts: int, *, out=None,
                      accumulate: bool = False, stream=0):
    """y float32 [s, d] (+)= the weighted sum of each token's rows of ``down`` (uint32 or int32 bits [s*k, d/2] =
    bf16 [s*k, d], rows in the order gather_pair_rows placed them); expert_ids int32 [s, k], expert_weights
    float32 [s, k]. ``accumulate`` adds to ``out`` (which must then be given)."""
    expert_ids = as_device(expert_ids, "expert_ids")
    check_array(expert_ids, "expert_ids", (None, None), [np.int32])
    s, k = expert_ids.shape
    expert_weights = as_device(expert_weights, "expert_weights")
    check_array(expert_weights, "expert_weights", (s, k), [np.float32])
    down = as_device(down, "down")
    if len(down.shape) != 2:
        raise ValueError(f"down: shape {tuple(down.shape)}, expected bf16 pairs [s*k, d/2]")
    words = down.shape[1]
    down = _words(down, "down", s * k, words)
    pair_rows = as_device(pair_rows, "pair_rows")
    check_array(pair_rows, "pair_rows", (s * k,), [np.int32])
    if accumulate and out is None:
        raise ValueError("accumulate needs out")
    y = output(out, "out", (s, 2 * words), stream)
    if s and words:
        _combine_kernel(k)[(math.ceil(words / ROW_THREADS), row_blocks(s)), ROW_THREADS, stream](
            down, pair_rows, expert_ids, expert_weights, n_experts, accumulate, y)
    return y
