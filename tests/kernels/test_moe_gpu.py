"""MoE kernels on a real GPU at Kimi K2 sizes (384 experts, top-8, d 7168, f 2048, bf16 weights) vs float64 numpy."""
import dataclasses

import numpy as np
import pytest
from numba import cuda, float32, uint16, uint64
from numba.cuda import libdevice

from kdspec.engine.golden import layers
from kdspec.engine.golden import model as ref
from kdspec.engine.model.config import PRESETS
from kdspec.numba_kernels.host_arrays import weight_view
from kdspec.numba_kernels.moe.experts import DEFAULT_CONFIG, moe_experts, word_width
from kdspec.numba_kernels.moe.router import route_experts, route_experts_from_hidden, router_options

pytestmark = pytest.mark.gpu

E, K, D, F = 384, 8, 7168, 2048


def to_bf16_bits(a):
    return (np.ascontiguousarray(a, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def widen_bf16(bits):
    """bf16 bits -> float64 values, independently of the kernels."""
    return (bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


# ---------------------------------------------------------------------------------------------- router
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


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (8, 4)])
@pytest.mark.parametrize("source", ["logits", "hidden_f32", "hidden_bf16"])
def test_router_kimi_size(n_group, topk_group, source):
    cfg = dataclasses.replace(PRESETS["k2-mini"], n_routed_experts=E, num_experts_per_tok=K, n_group=n_group,
                              topk_group=topk_group)
    rng = np.random.default_rng(21)
    s = 64
    x = rng.standard_normal((s, D)).astype(np.float32)
    gate = (rng.standard_normal((E, D)) / np.sqrt(D)).astype(np.float32)
    bias = (0.05 * rng.standard_normal(E)).astype(np.float32)
    out_ids = cuda.to_device(np.full((s, K), -7, np.int32))
    out_weights = cuda.to_device(np.full((s, K), np.nan, np.float32))
    options = dict(router_options(cfg), out_ids=out_ids, out_weights=out_weights)
    if source == "logits":
        logits = x @ gate.T  # fp32 logits given to both sides
        route_experts(logits, bias, **options)
        want_ids, want_weights = layers.moe_gate(cfg, logits, np.eye(E), bias)
        scores = layers.sigmoid(logits.astype(np.float64))
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
    expert_gap, group_gap = choice_margins(cfg, scores, bias.astype(np.float64))
    clear = (expert_gap > 1e-5) & (group_gap > 1e-5)
    assert clear.sum() >= s - 2, "too many near-ties to test"
    np.testing.assert_array_equal(ids[clear], want_ids[clear])
    np.testing.assert_allclose(weights[clear], want_weights[clear], rtol=1e-5, atol=0)


# -------------------------------------------------------------------------------------- grouped experts
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


def experts_reference(x, ids, weights, tokens, w_gate_up, w_down):
    """float64 numpy y[tokens] for the selected tokens, one expert at a time (weights copied back per expert)."""
    y = np.zeros((len(tokens), D))
    for expert in np.unique(ids[tokens]):
        rows, slots = np.nonzero(ids[tokens] == expert)
        gate_up = widen_bf16(w_gate_up[expert].copy_to_host())
        down = widen_bf16(w_down[expert].copy_to_host())
        xt = x[tokens][rows].astype(np.float64)
        h = layers.silu(xt @ gate_up[:F].T) * (xt @ gate_up[F:].T)
        y[rows] += weights[tokens][rows, slots][:, None] * (h @ down.T)
    return y


@pytest.mark.parametrize("s", [1, 8, 64, 256])
def test_moe_experts_kimi_size(kimi_experts, s):
    w_gate_up, w_down = kimi_experts
    rng = np.random.default_rng(s)
    x = rng.standard_normal((s, D)).astype(np.float32)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(s)]).astype(np.int32)
    weights = rng.random((s, K)).astype(np.float32)
    out = cuda.to_device(np.full((s, D), np.nan, np.float32))
    y = moe_experts(x, ids, weights, w_gate_up, w_down, out=out).copy_to_host()
    assert np.isfinite(y).all()
    # float64 numpy on up to 12 tokens (each costs its experts' 88 MB of weights on the host)
    tokens = np.arange(s) if s <= 12 else np.sort(rng.choice(s, 12, replace=False))
    want = experts_reference(x, ids, weights, tokens, w_gate_up, w_down)
    assert np.abs(y[tokens] - want).max() <= 1e-4 * np.abs(want).max()
    # determinism: a second launch gives the same bits
    again = moe_experts(x, ids, weights, w_gate_up, w_down).copy_to_host()
    np.testing.assert_array_equal(again, y)


@pytest.mark.parametrize("max_word", [8, 4, 2])
def test_moe_experts_kimi_size_word_widths(kimi_experts, max_word):
    """The same result whether bf16 is read 8 (16-byte loads, the default here), 4 or 2 columns a load."""
    w_gate_up, w_down = kimi_experts
    config = dataclasses.replace(DEFAULT_CONFIG, max_word=max_word)
    rng = np.random.default_rng(100 + max_word)
    s = 6
    x = rng.standard_normal((s, D)).astype(np.float32)
    assert word_width(weight_view(w_gate_up, "w_gate_up"), cuda.to_device(x), config) == max_word
    # experts from a pool of 16 (the host reference costs ~0.4 s an expert); expert 7 takes 5 tokens: a chunk
    # of 4 and one of 1 with 4 tokens a pass
    ids = np.stack([rng.choice(np.arange(8, 24), K, replace=False) for _ in range(s)]).astype(np.int32)
    ids[:5, 0] = 7
    weights = rng.random((s, K)).astype(np.float32)
    out = cuda.to_device(np.full((s, D), np.nan, np.float32))
    y = moe_experts(x, ids, weights, w_gate_up, w_down, out=out, config=config).copy_to_host()
    assert np.isfinite(y).all()
    tokens = np.arange(s)
    want = experts_reference(x, ids, weights, tokens, w_gate_up, w_down)
    assert np.abs(y - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("offset,width", [(0, 8), (2, 4), (1, 2)])
def test_moe_experts_misaligned_x_falls_back(kimi_experts, offset, width):
    """x starting `offset` floats into its buffer (0, 8 or 4 bytes aligned): narrower words, same result."""
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
    want = experts_reference(x_host, ids, weights, np.arange(s), w_gate_up, w_down)
    assert np.abs(y - want).max() <= 1e-4 * np.abs(want).max()


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
