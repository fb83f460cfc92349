"""The routed experts through torch's grouped GEMM (torch._grouped_mm: CUTLASS, group offsets on the device, so a
captured step can hold it), an opt-in alternative to the Numba tensor-core experts (DeviceModel's
``grouped_experts``; issue #19, BENCHMARKS.md "a grouped-GEMM lead for the experts").

One MoE layer's routed experts for s tokens, k experts each, P = s*k (token, slot) pairs:

    plan_pairs (Numba)    the pairs sorted by expert, each expert's end offset            [P], [e+1]
    gather                x rounded to bf16, row t of each pair                            [P, d]  bf16
    grouped GEMM          gate_up = rows @ w_gate_up[e].T per expert's rows               [P, 2f] bf16
    SwiGLU                silu(gate) * up in fp32, rounded to bf16                        [P, f]  bf16
    grouped GEMM          down = act @ w_down[e].T                                        [P, d]  bf16
    scatter               pair_out[pair] = down, as fp32                                  [P, d]  fp32
    combine (Numba)       y[t] (+)= sum over slots in order of weight * pair_out[t*k + slot]  [s, d] fp32

Numerics: bf16 operands with fp32 accumulation as the tensor-core experts, but the grouped GEMM writes its operands'
dtype only, so gate, up and down are rounded to bf16 where experts_tc keeps fp32 (its results differ from
experts_tc's; each is its own path). Batch invariance: every step is per row, or per (row, expert) product whose
reduction order the GEMM's tile fixes whatever the group's row count (tools/grouped_mm_probe.py checks one
token alone against the same token among 256). Weights: bf16 [e, 2f, d] and [e, d, f] in their natural layout (not
experts_tc.fragment_layout). Expert ids must be in range (the router's always are): the plan leaves others out,
and the gather and scatter read every pair.
"""
from __future__ import annotations

import math

import numpy as np

from kdspec.numba_kernels.moe import experts as moe_experts
from kdspec.numba_kernels.runtime import row_blocks


def grouped_experts(ops, x, expert_ids, expert_weights, w_gate_up, w_down, *, out, accumulate: bool, stream=0):
    """y float32 [s, d] = (out if accumulate) + sum_i w_i * down_e(silu(gate_e x) * up_e x) (module docstring).
    ops: TorchOps; x float32 [s, d], expert_ids int32 [s, k], expert_weights float32 [s, k], out float32 [s, d]
    (Numba device arrays); w_gate_up [e, 2f, d] and w_down [e, d, f] bf16 bits (uint16 Numba views or bf16 torch
    tensors). Returns ``out``."""
    torch = ops.torch
    s, d = x.shape
    k = expert_ids.shape[1]
    gate_up, down = _bf16(ops, w_gate_up), _bf16(ops, w_down)
    n_experts, f = gate_up.shape[0], gate_up.shape[1] // 2
    if s == 0:
        return out
    plan = moe_experts.plan_pairs(expert_ids, n_experts, stream=stream)
    pairs = ops.torch_view(plan.sorted_pairs)             # int32 [P]: pair p = t*k + slot, grouped by expert
    ends = ops.torch_view(plan.expert_offsets)[1:]        # int32 [e]: each expert's last row + 1
    rows = ops.torch_view(x).to(torch.bfloat16).index_select(0, torch.div(pairs, k, rounding_mode="floor"))
    gate_up_out = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=ends)              # [P, 2f]
    act = (torch.nn.functional.silu(gate_up_out[:, :f].float()) * gate_up_out[:, f:].float()).to(torch.bfloat16)
    down_out = torch._grouped_mm(act, down.transpose(1, 2), offs=ends)                     # [P, d]
    pair_out = torch.empty((s * k, d), dtype=torch.float32, device="cuda")
    pair_out.index_copy_(0, pairs.long(), down_out.float())
    moe_experts.combine_kernel(k)[(math.ceil(d / moe_experts.COMBINE_THREADS), row_blocks(s)),
                                  moe_experts.COMBINE_THREADS, stream](
        ops.device_view(pair_out), expert_ids, expert_weights, n_experts, accumulate, out)
    return out


def _bf16(ops, weights):
    """A bf16 torch view of expert weights held as bf16 bits (a uint16 / int16 Numba view) or already bf16."""
    torch = ops.torch
    if isinstance(weights, torch.Tensor):
        return weights.view(torch.bfloat16)
    return ops.torch_view(weights.view(np.int16)).view(torch.bfloat16)
