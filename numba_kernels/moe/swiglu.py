"""Dense SwiGLU pieces for the shared expert and the dense MLP: y = down(silu(gate x) * up x).

- ``silu_mul``: when the caller does the GEMMs (cuBLAS): gate_up [s, 2F] (x @ [gate; up]^T) -> [s, F].
- ``swiglu_gemv``: the whole FFN without cuBLAS, for small s (decode): the grouped-expert kernels of
  moe_experts.py run with one "expert" that every token picks, so each weight row is read once for all
  tokens.
Weights are stacked like the routed experts': w_gate_up [2F, d] (F gate rows, then F up rows), w_down [d, F];
fp32 or bf16 bits (uint16/int16).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from kdspec.numba_kernels import kernel_cache
from kdspec.numba_kernels.host_arrays import as_device_array as as_device
from kdspec.numba_kernels.host_arrays import check_array, output, weight_view
from kdspec.numba_kernels.moe.experts import ExpertPlan, grouped_swiglu, silu
from kdspec.numba_kernels.runtime import ON_SIMULATOR, row_blocks

SILU_MUL_THREADS = 8 if ON_SIMULATOR else 256


@kernel_cache.jit
def _silu_mul(gate_up, out):
    """out[t, i] = silu(gate_up[t, i]) * gate_up[t, F + i]. gate_up float32 [s, 2F]; out float32 [s, F].
    Grid: (ceil(F / threads), row_blocks(s)), grid-stride over tokens."""
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    width = out.shape[1]
    if i < width:
        for t in range(cuda.blockIdx.y, out.shape[0], cuda.gridDim.y):
            out[t, i] = silu(gate_up[t, i]) * gate_up[t, width + i]


def silu_mul(gate_up, *, out=None, stream=0):
    """silu(gate) * up for gate_up float32 [s, 2F] (gate columns first) -> float32 [s, F]."""
    gate_up = as_device(gate_up, "gate_up")
    check_array(gate_up, "gate_up", (None, None), [np.float32])
    s, two_f = gate_up.shape
    if two_f % 2:
        raise ValueError(f"gate_up: width {two_f} is odd, expected [s, 2F]")
    out = output(out, "out", (s, two_f // 2), stream)
    if s and two_f:
        grid = (math.ceil(two_f // 2 / SILU_MUL_THREADS), row_blocks(s))
        _silu_mul[grid, SILU_MUL_THREADS, stream](gate_up, out)
    return out


@kernel_cache.jit
def _dense_plan(expert_offsets, sorted_pairs, active_experts, n_active):
    """The plan of a dense FFN: one expert (0) holding every token in order. One block."""
    n_tokens = sorted_pairs.shape[0]
    for t in range(cuda.threadIdx.x, n_tokens, cuda.blockDim.x):
        sorted_pairs[t] = t
    if cuda.threadIdx.x == 0:
        expert_offsets[0] = 0
        expert_offsets[1] = n_tokens
        active_experts[0] = 0
        n_active[0] = 1


def swiglu_gemv(x, w_gate_up, w_down, *, out=None, stream=0):
    """Dense SwiGLU FFN without cuBLAS. x float32 [s, d]; w_gate_up [2F, d]; w_down [d, F] (fp32 or bf16
    bits as uint16/int16; d and F even) -> float32 [s, d]. Meant for small s: weights stream once per call."""
    x = as_device(x, "x")
    check_array(x, "x", (None, None), [np.float32])
    s, d = x.shape
    w_gate_up = as_device(w_gate_up, "w_gate_up")
    if len(w_gate_up.shape) != 2 or w_gate_up.shape[1] != d or w_gate_up.shape[0] % 2:
        raise ValueError(f"w_gate_up: shape {tuple(w_gate_up.shape)}, expected [2F, d={d}]")
    f = w_gate_up.shape[0] // 2
    w_down = as_device(w_down, "w_down")
    check_array(w_down, "w_down", (d, f), [np.float32, np.uint16, np.int16])
    if d % 2 or f % 2:
        raise ValueError(f"swiglu_gemv: d ({d}) and F ({f}) must be even (weights are read in column pairs)")
    y = output(out, "out", (s, d), stream)
    if s == 0:
        return y
    gate_view = weight_view(w_gate_up.reshape(1, 2 * f, d), "w_gate_up")
    down_view = weight_view(w_down.reshape(1, d, f), "w_down")
    plan = ExpertPlan.allocate(1, s, stream)
    _dense_plan[1, 32, stream](plan.expert_offsets, plan.sorted_pairs, plan.active_experts, plan.n_active)
    act = cuda.device_array((s, f), dtype=np.float32, stream=stream)
    grouped_swiglu(x, 1, plan, gate_view, down_view, act, y, stream)  # k = 1: pair t is token t, row t of y
    return y
