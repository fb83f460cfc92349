"""The routed experts through torch's grouped GEMM (torch._grouped_mm: CUTLASS, group offsets on the device, so a
captured step can hold it): the batch-invariant bf16 model's routed experts on cuda, Hopper or newer (DeviceModel's
``grouped_experts``; BENCHMARKS.md "The grouped-GEMM experts in the model").

One MoE layer's routed experts for s tokens, k experts each, P = s*k (token, slot) pairs:

    plan_pairs (Numba)        the pairs sorted by expert, each expert's end offset            [P], [e+1]
    gather_pair_rows (Numba)  x rounded to bf16, the token's row for each pair in that order   [P, d]  bf16
    grouped GEMM              gate_up = rows @ w_gate_up[e].T per expert's rows               [P, 2f] bf16
    swiglu_rows (Numba)       silu(gate) * up in fp32, rounded to bf16                        [P, f]  bf16
    grouped GEMM              down = act @ w_down[e].T                                        [P, d]  bf16
    combine_pair_rows (Numba) y[t] (+)= sum over slots in order of weight * down[row of t*k + slot]  [s, d] fp32

Numerics: bf16 operands with fp32 accumulation as the tensor-core experts, but the grouped GEMM writes its operands'
dtype only, so gate, up and down are rounded to bf16 where experts_tc keeps fp32 (its results differ from
experts_tc's; each is its own path). Batch invariance: every step is per row, or per (row, expert) product whose
reduction order the GEMM's tile fixes whatever the group's row count, one tile at every token count (_grouped_mm;
tools/grouped_mm_probe.py checks one token alone against the same token among 256). Weights: bf16 [e, 2f, d] and
[e, d, f] in their natural layout (not experts_tc.fragment_layout). A pair with an out-of-range expert id has no
row and adds nothing (the router's ids are always in range).
"""
from __future__ import annotations

import numpy as np

from kdspec.numba_kernels.moe import experts as moe_experts
from kdspec.numba_kernels.moe import pair_rows as pair_rows_kernels

# The most pairs an expert has on average for which torch's grouped GEMM keeps the tile of a one-token step
# (its dispatch: "small" when P / e <= 128).
SMALL_TILE_ROWS = 128


def grouped_experts(ops, x, expert_ids, expert_weights, w_gate_up, w_down, *, out, accumulate: bool, stream=0):
    """y float32 [s, d] = (out if accumulate) + sum_i w_i * down_e(silu(gate_e x) * up_e x) (module docstring).
    ops: TorchOps; x float32 [s, d], expert_ids int32 [s, k], expert_weights float32 [s, k], out float32 [s, d]
    (Numba device arrays); w_gate_up [e, 2f, d] and w_down [e, d, f] bf16 bits (uint16 Numba views or bf16 torch
    tensors). Returns ``out``."""
    torch = ops.torch
    s, d = x.shape
    k = expert_ids.shape[1]
    gate_up, down = _bf16(ops, w_gate_up), _bf16(ops, w_down)
    n_experts = gate_up.shape[0]
    if s == 0:
        return out
    plan = moe_experts.plan_pairs(expert_ids, n_experts, stream=stream)
    ends = ops.torch_view(plan.expert_offsets)[1:]        # int32 [e]: each expert's last row + 1
    rows, pair_rows = pair_rows_kernels.gather_pair_rows(x, k, plan, stream=stream)
    gate_up_out = _grouped_mm(torch, _as_bf16(ops, rows), gate_up.transpose(1, 2), ends)   # [P, 2f]
    act = pair_rows_kernels.swiglu_rows(ops.device_view(gate_up_out.view(torch.int32)), plan, stream=stream)
    down_out = _grouped_mm(torch, _as_bf16(ops, act), down.transpose(1, 2), ends)          # [P, d]
    pair_rows_kernels.combine_pair_rows(ops.device_view(down_out.view(torch.int32)), pair_rows, expert_ids,
                                        expert_weights, n_experts, out=out, accumulate=accumulate, stream=stream)
    return out


def grouped_experts_supported(hidden_size: int, inner: int) -> bool:
    """Whether torch's grouped GEMM runs these experts here: torch with ``_grouped_mm``, a Hopper GPU or newer (the
    GPUs it is measured and tested on) and rows of whole 16-byte pieces (d and f multiples of 8)."""
    import torch
    return (hasattr(torch, "_grouped_mm") and torch.cuda.is_available()
            and torch.cuda.get_device_capability() >= (9, 0) and hidden_size % 8 == 0 and inner % 8 == 0)


def _grouped_mm(torch, rows, weights, ends):
    """rows bf16 [P, k] @ weights[e] bf16 [k, n] for each expert's rows (``ends`` int32 [e]: each expert's last
    row + 1), bf16 [P, n]. Torch's CUTLASS dispatch picks its tile from the rows an expert has on average (P / e):
    up to SMALL_TILE_ROWS it takes the tile that one token's step takes, above it another, whose reduction order
    need not give a row the same bits. So more pairs than that go through in chunks of SMALL_TILE_ROWS * e rows,
    each expert's rows clipped to the chunk: every row gets the one tile at every token count."""
    chunk = SMALL_TILE_ROWS * weights.shape[0]
    if rows.shape[0] <= chunk:
        return torch._grouped_mm(rows, weights, offs=ends)
    return torch.cat([torch._grouped_mm(rows[start:start + chunk], weights,
                                        offs=ends.clamp(start, start + chunk) - start)
                      for start in range(0, rows.shape[0], chunk)])


def _as_bf16(ops, words):
    """A bf16 torch view [rows, 2 * words] of a uint32 Numba array [rows, words] of bf16 pairs."""
    return ops.torch_view(words.view(np.int32)).view(ops.torch.bfloat16)


def _bf16(ops, weights):
    """A bf16 torch view of expert weights held as bf16 bits (a uint16 / int16 Numba view) or already bf16."""
    torch = ops.torch
    if isinstance(weights, torch.Tensor):
        return weights.view(torch.bfloat16)
    return ops.torch_view(weights.view(np.int16)).view(torch.bfloat16)
