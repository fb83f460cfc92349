"""MoE kernels under the CUDA simulator (toy sizes) against float64 references: router, grouped experts, SwiGLU."""
import dataclasses

import numpy as np
import pytest
from numba import cuda

from kdspec.engine.golden import layers
from kdspec.engine.golden import model as ref
from kdspec.engine.model.config import PRESETS
from kdspec.engine.model.weights import random_weights
from kdspec.numba_kernels.host_arrays import weight_view
from kdspec.numba_kernels.moe.experts import (
    DEFAULT_CONFIG,
    ExpertPlan,
    ExpertsConfig,
    moe_experts,
    plan_pairs,
    word_width,
)
from kdspec.numba_kernels.moe.router import route_experts, route_experts_from_hidden, router_options
from kdspec.numba_kernels.moe.swiglu import silu_mul, swiglu_gemv

pytestmark = pytest.mark.sim


def moe_config(e=8, k=3, n_group=1, topk_group=1, norm=True, scale=2.5, d=16, f=8):
    return dataclasses.replace(PRESETS["small"], hidden_size=d, moe_intermediate_size=f, n_routed_experts=e,
                               num_experts_per_tok=k, n_group=n_group, topk_group=topk_group,
                               norm_topk_prob=norm, routed_scaling_factor=scale)


def to_bf16_bits(a):
    """float32 -> bf16 bit patterns (uint16, truncated)."""
    return (np.ascontiguousarray(a, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def widen_bf16(bits):
    """bf16 bit patterns (uint16/int16) -> the float64 values they encode (independent of the kernels)."""
    return (bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def poisoned_route_outputs(s, k):
    return cuda.to_device(np.full((s, k), -7, np.int32)), cuda.to_device(np.full((s, k), np.nan, np.float32))


# ---------------------------------------------------------------------------------------------- router
ROUTINGS = [  # (e, k, n_group, topk_group, norm_topk_prob)
    (8, 3, 1, 1, True),
    (8, 3, 1, 1, False),
    (8, 3, 4, 2, True),
    (8, 3, 4, 2, False),
    (8, 2, 2, 1, True),
    (6, 1, 3, 3, False),
]


@pytest.mark.parametrize("e,k,n_group,topk_group,norm", ROUTINGS)
def test_router_from_logits_matches_reference(e, k, n_group, topk_group, norm):
    rng = np.random.default_rng(100 + e * 10 + k + n_group)
    cfg = moe_config(e, k, n_group, topk_group, norm)
    s = 5
    logits = rng.standard_normal((s, e)).astype(np.float32)
    bias = (0.5 * rng.standard_normal(e)).astype(np.float32)  # large enough to change the picks
    out_ids, out_weights = poisoned_route_outputs(s, k)
    ids, weights = route_experts(logits, bias, **router_options(cfg), out_ids=out_ids, out_weights=out_weights)
    ids, weights = ids.copy_to_host(), weights.copy_to_host()
    # the reference computes x @ I^T = the logits themselves, in float64
    want_ids, want_weights = layers.moe_gate(cfg, logits, np.eye(e), bias)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_weights, rtol=1e-5, atol=0)


@pytest.mark.parametrize("weight_dtype", ["float32", "bf16"])
@pytest.mark.parametrize("e,k,n_group,topk_group,norm", [ROUTINGS[0], ROUTINGS[3]])
def test_router_from_hidden_matches_reference(e, k, n_group, topk_group, norm, weight_dtype):
    rng = np.random.default_rng(7)
    cfg = moe_config(e, k, n_group, topk_group, norm, d=14)
    s, d = 4, 14
    x = rng.standard_normal((s, d)).astype(np.float32)
    gate = (rng.standard_normal((e, d)) / np.sqrt(d)).astype(np.float32)
    bias = (0.5 * rng.standard_normal(e)).astype(np.float32)
    if weight_dtype == "bf16":
        gate_dev, gate_ref = to_bf16_bits(gate), widen_bf16(to_bf16_bits(gate))
    else:
        gate_dev, gate_ref = gate, gate
    out_ids, out_weights = poisoned_route_outputs(s, k)
    ids, weights = route_experts_from_hidden(x, gate_dev, bias, **router_options(cfg), out_ids=out_ids,
                                             out_weights=out_weights)
    want_ids, want_weights = layers.moe_gate(cfg, x, gate_ref, bias)
    np.testing.assert_array_equal(ids.copy_to_host(), want_ids)
    np.testing.assert_allclose(weights.copy_to_host(), want_weights, rtol=1e-5, atol=0)


def test_router_ties_go_to_lower_index():
    e, k = 8, 3
    # token 0: all equal -> experts 0, 1, 2. token 1: experts 5 and 2 tie for best, 6 and 7 tie for third.
    logits = np.array([[0.0] * 8, [0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.5, 0.5]], np.float32)
    ids, weights = route_experts(logits, None, k=k, norm_topk_prob=True, routed_scaling_factor=1.0)
    np.testing.assert_array_equal(ids.copy_to_host(), [[0, 1, 2], [2, 5, 6]])
    np.testing.assert_allclose(weights.copy_to_host()[0], [1 / 3] * 3, rtol=1e-6)
    # groups of 2: (0,1) (2,3) (4,5) (6,7); scores 2a, 2b, 2b, 2c with a < b: groups 1 and 2 tie for the
    # single kept group -> group 1 (experts 2, 3) wins; with the bias, no expert of group 2 may appear.
    logits = np.array([[-1.0, -1.0, 0.5, 0.5, 0.5, 0.5, -2.0, -2.0]], np.float32)
    bias = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], np.float32)
    ids, _ = route_experts(logits, bias, k=2, n_group=4, topk_group=1)
    np.testing.assert_array_equal(ids.copy_to_host(), [[2, 3]])
    want_ids, _ = layers.moe_gate(moe_config(8, 2, 4, 1), logits, np.eye(8), bias)
    np.testing.assert_array_equal(want_ids, [[2, 3]])


def test_router_group_score_is_top2_sum_not_max():
    # group 0 = (0, 1) has the single best expert; group 1 = (2, 3) has the larger top-2 sum.
    logits = np.array([[3.0, -3.0, 1.0, 1.0]], np.float32)
    ids, _ = route_experts(logits, None, k=2, n_group=2, topk_group=1)
    np.testing.assert_array_equal(ids.copy_to_host(), [[2, 3]])


@pytest.mark.parametrize("kwargs,message", [
    (dict(k=9), "k=9"),
    (dict(k=2, n_group=3), "n_group=3"),
    (dict(k=2, n_group=4, topk_group=5), "topk_group=5"),
    (dict(k=5, n_group=4, topk_group=2), "exceeds"),
])
def test_router_rejects_bad_routing(kwargs, message):
    with pytest.raises(ValueError, match=message):
        route_experts(np.zeros((2, 8), np.float32), None, **kwargs)


def test_router_rejects_bad_arrays():
    with pytest.raises(ValueError, match="logits: dtype float64"):
        route_experts(np.zeros((2, 8)), None, k=2)
    with pytest.raises(ValueError, match="bias: shape"):
        route_experts(np.zeros((2, 8), np.float32), np.zeros(7, np.float32), k=2)
    with pytest.raises(ValueError, match="gate_weight: shape"):
        route_experts_from_hidden(np.zeros((2, 8), np.float32), np.zeros((4, 6), np.float32), None, k=2)


# -------------------------------------------------------------------------------------- grouped experts
def random_experts(rng, e, d, f):
    w_gate_up = (rng.standard_normal((e, 2 * f, d)) / np.sqrt(d)).astype(np.float32)
    w_down = (rng.standard_normal((e, d, f)) / np.sqrt(f)).astype(np.float32)
    return w_gate_up, w_down


def experts_reference(x, ids, weights, w_gate_up, w_down):
    """float64 loop over (token, slot) with engine.reference.swiglu; weights given as float64."""
    f = w_gate_up.shape[1] // 2
    y = np.zeros(x.shape, np.float64)
    for t in range(ids.shape[0]):
        for slot in range(ids.shape[1]):
            e = ids[t, slot]
            y[t] += weights[t, slot] * layers.swiglu(x[t:t + 1], w_gate_up[e, :f], w_gate_up[e, f:], w_down[e])[0]
    return y


def test_plan_pairs_groups_by_expert():
    rng = np.random.default_rng(3)
    e, s, k = 8, 5, 3
    ids = np.stack([rng.permutation(e)[:k] for _ in range(s)]).astype(np.int32)
    ids[:, 0] = 6  # one expert holds every token: more than one token chunk
    plan = ExpertPlan.allocate(e, s * k)
    for buffer in (plan.expert_counts, plan.expert_offsets, plan.sorted_pairs, plan.active_experts, plan.n_active):
        buffer.copy_to_device(np.full(buffer.shape, -7, np.int32))
    plan_pairs(ids, e, plan)
    flat = ids.ravel()
    counts = np.bincount(flat, minlength=e)
    np.testing.assert_array_equal(plan.expert_offsets.copy_to_host(), np.concatenate([[0], np.cumsum(counts)]))
    # brute force: pairs of expert 0 in ascending order, then expert 1, ...
    want_pairs = np.concatenate([np.flatnonzero(flat == j) for j in range(e)])
    np.testing.assert_array_equal(plan.sorted_pairs.copy_to_host(), want_pairs)
    active = np.flatnonzero(counts)
    assert plan.n_active.copy_to_host()[0] == len(active)
    np.testing.assert_array_equal(plan.active_experts.copy_to_host()[:len(active)], active)


@pytest.mark.parametrize("weight_dtype", ["float32", "uint16", "int16"])
def test_moe_experts_matches_float64_loop(weight_dtype):
    rng = np.random.default_rng(11)
    e, k, s, d, f = 8, 3, 5, 10, 6
    x = rng.standard_normal((s, d)).astype(np.float32)
    ids = np.stack([rng.permutation(e)[:k] for _ in range(s)]).astype(np.int32)
    ids[:, 1] = 4  # expert 4 takes all 5 tokens: two token chunks
    ids[ids == 7] = 0  # expert 7 unused
    assert s > DEFAULT_CONFIG.tokens_per_pass
    weights = rng.random((s, k)).astype(np.float32)
    w_gate_up, w_down = random_experts(rng, e, d, f)
    if weight_dtype == "float32":
        gate_dev, down_dev = w_gate_up, w_down
        gate_ref, down_ref = w_gate_up.astype(np.float64), w_down.astype(np.float64)
    else:
        gate_dev = to_bf16_bits(w_gate_up).view(weight_dtype)
        down_dev = to_bf16_bits(w_down).view(weight_dtype)
        gate_ref, down_ref = widen_bf16(gate_dev), widen_bf16(down_dev)
    out = cuda.to_device(np.full((s, d), np.nan, np.float32))
    y = moe_experts(x, ids, weights, gate_dev, down_dev, out=out).copy_to_host()
    assert np.isfinite(y).all()
    want = experts_reference(x.astype(np.float64), ids, weights, gate_ref, down_ref)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


# (d, f, max_word, config, word widths expected for gate_up and down). Sizes make words past the row end
# (d / vec not a multiple of lanes x unroll), rows past f or d in the last warp, and token chunks of every
# length up to tokens_per_pass; the simulator has 4 lanes.
WORD_CASES = [
    (24, 8, 8, ExpertsConfig(2, 3, 5, 2, 3), (8, 8)),
    (40, 16, 8, ExpertsConfig(1, 2, 7, 3, 4), (8, 8)),
    (32, 8, 8, ExpertsConfig(1, 2, 3, 4, 5, streaming=True), (8, 8)),
    (24, 12, 8, ExpertsConfig(1, 5, 3, 1, 2), (8, 4)),
    (20, 12, 4, ExpertsConfig(2, 2, 4, 2, 3), (4, 4)),
    (18, 10, 8, ExpertsConfig(1, 4, 6, 2, 4), (2, 2)),
    (16, 8, 2, ExpertsConfig(1, 3, 3, 3, 1), (2, 2)),
]


@pytest.mark.parametrize("d,f,max_word,config,widths", WORD_CASES, ids=lambda v: str(v) if isinstance(v, int) else None)
def test_moe_experts_word_widths_and_launch_shapes(d, f, max_word, config, widths):
    """bf16 read 8, 4 or 2 columns per load, under several launch shapes, vs the float64 loop."""
    rng = np.random.default_rng(d * 100 + f)
    e, k, s = 6, 2, 7
    config = dataclasses.replace(config, max_word=max_word)
    x = rng.standard_normal((s, d)).astype(np.float32)
    ids = np.stack([rng.permutation(e)[:k] for _ in range(s)]).astype(np.int32)
    ids[:, 0] = np.array([0, 0, 0, 0, 0, 1, 1])  # expert 0: 5 tokens, expert 1: 2 tokens, then 1-2 each
    ids[:, 1] = np.array([2, 3, 3, 3, 4, 5, 5])
    weights = rng.random((s, k)).astype(np.float32)
    w_gate_up, w_down = random_experts(rng, e, d, f)
    gate_dev, down_dev = to_bf16_bits(w_gate_up), to_bf16_bits(w_down)
    act_like = np.zeros((s * k, f), np.float32)
    assert (word_width(weight_view(cuda.to_device(gate_dev), "g"), cuda.to_device(x), config),
            word_width(weight_view(cuda.to_device(down_dev), "d"), cuda.to_device(act_like), config)) == widths
    out = cuda.to_device(np.full((s, d), np.nan, np.float32))
    y = moe_experts(x, ids, weights, gate_dev, down_dev, out=out, config=config).copy_to_host()
    assert np.isfinite(y).all(), "output not fully written"
    want = experts_reference(x.astype(np.float64), ids, weights, widen_bf16(gate_dev), widen_bf16(down_dev))
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("kwargs", [dict(unroll=5), dict(unroll=0), dict(tokens_per_pass=17),
                                    dict(max_word=16), dict(warps_per_block=0)])
def test_experts_config_rejects_bad_shapes(kwargs):
    shape = dict(warps_per_block=2, gate_rows_per_warp=2, down_rows_per_warp=2, unroll=2, tokens_per_pass=2)
    with pytest.raises(ValueError, match="ExpertsConfig"):
        ExpertsConfig(**{**shape, **kwargs})


def test_moe_experts_fp32_weights_with_a_gpu_like_shape():
    """fp32 weights (one column a load) with several tokens a pass and unrolled words."""
    rng = np.random.default_rng(13)
    e, k, s, d, f = 4, 2, 5, 10, 6
    x = rng.standard_normal((s, d)).astype(np.float32)
    ids = np.array([[0, 1], [0, 2], [0, 1], [3, 0], [2, 0]], np.int32)
    weights = rng.random((s, k)).astype(np.float32)
    w_gate_up, w_down = random_experts(rng, e, d, f)
    out = cuda.to_device(np.full((s, d), np.nan, np.float32))
    y = moe_experts(x, ids, weights, w_gate_up, w_down, out=out, config=ExpertsConfig(2, 2, 3, 3, 4)).copy_to_host()
    want = experts_reference(x.astype(np.float64), ids, weights, w_gate_up.astype(np.float64),
                             w_down.astype(np.float64))
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_moe_experts_reuses_buffers_across_calls():
    """Two calls of the same sizes (cached plan and buffers) with different routing: both right."""
    rng = np.random.default_rng(14)
    e, k, s, d, f = 5, 2, 3, 8, 4
    w_gate_up, w_down = random_experts(rng, e, d, f)
    for _ in range(2):
        x = rng.standard_normal((s, d)).astype(np.float32)
        ids = np.stack([rng.permutation(e)[:k] for _ in range(s)]).astype(np.int32)
        weights = rng.random((s, k)).astype(np.float32)
        y = moe_experts(x, ids, weights, w_gate_up, w_down, out=cuda.to_device(np.full((s, d), np.nan, np.float32)))
        want = experts_reference(x.astype(np.float64), ids, weights, w_gate_up.astype(np.float64),
                                 w_down.astype(np.float64))
        np.testing.assert_allclose(y.copy_to_host(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_moe_experts_accumulates_into_out():
    rng = np.random.default_rng(12)
    e, k, s, d, f = 4, 2, 3, 8, 4
    x = rng.standard_normal((s, d)).astype(np.float32)
    ids = np.array([[0, 3], [3, 1], [1, 0]], np.int32)
    weights = rng.random((s, k)).astype(np.float32)
    w_gate_up, w_down = random_experts(rng, e, d, f)
    base = rng.standard_normal((s, d)).astype(np.float32)
    out = cuda.to_device(base)
    moe_experts(x, ids, weights, w_gate_up, w_down, out=out, accumulate=True)
    want = base + experts_reference(x.astype(np.float64), ids, weights, w_gate_up.astype(np.float64),
                                    w_down.astype(np.float64))
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_moe_experts_rejects_bad_arrays():
    x = np.zeros((2, 8), np.float32)
    ids = np.zeros((2, 2), np.int32)
    weights = np.zeros((2, 2), np.float32)
    w_gate_up, w_down = np.zeros((4, 8, 8), np.float32), np.zeros((4, 8, 4), np.float32)
    with pytest.raises(ValueError, match="expert_ids: dtype int64"):
        moe_experts(x, ids.astype(np.int64), weights, w_gate_up, w_down)
    with pytest.raises(ValueError, match="w_down: shape"):
        moe_experts(x, ids, weights, w_gate_up, w_down[:, :, :3])
    with pytest.raises(ValueError, match="w_gate_up: dtype float64"):
        moe_experts(x, ids, weights, w_gate_up.astype(np.float64), w_down)
    with pytest.raises(ValueError, match="must be even"):
        moe_experts(np.zeros((2, 7), np.float32), ids, weights, np.zeros((4, 8, 7), np.float32),
                    np.zeros((4, 7, 4), np.float32))
    with pytest.raises(ValueError, match="accumulate"):
        moe_experts(x, ids, weights, w_gate_up, w_down, accumulate=True)
    with pytest.raises(ValueError, match="x: must be C-contiguous"):
        moe_experts(cuda.to_device(np.zeros((2, 16), np.float32))[:, ::2], ids, weights, w_gate_up, w_down)


# ------------------------------------------------------------------------------------------------ SwiGLU
def test_silu_mul_matches_float64():
    rng = np.random.default_rng(5)
    gate_up = (3 * rng.standard_normal((3, 10))).astype(np.float32)
    out = cuda.to_device(np.full((3, 5), np.nan, np.float32))
    got = silu_mul(gate_up, out=out).copy_to_host()
    g, u = gate_up[:, :5].astype(np.float64), gate_up[:, 5:].astype(np.float64)
    np.testing.assert_allclose(got, g / (1 + np.exp(-g)) * u, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("weight_dtype", ["float32", "uint16"])
def test_swiglu_gemv_matches_reference(weight_dtype):
    rng = np.random.default_rng(6)
    s, d, f = 5, 12, 8
    x = rng.standard_normal((s, d)).astype(np.float32)
    w_gate_up, w_down = (w[0] for w in random_experts(rng, 1, d, f))
    if weight_dtype == "float32":
        gate_dev, down_dev, gate_ref, down_ref = w_gate_up, w_down, w_gate_up, w_down
    else:
        gate_dev, down_dev = to_bf16_bits(w_gate_up), to_bf16_bits(w_down)
        gate_ref, down_ref = widen_bf16(gate_dev), widen_bf16(down_dev)
    out = cuda.to_device(np.full((s, d), np.nan, np.float32))
    got = swiglu_gemv(x, gate_dev, down_dev, out=out).copy_to_host()
    want = layers.swiglu(x, gate_ref[:f], gate_ref[f:], down_ref)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


# ----------------------------------------------------------------------------------- whole MoE layer
def test_moe_layer_matches_reference_moe():
    """Router + grouped experts + shared expert (swiglu_gemv) = engine.reference.moe on a seeded layer."""
    cfg = dataclasses.replace(moe_config(8, 3, 4, 2, norm=True, d=16, f=8), n_shared_experts=1)
    lw = ref.layer_weights(random_weights(cfg, seed=4), cfg.first_k_dense_replace)
    x = np.random.default_rng(9).standard_normal((4, cfg.hidden_size)).astype(np.float32)
    f32 = lambda name: np.ascontiguousarray(lw[name], dtype=np.float32)  # noqa: E731
    experts = range(cfg.n_routed_experts)
    w_gate_up = np.stack([np.concatenate([f32(f"mlp.experts.{j}.gate_proj.weight"),
                                          f32(f"mlp.experts.{j}.up_proj.weight")]) for j in experts])
    w_down = np.stack([f32(f"mlp.experts.{j}.down_proj.weight") for j in experts])
    shared_gate_up = np.concatenate([f32("mlp.shared_experts.gate_proj.weight"),
                                     f32("mlp.shared_experts.up_proj.weight")])
    ids, weights = route_experts_from_hidden(x, f32("mlp.gate.weight"), f32("mlp.gate.e_score_correction_bias"),
                                             **router_options(cfg))
    y = swiglu_gemv(x, shared_gate_up, f32("mlp.shared_experts.down_proj.weight"))
    moe_experts(x, ids, weights, w_gate_up, w_down, out=y, accumulate=True)
    want = ref.moe(cfg, x, {name: np.asarray(w, np.float64) for name, w in lw.items()})
    np.testing.assert_allclose(y.copy_to_host(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
