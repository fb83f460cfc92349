"""MoE kernels against float64 references: router, grouped experts, SwiGLU. Toy sizes under the CUDA simulator
(marked sim); the same checks at Kimi K2 sizes (384 experts, top-8, d 7168, f 2048, bf16 weights) on a GPU
(marked gpu), with the GPU-only checks (misaligned activations, a bandwidth report)."""
import dataclasses

import numpy as np
import pytest
from kernel_checks import by_size
from numba import cuda, float32, uint16, uint64
from numba.cuda import libdevice

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

E, K, D, F = 384, 8, 7168, 2048  # Kimi K2's routed experts


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


def choice_margins(cfg, scores, bias):
    """Per token: (gap between the k-th and (k+1)-th biased score after group masking, gap at the group
    cut), float64. Tokens with a tiny gap may legitimately route differently in fp32."""
    s, e, k = scores.shape[0], cfg.n_routed_experts, cfg.num_experts_per_tok
    choice = scores + bias
    group_gap = np.full(s, np.inf)
    if cfg.n_group > 1:
        grouped = choice.reshape(s, cfg.n_group, -1)
        group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(-1)
        ordered = -np.sort(-group_scores, axis=-1)
        if cfg.topk_group < cfg.n_group:
            group_gap = ordered[:, cfg.topk_group - 1] - ordered[:, cfg.topk_group]
        cut = ordered[:, cfg.topk_group - 1:cfg.topk_group]
        choice = np.where(np.repeat(group_scores < cut, e // cfg.n_group, axis=-1), -np.inf, choice)
    ordered = -np.sort(-choice, axis=-1)
    return ordered[:, k - 1] - ordered[:, k], group_gap


def router_inputs(size, case):
    """(cfg, x [s, d] or logits [s, e] when source is "logits", gate [e, d] or None, bias [e]). Toy case =
    (source, routing of ROUTINGS); K2 case = (source, n_group, topk_group) with 64 tokens."""
    if size == "toy":
        source, (e, k, n_group, topk_group, norm) = case
        if source == "logits":
            rng = np.random.default_rng(100 + e * 10 + k + n_group)
            cfg = moe_config(e, k, n_group, topk_group, norm)
            logits = rng.standard_normal((5, e)).astype(np.float32)
            bias = (0.5 * rng.standard_normal(e)).astype(np.float32)  # large enough to change the picks
            return cfg, logits, None, bias
        rng = np.random.default_rng(7)
        cfg = moe_config(e, k, n_group, topk_group, norm, d=14)
        s, d = 4, 14
        x = rng.standard_normal((s, d)).astype(np.float32)
        gate = (rng.standard_normal((e, d)) / np.sqrt(d)).astype(np.float32)
        bias = (0.5 * rng.standard_normal(e)).astype(np.float32)
        return cfg, x, gate, bias
    source, n_group, topk_group = case
    cfg = dataclasses.replace(PRESETS["k2-mini"], n_routed_experts=E, num_experts_per_tok=K, n_group=n_group,
                              topk_group=topk_group)
    rng = np.random.default_rng(21)
    x = rng.standard_normal((64, D)).astype(np.float32)
    gate = (rng.standard_normal((E, D)) / np.sqrt(D)).astype(np.float32)
    bias = (0.05 * rng.standard_normal(E)).astype(np.float32)
    return cfg, (x @ gate.T if source == "logits" else x), None if source == "logits" else gate, bias


@pytest.mark.parametrize("size,case", by_size(
    [("logits", routing) for routing in ROUTINGS]
    + [(source, routing) for routing in (ROUTINGS[0], ROUTINGS[3]) for source in ("hidden_f32", "hidden_bf16")],
    [(source, n_group, topk_group) for source in ("logits", "hidden_f32", "hidden_bf16")
     for n_group, topk_group in ((1, 1), (8, 4))]))
def test_router_matches_reference(size, case):
    """Routing from fp32 logits (the caller's GEMM) or from hidden states (fp32 or bf16 gate weights, the GEMV
    in the kernel) against the float64 gate. Toy routings are compared on every token; at K2 size, tokens
    whose choice is a near-tie (may legitimately differ in fp32) are left out, at most 2 of 64."""
    cfg, x, gate, bias = router_inputs(size, case)
    source, s, e, k = case[0], x.shape[0], cfg.n_routed_experts, cfg.num_experts_per_tok
    out_ids, out_weights = poisoned_route_outputs(s, k)
    options = dict(router_options(cfg), out_ids=out_ids, out_weights=out_weights)
    if source == "logits":
        route_experts(x, bias, **options)
        # the reference computes x @ I^T = the logits themselves, in float64
        want_ids, want_weights = layers.moe_gate(cfg, x, np.eye(e), bias)
        scores = layers.sigmoid(x.astype(np.float64))
    else:
        if source == "hidden_f32":
            gate_dev, gate_ref = gate, gate
        else:
            gate_dev, gate_ref = to_bf16_bits(gate), widen_bf16(to_bf16_bits(gate))
        route_experts_from_hidden(x, gate_dev, bias, **options)
        want_ids, want_weights = layers.moe_gate(cfg, x, gate_ref, bias)
        scores = layers.sigmoid(ref.linear(x, gate_ref))
    ids, weights = out_ids.copy_to_host(), out_weights.copy_to_host()
    assert (ids >= 0).all() and np.isfinite(weights).all()
    clear = np.ones(s, bool)
    if size == "k2":
        expert_gap, group_gap = choice_margins(cfg, scores, bias.astype(np.float64))
        clear = (expert_gap > 1e-5) & (group_gap > 1e-5)
        assert clear.sum() >= s - 2, "too many near-ties to test"
    np.testing.assert_array_equal(ids[clear], want_ids[clear])
    np.testing.assert_allclose(weights[clear], want_weights[clear], rtol=1e-5, atol=0)


@pytest.mark.sim
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


@pytest.mark.sim
def test_router_never_picks_a_nan_score():
    logits = np.array([[np.nan, 0.2, 1.0, 0.5], [0.3, np.nan, np.nan, 0.3]], np.float32)
    ids, _ = route_experts(logits, None, k=2, norm_topk_prob=True, routed_scaling_factor=1.0)
    np.testing.assert_array_equal(ids.copy_to_host(), [[2, 3], [0, 3]])


@pytest.mark.sim
def test_router_group_score_is_top2_sum_not_max():
    # group 0 = (0, 1) has the single best expert; group 1 = (2, 3) has the larger top-2 sum.
    logits = np.array([[3.0, -3.0, 1.0, 1.0]], np.float32)
    ids, _ = route_experts(logits, None, k=2, n_group=2, topk_group=1)
    np.testing.assert_array_equal(ids.copy_to_host(), [[2, 3]])


@pytest.mark.sim
@pytest.mark.parametrize("kwargs,message", [
    (dict(k=9), "k=9"),
    (dict(k=2, n_group=3), "n_group=3"),
    (dict(k=2, n_group=4, topk_group=5), "topk_group=5"),
    (dict(k=5, n_group=4, topk_group=2), "exceeds"),
])
def test_router_rejects_bad_routing(kwargs, message):
    with pytest.raises(ValueError, match=message):
        route_experts(np.zeros((2, 8), np.float32), None, **kwargs)


@pytest.mark.sim
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


@cuda.jit
def _fill_bf16(out, seed, amplitude):
    """out[i] = bf16 bits of a hash-uniform value in [-amplitude, amplitude); out uint16 [n]."""
    start = cuda.grid(1)
    for i in range(start, out.shape[0], cuda.gridsize(1)):
        z = uint64(i) * uint64(0x9E3779B97F4A7C15) + uint64(seed)
        z = (z ^ (z >> uint64(30))) * uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> uint64(27))) * uint64(0x94D049BB133111EB)
        z = z ^ (z >> uint64(31))
        unit = float32(z >> uint64(40)) * float32(1.0 / (1 << 24))  # [0, 1)
        value = (float32(2.0) * unit - float32(1.0)) * amplitude
        out[i] = uint16(libdevice.float_as_int(value) >> 16)


@pytest.fixture(scope="module")
def kimi_experts():
    """bf16 expert weights made on the device (34 GB): w_gate_up uint16 [E, 2F, D], w_down uint16 [E, D, F]."""
    w_gate_up = cuda.device_array((E, 2 * F, D), dtype=np.uint16)
    w_down = cuda.device_array((E, D, F), dtype=np.uint16)
    _fill_bf16[1024, 256](w_gate_up.reshape(-1), 1, np.float32(np.sqrt(3.0 / D)))
    _fill_bf16[1024, 256](w_down.reshape(-1), 2, np.float32(np.sqrt(3.0 / F)))
    cuda.synchronize()
    yield w_gate_up, w_down
    del w_gate_up, w_down


def kimi_experts_reference(x, ids, weights, tokens, w_gate_up, w_down):
    """float64 numpy y[tokens] for the selected tokens, one expert at a time (device bf16 weights copied back
    per expert)."""
    y = np.zeros((len(tokens), D))
    for expert in np.unique(ids[tokens]):
        rows, slots = np.nonzero(ids[tokens] == expert)
        gate_up = widen_bf16(w_gate_up[expert].copy_to_host())
        down = widen_bf16(w_down[expert].copy_to_host())
        xt = x[tokens][rows].astype(np.float64)
        h = layers.silu(xt @ gate_up[:F].T) * (xt @ gate_up[F:].T)
        y[rows] += weights[tokens][rows, slots][:, None] * (h @ down.T)
    return y


@pytest.mark.sim
@pytest.mark.parametrize("e, s, k", [(8, 5, 3), (4, 40, 3)])  # (4, 40, 3): ~30 pairs an expert, many per thread
def test_plan_pairs_groups_by_expert(e, s, k):
    rng = np.random.default_rng(3)
    ids = np.stack([rng.permutation(e)[:k] for _ in range(s)]).astype(np.int32)
    ids[:, 0] = 6 % e  # one expert holds every token: more than one token chunk
    plan = ExpertPlan.allocate(e, s * k)
    for buffer in (plan.expert_counts, plan.expert_offsets, plan.placed_pairs, plan.sorted_pairs,
                   plan.active_experts, plan.n_active):
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


@pytest.mark.parametrize("size,case", by_size(["float32", "uint16", "int16"], [1, 8, 64, 256]))
def test_moe_experts_matches_float64_loop(size, case, request):
    """Toy: case = the weights' dtype (fp32, bf16 bits as uint16 / int16), an expert holding every token (more
    than one token chunk) and one unused; K2: case = s tokens with random distinct top-8 routing over 384
    bf16 experts, up to 12 tokens checked (each costs its experts' 88 MB of weights on the host). A second
    launch gives the same bits."""
    if size == "toy":
        rng = np.random.default_rng(11)
        e, k, s, d, f = 8, 3, 5, 10, 6
        x = rng.standard_normal((s, d)).astype(np.float32)
        ids = np.stack([rng.permutation(e)[:k] for _ in range(s)]).astype(np.int32)
        ids[:, 1] = 4  # expert 4 takes all 5 tokens: two token chunks
        ids[ids == 7] = 0  # expert 7 unused
        assert s > DEFAULT_CONFIG.tokens_per_pass
        weights = rng.random((s, k)).astype(np.float32)
        w_gate_up, w_down = random_experts(rng, e, d, f)
        if case == "float32":
            gate_dev, down_dev = w_gate_up, w_down
            gate_ref, down_ref = w_gate_up.astype(np.float64), w_down.astype(np.float64)
        else:
            gate_dev = to_bf16_bits(w_gate_up).view(case)
            down_dev = to_bf16_bits(w_down).view(case)
            gate_ref, down_ref = widen_bf16(gate_dev), widen_bf16(down_dev)
        tokens = np.arange(s)
        want = experts_reference(x.astype(np.float64), ids, weights, gate_ref, down_ref)
    else:
        gate_dev, down_dev = request.getfixturevalue("kimi_experts")
        s, d = case, D
        rng = np.random.default_rng(s)
        x = rng.standard_normal((s, D)).astype(np.float32)
        ids = np.stack([rng.choice(E, K, replace=False) for _ in range(s)]).astype(np.int32)
        weights = rng.random((s, K)).astype(np.float32)
        tokens = np.arange(s) if s <= 12 else np.sort(rng.choice(s, 12, replace=False))
        want = kimi_experts_reference(x, ids, weights, tokens, gate_dev, down_dev)
    out = cuda.to_device(np.full((s, d), np.nan, np.float32))
    y = moe_experts(x, ids, weights, gate_dev, down_dev, out=out).copy_to_host()
    assert np.isfinite(y).all()
    if size == "toy":
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    else:
        assert np.abs(y[tokens] - want).max() <= 1e-4 * np.abs(want).max()
    again = moe_experts(x, ids, weights, gate_dev, down_dev).copy_to_host()
    np.testing.assert_array_equal(again, y)


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


def word_case_id(case):
    """d-f-max_word of a toy case, max_word of a K2 one."""
    return "-".join(str(v) for v in case[:3]) if isinstance(case, tuple) else str(case)


@pytest.mark.parametrize("size,case", by_size(WORD_CASES, [8, 4, 2], word_case_id))
def test_moe_experts_word_widths_and_launch_shapes(size, case, request):
    """bf16 read 8, 4 or 2 columns per load vs the float64 loop. Toy: case = WORD_CASES' (d, f, max_word,
    launch shape, expected widths of gate_up and down); K2: case = max_word at K2's d and f (16-byte loads the
    default there), 6 tokens over a pool of 16 experts (the host reference costs ~0.4 s an expert), expert 7
    taking 5 tokens: a chunk of 4 and one of 1 with 4 tokens a pass."""
    if size == "toy":
        d, f, max_word, config, widths = case
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
        want = experts_reference(x.astype(np.float64), ids, weights, widen_bf16(gate_dev), widen_bf16(down_dev))
    else:
        gate_dev, down_dev = request.getfixturevalue("kimi_experts")
        max_word, d = case, D
        config = dataclasses.replace(DEFAULT_CONFIG, max_word=max_word)
        rng = np.random.default_rng(100 + max_word)
        s = 6
        x = rng.standard_normal((s, D)).astype(np.float32)
        assert word_width(weight_view(gate_dev, "w_gate_up"), cuda.to_device(x), config) == max_word
        ids = np.stack([rng.choice(np.arange(8, 24), K, replace=False) for _ in range(s)]).astype(np.int32)
        ids[:5, 0] = 7
        weights = rng.random((s, K)).astype(np.float32)
        want = kimi_experts_reference(x, ids, weights, np.arange(s), gate_dev, down_dev)
    out = cuda.to_device(np.full((s, d), np.nan, np.float32))
    y = moe_experts(x, ids, weights, gate_dev, down_dev, out=out, config=config).copy_to_host()
    assert np.isfinite(y).all(), "output not fully written"
    if size == "toy":
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    else:
        assert np.abs(y - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.gpu
@pytest.mark.parametrize("offset,width", [(0, 8), (2, 4), (1, 2)])
def test_moe_experts_misaligned_x_falls_back(kimi_experts, offset, width):
    """x starting `offset` floats into its buffer (0, 8 or 4 bytes aligned): narrower words, same result (the
    simulator has no addresses to misalign)."""
    w_gate_up, w_down = kimi_experts
    rng = np.random.default_rng(200 + offset)
    s = 2
    x_host = rng.standard_normal((s, D)).astype(np.float32)
    buffer = cuda.device_array(s * D + 4, dtype=np.float32)
    x = buffer[offset:offset + s * D].reshape(s, D)
    x.copy_to_device(x_host)
    assert word_width(weight_view(w_gate_up, "w_gate_up"), x, DEFAULT_CONFIG) == width
    ids = np.stack([rng.choice(np.arange(8, 20), K, replace=False) for _ in range(s)]).astype(np.int32)
    weights = rng.random((s, K)).astype(np.float32)
    out = cuda.to_device(np.full((s, D), np.nan, np.float32))
    y = moe_experts(x, ids, weights, w_gate_up, w_down, out=out).copy_to_host()
    assert np.isfinite(y).all()
    want = kimi_experts_reference(x_host, ids, weights, np.arange(s), w_gate_up, w_down)
    assert np.abs(y - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.gpu
def test_moe_experts_bandwidth_report(kimi_experts):
    """Informative: effective bandwidth on expert weight reads at 64 tokens vs a device copy (target >= 60%)."""
    w_gate_up, w_down = kimi_experts
    rng = np.random.default_rng(0)
    s = 64
    x = cuda.to_device(rng.standard_normal((s, D)).astype(np.float32))
    ids = cuda.to_device(np.stack([rng.choice(E, K, replace=False) for _ in range(s)]).astype(np.int32))
    weights = cuda.to_device(rng.random((s, K)).astype(np.float32))
    out = cuda.device_array((s, D), dtype=np.float32)
    n_used = len(np.unique(ids.copy_to_host()))
    weight_bytes = n_used * 3 * F * D * 2

    def timed(fn, repeats=5):
        fn()
        start, stop = cuda.event(), cuda.event()
        start.record()
        for _ in range(repeats):
            fn()
        stop.record()
        stop.synchronize()
        return cuda.event_elapsed_time(start, stop) / 1e3 / repeats

    seconds = timed(lambda: moe_experts(x, ids, weights, w_gate_up, w_down, out=out))
    source = w_down.reshape(-1)[:1 << 31]  # 4 GiB
    target = cuda.device_array(source.shape, dtype=np.uint16)
    copy_seconds = timed(lambda: target.copy_to_device(source))
    moe_bw, copy_bw = weight_bytes / seconds / 1e9, 2 * source.nbytes / copy_seconds / 1e9
    print(f"\nmoe_experts s={s}: {n_used} experts, {weight_bytes / 1e9:.2f} GB in {seconds * 1e3:.3f} ms = "
          f"{moe_bw:.0f} GB/s; device copy {copy_bw:.0f} GB/s (read+write); ratio {moe_bw / copy_bw:.2f}")
    assert moe_bw > 0


@pytest.mark.sim
@pytest.mark.parametrize("kwargs", [dict(unroll=5), dict(unroll=0), dict(tokens_per_pass=17),
                                    dict(max_word=16), dict(warps_per_block=0)])
def test_experts_config_rejects_bad_shapes(kwargs):
    shape = dict(warps_per_block=2, gate_rows_per_warp=2, down_rows_per_warp=2, unroll=2, tokens_per_pass=2)
    with pytest.raises(ValueError, match="ExpertsConfig"):
        ExpertsConfig(**{**shape, **kwargs})


@pytest.mark.sim
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


@pytest.mark.sim
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


@pytest.mark.sim
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


@pytest.mark.sim
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
@pytest.mark.sim
def test_silu_mul_matches_float64():
    rng = np.random.default_rng(5)
    gate_up = (3 * rng.standard_normal((3, 10))).astype(np.float32)
    out = cuda.to_device(np.full((3, 5), np.nan, np.float32))
    got = silu_mul(gate_up, out=out).copy_to_host()
    g, u = gate_up[:, :5].astype(np.float64), gate_up[:, 5:].astype(np.float64)
    np.testing.assert_allclose(got, g / (1 + np.exp(-g)) * u, rtol=1e-6, atol=1e-7)


@pytest.mark.sim
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
@pytest.mark.sim
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
