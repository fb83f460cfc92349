"""MoE router (noaux_tc, sigmoid scores) in one kernel launch: one block per token (grid-stride over
tokens: the simulator runs one block, numba_kernels.runtime.row_blocks).

For token t with router logits l [e] (x @ Wg^T):
  score = sigmoid(l); biased = score + e_score_correction_bias
  n_group > 1: group score = sum of the group's top-2 biased scores; groups outside the topk_group best
               ones get biased = -inf (ties -> lower group index)
  expert_ids = top-k of biased (best first, ties -> lower expert index)
  expert_weights = score[expert_ids] (/ their sum when norm_topk_prob) * routed_scaling_factor
``route_experts`` takes the logits (the caller's cuBLAS GEMM); ``route_experts_from_hidden`` takes x [s, d]
and Wg [e, d] and does the gate GEMV in the same kernel (no cuBLAS needed).
For topk_method "greedy" pass bias=None and n_group=1 (``router_options`` does the latter).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32

from kdspec.numba_kernels import kernel_cache
from kdspec.numba_kernels.host_arrays import as_device_array as as_device
from kdspec.numba_kernels.host_arrays import check_array, weight_view
from kdspec.numba_kernels.moe.experts import load_pair_bf16, load_pair_f32
from kdspec.numba_kernels.reductions import block_sum
from kdspec.numba_kernels.runtime import ON_SIMULATOR, device_function, row_blocks

ROUTER_THREADS = 8 if ON_SIMULATOR else 256   # a power of two (block_sum)
MAX_EXPERTS = 1024                             # shared-memory capacity of one block
NEG_INF = -math.inf


def router_options(cfg) -> dict:
    """Keyword arguments of the launchers from a ModelConfig (greedy routing: no groups)."""
    greedy = cfg.topk_method == "greedy"
    return dict(k=cfg.num_experts_per_tok, n_group=1 if greedy else cfg.n_group,
                topk_group=1 if greedy else cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
                routed_scaling_factor=cfg.routed_scaling_factor)


@device_function()
def _select_experts(token, score, biased, n_experts, n_group, topk_group, norm, scale, group_scores, expert_ids,
                    expert_weights):
    """Group mask, top-k and weights for one token from shared score/biased [e] (dropped groups' biased set to
    -inf). Called by every thread of the block after score and biased are stored and synchronised."""
    tid = cuda.threadIdx.x
    width = cuda.blockDim.x
    k = expert_ids.shape[1]
    if n_group > 1:
        group_size = n_experts // n_group
        for g in range(tid, n_group, width):
            top1 = float32(NEG_INF)
            top2 = float32(NEG_INF)
            for j in range(g * group_size, (g + 1) * group_size):
                value = biased[j]
                if value > top1:
                    top2 = top1
                    top1 = value
                elif value > top2:
                    top2 = value
            group_scores[g] = top1 + top2
        cuda.syncthreads()  # every group score is stored before the ranking reads them
        for g in range(tid, n_group, width):
            mine = group_scores[g]
            rank = 0
            for h in range(n_group):
                other = group_scores[h]
                if other > mine or (other == mine and h < g):
                    rank += 1
            if rank >= topk_group:
                for j in range(g * group_size, (g + 1) * group_size):
                    biased[j] = NEG_INF
        cuda.syncthreads()  # dropped groups are masked before the top-k scans
    # Top-k by rank: an expert's rank is the number of experts before it (a higher biased score, or the same one
    # at a lower index), and those of rank < k fill the slots in rank order. These are the picks of k rounds of
    # argmax with ties to the lower index, without a block reduction (and its syncs) per slot. An expert at -inf
    # (a dropped group; NaN counts as -inf) is no pick: its slot gets -1, as a round finding no candidate would.
    for j in range(tid, n_experts, width):
        mine = biased[j] if biased[j] == biased[j] else float32(NEG_INF)
        rank = 0
        for other_j in range(n_experts):
            other = biased[other_j] if biased[other_j] == biased[other_j] else float32(NEG_INF)
            if other > mine or (other == mine and other_j < j):
                rank += 1
        if rank < k:
            expert_ids[token, rank] = int32(j) if mine > NEG_INF else int32(-1)
    cuda.syncthreads()  # every slot written before thread 0 reads them
    if tid == 0:
        total = float32(0.0)
        for slot in range(k):
            j = expert_ids[token, slot]
            total += score[j] if j >= 0 else float32(0.0)
        for slot in range(k):
            j = expert_ids[token, slot]
            weight = score[j] if j >= 0 else float32(0.0)
            if norm:
                weight = weight / total
            expert_weights[token, slot] = weight * scale


@device_function()
def _store_score(j, logit, bias, has_bias, score, biased):
    value = float32(1.0) / (float32(1.0) + math.exp(-logit))
    score[j] = value
    biased[j] = value + bias[j] if has_bias else value


@kernel_cache.jit
def _route_from_logits(logits, bias, has_bias, n_group, topk_group, norm, scale, expert_ids, expert_weights):
    """logits float32 [s, e]; bias float32 [e] (ignored unless has_bias) -> expert_ids int32 [s, k],
    expert_weights float32 [s, k]. Grid: row_blocks(s) blocks, grid-stride over tokens."""
    score = cuda.shared.array(MAX_EXPERTS, float32)
    biased = cuda.shared.array(MAX_EXPERTS, float32)
    group_scores = cuda.shared.array(MAX_EXPERTS, float32)
    n_experts = logits.shape[1]
    for token in range(cuda.blockIdx.x, logits.shape[0], cuda.gridDim.x):  # block-uniform: syncs inside
        for j in range(cuda.threadIdx.x, n_experts, cuda.blockDim.x):
            _store_score(j, logits[token, j], bias, has_bias, score, biased)
        cuda.syncthreads()  # all scores stored before selection reads them
        _select_experts(token, score, biased, n_experts, n_group, topk_group, norm, scale, group_scores, expert_ids,
                        expert_weights)
        cuda.syncthreads()  # thread 0 has read this token's scores before the next token overwrites them


def _make_route_from_hidden(load_pair):
    @kernel_cache.jit
    def route_from_hidden(x, gate_weight, bias, has_bias, n_group, topk_group, norm, scale, expert_ids,
                          expert_weights):
        """x float32 [s, d]; gate_weight [1, e, d] (see load_pair); then as _route_from_logits.
        The block computes the token's e logits (one block-wide dot product each).
        Grid: row_blocks(s) blocks, grid-stride over tokens."""
        score = cuda.shared.array(MAX_EXPERTS, float32)
        biased = cuda.shared.array(MAX_EXPERTS, float32)
        group_scores = cuda.shared.array(MAX_EXPERTS, float32)
        scratch = cuda.shared.array(ROUTER_THREADS, float32)
        tid = cuda.threadIdx.x
        n_experts = gate_weight.shape[1]
        n_words = x.shape[1] // 2
        for token in range(cuda.blockIdx.x, x.shape[0], cuda.gridDim.x):  # block-uniform: syncs inside
            for j in range(n_experts):
                partial = float32(0.0)
                for word in range(tid, n_words, cuda.blockDim.x):
                    w_lo, w_hi = load_pair(gate_weight, 0, j, word)
                    partial += w_lo * x[token, 2 * word] + w_hi * x[token, 2 * word + 1]
                logit = block_sum(partial, scratch)
                if tid == 0:
                    _store_score(j, logit, bias, has_bias, score, biased)
            cuda.syncthreads()  # all scores stored before selection reads them
            _select_experts(token, score, biased, n_experts, n_group, topk_group, norm, scale, group_scores,
                            expert_ids, expert_weights)
            cuda.syncthreads()  # thread 0 has read this token's scores before the next token overwrites them
    return route_from_hidden


_route_from_hidden_f32 = _make_route_from_hidden(load_pair_f32)
_route_from_hidden_bf16 = _make_route_from_hidden(load_pair_bf16)


def _check_routing(n_experts, k, n_group, topk_group):
    if not 1 <= n_experts <= MAX_EXPERTS:
        raise ValueError(f"router: {n_experts} experts, the kernel holds 1..{MAX_EXPERTS}")
    if not 1 <= k <= n_experts:
        raise ValueError(f"router: k={k} must be in 1..{n_experts}")
    if n_group < 1 or n_experts % n_group:
        raise ValueError(f"router: n_group={n_group} must divide the {n_experts} experts")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"router: topk_group={topk_group} must be in 1..n_group ({n_group})")
    if n_group > 1 and n_experts // n_group < 2:
        raise ValueError("router: group-limited routing needs >= 2 experts per group (top-2 group score)")
    if n_group > 1 and k > topk_group * (n_experts // n_group):
        raise ValueError(f"router: k={k} exceeds the {topk_group * (n_experts // n_group)} experts of the kept groups")


def _prepare(s, n_experts, bias, k, n_group, topk_group, out_ids, out_weights, stream):
    _check_routing(n_experts, k, n_group, topk_group)
    if bias is None:
        bias = cuda.device_array(1, dtype=np.float32, stream=stream)
        has_bias = False
    else:
        bias = as_device(bias, "bias")
        check_array(bias, "bias", (n_experts,), [np.float32])
        has_bias = True
    if out_ids is None:
        out_ids = cuda.device_array((s, k), dtype=np.int32, stream=stream)
    else:
        out_ids = as_device(out_ids, "out_ids")
        check_array(out_ids, "out_ids", (s, k), [np.int32])
    if out_weights is None:
        out_weights = cuda.device_array((s, k), dtype=np.float32, stream=stream)
    else:
        out_weights = as_device(out_weights, "out_weights")
        check_array(out_weights, "out_weights", (s, k), [np.float32])
    return bias, has_bias, out_ids, out_weights


def route_experts(logits, bias, *, k, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
                  out_ids=None, out_weights=None, stream=0):
    """Route from router logits float32 [s, e] and bias float32 [e] (or None).
    Returns (expert_ids int32 [s, k], expert_weights float32 [s, k]), best expert first."""
    logits = as_device(logits, "logits")
    check_array(logits, "logits", (None, None), [np.float32])
    s, n_experts = logits.shape
    bias, has_bias, out_ids, out_weights = _prepare(s, n_experts, bias, k, n_group, topk_group, out_ids,
                                                    out_weights, stream)
    if s:
        _route_from_logits[row_blocks(s), ROUTER_THREADS, stream](
            logits, bias, has_bias, n_group, topk_group, bool(norm_topk_prob), float(routed_scaling_factor),
            out_ids, out_weights)
    return out_ids, out_weights


def route_experts_from_hidden(x, gate_weight, bias, *, k, n_group=1, topk_group=1, norm_topk_prob=True,
                              routed_scaling_factor=1.0, out_ids=None, out_weights=None, stream=0):
    """Route from hidden states x float32 [s, d] and the gate weight [e, d] (float32 or bf16 bits as
    uint16/int16; d even), the GEMV done in the kernel. Returns (expert_ids, expert_weights) as route_experts."""
    x = as_device(x, "x")
    check_array(x, "x", (None, None), [np.float32])
    s, d = x.shape
    gate_weight = as_device(gate_weight, "gate_weight")
    if len(gate_weight.shape) != 2 or gate_weight.shape[1] != d:
        raise ValueError(f"gate_weight: shape {tuple(gate_weight.shape)}, expected [e, d={d}]")
    if d % 2:
        raise ValueError(f"route_experts_from_hidden: d ({d}) must be even (weights are read in column pairs)")
    n_experts = gate_weight.shape[0]
    bias, has_bias, out_ids, out_weights = _prepare(s, n_experts, bias, k, n_group, topk_group, out_ids,
                                                    out_weights, stream)
    view, is_bf16 = weight_view(gate_weight.reshape(1, n_experts, d), "gate_weight")
    kernel = _route_from_hidden_bf16 if is_bf16 else _route_from_hidden_f32
    if s:
        kernel[row_blocks(s), ROUTER_THREADS, stream](x, view, bias, has_bias, n_group, topk_group,
                                                      bool(norm_topk_prob), float(routed_scaling_factor),
                                                      out_ids, out_weights)
    return out_ids, out_weights
