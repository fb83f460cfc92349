"""Routed experts on the tensor cores: experts.py's grouped SwiGLU with bf16 activations and weights (bf16 compute).

The same plan, buffers and combine as experts.py (read it first); only the two product kernels differ:
    gate_up: act[row, i] = silu(gate_i . bf16(x_t)) * (up_i . bf16(x_t))   (row: a sorted pair, t its token)
    down:    pair_out[pair, j] = down_j . bf16(act[row])
Each product is a tf32 mma.sync m16n8k8 (numba_kernels/mma.py): bf16 values are exact in tf32 (same exponent,
fewer mantissa bits), so every product of a bf16 activation and a bf16 weight is exact and only the mma's fp32
accumulation rounds. Activations are rounded to bf16 (nearest even) as they are loaded, as the bf16 dense
products (cuBLAS) round theirs.

A warp owns 8 weight rows (the mma's n = 8; gate_up: 8 gate rows and the 8 matching up rows) and walks K in
chunks of 32 columns: lane (g, tq) (lane = 4 g + tq) loads columns 8 tq .. 8 tq + 7 of weight row g with one
16-byte load, and of the activation rows g and g + 8 of each 16-row tile of the expert's pairs. The four
mma k-steps of a chunk take those columns in a fixed permuted order (step j: logical k = tq is column
8 tq + 2 j, k = tq + 4 is 8 tq + 2 j + 1; A and B alike), so no shared memory is needed. TILES 16-row tiles
(pairs) share each weight load; an expert with more pairs takes several passes.

Batch invariance: a pair's result depends only on its activation row, the weights and the fixed K order, not on
which tile or row of a tile it sits in (every row of an mma adds its products the same way) nor on how many
pairs the expert has: s = 1 and s = 256 give a token the same bits.
Requirements: bf16 weights (uint16 / int16 bits), d and f multiples of 32, every array 16-byte aligned.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, uint32, uint64

from kdspec.numba_kernels import kernel_cache
from kdspec.numba_kernels.moe.experts import (
    ExpertPlan,
    _address,
    a_word_x8,
    load_u64x2,
    silu,
)
from kdspec.numba_kernels.mma import SIM_SCRATCH_PER_WARP, WARP, float_bits, mma_tf32
from kdspec.numba_kernels.runtime import ON_SIMULATOR, device_function, row_blocks

CHUNK = 32                               # columns per K step: 4 lanes x 8 columns
WARPS = 1 if ON_SIMULATOR else 4         # warps per block
TILES = 2 if ON_SIMULATOR else 4         # 16-row tiles of pairs sharing one weight load
ROWS_PER_BLOCK = 8 * WARPS
SCRATCH = WARPS * SIM_SCRATCH_PER_WARP if ON_SIMULATOR else 1
_DEVICE = {} if ON_SIMULATOR else dict(forceinline=True)


@device_function(**_DEVICE)
def bf16_rne_bits(x):
    """float32 x rounded to bf16 (nearest even) as tf32 operand bits (uint32, low 16 bits zero)."""
    bits = uint32(float_bits(x))
    return (bits + uint32(0x7FFF) + ((bits >> uint32(16)) & uint32(1))) & uint32(0xFFFF0000)


@device_function(**_DEVICE)
def load_activation(a, row, word, valid, out):
    """out[0..7] = tf32 bits of bf16(a row ``row``, columns 8 word .. 8 word + 7), zeros when not valid.
    a: fp32 [1, rows, cols] viewed as uint64 [1, rows, cols / 2]."""
    v0, v1, v2, v3, v4, v5, v6, v7 = a_word_x8(a, row, word)
    out[0] = bf16_rne_bits(v0) if valid else uint32(0)
    out[1] = bf16_rne_bits(v1) if valid else uint32(0)
    out[2] = bf16_rne_bits(v2) if valid else uint32(0)
    out[3] = bf16_rne_bits(v3) if valid else uint32(0)
    out[4] = bf16_rne_bits(v4) if valid else uint32(0)
    out[5] = bf16_rne_bits(v5) if valid else uint32(0)
    out[6] = bf16_rne_bits(v6) if valid else uint32(0)
    out[7] = bf16_rne_bits(v7) if valid else uint32(0)


@device_function(**_DEVICE)
def load_weights(w, expert, row, word, out):
    """out[0..7] = tf32 bits of w[expert, row, 8 word .. 8 word + 7] (bf16 viewed as uint64 [e, rows, cols/4])."""
    first, second = load_u64x2(w, expert, row, word)
    for i in range(4):
        out[i] = uint32((first >> uint64(16 * i)) & uint64(0xFFFF)) << uint32(16)
        out[4 + i] = uint32((second >> uint64(16 * i)) & uint64(0xFFFF)) << uint32(16)


@device_function(**_DEVICE)
def chunk_mma(acc, tile, x0, x1, wb, scratch):
    """acc[tile, 0..3] += the chunk's 4 mma k-steps (module docstring's column order)."""
    for j in range(4):
        d0, d1, d2, d3 = mma_tf32(x0[2 * j], x1[2 * j], x0[2 * j + 1], x1[2 * j + 1], wb[2 * j], wb[2 * j + 1],
                                  acc[tile, 0], acc[tile, 1], acc[tile, 2], acc[tile, 3], scratch)
        acc[tile, 0] = d0
        acc[tile, 1] = d1
        acc[tile, 2] = d2
        acc[tile, 3] = d3


@kernel_cache.jit
def gate_up_tc(x, w_gate_up, n_words, f, k, expert_offsets, sorted_pairs, active_experts, n_active, act):
    """act[row, i] for every sorted row of every active expert. x: fp32 [s, d] viewed as uint64 [1, s, d/2];
    w_gate_up: bf16 [e, 2f, d] viewed as uint64 [e, 2f, d/4] (n_words = d/8 words of 8 columns a row);
    act float32 [P, f]. Grid (ceil(f / ROWS_PER_BLOCK), row_blocks(max active)), WARPS * 32 threads."""
    scratch = cuda.shared.array(SCRATCH, float32)
    lane = cuda.threadIdx.x % WARP
    g, tq = lane >> 2, lane & 3
    first_row = (cuda.blockIdx.x * WARPS + cuda.threadIdx.x // WARP) * 8
    weight_row = min(first_row + g, f - 1)  # past f: a valid row, never stored
    gate = cuda.local.array((TILES, 4), float32)
    up = cuda.local.array((TILES, 4), float32)
    w_gate = cuda.local.array(8, uint32)
    w_up = cuda.local.array(8, uint32)
    x0 = cuda.local.array(8, uint32)
    x1 = cuda.local.array(8, uint32)
    for active in range(cuda.blockIdx.y, n_active[0], cuda.gridDim.y):  # block-uniform: the mma syncs a warp
        expert = active_experts[active]
        begin = expert_offsets[expert]
        end = expert_offsets[expert + 1]
        for base in range(begin, end, 16 * TILES):
            for t in range(TILES):
                for c in range(4):
                    gate[t, c] = 0.0
                    up[t, c] = 0.0
            for word in range(tq, n_words, 4):  # chunk of 32 columns: this lane's 8 of them
                load_weights(w_gate_up, expert, weight_row, word, w_gate)
                load_weights(w_gate_up, expert, f + weight_row, word, w_up)
                for t in range(TILES):
                    row0 = base + 16 * t + g
                    row1 = row0 + 8
                    load_activation(x, sorted_pairs[min(row0, end - 1)] // k, word, row0 < end, x0)
                    load_activation(x, sorted_pairs[min(row1, end - 1)] // k, word, row1 < end, x1)
                    chunk_mma(gate, t, x0, x1, w_gate, scratch)
                    chunk_mma(up, t, x0, x1, w_up, scratch)
            for t in range(TILES):
                for c in range(4):  # C fragment: c0 (g, 2tq), c1 (g, 2tq + 1), c2 (g + 8, 2tq), c3 (g + 8, 2tq + 1)
                    row = base + 16 * t + g + 8 * (c >> 1)
                    column = first_row + 2 * tq + (c & 1)
                    if row < end and column < f:
                        act[row, column] = silu(gate[t, c]) * up[t, c]


@kernel_cache.jit
def down_tc(act, w_down, n_words, expert_offsets, sorted_pairs, active_experts, n_active, pair_out):
    """pair_out[pair, j] for every sorted row of every active expert. act: fp32 [P, f] viewed as uint64
    [1, P, f/2]; w_down: bf16 [e, d, f] viewed as uint64 [e, d, f/4] (n_words = f/8); pair_out float32 [P, d].
    Grid (ceil(d / ROWS_PER_BLOCK), row_blocks(max active)), WARPS * 32 threads."""
    scratch = cuda.shared.array(SCRATCH, float32)
    d = pair_out.shape[1]
    lane = cuda.threadIdx.x % WARP
    g, tq = lane >> 2, lane & 3
    first_row = (cuda.blockIdx.x * WARPS + cuda.threadIdx.x // WARP) * 8
    weight_row = min(first_row + g, d - 1)
    acc = cuda.local.array((TILES, 4), float32)
    w_row = cuda.local.array(8, uint32)
    x0 = cuda.local.array(8, uint32)
    x1 = cuda.local.array(8, uint32)
    for active in range(cuda.blockIdx.y, n_active[0], cuda.gridDim.y):
        expert = active_experts[active]
        begin = expert_offsets[expert]
        end = expert_offsets[expert + 1]
        for base in range(begin, end, 16 * TILES):
            for t in range(TILES):
                for c in range(4):
                    acc[t, c] = 0.0
            for word in range(tq, n_words, 4):
                load_weights(w_down, expert, weight_row, word, w_row)
                for t in range(TILES):
                    row0 = base + 16 * t + g
                    row1 = row0 + 8
                    load_activation(act, min(row0, end - 1), word, row0 < end, x0)
                    load_activation(act, min(row1, end - 1), word, row1 < end, x1)
                    chunk_mma(acc, t, x0, x1, w_row, scratch)
            for t in range(TILES):
                for c in range(4):
                    row = base + 16 * t + g + 8 * (c >> 1)
                    column = first_row + 2 * tq + (c & 1)
                    if row < end and column < d:
                        pair_out[sorted_pairs[row], column] = acc[t, c]


def supports(d: int, f: int) -> bool:
    """Whether the tensor-core kernels take these dimensions (whole 32-column chunks of both products)."""
    return d % CHUNK == 0 and f % CHUNK == 0


def grouped_swiglu_tc(x, k, plan: ExpertPlan, w_gate_up, w_down, act, pair_out, stream=0):
    """experts.grouped_swiglu on the tensor cores. Arguments already checked as there, plus: bf16 weight views
    (weight_view) and d, f multiples of 32; x, act and the weights 16-byte aligned."""
    (gate_view, gate_bf16), (down_view, down_bf16) = w_gate_up, w_down
    s, d = x.shape
    f = act.shape[1]
    if not (gate_bf16 and down_bf16) or not supports(d, f):
        raise ValueError(f"tensor-core experts need bf16 weights and d, f multiples of {CHUNK} (d={d}, f={f})")
    for name, array in (("x", x), ("act", act), ("w_gate_up", gate_view), ("w_down", down_view)):
        if _address(array) % 16:
            raise ValueError(f"tensor-core experts: {name} must be 16-byte aligned")
    max_active = plan.active_experts.shape[0]
    if max_active == 0:
        return
    threads = WARPS * WARP
    gate_up_tc[(math.ceil(f / ROWS_PER_BLOCK), row_blocks(max_active)), threads, stream](
        x.view(np.uint64).reshape(1, s, d // 2), gate_view.view(np.uint64), d // 8, f, k, plan.expert_offsets,
        plan.sorted_pairs, plan.active_experts, plan.n_active, act)
    down_tc[(math.ceil(d / ROWS_PER_BLOCK), row_blocks(max_active)), threads, stream](
        act.view(np.uint64).reshape(1, act.shape[0], f // 2), down_view.view(np.uint64), f // 8, plan.expert_offsets,
        plan.sorted_pairs, plan.active_experts, plan.n_active, pair_out)
